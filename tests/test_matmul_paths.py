"""The GPU matmul paths' semantics, checked where CI runs (CPU): the block-scaled matmul's
bf16 decomposition and the fused W4A16 kernel's size rule and K-split rule."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4 as jf
from jax_fp4 import primitives
from jax_fp4.ops import _qarray_rows


@pytest.mark.parametrize("a_fmt,b_fmt", [("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"),
                                         ("mxfp8_e4m3", "mxfp8_e5m2"), ("mxfp6_e3m2", "mxfp8_e4m3")])
def test_scaled_matmul_bf16_decomposition_equals_reference(a_fmt, b_fmt, rng):
    """Operands decoded to bf16 without the NVFP4 tensor scales (exact), bf16 dot with
    float32 accumulation, tensor scales / alpha / bias after: equal to the float32
    reference up to float32 rounding."""
    m, n, k = 24, 40, 256
    kw = {"tensor_scale": "auto"} if a_fmt == "nvfp4" else {}
    a = jf.quantize(jnp.asarray(rng.standard_normal((m, k)) * 7, jnp.float32), a_fmt, axis=1, **kw)
    b = jf.quantize(jnp.asarray(rng.standard_normal((n, k)) / 3, jnp.float32), b_fmt, axis=1, **kw)
    (ac, asc, _, ats), _, _ = _qarray_rows(a)
    (bc, bsc, _, bts), _, _ = _qarray_rows(b)
    bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
    args = (ac, asc, ats, bc, bsc, bts, jnp.float32(0.75), bias)
    kw2 = dict(a_fmt=a_fmt, b_fmt=b_fmt, k=k, out_dtype=np.dtype(np.float32), impl="reference")
    got = np.asarray(jax.jit(lambda *v: primitives.scaled_matmul_bf16(*v, **kw2))(*args),
                     np.float64)
    ad = np.asarray(a.dequantize(jnp.float32), np.float64)
    bd = np.asarray(b.dequantize(jnp.float32), np.float64)
    exact = 0.75 * ad @ bd.T + np.asarray(bias, np.float64)
    bound = k * 2.0**-22 * (0.75 * np.abs(ad) @ np.abs(bd).T + np.abs(np.asarray(bias)))
    err = np.abs(got - exact)
    assert (err <= bound).all(), f"max err {err.max()}"
    # and the bf16 operands really are exact: decoding to bf16 loses nothing
    deq = np.asarray(jf.QArray(a.data, a.scales, None, None, format=a_fmt, axis=1, shape=(m, k),
                               dtype=jnp.float32, block_size=a.block_size)
                     .dequantize(jnp.bfloat16), np.float32)
    deq32 = np.asarray(jf.QArray(a.data, a.scales, None, None, format=a_fmt, axis=1,
                                 shape=(m, k), dtype=jnp.float32, block_size=a.block_size)
                       .dequantize(jnp.float32))
    np.testing.assert_array_equal(deq, deq32)


def test_wmatmul_splits_rule():
    for m in (1, 16, 64, 65, 256):
        for n in (128, 4096, 14336, 28672, 200):
            for k in (32, 128, 4096, 8192, 28672, 160):
                s = primitives.wmatmul_splits(m, n, k)
                n_steps = -(-k // 128)
                assert 1 <= s <= max(1, n_steps // 4), (m, n, k, s)
    # small N at decode is split along K to fill the GPU; large N is not
    assert primitives.wmatmul_splits(1, 4096, 4096) == 8
    assert primitives.wmatmul_splits(1, 28672, 8192) == 3
    assert primitives.wmatmul_splits(256, 28672, 8192) == 1


def test_fused_wmatmul_size_rule():
    def avals(m, k, dtype=jnp.bfloat16):
        return (jax.core.ShapedArray((m, k), dtype), jax.core.ShapedArray((64, k // 2), np.uint8))

    ok = primitives.fused_wmatmul_applies
    assert ok(avals(1, 256), dict(fmt="nvfp4", block_size=16))
    assert ok(avals(primitives.FUSED_MAX_M, 256), dict(fmt="int4", block_size=128))
    assert not ok(avals(primitives.FUSED_MAX_M + 1, 256), dict(fmt="nvfp4", block_size=16))
    assert not ok(avals(4, 256, jnp.float32), dict(fmt="nvfp4", block_size=16))
    assert not ok(avals(4, 48), dict(fmt="nvfp4", block_size=16))  # K % 32
    assert not ok(avals(4, 288), dict(fmt="int4", block_size=48))  # odd group size
    assert not ok(avals(4, 256), dict(fmt="mxfp8_e4m3", block_size=32))  # 8-bit weights
