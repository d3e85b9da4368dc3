"""End to end: all-MiniLM-L6-v2 quantized by llm-compressor (NVFP4 weight-only and int4
W4A16), saved compressed, loaded by jax-fp4 into the Flax MiniLM; and MiniLM quantized by
jax-fp4, saved as compressed-tensors, decompressed by compressed-tensors in transformers."""
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4 as jf

torch = pytest.importorskip("torch")
pytest.importorskip("flax")
pytest.importorskip("tokenizers")
pytest.importorskip("compressed_tensors")
llmcompressor = pytest.importorskip("llmcompressor")
from transformers import AutoModel  # noqa: E402
from transformers.utils.quantization_config import CompressedTensorsConfig  # noqa: E402

from jax_fp4 import io as jio  # noqa: E402
from jax_fp4.models import minilm  # noqa: E402

pytestmark = pytest.mark.peers
SENTENCES = ["A man is eating food.", "The quick brown fox jumps over the lazy dog.",
             "jax-fp4 reads checkpoints that PyTorch libraries write."]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "vocab.txt", "sentence_bert_config.json")


def _src():
    try:
        return minilm.default_model_dir()
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(f"MiniLM weights: {e}")


def _with_tokenizer(d):
    for f in _TOKENIZER_FILES:
        if (_src() / f).exists():
            shutil.copy(_src() / f, d)
    return d


@pytest.fixture(scope="module")
def compressed(tmp_path_factory):
    """{scheme: directory} written by llm-compressor's oneshot + save_pretrained."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    out = {}
    for scheme in ("NVFP4A16", "W4A16"):
        model = AutoModel.from_pretrained(_src(), dtype=torch.float32)
        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme,
                                                         ignore=["pooler.dense"]))
        d = tmp_path_factory.mktemp(scheme)
        model.save_pretrained(d, save_compressed=True)
        out[scheme] = _with_tokenizer(d)
    return out


def _decompressed(d):
    """The float32 PyTorch model compressed-tensors decompresses from ``d``."""
    m = AutoModel.from_pretrained(d, quantization_config=CompressedTensorsConfig(dequantize=True))
    return m.eval()


def _torch_embed(model, enc):
    ids, mask = enc.tokenize(SENTENCES)
    with torch.no_grad():
        model = model.float()
        am = torch.from_numpy(mask).float()[..., None]
        h = model(input_ids=torch.from_numpy(ids).long(),
                  attention_mask=torch.from_numpy(mask).long()).last_hidden_state
        pooled = (h * am).sum(1) / am.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).numpy()


def _linears(model):
    return {n: m.weight.detach() for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and not n.startswith("pooler")}


def _ulps(a, b):
    a, b = np.asarray(a), np.asarray(b)
    it = {2: np.int16, 4: np.int32}[a.dtype.itemsize]
    return np.abs(a.view(it).astype(np.int64) - b.view(it).astype(np.int64))


@pytest.mark.parametrize("scheme", ["NVFP4A16", "W4A16"])
def test_llmcompressor_minilm_loads_into_flax(compressed, scheme):
    d = compressed[scheme]
    assert jio.detect(d) == "compressed-tensors"
    tensors = jio.load(d)
    ref_model = _decompressed(d)
    weights = _linears(ref_model)
    assert len(weights) == 36
    for name, w in weights.items():
        q = tensors[name + ".weight"]
        assert q.format == {"NVFP4A16": "nvfp4", "W4A16": "int4"}[scheme], name
        ours = np.asarray(q.dequantize())
        theirs = w.view(torch.int16 if w.dtype == torch.bfloat16 else torch.int32).numpy()
        u = _ulps(ours, theirs.view(ours.dtype))
        if scheme == "W4A16":
            assert u.max() == 0, name  # int4: bit for bit
        else:  # the divisor global scale: within one unit in the last place (bf16)
            assert u.max() <= 1 and u.mean() < 1e-3, (name, u.max(), u.mean())
    enc = minilm.load_sentence_encoder(d)
    got = np.asarray(enc.encode(SENTENCES))
    want = _torch_embed(ref_model, enc)
    # int4 weights decode exactly in float32 on both sides: float32 rounding only. NVFP4:
    # compressed-tensors rounds the decoded weights to bfloat16, jax-fp4's matmul decodes
    # them in float32, so the embeddings differ at bfloat16 rounding of the weights.
    tol = 2e-6 if scheme == "W4A16" else 3e-3
    np.testing.assert_allclose(got, want, atol=tol, rtol=0)
    if scheme == "NVFP4A16":  # the same model with the bf16 weights CT uses: float32 rounding
        dense = {k: (v.dequantize().astype(jnp.float32) if isinstance(v, jf.QArray) else v)
                 for k, v in tensors.items()}
        dd = d.parent / (d.name + "_dense")
        dd.mkdir()
        _with_tokenizer(dd)
        cfg = json.loads((d / "config.json").read_text())
        cfg.pop("quantization_config")
        (dd / "config.json").write_text(json.dumps(cfg))
        jio.save(dd / "model.safetensors", dense)
        got = np.asarray(minilm.load_sentence_encoder(dd).encode(SENTENCES))
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)


def test_jax_quantized_minilm_decompresses_in_compressed_tensors(tmp_path):
    src = jio.load(_src() / "model.safetensors")
    cfg = json.loads((_src() / "config.json").read_text())
    for fmt in ("nvfp4", "int4"):  # one scheme per checkpoint
        qt = {k: (jf.quantize(v, "nvfp4", axis=1, tensor_scale="auto") if fmt == "nvfp4"
                  else jf.quantize(v, "int4", axis=1, block_size=128))
              if k.startswith("encoder.") and k.endswith(".weight") and v.ndim == 2 else v
              for k, v in src.items()}
        d = tmp_path / fmt
        jio.save(d, qt, convention="compressed-tensors", config=cfg)
        m = _decompressed(d)
        for name, w in _linears(m).items():
            q = qt[name + ".weight"]
            ours = np.asarray(q.dequantize(jnp.bfloat16 if fmt == "nvfp4" else jnp.float32))
            it = torch.int16 if w.dtype == torch.bfloat16 else torch.int32
            u = _ulps(ours, w.view(it).numpy().view(ours.dtype))
            assert u.max() <= (1 if fmt == "nvfp4" else 0), (fmt, name, u.max())
        back = jio.load(d)  # and our own reader agrees
        for name in _linears(m):
            np.testing.assert_array_equal(np.asarray(back[name + ".weight"].data),
                                          np.asarray(qt[name + ".weight"].data))
