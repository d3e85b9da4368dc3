"""The GPU matmul paths' semantics, checked where CI runs (CPU): the block-scaled matmul's
bf16 decomposition and the fused W4A16 kernel's size rule and K-split rule."""
import functools
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4 as jf
from jax_fp4.prims import _launch_plan as LP, wmatmul as W
from jax_fp4.prims._gpu import GpuProps
from jax_fp4.prims.scaled_matmul import scaled_matmul_bf16
from jax_fp4.ops import _qarray_rows

from edge import assert_matmul_close


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
    got = np.asarray(jax.jit(lambda *v: scaled_matmul_bf16(*v, **kw2))(*args),
                     np.float64)
    ad = np.asarray(a.dequantize(jnp.float32), np.float64)
    bd = np.asarray(b.dequantize(jnp.float32), np.float64)
    assert_matmul_close(got, ad, bd.T, scale=0.75, bias=bias, msg=f"{a_fmt} x {b_fmt}")
    # and the bf16 operands really are exact: decoding to bf16 loses nothing
    deq = np.asarray(jf.QArray(a.data, a.scales, None, None, format=a_fmt, axis=1, shape=(m, k),
                               dtype=jnp.float32, block_size=a.block_size)
                     .dequantize(jnp.bfloat16), np.float32)
    deq32 = np.asarray(jf.QArray(a.data, a.scales, None, None, format=a_fmt, axis=1,
                                 shape=(m, k), dtype=jnp.float32, block_size=a.block_size)
                       .dequantize(jnp.float32))
    np.testing.assert_array_equal(deq, deq32)


