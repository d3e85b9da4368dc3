"""jax-fp4 finetune (jax_fp4.train.finetune): the split is disjoint, training text comes from
the training sentences only, and a short run trains the adapters alone on a frozen base."""
import jax
import numpy as np
import pytest

pytest.importorskip("optax")
pytest.importorskip("flax")
from jax_fp4.train import finetune as F  # noqa: E402


def test_split_is_disjoint_and_spans_come_from_training_text():
    sents = [f"sentence number {i} about topic {i % 5} and more words" for i in range(50)]
    train, held = F.split_sentences(sents + sents[:3], 0.3, seed=1)
    assert len(held) == 15 and len(train) == 35 and not set(train) & set(held)
    assert F.split_sentences(sents, 0.3, seed=1) == (train, held)
    spans = F.word_spans(train, 200, np.random.default_rng(0))
    for s in spans:
        assert any(s in t for t in train) and not any(s == h for h in held)
        assert len(s.split()) >= 3
    with pytest.raises(ValueError, match="eval_fraction"):
        F.split_sentences(sents, 1.0, 0)


def test_short_finetune_trains_adapters_on_a_frozen_base(encoder):
    from flax import nnx

    from jax_fp4 import nn as jnn
    from jax_fp4.models.demo import load_sentences
    from jax_fp4.qarray import QArray

    sents = load_sentences()[:24]
    r = F.finetune("nvfp4", rank=2, steps=3, batch_size=4, eval_fraction=0.25,
                   sentences=sents, encoder=encoder)
    assert (r["n_train"], r["n_eval"]) == (18, 6) and len(r["loss"]) == 3
    assert 0 < r["adapter_share"] < 0.02
    assert r["adapter_params"] == 2 * 6 * (4 * (384 + 384) + 2 * (384 + 1536))
    for key in ("cos_mean", "cos_min", "top1", "spearman"):
        assert np.isfinite(r["before"][key]) and np.isfinite(r["after"][key])
    # the student's 4-bit weights are exactly the quantized teacher's
    base = jnn.quantize_params(encoder.model, "nvfp4", prepare=False, tensor_scale="auto")
    is_q = lambda x: isinstance(x, QArray)  # noqa: E731
    got = [q for q in jax.tree_util.tree_leaves(nnx.state(r["model"]), is_leaf=is_q) if is_q(q)]
    want = [q for q in jax.tree_util.tree_leaves(nnx.state(base), is_leaf=is_q) if is_q(q)]
    assert len(got) == len(want) == 36
    for g, w in zip(got, want):
        for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(w)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
