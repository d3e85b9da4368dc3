"""CUDA kernels == reference, bit for bit (runs on a GPU machine; skipped elsewhere).

The oracle is the pure-jnp reference evaluated on the CPU device, so neither XLA:GPU's
arithmetic nor our CPU kernels stand between the CUDA kernels and the definition.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4 as jf

from edge import assert_bits_equal, kernel_cases, make_input

pytestmark = pytest.mark.gpu

CASES = kernel_cases((64, 32, 4096), [(128, {}), (32, {}), (64, {"scale_dtype": jnp.float32})])


def _gpu():
    return jax.devices("gpu")[0]


def _cpu():
    return jax.devices("cpu")[0]


def _run(fn, x, backend, device):
    old = jf.get_backend()
    jf.set_backend(backend)
    try:
        return jax.tree_util.tree_map(np.asarray, jax.jit(fn)(jax.device_put(x, device)))
    finally:
        jf.set_backend(old)


def _shapes(bs):
    return [(1, bs), (3, 2 * bs), (129, bs * max(1, 256 // bs)), (257, max(bs, 512))]


@pytest.mark.parametrize("fmt,bs,kw", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_cuda_matches_reference(fmt, bs, kw, dtype, rng):
    assert jf.capabilities()["kernels"]["cuda"], jf.capabilities()["load_error"]
    for shape in _shapes(bs):
        x = jnp.asarray(make_input(rng, *shape, fmt, block_size=bs)).astype(dtype)

        def q(v):
            qa = jf.quantize(v, fmt, block_size=bs, **kw)
            return qa.data, qa.scales, qa.zeros, qa.dequantize(), qa.dequantize(jnp.float32)

        def fq(v):
            kw2 = {k: v2 for k, v2 in kw.items() if k != "scale_dtype"}
            return jf.fake_quantize(v, fmt, block_size=bs, **kw2)

        got = _run(q, x, "kernels", _gpu())
        want = _run(q, x, "reference", _cpu())
        for name, g, w in zip(("data", "scales", "zeros", "deq", "deq32"), got, want):
            if w is not None:
                assert_bits_equal(g, w, f"{fmt} {kw} {dtype.__name__} {shape} {name}")
        assert_bits_equal(_run(fq, x, "kernels", _gpu()), _run(fq, x, "reference", _cpu()),
                          f"{fmt} {kw} {dtype.__name__} {shape} fake_quantize")


@pytest.mark.parametrize("fmt,bs,kw", [("nvfp4", 16, {"tensor_scale": "auto"}),
                                       ("mxfp8_e4m3", 32, {}), ("mxfp4", 32, {}),
                                       ("nf4", 64, {})], ids=lambda v: str(v))
def test_cuda_swizzled_scales_match_reference(fmt, bs, kw, rng):
    """Scales written by the kernel in the 128x4 layout (padding zero) == reference."""
    for shape in [(129, 5 * bs), (256, 8 * bs), (1, bs)]:
        x = jnp.asarray(make_input(rng, *shape, fmt, block_size=bs)).astype(jnp.bfloat16)

        def q(v):
            qa = jf.quantize(v, fmt, block_size=bs, scale_layout="swizzled", **kw)
            return qa.data, qa.scales, qa.dequantize()

        for name, g, w in zip(("data", "scales", "deq"), _run(q, x, "kernels", _gpu()),
                              _run(q, x, "reference", _cpu())):
            assert_bits_equal(g, w, f"{fmt} swizzled {shape} {name}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_cuda_auto_tensor_scale_matches_reference(dtype, rng):
    """jax_fp4_tensor_scale_v1 == reference.tensor_scale_from_amax(reference.amax(x)):
    subnormals (scale clamped to 2^-120), zeros (1.0), -0.0, Inf, NaN, a K that is not a
    multiple of 16 (the kernel's scalar tail), many CTAs."""
    from jax_fp4 import reference
    from jax_fp4.prims.tensor_scale import auto_tensor_scale
    for shape, special in [((3, 13), None), ((1000, 1000), "inf"), ((4096, 520), "nan"),
                           ((7, 9), "sub"), ((5, 48), "zero")]:
        x = rng.standard_normal(shape).astype(np.float32) * 100
        if special == "sub":
            x = x * np.float32(1e-41)
        elif special == "zero":
            x[:] = 0.0
        elif special is not None:
            x.flat[rng.integers(x.size)] = -np.inf if special == "inf" else np.nan
        x.flat[rng.integers(x.size)] = -0.0
        xd = jnp.asarray(x).astype(dtype)
        got = _run(auto_tensor_scale, xd, "kernels", _gpu())
        want = _run(lambda v: reference.tensor_scale_from_amax(reference.amax(v)), xd,
                    "reference", _cpu())
        assert_bits_equal(got, want, f"tensor scale {dtype.__name__} {shape} {special}")
    text = jax.jit(auto_tensor_scale).lower(jax.device_put(xd, _gpu())).as_text()
    assert "jax_fp4_tensor_scale_v1" in text


def test_cuda_rows_across_grid_steps(rng):
    """More chunks than one grid step covers (> 132*16 CTAs * 512 threads * 16 elements), a
    row length that does not divide the stride: the kernels' row cursor stays right as it
    wraps, for per-row tensor scales (vmap: each member its own "auto" scale) and for
    swizzled scale slots."""
    x = jnp.asarray(rng.standard_normal((7, 600, 4256)) * np.exp(rng.standard_normal((7, 1, 1))),
                    jnp.bfloat16)

    def per_member(v):
        def one(m):
            qa = jf.quantize(m, "nvfp4", tensor_scale="auto")
            return qa.data, qa.scales, qa.dequantize(), jf.fake_quantize(m, "nvfp4",
                                                                          tensor_scale="auto")
        return jax.vmap(one)(v)

    def swizzled(v):
        qa = jf.quantize(v.reshape(-1, v.shape[-1]), "mxfp4", scale_layout="swizzled")
        return qa.data, qa.scales

    for fn in (per_member, swizzled):
        for name, g, w in zip(("data", "scales", "deq", "fake"), _run(fn, x, "kernels", _gpu()),
                              _run(fn, x, "reference", _cpu())):
            assert_bits_equal(g, w, f"grid steps {fn.__name__} {name}")


def test_cuda_lowering_uses_our_custom_calls():
    x = jax.device_put(jnp.ones((4, 64), jnp.bfloat16), _gpu())
    text = jax.jit(lambda v: jf.fake_quantize(v, "nvfp4")).lower(x).as_text()
    assert "jax_fp4_fake_quantize_v1" in text
    text = jax.jit(lambda v: jf.quantize(v, "mxfp4").dequantize()).lower(x).as_text()
    assert "jax_fp4_quantize_v2" in text and "jax_fp4_dequantize_v1" in text


def test_cuda_transforms(rng):
    x = jax.device_put(jnp.asarray(rng.standard_normal((3, 5, 64)), jnp.float32), _gpu())
    v = jax.vmap(lambda r: jf.fake_quantize(r, "mxfp4"), in_axes=1)(x)
    w = jnp.stack([jf.fake_quantize(x[:, i], "mxfp4") for i in range(5)])
    np.testing.assert_array_equal(np.asarray(v), np.asarray(w))
    g = jax.grad(lambda r: jnp.sum(jf.fake_quantize(r, "nf4")))(x)
    np.testing.assert_array_equal(np.asarray(g), np.ones(x.shape, np.float32))


def test_cuda_above_2_31_elements():
    """64-bit indexing: a (2**31 + 2**20)-element tensor, checked at its far end."""
    rows, k = (1 << 17) + (1 << 6), 1 << 14
    assert rows * k > 2 ** 31
    gpu = _gpu()
    # drawn on the GPU (jit follows its committed key): 4 GiB of bf16
    key = jax.device_put(jax.random.key(3), gpu)
    x = jax.jit(lambda kk: jax.random.normal(kk, (rows, k), jnp.bfloat16))(key)
    jf.set_backend("kernels")
    try:
        q = jax.jit(lambda v: jf.quantize(v, "nvfp4"))(x)
        y = jax.jit(lambda qq: qq.dequantize())(q)
        tail = np.asarray(x[-3:])
        want = _run(lambda v: jf.quantize(v, "nvfp4").data, tail, "reference", _cpu())
        np.testing.assert_array_equal(np.asarray(q.data[-3:]), want)
        want_y = _run(lambda v: jf.quantize(v, "nvfp4").dequantize(), tail, "reference", _cpu())
        assert_bits_equal(np.asarray(y[-3:]), want_y, "dequantize tail")
    finally:
        jf.set_backend("auto")


@pytest.mark.parametrize("sd", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_cuda_int4_wide_blocks_match_reference(sd):
    """INT4 blocks with max - min >= 2**127 or overflowing (docs/spec.md section 3, INT4):
    the CUDA kernels give the reference's bits, and float32 decodes stay finite."""
    f32_max = float(np.finfo(np.float32).max)
    blocks = [(-1.8e38, 1.8e38), (-f32_max, f32_max), (-1e38, f32_max), (0.0, f32_max),
              (-f32_max, -1.0), (-3e4, 4e4), (-1e6, 2e6)]
    x = np.stack([np.linspace(lo, hi, 128, dtype=np.float32) for lo, hi in blocks])
    x = jnp.asarray(np.tile(x, (3, 2)))

    def f(v):
        q = jf.quantize(v, "int4", block_size=128, scale_dtype=sd)
        return q.data, q.scales, q.zeros, jf.dequantize(q, jnp.float32)

    got = _run(f, x, "kernels", _gpu())
    want = _run(f, x, "reference", _cpu())
    for name, a, b in zip(("data", "scales", "zeros", "dequantize"), got, want):
        assert_bits_equal(a, b, name)
    assert np.isfinite(got[3]).all()
    fq = lambda v: jf.fake_quantize(v, "int4", block_size=128)
    assert_bits_equal(_run(fq, x, "kernels", _gpu()), _run(fq, x, "reference", _cpu()),
                      "fake_quantize")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_cuda_division_shortcuts_and_fallbacks(dtype, rng):
    """The quantize kernels divide by one Markstein step from a correctly rounded reciprocal
    where that is exact (csrc/cuda/quant: nvfp4_scale_fast, int4_params_fast,
    int4_code_biased; benchmarks/check_codecs.cu checks them over every amax and every
    16-bit x and scale) and take the IEEE divisions elsewhere. Both sides of each boundary
    == reference: tensor scales around 2^100 and at 2^-120, INT4 blocks whose quotients
    x / s pass kInt4FastLimit = 2^100 (a huge offset over a tiny range), ones just inside
    and ones past 2^22 (where the rounding by 1.5 2^23 saturates), quotients near the
    rounding ties, amax at the bottom of the normal range."""
    # A constant block has s = 1e-5 / 15: x / s = 1.5e6 x, small for x = 500, past 2^22
    # for 3e4, just inside 2^100 for 5e23 and beyond it for 1e25 (float32 / bfloat16);
    # noisy blocks around 1 and around a quarter of the dtype's largest value.
    big = float(jnp.finfo(dtype).max) / 4
    rows = [np.full(4096, 500.0), np.full(4096, -3.0e4), np.full(4096, 5.0e23),
            np.full(4096, -1.0e25)]
    for c in (1.0, big):
        rows.append(c + rng.standard_normal(4096) * 1e-3 * c)
    half = (np.arange(4096) % 16 + 0.5).astype(np.float32)  # ties of rint(x / s) and of E2M1
    rows += [half, half * np.float32(2.0 ** -126) * 6, rng.standard_normal(4096) * 1e-38]
    x = jnp.asarray(np.stack(rows).astype(np.float32)).astype(dtype)
    x = jnp.where(jnp.isfinite(x), x, 0)  # rows beyond a 16-bit dtype's range: zeros

    def int4(v):
        qa = jf.quantize(v, "int4", block_size=128, scale_dtype=jnp.float32)
        return qa.data, qa.scales, qa.zeros

    def nvfp4(ts):
        def f(v):
            qa = jf.quantize(v, "nvfp4", tensor_scale=ts)
            return qa.data, qa.scales, jf.fake_quantize(v, "nvfp4", tensor_scale=ts)
        return f

    edge = 2.0 ** 100  # the largest tensor scale of the fast path
    fns = [int4, nvfp4(None)] + [nvfp4(np.float32(ts)) for ts in (
        2.0 ** -120, 1 / 2688, edge * (1 - 2.0 ** -24), edge, edge * (1 + 2.0 ** -23), 2.0 ** 110)]
    for i, fn in enumerate(fns):
        for name, g, w in zip(("data", "scales", "zeros / fake-quantized"),
                              _run(fn, x, "kernels", _gpu()), _run(fn, x, "reference", _cpu())):
            assert_bits_equal(g, w, f"{dtype.__name__} case {i} {name}")