@pytest.mark.parametrize("wgmma", [False, True])
def test_wmatmul_splits_rule(wgmma):
    """Waves >= 90% full on a 132-SM GPU, no empty split, bounded partial-sum bytes, for
    the mma.sync kernels and the wgmma kernel's tiles."""
    for m in (1, 8, 16, 17, 33, 64, 65, 256, 1024):
        tile_m = LP.wmatmul_tile_m(m, wgmma)
        assert (tile_m > 0) == wgmma and (not tile_m or tile_m >= min(m, 256))
        kind = tile_m or ("direct" if m <= 16 else "staged")
        rows, step, per_sm, min_steps = LP.TUNING.geometry[kind]
        slots = per_sm * 132
        for n in (128, 200, 4096, 14336, 28672):
            for k in (32, 160, 4096, 8192, 28672):
                s = LP.wmatmul_splits(m, n, k, 132, tile_m=tile_m)
                n_steps = -(-k // step)
                s_max = max(1, min(n_steps // min_steps, k // (32 * m)))  # partials <= w / 4
                assert 1 <= s <= s_max, (m, n, k, s)
                m_tile = tile_m or (m if m <= 16 else 64)
                ctas = -(-n // rows) * -(-m // m_tile)

                def eff(s):
                    return ctas * s / (-(-ctas * s // slots) * slots)

                allowed = [v for v in range(1, s_max + 1)
                           if -(-n_steps // -(-n_steps // v)) == v]  # no empty split
                good = [v for v in allowed if eff(v) >= 0.9]
                if good:  # the fewest splits that fill their waves to >= 90%
                    assert s == good[0], (m, n, k, s, good)
                else:
                    assert eff(s) == max(eff(v) for v in allowed), (m, n, k, s)
    assert LP.wmatmul_splits(256, 28672, 8192, 132) == 1


def test_wmatmul_tile_rule():
    """The wgmma kernel's tiles by M, from M = 1 for every format: the smallest of 8, 16,
    32, 64, 128, 256 rows that holds M; none (the mma.sync kernels) without wgmma."""
    tile = LP.wmatmul_tile_m
    assert [tile(m, True) for m in (1, 3, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 2048)] == \
        [8, 8, 8, 16, 16, 32, 32, 64, 64, 128, 128, 256, 256]
    assert tile(1, False) == tile(64, False) == 0
    folded = LP.wmatmul_folded
    assert folded("nvfp4", jnp.bfloat16, 0)
    assert folded("nvfp4", jnp.bfloat16, 1)  # two-level: the tensor scale multiplies the accumulator
    assert folded("nvfp4", jnp.float16, 0)
    assert not folded("mxfp4", jnp.bfloat16, 0)
    # 2-CTA clusters (x multicast) only at tile_m = 256, and only from some M on
    for fmt in LP.TUNING.formats:
        want = [1, 1, 1 if fmt in ("nf4", "bnb_fp4") else 2]  # the table decode: never
        assert [LP.wmatmul_cluster(fmt, m, t) for m, t in
                ((4096, 128), (129, 256), (4096, 256))] == want, fmt
        # a prepared weight: never (it runs faster without: benchmarks/RESULTS.md)
        assert LP.wmatmul_cluster(fmt, 4096, 256, tiled=True) == 1, fmt


def test_wmatmul_head_rows_rule():
    """A ragged last 256-row tile (M % 256 in 1..128) becomes a second launch, where the
    first launch alone fills >= 90% of a wave (132 SMs, one CTA each at tile_m = 256)."""
    head = LP.wmatmul_head_rows
    assert head(300, 28672, 8192, 256, 132) == 256  # 224 CTAs
    assert head(1100, 28672, 8192, 256, 132) == 1024
    assert head(300, 8192, 28672, 256, 132) == 256  # 64 CTAs x 2 K-splits
    assert head(300, 4096, 4096, 256, 132) == 0  # 32 CTAs x 2: the GPU half idle
    assert head(300, 16896, 256, 256, 132) == 256  # 132 CTAs, one K-split
    assert head(300, 15232, 256, 256, 132) == 256  # 119 CTAs >= 0.9 x 132
    assert head(300, 15104, 256, 256, 132) == 0  # 118 CTAs
    for m in (129, 256, 400, 512, 1024):  # one tile, whole tiles, or a tail of > 128 rows
        assert head(m, 28672, 8192, 256, 132) == 0, m
    assert head(300, 28672, 8192, 128, 132) == 0  # only the 256-row tile


def test_wmatmul_grid_rule():
    """Where the plain wgmma grid keeps under half of the CTA slots busy (132 SMs; 1 CTA per
    SM at tile_m 128 / 256), the grid that fills most of a wave of one CTA per SM with
    partial sums of up to twice the codes' bytes and splits of >= 2 steps: then fewer
    splits, then the larger tile. Elsewhere the plain tile and splits."""
    grid = LP.wmatmul_grid
    cases = {  # (M, K, N): the grid's (tile_m, splits); H100 times in benchmarks/RESULTS.md
        (256, 4096, 4096): (128, 2),  # 32 CTAs -> 128
        (512, 4096, 4096): (128, 1),  # 64 -> 128, no splits (t256 s2 fills as much)
        (128, 4096, 4096): (128, 4),  # 32 -> 128
        (300, 4096, 4096): (256, 2),  # 64 -> 128 (t128: 96 or 192 of 132 / 264)
        (256, 14336, 4096): (128, 2),
        (160, 14336, 4096): (128, 2),  # was t256 s2: 64 CTAs
        (256, 8192, 8192): (128, 1),
        (256, 8192, 28672): (256, 1),  # 224 of 264 slots: plain
        (256, 28672, 8192): (256, 2),
        (1024, 8192, 28672): (256, 1),
        (16, 4096, 4096): (16, 4),  # 64 of 264 -> 128 CTAs of 8 steps, one per SM
        (4, 4096, 4096): (8, 4),  # as at 16 (8 K-splits, two per SM, were not faster)
        (1, 4096, 1024): (8, 16),  # 8 tiles -> 128 CTAs of 2 steps
        (64, 4096, 1024): (64, 16),
        (1, 8192, 1024): (8, 16),
        (1, 14336, 4096): (8, 8),  # 256 of 264 slots: plain (8 splits of 14 steps)
    }
    for (m, k, n), want in cases.items():
        assert grid(m, n, k, True, 132) == want, (m, k, n)
    m, k, n = 4, 4096, 4096  # without wgmma: the direct kernel's splits
    assert grid(m, n, k, False, 132) == (0, LP.wmatmul_splits(m, n, k, 132))
    # the plain rule where the grid fills >= half
    for m, k, n in ((256, 8192, 28672), (64, 8192, 28672), (512, 8192, 8192)):
        t = LP.wmatmul_tile_m(m, True)
        assert grid(m, n, k, True, 132) == (
            t, LP.wmatmul_splits(m, n, k, 132, tile_m=t)), (m, k, n)


@pytest.mark.parametrize("wgmma", [False, True])
def test_fused_wmatmul_size_rule(wgmma):
    """Fused up to Tuning.max_m_mma_sync, or wgmma_max_m where the wgmma kernel runs: further for
    nvfp4 (folded, one or two levels) than for the other formats, and per format
    (pinned either way, so the test means the same on every machine)."""
    gpu = GpuProps(9 if wgmma else 8, 132, ("80", "90a"))

    def avals(m, k, dtype=jnp.bfloat16, scale_dtype=np.uint8):
        return (jax.core.ShapedArray((m, k), dtype), jax.core.ShapedArray((64, k // 2), np.uint8),
                jax.core.ShapedArray((64, k // 16), scale_dtype))

    def ok(avals_in, params):
        return W.fused_wmatmul_applies(avals_in, params, gpu)

    max_m = LP.wgmma_max_m("nvfp4", folded=False) if wgmma else LP.TUNING.max_m_mma_sync
    max_f = LP.wgmma_max_m("nvfp4", folded=True) if wgmma else LP.TUNING.max_m_mma_sync
    assert max_f > max_m if wgmma else max_f == max_m
    nv, nv2 = (dict(fmt="nvfp4", block_size=16, two_level=t, tiled=False) for t in (False, True))
    for q in (nv, nv2):  # one or two levels: the same folded decode, the same limit
        assert ok(avals(max_f, 256), q) and not ok(avals(max_f + 1, 256), q)
    for fmt, bs, sd in (("mxfp4", 32, np.uint8), ("nf4", 64, np.float32),
                        ("bnb_fp4", 64, np.float32), ("int4", 128, jnp.bfloat16)):
        lim = LP.wgmma_max_m(fmt) if wgmma else LP.TUNING.max_m_mma_sync
        assert lim >= max_m, fmt
        q = dict(fmt=fmt, block_size=bs, two_level=False, tiled=False)
        x = functools.partial(avals, k=256, scale_dtype=sd)
        assert ok(x(lim), q) and not ok(x(lim + 1), q), fmt
        # a prepared weight: the wgmma kernel at any M; without it, as the linear layout
        tiled = dict(q, tiled=True)
        assert ok(x(lim + 1), tiled) == wgmma and ok(x(16384), tiled) == wgmma
        assert ok(x(lim), tiled)
    if wgmma:  # the multicast formats go further than the table decode
        assert LP.wgmma_max_m("int4") > LP.wgmma_max_m("nf4")
    # where a format decodes otherwise than its FUSED_MAX_M_WGMMA entry was measured on (bf16
    # x, the bit path): its own limit (FUSED_MAX_M_WGMMA_DECODE), lower
    for fmt, bs, x_dtype, s_dtype, decode in (("int4", 128, jnp.float16, jnp.bfloat16, "table"),
                                              ("int4", 128, jnp.bfloat16, jnp.float32, "table"),
                                              ("int4", 128, jnp.bfloat16, jnp.float16, "split"),
                                              ("mxfp4", 32, jnp.float16, np.uint8, "bits")):
        assert LP.wmatmul_decode(fmt, x_dtype, False, s_dtype) == decode
        q = dict(fmt=fmt, block_size=bs, two_level=False, tiled=False)
        lim = LP.wgmma_max_m(fmt, decode=decode, x_dtype=x_dtype) if wgmma else LP.TUNING.max_m_mma_sync
        assert lim < LP.wgmma_max_m(fmt) if wgmma else lim == LP.TUNING.max_m_mma_sync
        assert ok(avals(lim, 256, x_dtype, s_dtype), q), fmt
        assert not ok(avals(lim + 1, 256, x_dtype, s_dtype), q), fmt
        assert ok(avals(lim + 1, 256, x_dtype, s_dtype), dict(q, tiled=True)) == wgmma, fmt
    int4 = dict(fmt="int4", block_size=128, two_level=False, tiled=False)
    lim = LP.wgmma_max_m("int4") if wgmma else LP.TUNING.max_m_mma_sync
    for x_dtype in (jnp.bfloat16, jnp.float16):  # the bit path (scales in x's dtype)
        assert ok(avals(lim, 256, x_dtype, x_dtype), int4) and not ok(avals(lim + 1, 256, x_dtype, x_dtype), int4)
    if wgmma:  # the split scale's bit decode goes further than the table decode
        assert LP.wgmma_max_m("int4", decode="split") > LP.wgmma_max_m("int4", decode="table")
    assert ok(avals(1, 256), nv)
    assert ok(avals(max_m, 256, jnp.float16), dict(nv, block_size=16))
    assert ok(avals(max_f, 256, jnp.float16), nv) and not ok(avals(max_f + 1, 256, jnp.float16), nv)
    assert not ok(avals(4, 256, jnp.float32), nv)
    assert not ok(avals(4, 48), nv)  # K % 32
    assert not ok(avals(4, 288), dict(int4, block_size=48))  # odd group size
    mxfp8 = dict(fmt="mxfp8_e4m3", block_size=32, two_level=False, tiled=False)
    assert not ok(avals(4, 256), mxfp8)


@pytest.mark.parametrize("a_fmt,b_fmt", [("nvfp4", "nvfp4"), ("mxfp8_e4m3", "mxfp8_e5m2"),
                                         ("mxfp4", "mxfp4"), ("mxfp6_e2m3", "mxfp6_e3m2")])
def test_scaled_matmul_operands_follow_jax_nn_scaled_matmul(a_fmt, b_fmt, rng):
    """The Blackwell path's operands, multiplied by jax.nn.scaled_matmul's documented
    formula (a * repeat(a_scales), einsum over K; cuDNN itself cannot run here), times the
    NVFP4 tensor scales, equal the reference scaled_matmul."""
    m, n, k = 16, 24, 128
    kw = {"tensor_scale": "auto"} if a_fmt == "nvfp4" else {}
    a = jf.quantize(jnp.asarray(rng.standard_normal((m, k)) * 5, jnp.float32), a_fmt, axis=1, **kw)
    b = jf.quantize(jnp.asarray(rng.standard_normal((n, k)), jnp.float32), b_fmt, axis=1, **kw)
    da, sa, ta = jf.scaled_matmul_operands(a)
    db, sb, tb = jf.scaled_matmul_operands(b)
    assert da.shape == (1, m, k) and sa.shape == (1, m, k // a.block_size)
    assert sa.dtype == (jnp.float8_e4m3fn if a_fmt == "nvfp4" else jnp.float8_e8m0fnu)
    if a_fmt in ("nvfp4", "mxfp4"):
        assert da.dtype == jnp.float4_e2m1fn

    def scaled(d, s):
        return np.asarray(d, np.float64) * np.repeat(np.asarray(s.astype(jnp.float32), np.float64),
                                                     k // s.shape[-1], axis=-1)

    got = np.einsum("bmk,bnk->mn", scaled(da, sa), scaled(db, sb))
    if ta is not None:
        got = got * float(ta) * float(tb)
    ad = np.asarray(a.dequantize(jnp.float32), np.float64)
    bd = np.asarray(b.dequantize(jnp.float32), np.float64)
    assert_matmul_close(got, ad, bd.T, msg=f"{a_fmt} x {b_fmt} operands")
    # the operands hold the exact element values: data * scale == dequantize (with a
    # tensor scale the reference rounds ts * s and the product to float32 once each)
    if ta is None:
        np.testing.assert_array_equal(scaled(da, sa)[0], ad)
    else:
        np.testing.assert_allclose(scaled(da, sa)[0] * float(ta), ad, rtol=2.0**-23, atol=0)


def test_scaled_matmul_operands_errors():
    q = jf.quantize(jnp.ones((4, 64)), "nf4", axis=1)
    with pytest.raises(ValueError, match="q: expected a 2-D nvfp4 or MX QArray"):
        jf.scaled_matmul_operands(q)
    with pytest.raises(TypeError):
        jf.scaled_matmul_operands(jnp.ones((4, 64)))


@pytest.mark.parametrize("bit_path", [True, False])
@pytest.mark.parametrize("m,k,tile_m", [(3, 160, 16), (16, 256, 16), (70, 8000, 128)])
def test_wmatmul_x_layout(bit_path, m, k, tile_m):
    """The wgmma kernel's activation order (csrc/cuda/wmatmul/): block position
    32 s2 + 16 hh + 8 sec + 2 tt + e holds element 32 tt + 8 s2 + 4 e + 2 hh + sec (bit
    path) or 32 tt + 8 s2 + 4 hh + 2 sec + e (table path) of its 128-k block; K is
    zero-padded to a multiple of 128, M with zero rows to a multiple of tile_m; a small
    x, an unpadded one and a large one padded in both M and K. The table path moves bf16
    elements for the small padded x and 32-bit pairs for the other two
    (jax_fp4.prims.wmatmul._X_PAIRS_MIN_SIZE), so both of its forms are checked."""
    kp, mp = -(-k // 128) * 128, -(-m // tile_m) * tile_m
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.bfloat16)
    assert W.wmatmul_x_layout(x, bit_path).shape == (m, kp)
    y = np.asarray(W.wmatmul_x_layout(x, bit_path, tile_m)).view(np.uint16)
    assert y.shape == (mp, kp)
    xp = np.zeros((mp, kp), np.uint16)
    xp[:m, :k] = np.asarray(x).view(np.uint16)
    q = np.arange(kp) % 128
    s2, hh, sec, tt, e = q // 32, q // 16 % 2, q // 8 % 2, q // 2 % 4, q % 2
    src = 128 * (np.arange(kp) // 128) + 32 * tt + 8 * s2 + (4 * e + 2 * hh + sec if bit_path else 4 * hh + 2 * sec + e)
    np.testing.assert_array_equal(y, xp[:, src])


def test_wmatmul_decode_rule():
    """The Python mirror of the kernel's use_bit_path (it picks the activation order)."""
    bf16, f16, f32, u8 = jnp.bfloat16, jnp.float16, np.float32, np.uint8
    d = LP.wmatmul_decode
    assert d("nvfp4", bf16, False, u8) == d("nvfp4", f16, False, u8) == "bits"
    assert d("nvfp4", bf16, True, u8) == d("nvfp4", f16, True, u8) == "bits"
    assert d("mxfp4", bf16, False, u8) == d("mxfp4", f16, False, u8) == "bits"
    assert d("int4", f16, False, f16) == d("int4", bf16, False, bf16) == "bits"
    assert d("int4", bf16, False, f16) == "split"
    assert d("int4", f16, False, bf16) == d("int4", bf16, False, f32) == d("int4", f16, False, f32) == "table"
    assert d("nf4", bf16, False, f32) == d("bnb_fp4", f16, False, f32) == "table"
