"""Test inputs shared by the reference, kernel and API tests: fresh random data plus the
edge values docs/spec.md section 3 singles out (ties, zeros, -0.0, subnormals, huge, Inf,
NaN)."""
import numpy as np

from jax_fp4.formats import FORMAT_NAMES, decode_table, get_format

F32_MAX = np.float32(3.4028235e38)
EDGE = np.float32([0.0, -0.0, 1e-40, -1e-40, 1e-45, 2.0 ** -126, 3e38, -3e38, F32_MAX,
                   -F32_MAX, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 7.0, 1e-20])


def element_ties(fmt: str) -> np.ndarray:
    """Midpoints between consecutive representable element values (rounding ties)."""
    f = get_format(fmt)
    table = f.table if f.table is not None else (
        decode_table(f.elem) if f.elem is not None else np.arange(16, dtype=np.float32))
    v = np.unique(table[np.isfinite(table)])
    return ((v[:-1] + v[1:]) / 2).astype(np.float32)


def make_input(rng, rows: int, k: int, fmt: str, *, edge=True, nonfinite=True,
               block_size=None) -> np.ndarray:
    """(rows, k) float32: random normal at mixed scales, ties, edge values, a NaN block,
    an Inf block, an all-zero block and an all-subnormal block (when there is room)."""
    f = get_format(fmt)
    bs = block_size or f.default_block
    scales = np.float32(10.0) ** rng.integers(-6, 6, size=(rows, 1))
    x = (rng.standard_normal((rows, k)) * scales).astype(np.float32)
    flat = x.reshape(-1)
    n = flat.size
    if edge and n >= 64:
        ties = element_ties(fmt)
        idx = rng.choice(n, size=min(n // 4, 4 * len(ties)), replace=False)
        flat[idx] = rng.choice(ties, size=len(idx)) * np.float32(2.0) ** rng.integers(
            -3, 3, size=len(idx))
        idx = rng.choice(n, size=min(n // 8, len(EDGE)), replace=False)
        flat[idx] = EDGE[: len(idx)]
    blocks = x.reshape(-1, bs)
    nb = blocks.shape[0]
    if edge and nb >= 6:
        picks = rng.choice(nb, size=4, replace=False)
        blocks[picks[0]] = 0.0
        blocks[picks[1]] = (rng.standard_normal(bs) * 1e-39).astype(np.float32)
        if nonfinite:
            blocks[picks[2], rng.integers(bs)] = np.nan
            blocks[picks[3], rng.integers(bs)] = rng.choice([np.inf, -np.inf])
    return x


def bits_equal(a, b) -> np.ndarray:
    """Elementwise: identical bits, or both NaN (any payload/sign)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind in "iub":
        return a == b
    # floats, ml_dtypes included (bfloat16, float8_*): same bits, or NaN on both sides
    both_nan = np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32))
    ua, ub = a.view(f"u{a.dtype.itemsize}"), b.view(f"u{b.dtype.itemsize}")
    return (ua == ub) | both_nan


def assert_bits_equal(a, b, msg=""):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, f"{msg}: shape {a.shape} != {b.shape}"
    assert a.dtype == b.dtype, f"{msg}: dtype {a.dtype} != {b.dtype}"
    eq = bits_equal(a, b)
    if not eq.all():
        bad = np.argwhere(~eq)[:5]
        raise AssertionError(f"{msg}: {int((~eq).sum())} of {eq.size} differ; first at "
                             f"{bad.tolist()}: {a[tuple(bad.T)]} vs {b[tuple(bad.T)]}")


def assert_matmul_close(got, a, b, *, scale=1.0, bias=None, msg=""):
    """got ~ scale * a @ b (+ bias) to float32-accumulation rounding: the exact float64
    result, with |error| <= K * 2^-22 * (|scale| |a| @ |b| + |bias|) element-wise (a
    wrong operand, index or scale shows as an error of the order of the sum itself)."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    exact = scale * (a64 @ b64)
    mag = abs(scale) * (np.abs(a64) @ np.abs(b64))
    if bias is not None:
        exact = exact + np.asarray(bias, np.float64)
        mag = mag + np.abs(np.asarray(bias, np.float64))
    err = np.abs(np.asarray(got, np.float64) - exact)
    bound = a64.shape[-1] * 2.0**-22 * mag + 1e-30
    bad = ~(err <= bound)
    assert not bad.any(), (f"{msg}: {bad.sum()} of {bad.size} beyond float32 rounding; max "
                           f"error {err.max():.3g}, got {np.asarray(got)[bad][:3]}, "
                           f"want {exact[bad][:3]}")


def kernel_cases(codebook_blocks, int4):
    """(format, block size, options) for every format, for the tests of a kernel against
    the reference: nvfp4 with and without the per-tensor scale, MX with both scale
    roundings, the codebook formats at each of `codebook_blocks`, and INT4 as the
    (block size, options) pairs of `int4` (the CUDA kernels take blocks of 16 * 2^k)."""
    cases = []
    for fmt in FORMAT_NAMES:
        family = get_format(fmt).family
        if family == "nvfp4":
            cases += [(fmt, 16, {}), (fmt, 16, {"tensor_scale": "auto"})]
        elif family == "mx":
            cases += [(fmt, 32, {}), (fmt, 32, {"scale_rounding": "rceil"})]
        elif family == "codebook":
            cases += [(fmt, bs, {}) for bs in codebook_blocks]
        else:
            cases += [(fmt, bs, dict(opts)) for bs, opts in int4]
    return cases
