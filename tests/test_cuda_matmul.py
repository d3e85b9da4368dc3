"""CUDA W4A16 fused matmul and block-scaled matmul vs the reference (GPU machine only).

The weights are decoded by the reference on the CPU device; the exact result is the
float64 sum of x * w over k, and the GPU result must lie within float32-accumulation
rounding of it: |got - exact| <= K * 2^-22 * sum_k |x w| (a wrong index, scale or
rounding shows up as an error of the order of sum_k |x w| itself).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4 as jf
from edge import make_input
from jax_fp4 import formats, layout
from jax_fp4.prims import _gpu as G, _launch_plan as LP, wmatmul as W
from jax_fp4.prims._common import _attrs
from jax_fp4.prims.scaled_matmul import scaled_matmul_cudnn

pytestmark = pytest.mark.gpu


def _require_wgmma(needed=True):
    """The CUDA kernels are loaded (a GPU test fails, not skips, without them); where the
    test needs the wgmma kernel, skip on GPUs or builds without sm_90a."""
    assert jf.capabilities()["kernels"]["cuda"], jf.capabilities()["load_error"]
    if needed and not G.wgmma_available():
        pytest.skip("the wgmma kernel needs a compute capability 9.0 GPU and an sm_90a build")


def _mma_only(monkeypatch):
    """Lower for the mma.sync kernels that GPUs without wgmma run (the lowering reads the
    target GPU's properties through jax_fp4.prims._gpu.gpu_props)."""
    sms = G.gpu_props().sm_count
    monkeypatch.setattr(G, "gpu_props", lambda ctx=None: G.GpuProps(8, sms))


# Every decode path of csrc/cuda/wmatmul/: the bit path (nvfp4 one level, mxfp4 with bf16
# x, int4 with scales in x's dtype, incl. 16-element groups, and int4 with f16 scales and
# bf16 x, the split scale) and the table path (nvfp4 with a per-tensor scale, nf4, bnb_fp4,
# mxfp4 with f16 x, int4 with other scale dtypes).
BF16, F16 = jnp.bfloat16, jnp.float16
W_CASES = [
    ("nvfp4", 16, {}, BF16), ("nvfp4", 16, {"tensor_scale": "auto"}, BF16), ("mxfp4", 32, {}, BF16),
    ("nf4", 64, {}, BF16), ("bnb_fp4", 32, {}, BF16), ("int4", 128, {}, BF16),
    ("int4", 128, {"scale_dtype": BF16}, BF16), ("int4", 16, {"scale_dtype": BF16}, BF16),
    ("int4", 32, {"scale_dtype": jnp.float32}, BF16),
    ("nvfp4", 16, {}, F16), ("nvfp4", 16, {"tensor_scale": "auto"}, F16), ("mxfp4", 32, {}, F16),
    ("int4", 64, {}, F16), ("int4", 16, {"scale_dtype": F16}, F16),
    ("int4", 128, {"scale_dtype": F16}, BF16), ("int4", 32, {"scale_dtype": BF16}, F16)]
# (M, K, N): M = 1, 4, 13, 17, 33, 100, 300 (the wgmma kernel with tile_m = 8, 8, 16, 32,
# 64, 128, 256, M ragged, two M tiles at 300; without wgmma, the mma family: the direct
# kernel up to 13, the staged kernel above); K not a multiple of the 128/256-k steps; N not a
# multiple of 128 (at 300: three 128-row weight tiles, so the last 2-CTA cluster of the
# BN = 256 kernel has a CTA wholly past N), and at 100 not a multiple of 4 either (the
# wgmma epilogue's one-output-per-store path; the others take its four-output stores)
SHAPES = [(1, 384, 200), (13, 1056, 136), (4, 4096, 520), (17, 416, 264), (33, 640, 136),
          (100, 384, 198), (300, 1056, 264)]


_TUNING = LP.TUNING


def _tune(monkeypatch, **fields):
    """Lower with these fields of the launch policy's tuning table replaced."""
    monkeypatch.setattr(LP, "TUNING", dataclasses.replace(LP.TUNING, **fields))


@pytest.fixture(autouse=True)
def _plain_grid():
    """The small weights here keep under half of the GPU busy, where wmatmul_grid would
    trade 256-row tiles for 128-row ones and add K-splits: keep the plain tile and split
    rule so that every tile width stays tested (test_fused_wgmma_grid_small_weights tests
    wmatmul_grid's choices)."""
    LP.TUNING = dataclasses.replace(_TUNING, grid_min_fill=0.0)
    yield
    LP.TUNING = _TUNING


def _gpu():
    return jax.devices("gpu")[0]


def _cpu():
    return jax.devices("cpu")[0]


def _k_for(k, bs):
    return k if k % bs == 0 else bs * (k // bs + 1)


def _ref_weight(q, dtype):
    """The weight as the reference decodes it for W4A16 (float32, rounded to x's dtype), as
    a float32 numpy array."""
    jf.set_backend("reference")
    try:
        return np.asarray(jax.jit(lambda q: q.dequantize(dtype))(q)).astype(np.float32)
    finally:
        jf.set_backend("auto")


def _exact_weight(q):
    """The (K, N) weight's exact real values in float64 (code x block scale x per-tensor
    scale; int4 (code - zero) x scale), with no rounding: y* of the W4A16 contract."""
    q = jf.unprepare(q) if q.scale_layout == "tiled" else q
    f = q.fmt
    data = np.asarray(q.data)
    codes = np.stack([data & 15, data >> 4], -1).reshape(data.shape[0], -1)
    if f.family in ("nvfp4", "mx"):
        vals = formats.decode_table(f.elem).astype(np.float64)[codes]
    elif f.family == "codebook":
        vals = f.table.astype(np.float64)[codes]
    else:
        vals = codes.astype(np.float64) - np.repeat(np.asarray(q.zeros, np.float64), q.block_size, 1)
    with np.errstate(invalid="ignore", over="ignore"):
        w = vals * np.repeat(np.asarray(q.scales).astype(np.float64), q.block_size, 1)
        if q.tensor_scale is not None:
            w = w * np.float64(np.asarray(q.tensor_scale))
    return w.T if q.axis == 0 else w


# u of the W4A16 contract (docs/spec.md): each decoded weight may be rounded once to x's dtype
_U = {np.dtype(jnp.bfloat16): 2.0**-8, np.dtype(jnp.float16): 2.0**-11, np.dtype(np.float32): 2.0**-24}


def _check(got, x, w, what, out_dtype=None, x_dtype=jnp.bfloat16):
    """got (M, N) vs y* = x (M, K) @ w (K, N) exact in float64 (w: _exact_weight), within
    the W4A16 contract |y - y*| <= (u + K 2^-24) sum |x w| (u: x_dtype's) plus the
    output's least subnormal; out_dtype: got is then rounded once to it (half an ulp
    more)."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    exact = x64 @ w64
    out_fi = jnp.finfo(out_dtype or np.float32)
    bound = ((_U[np.dtype(x_dtype)] + x64.shape[1] * 2.0**-24) * (np.abs(x64) @ np.abs(w64))
             + float(out_fi.smallest_subnormal))
    if out_dtype is not None:
        fi = jnp.finfo(out_dtype)
        top = np.maximum(np.abs(exact) + bound, float(fi.tiny))
        bound = bound + 0.5 * float(fi.eps) * 2.0 ** np.floor(np.log2(top))
    got = np.asarray(got, np.float64)
    assert got.shape == exact.shape, what
    err = np.abs(got - exact)
    bad = ~(err <= bound)
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} outside float32-accumulation "
                           f"rounding, e.g. got {got[bad][:4]} want {exact[bad][:4]}")


def _check_fused(fmt, bs, kw, dtype, m, k, n, family, rng, splits=None, cluster=None, w=None):
    """One fused matmul (float32 and x-dtype output) against the reference decode;
    `splits`, `cluster`: the K-splits and cluster CTAs the lowering must have chosen (None:
    any); `w`: the (K, N) weight (default: normal, each column at a random power of ten)."""
    k = _k_for(k, bs)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    if w is None:
        w = (rng.standard_normal((k, n)) * 10.0 ** rng.integers(-3, 3, size=(1, n))).astype(np.float32)
    assert w.shape == (k, n), (w.shape, k, n)
    q = jf.quantize(jax.device_put(jnp.asarray(w), _cpu()), fmt, axis=0, block_size=bs, **kw)
    w_ref = _exact_weight(q)
    qg, xg = jax.device_put(q, _gpu()), jax.device_put(x, _gpu())
    f32 = jax.jit(lambda x, q: jf.dot_general(x, q, (((1,), (0,)), ((), ())),
                                              preferred_element_type=jnp.float32))
    text = f32.lower(xg, qg).as_text()
    assert "jax_fp4_wmatmul_v3" in text, f"{fmt} M={m} K={k}: fused kernel not used"
    g = G.gpu_props()
    want_tile = LP.wmatmul_grid(m, n, k, g.wgmma, g.sm_count)[0]
    assert f"tile_m = {want_tile} " in text, (m, want_tile)
    assert (want_tile > 0) == (family == "wgmma"), m
    if splits is not None:
        assert f"splits = {splits} " in text, (m, k, splits)
    if cluster is not None:
        assert f"cluster = {cluster} " in text, (m, k, cluster)
    what = f"{fmt} {kw} {dtype.__name__} M={m} K={k} N={n} splits={splits}"
    _check(f32(xg, qg), np.asarray(x, np.float32), w_ref, what, x_dtype=dtype)
    # x's dtype out: the float32 sum rounded once. (Not compared bit for bit with the
    # float32 program's result cast: XLA may add the K-split partials in another order
    # when it fuses the cast, which moves results with cancellation by ulps.)
    y = jax.jit(lambda x, q: jf.dot_general(x, q, (((1,), (0,)), ((), ())),
                                            preferred_element_type=dtype))(xg, qg)
    assert y.dtype == np.dtype(dtype)
    _check(np.asarray(y, np.float32), np.asarray(x, np.float32), w_ref,
           f"{what} ({dtype.__name__} out)", dtype, x_dtype=dtype)


@pytest.mark.parametrize("family", ["wgmma", "mma"])
@pytest.mark.parametrize("fmt,bs,kw,dtype", W_CASES, ids=str)
def test_fused_wmatmul_matches_reference(fmt, bs, kw, dtype, family, rng, monkeypatch):
    """family: the kernels of this GPU (wgmma at every M on an sm_90a build on Hopper) or
    the mma.sync kernels that other GPUs run (wgmma switched off)."""
    _require_wgmma(family == "wgmma")
    if family == "mma":
        _mma_only(monkeypatch)
    _tune(monkeypatch, max_m_mma_sync=1 << 30)  # every M fused
    for m, k, n in SHAPES:
        _check_fused(fmt, bs, kw, dtype, m, k, n, family, rng)


def _one_hot_matmul(qg, w_ref, dtype, rows):
    """The fused matmul (float32 out) of x = one-hot rows (row i picks weight row rows[i])
    with the GPU QArray qg, and x @ w_ref in float64 (w_ref: the reference's decoded (K, N)
    weight). Each output is 1 * w plus exact zeros, so the two are equal bit for bit, NaN
    where 0 * inf is in the sum in both: a check of the kernel's decode."""
    x = np.zeros((len(rows), qg.shape[0]))
    x[np.arange(len(rows)), rows] = 1.0
    xg = jax.device_put(jnp.asarray(x, dtype), _gpu())
    f32 = jax.jit(lambda x, q: jf.dot_general(x, q, (((1,), (0,)), ((), ())),
                                              preferred_element_type=jnp.float32))
    assert "jax_fp4_wmatmul_v3" in f32.lower(xg, qg).as_text(), len(rows)
    with np.errstate(invalid="ignore"):  # 0 * inf
        want = x @ np.asarray(w_ref, np.float64)
    return np.asarray(f32(xg, qg)), want


@pytest.mark.parametrize("family", ["wgmma", "mma"])
@pytest.mark.parametrize("fmt,bs,kw,dtype", W_CASES, ids=str)
def test_fused_wmatmul_decode_bit_exact(fmt, bs, kw, dtype, family, rng, monkeypatch):
    """Each decode path's weights, read back through one-hot rows of x, in every kernel
    family (wgmma at tiles 8 .. 256; the mma.sync kernels other GPUs run, direct and
    staged), linear and prepared layouts: equal to the reference's decode rounded to x's
    dtype bit for bit where the kernels still decode that way (a 1-ulp decode error could
    hide in a sum's bound), and within the W4A16 contract for two-level NVFP4, whose
    per-tensor scale multiplies the accumulator."""
    _require_wgmma(family == "wgmma")
    if family == "mma":
        _mma_only(monkeypatch)
    _tune(monkeypatch, max_m_mma_sync=1 << 30)
    k, n = 256, 256
    w = (rng.standard_normal((k, n)) * 10.0 ** rng.integers(-3, 3, size=(1, n))).astype(np.float32)
    q = jf.quantize(jax.device_put(jnp.asarray(w), _cpu()), fmt, axis=0, block_size=bs, **kw)
    qs = [q] + ([jf.prepare(q)] if layout.tileable(fmt, bs, kw.get("scale_dtype", jnp.float32), k, n) else [])
    for qq in qs:
        qg, w_ref = jax.device_put(qq, _gpu()), _ref_weight(qq, dtype)
        for m in (5, 16, 32, 64, 100, 256):
            rows = rng.permutation(k)[:m]
            got, want = _one_hot_matmul(qg, w_ref, dtype, rows)
            what = f"{fmt} {kw} M={m} {qq.scale_layout}"
            if qq.tensor_scale is None:
                np.testing.assert_array_equal(got, want, err_msg=what)
            else:
                _check(got, np.eye(k)[rows], _exact_weight(qq), what, x_dtype=dtype)


@pytest.mark.parametrize("family", ["wgmma", "mma"])
def test_fused_int4_split_scale_specials(family, rng, monkeypatch):
    """int4 with f16 scales and bf16 x (the bit path with the scale split in two bf16
    factors, csrc/cuda/wmatmul/decode.cuh make_dec): scales from random f16 bits (subnormals,
    65504, +-0, low mantissa bits set) decoded bit for bit; an infinite or NaN scale makes
    its column NaN as in the reference ((q - z) * inf is inf or, where q = z, NaN, and a
    one-hot x adds 0 * inf)."""
    _require_wgmma(family == "wgmma")
    if family == "mma":
        _mma_only(monkeypatch)
    _tune(monkeypatch, max_m_mma_sync=1 << 30)
    k, n, bs = 256, 136, 32
    assert LP.wmatmul_decode("int4", jnp.bfloat16, False, jnp.float16) == "split"
    bits = rng.integers(0, 0x7c00, size=(n, k // bs), dtype=np.uint16)  # finite, >= 0
    bits |= (rng.random(bits.shape) < 0.5).astype(np.uint16) << 15  # either sign
    bits[0, :3] = (0x7bff, 0x0001, 0x03ff)  # 65504, the least subnormal, the largest one
    bits[1, :2] = (0x0000, 0x8000)  # +-0
    bits[7, 2], bits[9, 5], bits[11, 0] = 0x7c00, 0xfc00, 0x7e00  # inf, -inf, NaN
    q = jf.QArray(jnp.asarray(rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)),
                  jnp.asarray(bits).view(jnp.float16), None,
                  jnp.asarray(rng.integers(0, 16, size=(n, k // bs), dtype=np.uint8)),
                  format="int4", axis=0, shape=(k, n), dtype=jnp.bfloat16, block_size=bs)
    qg, w_ref = jax.device_put(q, _gpu()), _ref_weight(q, jnp.bfloat16)
    for m in (5, 64, 256):
        got, want = _one_hot_matmul(qg, w_ref, jnp.bfloat16, rng.permutation(k)[:m])
        np.testing.assert_array_equal(got, want, err_msg=f"M={m}")
        assert np.isnan(got[:, [7, 9, 11]]).all() and np.isfinite(np.delete(got, [7, 9, 11], 1)).all()


@pytest.mark.parametrize("family", ["wgmma", "mma"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
def test_fused_mxfp4_every_scale_bit_exact(dtype, family, rng, monkeypatch):
    """mxfp4's bit path at every E8M0 scale 0..255, x bf16 and f16 (f16: the scale as
    2^clamp(T + 14, -24, 15) then, past 2, 2^min(T - 1, 15) and 2^15: f16 subnormals,
    rounding to zero, overflow to inf; csrc/cuda/wmatmul/decode.cuh make_decs): output column c has
    scale c in block 1, whose codes are all zero but row `r0`'s (every code, both signs,
    across the columns); the other blocks are random codes at scales 2^-20..2^1. x = one-hot
    rows, r0 first: got equals x @ the reference's decoded weight in float64 bit for bit
    (an infinite weight makes 0 * inf = NaN in the rows that miss it, in both)."""
    _require_wgmma(family == "wgmma")
    if family == "mma":
        _mma_only(monkeypatch)
    _tune(monkeypatch, max_m_mma_sync=1 << 30)
    k, n, r0 = 256, 256, 45
    codes = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    codes[:, 16:32] = 0  # block 1 (k 32..63): +0 codes
    nib = (np.arange(n) % 15 + 1).astype(np.uint8)  # codes 1..15 at row r0
    codes[:, r0 // 2] = nib << 4 if r0 % 2 else nib
    scales = rng.integers(107, 129, size=(n, k // 32), dtype=np.uint8)
    scales[:, 1] = np.arange(n)
    q = jf.QArray(jnp.asarray(codes), jnp.asarray(scales).view(jnp.float8_e8m0fnu), None, None,
                  format="mxfp4", axis=0, shape=(k, n), dtype=jnp.float32, block_size=32)
    w_ref = _ref_weight(q, dtype).astype(np.float64)
    assert np.isinf(w_ref[r0]).any() and np.isnan(w_ref[r0, 255])  # (the cases exist)
    qg = jax.device_put(q, _gpu())
    for m in (5, 16, 64, 256):
        rows = np.concatenate([[r0], rng.permutation(np.delete(np.arange(k), r0))[:m - 1]])
        got, want = _one_hot_matmul(qg, w_ref, dtype, rows)
        np.testing.assert_array_equal(got, want, err_msg=f"M={m}")


# mxfp4's bit path multiplies by two scale factors, the second 1 unless E8M0 > 128; the
# wgmma kernel skips it where every lane of a warp has block scales <= 2 (csrc/cuda/
# wmatmul/decode.cuh, make_decs and mx_scale_fixup). The default
# weights above put most warps (16 output columns at 10^-3..10^2) on the second path, so
# here: weights whose blocks are all small (one multiply everywhere; a zero block, and a
# subnormal one whose scale is E8M0 = 0, 2^-127), the same with one large block in every
# 16th column (one step of each warp on two multiplies), and edge.make_input's columns
# (powers of ten from 10^-6 to 10^5, ties, zero and subnormal blocks; its huge values
# clipped to 10^6, where sums of K products would overflow float32), through every kernel
# family and tile width.
@pytest.mark.parametrize("family", ["wgmma", "mma"])
def test_fused_mxfp4_scale_ranges(family, rng, monkeypatch):
    _require_wgmma(family == "wgmma")
    if family == "mma":
        _mma_only(monkeypatch)
    _tune(monkeypatch, max_m_mma_sync=1 << 30)
    for m, k, n in SHAPES:
        k = _k_for(k, 32)
        small = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
        small[:32, 5] = rng.standard_normal(32) * 1e-39
        small[64:96, 6] = 0.0
        large = small.copy()
        large[32:64, ::16] *= np.float32(1e4)
        edge = np.clip(make_input(rng, n, k, "mxfp4", nonfinite=False).T, -1e6, 1e6)
        for w in (small, large, edge):
            _check_fused("mxfp4", 32, {}, BF16, m, k, n, family, rng, w=w)


# The size rule gives the wgmma kernel K-splits only for >= 12 steps per split (2 where the
# grid would fill under half of the GPU), which the small shapes above never reach; the
# big-shape benchmarks run S = 2-16. Forced here:
# K = 1056 is 9 steps of 128, so S = 2 / 4 / 5 split them 5+4 / 3+3+3+0 (an empty split)
# / 2+2+2+2+1, at each tile width (BN = 8 / 16 / 32 / 64 / 128 refilled by thread 0, 256 by
# the producer warpgroup) and through the bit and table decode paths. The nvfp4 / mxfp4 bit
# path at BN <= 32 stages two steps at a time (wg_sub), so a split of an odd step count
# copies one step past its end (the next split's, or zeros past K) that it must not use.
# K = 1152 is 9 whole steps: those stages take their codes as one 3-D box (stage_codes),
# K = 1056's as one 2-D box per step (its last step is partial).
@pytest.mark.parametrize("splits", [2, 4, 5])
@pytest.mark.parametrize("fmt,bs,kw,dtype", [W_CASES[0], W_CASES[1], W_CASES[3], W_CASES[7]],
                         ids=str)
def test_fused_wgmma_k_splits(fmt, bs, kw, dtype, splits, rng, monkeypatch):
    _require_wgmma()
    _tune(monkeypatch, max_m_mma_sync=1 << 30)
    monkeypatch.setattr(LP, "wmatmul_splits", lambda *a, **k: splits)
    for k in (1056, 1152):
        for m in (5, 13, 17, 33, 100, 300):
            _check_fused(fmt, bs, kw, dtype, m, k, 200, "wgmma", rng, splits)


# The wgmma kernel takes the block scales (and INT4 zero points) by TMA with each stage
# (scale boxes) where the scale rows are 16-byte multiples and wg_boxes allows (nvfp4 at BN
# = 8, 16, 32, where its stages hold two steps; the other formats at BN = 8, 16, 32, 128 and,
# where two CTAs per SM still fit, 64); the shapes above mostly do not qualify (K / block_size scale bytes per row), so
# they test the lanes' scale loads. K = 2048 qualifies for every format here (M = 5, 13, 17,
# 33, 100: BN = 8, 16, 32, 64, 128); N = 200 leaves rows past N in the last CTA's boxes;
# S = 3 starts two splits mid-row; S = 6 (3 steps each) starts stages of two at odd steps,
# whose scale bytes (nvfp4: 8 per step) then begin 8 bytes into the stage's 32-byte box.
@pytest.mark.parametrize("fmt,bs,kw,dtype", W_CASES, ids=str)
def test_fused_wgmma_scale_boxes(fmt, bs, kw, dtype, rng, monkeypatch):
    _require_wgmma()
    _tune(monkeypatch, max_m_mma_sync=1 << 30)
    for m in (5, 13, 17, 33, 100):
        _check_fused(fmt, bs, kw, dtype, m, 2048, 200, "wgmma", rng)
    for splits in (3, 6):
        monkeypatch.setattr(LP, "wmatmul_splits", lambda *a, _s=splits, **k: _s)
        for m in (5, 13):
            _check_fused(fmt, bs, kw, dtype, m, 2048, 200, "wgmma", rng, splits)


# The BN = 256 kernel in 2-CTA clusters that multicast x (forced from M = 1 here; the rule
# takes them from M = 512 or 2048, wmatmul_cluster): N = 264 is three 128-row weight tiles, so the second
# cluster has a CTA wholly past N that still copies its half of x for the other; N = 200
# ends inside the second CTA; S = 3 splits K (the pair shares the split's steps). Only
# who copies x changes, so the result equals the 1-CTA kernel's bit for bit.
@pytest.mark.parametrize("fmt,bs,kw,dtype", W_CASES, ids=str)
def test_fused_wgmma_multicast(fmt, bs, kw, dtype, rng, monkeypatch):
    _require_wgmma()
    for m, k, n, splits in ((300, 1056, 264, None), (129, 2048, 200, None), (520, 4096, 264, 3)):
        _tune(monkeypatch, multicast_min_m=dict.fromkeys(_TUNING.formats, 1))
        if splits is not None:
            monkeypatch.setattr(LP, "wmatmul_splits", lambda *a, s=splits, **k: s)
        _check_fused(fmt, bs, kw, dtype, m, k, n, "wgmma", rng, splits, cluster=2)
        kk = _k_for(k, bs)
        w = jnp.asarray(rng.standard_normal((kk, n)), jnp.float32)
        q = jax.device_put(jf.quantize(jax.device_put(w, _cpu()), fmt, axis=0, block_size=bs, **kw), _gpu())
        x = jax.device_put(jnp.asarray(rng.standard_normal((m, kk)), dtype), _gpu())
        got = {}
        for c, min_m in ((2, 1), (1, None)):
            _tune(monkeypatch, multicast_min_m=dict.fromkeys(_TUNING.formats, min_m))
            fn = jax.jit(lambda x, q: jf.matmul(x, q))  # a fresh trace for each rule
            assert f"cluster = {c} " in fn.lower(x, q).as_text(), (m, c)
            got[c] = np.asarray(fn(x, q), np.float32)
        np.testing.assert_array_equal(got[2], got[1], err_msg=f"{fmt} M={m} K={kk} N={n}")


# A weight in the prepared layout (jax_fp4.prepare: each 128-row x 128-k tile's codes,
# scales and zero points contiguous, copied by 1-D bulk copies) gives the linear layout's
# result bit for bit: the kernel decodes and accumulates the same steps in the same order.
# Every format case the layout applies to (int4 with float32 scales where none is named:
# quantize's choice for a float32 weight; int4 in groups of 16 and 32-groups with float32
# scales have too many scale bytes per step), every tile width (M = 1-300, two M tiles at
# 300), the bit and table paths, K = 1152 (9 steps: stages of two reach one step past K,
# which repeats the last step) with S = 1 / 2 / 5 K-splits (5 + 4, 2 + 2 + 2 + 2 + 1:
# splits of odd step counts), K = 2048, and 2-CTA clusters on N = 384 (3 tiles: the second
# cluster's second CTA lies past N and copies no weight bytes).
PREPARED_CASES = [c for c in W_CASES
                  if layout.tileable(c[0], c[1], c[2].get("scale_dtype", jnp.float32), 128, 128)]


@pytest.mark.parametrize("fmt,bs,kw,dtype", PREPARED_CASES, ids=str)
def test_fused_wgmma_prepared_layout(fmt, bs, kw, dtype, rng, monkeypatch):
    _require_wgmma()
    _tune(monkeypatch, max_m_mma_sync=1 << 30)
    cases = [(m, 1152, 256, s, None) for m in (1, 5, 13, 17, 33, 100, 300) for s in (None, 2, 5)]
    cases += [(m, 2048, 384, None, None) for m in (1, 16, 64)] + [(520, 2048, 384, 3, 2)]
    rule = LP.wmatmul_splits
    for m, k, n, splits, cluster in cases:
        monkeypatch.setattr(LP, "wmatmul_splits",
                            lambda *a, _s=splits, **kk: _s or rule(*a, **kk))
        _tune(monkeypatch, multicast_min_m_tiled=dict.fromkeys(_TUNING.formats, 1 if cluster else None))
        w = (rng.standard_normal((k, n)) * 10.0 ** rng.integers(-3, 3, size=(1, n))).astype(np.float32)
        q = jf.quantize(jax.device_put(jnp.asarray(w), _cpu()), fmt, axis=0, block_size=bs, **kw)
        qp = jf.prepare(q)
        assert qp.scale_layout == "tiled"
        x = jax.device_put(jnp.asarray(rng.standard_normal((m, k)), dtype), _gpu())
        f32 = jax.jit(lambda x, q: jf.dot_general(x, q, (((1,), (0,)), ((), ())),
                                                  preferred_element_type=jnp.float32))
        qg, qpg = jax.device_put(q, _gpu()), jax.device_put(qp, _gpu())
        text = f32.lower(x, qpg).as_text()
        assert "jax_fp4_wmatmul_v3" in text and "tiled = 1 " in text, (m, k, n)
        if splits:
            assert f"splits = {splits} " in text, (m, k, splits)
        if cluster:
            assert "cluster = 2 " in text, m
        got, want = np.asarray(f32(x, qpg)), np.asarray(f32(x, qg))
        np.testing.assert_array_equal(got, want, err_msg=f"{fmt} {kw} M={m} K={k} N={n} S={splits}")
        _check(got, np.asarray(x, np.float32), _exact_weight(q),
               f"{fmt} {kw} prepared M={m} K={k} N={n}", x_dtype=dtype)


@pytest.mark.parametrize("fmt,bs", [("int4", 128), ("nf4", 64)])
def test_prepared_weight_fused_past_linear_limit(fmt, bs, rng):
    """A prepared weight stays on the wgmma kernel past wgmma_max_m (where the linear
    layout takes dequantize + dot); M = that limit + 1 ends in a ragged 256-row tile."""
    _require_wgmma()
    k, n = 256, 256
    m = LP.wgmma_max_m(fmt) + 1
    w = (rng.standard_normal((k, n)) * 10.0 ** rng.integers(-3, 3, size=(1, n))).astype(np.float32)
    q = jf.quantize(jax.device_put(jnp.asarray(w), _cpu()), fmt, axis=0, block_size=bs)
    x = jax.device_put(jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16), _gpu())
    f32 = jax.jit(lambda x, q: jf.dot_general(x, q, (((1,), (0,)), ((), ())),
                                              preferred_element_type=jnp.float32))
    qg, qpg = jax.device_put(q, _gpu()), jax.device_put(jf.prepare(q), _gpu())
    linear, prepared = f32.lower(x, qg).as_text(), f32.lower(x, qpg).as_text()
    assert "jax_fp4_dequantize_v1" in linear and "jax_fp4_wmatmul_v3" not in linear
    assert "jax_fp4_wmatmul_v3" in prepared and "jax_fp4_dequantize_v1" not in prepared
    assert "tiled = 1 " in prepared
    _check(f32(x, qpg), np.asarray(x, np.float32), _exact_weight(q), f"{fmt} prepared M={m}")


def test_fused_wmatmul_nonfinite_and_vmap(rng):
    k, n = 256, 136
    w = rng.standard_normal((k, n)).astype(np.float32)
    q = jax.device_put(jf.quantize(jnp.asarray(w), "mxfp4", axis=0), _gpu())
    x = rng.standard_normal((3, 5, k)).astype(np.float32)
    x[1, 2, 7] = np.nan
    xg = jax.device_put(jnp.asarray(x, jnp.bfloat16), _gpu())
    y = np.asarray(jax.jit(jax.vmap(jf.matmul, in_axes=(0, None)))(xg, q), np.float32)
    assert np.isnan(y[1, 2]).all() and np.isfinite(np.delete(y.reshape(15, n), 7, 0)).all()
    want = np.asarray(jax.jit(jf.matmul)(xg.reshape(15, k), q), np.float32).reshape(3, 5, n)
    np.testing.assert_array_equal(y, want)
    # an MX block scale of 255 (NaN) poisons its output column only
    scales = np.asarray(q.scales).view(np.uint8).copy()
    scales[17, 3] = 255  # (N, K / 32) linear scales: output column 17, block 3
    q_nan = jf.QArray(q.data, jnp.asarray(scales).view(jnp.float8_e8m0fnu), None, None,
                      format="mxfp4", axis=0, shape=(k, n), dtype=jnp.float32, block_size=32)
    x2 = jax.device_put(jnp.ones((2, k), jnp.bfloat16), _gpu())
    y2 = np.asarray(jax.jit(jf.matmul)(x2, q_nan), np.float32)
    assert np.isnan(y2[:, 17]).all() and np.isfinite(np.delete(y2, 17, 1)).all()


@pytest.mark.parametrize("fmt,bs", [("nvfp4", 32), ("mxfp4", 16)])
def test_wmatmul_handler_rejects_foreign_block_size(fmt, bs):
    """The kernel decodes nvfp4 blocks of 16 and mxfp4 blocks of 32; a direct FFI call
    with another (valid-looking) block_size gets an error naming it, not a wrong sum."""
    assert jf.capabilities()["kernels"]["cuda"], jf.capabilities()["load_error"]  # registers
    m, k, n = 4, 256, 128
    args = jax.device_put((jnp.ones((m, k), jnp.bfloat16), jnp.zeros((n, k // 2), jnp.uint8),
                           jnp.zeros((n, k // bs), jnp.uint8), jnp.zeros((0,), jnp.uint8),
                           jnp.ones((n,), jnp.float32)), _gpu())
    call = jax.ffi.ffi_call(W._FUSED_TARGET,
                            jax.ShapeDtypeStruct((1, m, n), jnp.float32))
    with pytest.raises(Exception, match=rf"`block_size` = {bs}: the fused kernel decodes nvfp4"):
        jax.block_until_ready(jax.jit(lambda *a: call(
            *a, **_attrs(fmt, bs, two_level=False), splits=np.int64(1),
            tile_m=np.int64(0), cluster=np.int64(1), tiled=np.int32(0)))(*args))
    # only v3 is served (v1 / v2 were never released)
    from jax_fp4 import _ext
    assert not {"jax_fp4_wmatmul_v1", "jax_fp4_wmatmul_v2"} & set(_ext.registered_targets())
    # a cluster only for the tile_m = 256 kernel
    with pytest.raises(Exception, match=r"`cluster` = 2 must be 1, or 2 with tile_m = 256 \(got tile_m = 0\)"):
        jax.block_until_ready(jax.jit(lambda *a: call(
            *a, **_attrs(fmt, bs, two_level=False), splits=np.int64(1),
            tile_m=np.int64(0), cluster=np.int64(2), tiled=np.int32(0)))(*args))


def test_wmatmul_handler_rejects_bad_tiled_calls():
    """The prepared layout (attribute `tiled`) only on the wgmma kernel, with N and K
    multiples of 128 and the layouts jax_fp4.layout.tileable makes (blocks <= 128, <= 16
    scale and zero-point bytes per row and step): any other call gets an error naming the
    attribute."""
    assert jf.capabilities()["kernels"]["cuda"], jf.capabilities()["load_error"]  # registers
    call = lambda m, n: jax.ffi.ffi_call(W._FUSED_TARGET,  # noqa: E731
                                         jax.ShapeDtypeStruct((1, m, n), jnp.float32))
    u8, f32 = jnp.uint8, jnp.float32
    for fmt, bs, sdt, k, n, tile_m, tiled in (
            ("nvfp4", 16, u8, 256, 200, 8, 1), ("nvfp4", 16, u8, 288, 128, 8, 1),
            ("nf4", 256, f32, 512, 128, 8, 1), ("int4", 16, BF16, 256, 128, 8, 1),
            ("int4", 32, f32, 256, 128, 16, 1), ("mxfp4", 32, u8, 256, 128, 0, 1),
            ("mxfp4", 32, u8, 256, 128, 8, 2)):
        assert not layout.tileable(fmt, bs, sdt, n, k) or tile_m == 0 or tiled == 2
        m = 4
        zeros = jnp.zeros((n, k // bs) if fmt == "int4" else (0,), jnp.uint8)
        args = jax.device_put((jnp.ones((m, -(-k // 128) * 128 if tile_m else k), jnp.bfloat16),
                               jnp.zeros((n, k // 2), jnp.uint8), jnp.zeros((n, k // bs), sdt),
                               zeros, jnp.ones((n,), jnp.float32)), _gpu())
        with pytest.raises(Exception, match=r"attribute `tiled` = \d"):
            jax.block_until_ready(jax.jit(lambda *a: call(m, n)(
                *a, **_attrs(fmt, bs, two_level=False), splits=np.int64(1),
                tile_m=np.int64(tile_m), cluster=np.int64(1), tiled=np.int32(tiled)))(*args))


@pytest.mark.parametrize("m,k,n", [(33, 640, 136), (129, 1024, 264)])
def test_fused_wgmma_padded_x_rows(m, k, n, rng, monkeypatch):
    """The lowering pads x with zero rows to a multiple of tile_m (no activation box
    reaches past x); x with M rows (jax.export artifacts from before) gives the same
    result bit for bit; any other row count is refused with the counts named."""
    _require_wgmma()
    _tune(monkeypatch, max_m_mma_sync=1 << 30)
    x = jax.device_put(jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16), _gpu())
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    outs = []
    for fmt in ("nvfp4", "nf4"):
        q = jax.device_put(jf.quantize(jax.device_put(w, _cpu()), fmt, axis=0), _gpu())
        for pad in (True, False):
            if not pad:
                layout = W.wmatmul_x_layout
                monkeypatch.setattr(W, "wmatmul_x_layout", lambda x, b, t=1: layout(x, b))
            f = jax.jit(lambda x, q: jf.dot_general(x, q, (((1,), (0,)), ((), ())),
                                                    preferred_element_type=jnp.float32))
            text = f.lower(x, q).as_text()
            tile = LP.wmatmul_tile_m(m, G.gpu_props().wgmma)
            assert f"tile_m = {tile} " in text and tile > 0 and m % tile != 0
            assert (f"tensor<{-(-m // tile) * tile}x" in text) == pad  # x's rows as passed
            outs.append(np.asarray(f(x, q)))
            monkeypatch.undo()
            _tune(monkeypatch, max_m_mma_sync=1 << 30)
        np.testing.assert_array_equal(outs[-2], outs[-1], err_msg=fmt)
    # rows neither M nor M rounded up to tile_m
    kk, nn = 256, 128
    args = jax.device_put((jnp.ones((5, kk), jnp.bfloat16), jnp.zeros((nn, kk // 2), jnp.uint8),
                           jnp.zeros((nn, kk // 16), jnp.uint8), jnp.zeros((0,), jnp.uint8),
                           jnp.ones((nn,), jnp.float32)), _gpu())
    call = jax.ffi.ffi_call(W._FUSED_TARGET, jax.ShapeDtypeStruct((1, 4, nn), jnp.float32))
    with pytest.raises(Exception, match=r"buffer `x` must have the output's M = 4 rows, or M "
                                        r"rounded up to tile_m \(16\), got 5"):
        jax.block_until_ready(jax.jit(lambda *a: call(
            *a, **_attrs("nvfp4", 16, two_level=False), splits=np.int64(1),
            tile_m=np.int64(16), cluster=np.int64(1), tiled=np.int32(0)))(*args))


@pytest.mark.parametrize("fmt,bs,kw,dtype", [W_CASES[0], W_CASES[2], W_CASES[3]], ids=str)
def test_fused_wgmma_ragged_last_tile(fmt, bs, kw, dtype, rng, monkeypatch):
    """M = 300 on a weight wide enough for one full wave: the first 256 rows on the
    256-row tile, the last 44 in a second launch on the 64-row tile (wmatmul_head_rows);
    the result as the reference's."""
    _require_wgmma()
    _tune(monkeypatch, max_m_mma_sync=1 << 30)
    sms = G.gpu_props().sm_count
    m, k, n = 300, 256, 128 * sms
    assert LP.wmatmul_head_rows(m, n, k, 256, sms) == 256
    x = jax.device_put(jnp.zeros((m, k), dtype), _gpu())
    q = jax.device_put(jf.quantize(jnp.ones((k, n), jnp.float32), fmt, axis=0, block_size=bs, **kw), _gpu())
    text = jax.jit(lambda x, q: jf.matmul(x, q)).lower(x, q).as_text()
    assert text.count("jax_fp4_wmatmul_v3") == 2 and "tile_m = 256 " in text and "tile_m = 64 " in text
    _check_fused(fmt, bs, kw, dtype, m, k, n, "wgmma", rng)


# wmatmul_grid on weights of 32 128-row tiles: at M = 256 and K = 4096 the plain rule runs
# 32 CTAs of 256 rows (a quarter of an H100's SMs), the grid 128-row tiles in 2 K-splits;
# at M = 160, K = 2048 128-row tiles without splits; at M = 13 4 K-splits of 8 steps. On 8
# tiles (N = 1024) at M = 1, 16 K-splits of 2 steps.
@pytest.mark.parametrize("fmt,bs,kw,dtype", [W_CASES[0], W_CASES[3], W_CASES[6]], ids=str)
def test_fused_wgmma_grid_small_weights(fmt, bs, kw, dtype, rng, monkeypatch):
    _require_wgmma()
    _tune(monkeypatch, grid_min_fill=_TUNING.grid_min_fill)
    g = G.gpu_props()
    for m, k, n in ((256, 4096, 4096), (160, 2048, 4096), (13, 4096, 4096), (1, 4096, 1024)):
        tile, splits = LP.wmatmul_grid(m, n, k, g.wgmma, g.sm_count)
        plain = LP.wmatmul_tile_m(m, g.wgmma)
        assert (tile, splits) != (plain, LP.wmatmul_splits(m, n, k, g.sm_count, tile_m=plain)), (m, k, n)
        _check_fused(fmt, bs, kw, dtype, m, k, n, "wgmma", rng, splits)


def test_wmatmul_grad_and_large_m_path(rng):
    k, n = 512, 256
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    q = jax.device_put(jf.quantize(w, "nvfp4", axis=0), _gpu())
    x = jax.device_put(jnp.asarray(rng.standard_normal((8, k)), jnp.bfloat16), _gpu())
    g = jax.jit(jax.grad(lambda x: jf.matmul(x, q).astype(jnp.float32).sum()))(x)
    wd = np.asarray(q.dequantize(jnp.bfloat16), np.float32)
    np.testing.assert_allclose(np.asarray(g, np.float32)[0], wd.sum(1), rtol=1e-2, atol=1e-2)
    # the size rule: fused up to its limit, dequantize kernel + XLA dot past it
    folded = LP.wmatmul_folded("nvfp4", jnp.bfloat16, q.tensor_scale is not None)
    limit = (LP.wgmma_max_m("nvfp4", folded) if G.wgmma_available()
             else LP.TUNING.max_m_mma_sync)
    for m, fused in ((limit, True), (limit + 1, False)):
        xm = jax.device_put(jnp.zeros((m, k), jnp.bfloat16), _gpu())
        text = jax.jit(jf.matmul).lower(xm, q).as_text()
        assert ("jax_fp4_wmatmul_v3" in text) == fused, m
        assert ("jax_fp4_dequantize_v1" in text) == (not fused), m


@pytest.mark.parametrize("a_fmt,b_fmt", [("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"),
                                         ("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp6_e2m3", "mxfp8_e5m2")])
def test_cuda_scaled_matmul_matches_reference(a_fmt, b_fmt, rng):
    m, n, k = 100, 72, 320
    kw = {"tensor_scale": "auto"} if a_fmt == "nvfp4" else {}
    a = jf.quantize(jnp.asarray(rng.standard_normal((m, k)), jnp.float32), a_fmt, axis=1, **kw)
    b = jf.quantize(jnp.asarray(rng.standard_normal((n, k)) * 30, jnp.float32), b_fmt, axis=1,
                    **kw)
    bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
    ad = np.asarray(jax.device_put(a, _cpu()).dequantize(jnp.float32), np.float64)
    bd = np.asarray(jax.device_put(b, _cpu()).dequantize(jnp.float32), np.float64)
    got = jax.jit(lambda a, b, c: jf.scaled_matmul(a, b, alpha=0.5, bias=c,
                                                   out_dtype=jnp.float32))(
        *jax.device_put((a, b, bias), _gpu()))
    exact = 0.5 * (ad @ bd.T) + np.asarray(bias, np.float64)[None]
    bound = k * 2.0**-22 * (0.5 * np.abs(ad) @ np.abs(bd).T + np.abs(np.asarray(bias))[None])
    err = np.abs(np.asarray(got, np.float64) - exact)
    assert (err <= bound).all(), f"{a_fmt} x {b_fmt}: max err {err.max()} bound {bound.min()}"


@pytest.mark.parametrize("a_fmt,b_fmt", [("nvfp4", "nvfp4"), ("mxfp8_e4m3", "mxfp8_e5m2")])
def test_blackwell_path_through_xla_fallback(a_fmt, b_fmt, rng):
    """The sm_100+ path (jax.nn.scaled_matmul on our operands) run where XLA decomposes
    its block-scaled dot itself (Hopper): equal to the reference to float32 rounding."""
    import functools

    from jax_fp4.ops import _qarray_rows

    m, n, k = 128, 64, 256
    kw = {"tensor_scale": "auto"} if a_fmt == "nvfp4" else {}
    a = jf.quantize(jnp.asarray(rng.standard_normal((m, k)), jnp.float32), a_fmt, axis=1, **kw)
    b = jf.quantize(jnp.asarray(rng.standard_normal((n, k)), jnp.float32), b_fmt, axis=1, **kw)
    (ac, asc, _, ats), _, _ = _qarray_rows(a)
    (bc, bsc, _, bts), _, _ = _qarray_rows(b)
    fn = functools.partial(scaled_matmul_cudnn, a_fmt=a_fmt, b_fmt=b_fmt, k=k,
                           out_dtype=np.dtype(np.float32), impl="auto")
    args = jax.device_put((ac, asc, ats, bc, bsc, bts, jnp.float32(1.0), jnp.zeros(n)), _gpu())
    got = np.asarray(jax.jit(fn)(*args), np.float64)
    ad = np.asarray(jax.device_put(a, _cpu()).dequantize(jnp.float32), np.float64)
    bd = np.asarray(jax.device_put(b, _cpu()).dequantize(jnp.float32), np.float64)
    bound = k * 2.0**-22 * (np.abs(ad) @ np.abs(bd).T)
    assert (np.abs(got - ad @ bd.T) <= bound).all()


# Grouped calls (jax_fp4.group_matmuls): weights of one x in the prepared layout run as one
# launch of the wgmma kernel that reads them as one weight of their rows together
# (WMembers), each output within the W4A16 bound. Members of 128-384 rows (1-3 weight
# tiles each, so CTAs of every member run at once), K = 1152 (9 steps, splits of odd step
# counts), ragged M up to two 256-row tiles; 5 weights make a group of 4 and a single call.
GROUP_CASES = [PREPARED_CASES[i] for i in (0, 1, 2, 3, 4, 5)]


def _grouped_fn(n_weights):
    def fn(x, ws):
        return [jf.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
                for w in ws[:n_weights]]
    return fn


@pytest.mark.parametrize("fmt,bs,kw,dtype", GROUP_CASES, ids=str)
def test_grouped_wmatmul_one_launch(fmt, bs, kw, dtype, rng):
    _require_wgmma()
    k, ns = 1152, (256, 128, 384, 128, 256)
    qs = []
    for n in ns:
        w = (rng.standard_normal((k, n)) * 10.0 ** rng.integers(-3, 3, size=(1, n))).astype(np.float32)
        qs.append(jf.quantize(jax.device_put(jnp.asarray(w), _cpu()), fmt, axis=0, block_size=bs, **kw))
    qpg = [jax.device_put(jf.prepare(q), _gpu()) for q in qs]
    for m in (1, 5, 16, 33, 300):
        x = jax.device_put(jnp.asarray(rng.standard_normal((m, k)), dtype), _gpu())
        for count in (2, 3, 5):
            fn = jax.jit(jf.group_matmuls(_grouped_fn(count)))
            text = fn.lower(x, qpg).as_text()
            eqn = next(e for e in jax.make_jaxpr(jf.group_matmuls(_grouped_fn(count)))(
                x, qpg).jaxpr.eqns if e.primitive.name == "jax_fp4_weight_matmul_group")
            plan = W._plan([v.aval for v in eqn.invars], eqn.params, G.gpu_props(),
                           n=sum(ns[:min(count, 4)]))
            calls = len(plan.launches)
            if count == 5:  # the fifth weight on its own
                calls += len(W._plan([v.aval for v in eqn.invars], eqn.params, G.gpu_props(),
                                     n=ns[4]).launches)
            assert text.count("jax_fp4_wmatmul_v3") == calls, (fmt, m, count, calls)
            got = fn(x, qpg)
            for i, y in enumerate(got):
                _check(y, np.asarray(x, np.float32), _exact_weight(qs[i]),
                       f"{fmt} {kw} grouped M={m} weight {i} of {count}", x_dtype=dtype)


def test_grouped_wmatmul_linear_weights_run_one_by_one(rng):
    """Weights in the linear layout: the grouped call lowers to one launch per weight (the
    kernel reads several weights in the prepared layout only), with the results of
    ungrouped calls, bit for bit."""
    _require_wgmma()
    k = 256
    qs = [jax.device_put(jf.quantize(jnp.asarray(rng.standard_normal((k, n)), jnp.float32),
                                     "nvfp4", axis=0), _gpu()) for n in (128, 200)]
    x = jax.device_put(jnp.asarray(rng.standard_normal((4, k)), jnp.bfloat16), _gpu())
    fn = _grouped_fn(2)
    grouped = jax.jit(jf.group_matmuls(fn))
    assert "jax_fp4_weight_matmul_group" in str(jax.make_jaxpr(jf.group_matmuls(fn))(x, qs))
    assert grouped.lower(x, qs).as_text().count("jax_fp4_wmatmul_v3") == 2
    for a, b in zip(grouped(x, qs), jax.jit(fn)(x, qs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_wmatmul_handler_rejects_bad_groups():
    """A direct FFI call with a number of weight buffers that is not 4 per weight, more
    than 4 weights, or several weights outside the prepared layout gets an error naming
    what it expected."""
    assert jf.capabilities()["kernels"]["cuda"], jf.capabilities()["load_error"]  # registers
    m, k, n = 4, 256, 128
    weight = (jnp.zeros((n, k // 2), jnp.uint8), jnp.zeros((n, k // 16), jnp.uint8),
              jnp.zeros((0,), jnp.uint8), jnp.ones((1,), jnp.float32))
    x = jnp.ones((m, k), jnp.bfloat16)

    def run(bufs, n_out, tiled):
        call = jax.ffi.ffi_call(W._FUSED_TARGET, jax.ShapeDtypeStruct((1, m, n_out), jnp.float32))
        args = jax.device_put((x, *bufs), _gpu())
        return jax.block_until_ready(jax.jit(lambda *a: call(
            *a, **_attrs("nvfp4", 16, two_level=False), splits=np.int64(1),
            tile_m=np.int64(8 if tiled else 0), cluster=np.int64(1), tiled=np.int32(tiled)))(*args))

    with pytest.raises(Exception, match=r"4 buffers \(codes, scales, zeros, ts\) for each of 1 to 4 weights, got 7"):
        run(weight + weight[:3], 2 * n, 0)
    with pytest.raises(Exception, match=r"got 20 buffers"):
        run(weight * 5, 5 * n, 0)
    with pytest.raises(Exception, match=r"a call of 2 weights needs the prepared layout \(tiled = 1\)"):
        run(weight * 2, 2 * n, 0)
    run(weight * 2, 2 * n, 1)  # two weights in the prepared layout: accepted
