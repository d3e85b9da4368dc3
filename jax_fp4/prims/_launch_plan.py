"""The launch policy of the fused W4A16 CUDA kernels (csrc/cuda/wmatmul/): one pure
function, :func:`wmatmul_plan`, of the problem (M, N, K, formats, dtypes, layout) and the
target GPU's :class:`~jax_fp4.prims._gpu.GpuProps`, fed by one tuning table,
:data:`TUNING`. Nothing here queries a device, so every rule is tested on CPU.

Every plan satisfies the W4A16 contract (docs/spec.md section 5); the choices are tuning
data, each limit the M up to which the fused kernel was faster than the CUDA dequantize
kernel + XLA's bf16 dot on H100 / H200 (the measurements: benchmarks/RESULTS.md and the
log, benchmarks/log/NOTES.md):

- sm_90a: the wgmma kernel from M = 1 up to :func:`wgmma_max_m`, by format and decode path
  (the table decode stops earlier than the bit path; a prepared weight never stops, since
  dequantize + dot would first have to restore the linear layout, a copy);
- other GPUs: the mma.sync kernels (direct up to M = 16, staged beyond) up to
  ``Tuning.max_m_mma_sync``;
- beyond: dequantize + dot (:func:`wmatmul_plan` returns None).

Private: the public modules (:mod:`jax_fp4.ops`, :mod:`jax_fp4.nn`) never import it.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import ml_dtypes
import numpy as np

from ._gpu import GpuProps


def _frozen(d):
    return dataclasses.field(default_factory=lambda: dict(d))


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The tuning table of :func:`wmatmul_plan` (replace fields with
    ``dataclasses.replace(TUNING, ...)`` to try other policies).

    formats: weight formats the fused kernels decode.
    max_m_mma_sync: most rows of x for the mma.sync kernels (GPUs without wgmma).
    max_m_wgmma: most rows of x for the wgmma kernel, per format (bf16 x, the bit path or
      the format's only decode).
    max_m_wgmma_folded: ... for nvfp4's folded decode (one multiply per pair).
    max_m_wgmma_decode: {(format, decode path, x dtype name): most rows} where a format
      decodes otherwise than its max_m_wgmma entry was measured on.
    max_m_wgmma_tiled: ... for a weight in the prepared layout (no limit).
    direct_max_m: most rows of x for the direct mma.sync kernel (the staged one beyond).
    geometry: {kernel: (rows per CTA, k per super-step, resident CTAs per SM, fewest
      super-steps per split)} for "direct", "staged" and the wgmma kernel by tile_m. The
      wgmma kernel splits K into runs of >= 12 steps (the smallest split count that fills
      the GPU was fastest).
    multicast_min_m: {format: fewest rows of x for 2-CTA clusters at tile_m = 256 that
      share x's tile by TMA multicast (None: never)}: half the L2 reads of x, at the cost
      of the pair waiting for each other every step; for nvfp4 only where the copies
      rather than the MMAs bound it, never for the table decode (bound by its lookups).
    multicast_min_m_tiled: ... for a prepared weight (one 1-D bulk copy per stage for its
      codes, scales and zero points runs faster without: never).
    wave_fill: the fraction of a wave's CTA slots a grid must keep busy for the split rule
      to stop, and for a ragged tail to take a second launch (:func:`wmatmul_head_rows`).
    grid_min_fill: the wave fill under which :func:`wmatmul_grid` considers other grids.
    grid_min_steps: ... and the fewest 128-k steps per K-split they may have.
    """
    formats: tuple = ("nvfp4", "mxfp4", "nf4", "bnb_fp4", "int4")
    max_m_mma_sync: int = 64
    max_m_wgmma: dict = _frozen({"nvfp4": 2048, "mxfp4": 4096, "nf4": 2048, "bnb_fp4": 2048,
                                 "int4": 4096})
    max_m_wgmma_folded: int = 4096
    max_m_wgmma_decode: dict = _frozen({("mxfp4", "bits", "float16"): 2048,
                                        ("int4", "split", "bfloat16"): 2048,
                                        ("int4", "table", "bfloat16"): 1024,
                                        ("int4", "table", "float16"): 1024})
    max_m_wgmma_tiled: float = float("inf")
    direct_max_m: int = 16
    geometry: dict = _frozen({"direct": (128, 256, 4, 1), "staged": (128, 128, 4, 2),
                              8: (128, 128, 2, 12), 16: (128, 128, 2, 12),
                              32: (128, 128, 2, 12), 64: (128, 128, 2, 12),
                              128: (128, 128, 1, 12), 256: (128, 128, 1, 12)})
    multicast_min_m: dict = _frozen({"nvfp4": 2048, "mxfp4": 512, "int4": 512, "nf4": None,
                                     "bnb_fp4": None})
    multicast_min_m_tiled: dict = _frozen({"nvfp4": None, "mxfp4": None, "int4": None,
                                           "nf4": None, "bnb_fp4": None})
    wave_fill: float = 0.9
    grid_min_fill: float = 0.5
    grid_min_steps: int = 2


TUNING = Tuning()


def _table(table):
    return TUNING if table is None else table


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch of the fused kernel (FFI target jax_fp4_wmatmul_v3, csrc/README.md).

    rows: x's rows [row0, row0 + rows) it computes; tile_m: activation rows per CTA of the
    wgmma kernel (0: the mma.sync kernels); splits: K-splits; cluster: CTAs per cluster (2:
    x multicast); final: the kernel writes the output dtype (one K-split; else float32
    partial sums that XLA adds and casts); bit_path: x in the bit path's pairing (else the
    table path's; wgmma only, :func:`jax_fp4.prims.wmatmul.wmatmul_x_layout`)."""
    row0: int
    rows: int
    tile_m: int
    splits: int
    cluster: int
    final: bool
    bit_path: bool

    @property
    def kernel(self) -> str:
        """"wgmma", "direct" or "staged" (mma.sync)."""
        if self.tile_m:
            return "wgmma"
        return "direct" if self.rows <= TUNING.direct_max_m else "staged"


@dataclasses.dataclass(frozen=True)
class WmatmulPlan:
    """How the fused kernel computes one W4A16 matmul.

    decode: :func:`wmatmul_decode`'s path; untile: a prepared weight is restored to the
    linear layout first (the mma.sync kernels read only that); tiled: the kernel reads the
    prepared layout (attribute ``tiled``); launches: one, or two where a ragged last
    256-row tile runs as a second launch (:func:`wmatmul_head_rows`)."""
    decode: str
    untile: bool
    tiled: bool
    launches: tuple


def wmatmul_decode(fmt, x_dtype, two_level, scale_dtype):
    """How the kernels decode this weight (csrc/cuda/wmatmul/launch.h use_bit_path, which
    also picks x's pairing): "bits" (bit placement and exact packed multiplies: one-level nvfp4,
    mxfp4, int4 with scales in x's dtype), "split" (int4 with f16 scales and bf16 x,
    AWQ's scales in a bf16 model: the bit path with each scale split into two bf16
    factors) or "table" (a shared-memory table and float32 arithmetic: everything else).
    The C++ rule is the definition and this a copy (x's pairing must match it): a
    disagreement shows as wrong products in tests/test_cuda_matmul.py, which runs every
    decode path on a GPU."""
    x_dtype, s = np.dtype(x_dtype), np.dtype(scale_dtype)
    if fmt in ("nvfp4", "mxfp4"):  # nvfp4's per-tensor scale multiplies the accumulator
        return "bits"
    if fmt == "int4" and s == x_dtype:
        return "bits"
    if fmt == "int4" and s == np.dtype(np.float16) and x_dtype == np.dtype(ml_dtypes.bfloat16):
        return "split"
    return "table"


def wmatmul_folded(fmt, x_dtype, two_level):
    """Whether the kernels decode with one multiply per pair by folding the bit placement's
    factor into the block scale and the accumulator: nvfp4 (one or two levels: the
    per-tensor scale multiplies the accumulator) with bf16 or f16 `x_dtype`
    (csrc/cuda/wmatmul/decode.cuh, kFold)."""
    return fmt == "nvfp4"


def wgmma_max_m(fmt, folded=False, tiled=False, decode="bits", x_dtype=ml_dtypes.bfloat16,
                table=None):
    """The most rows of x for which the wgmma kernel runs for weight format `fmt` (beyond
    it, dequantize + dot): max_m_wgmma_tiled for a weight in the prepared layout
    (`tiled`); max_m_wgmma_decode[fmt, decode, x dtype name] where the format decodes
    otherwise than its other limits were measured on (`decode`: wmatmul_decode's path);
    max_m_wgmma_folded where nvfp4's decode is one multiply per pair (`folded`); else
    max_m_wgmma[fmt]."""
    t = _table(table)
    if tiled:
        return t.max_m_wgmma_tiled
    key = (fmt, decode, np.dtype(x_dtype).name)
    if key in t.max_m_wgmma_decode:
        return t.max_m_wgmma_decode[key]
    return t.max_m_wgmma_folded if folded else t.max_m_wgmma[fmt]


def wmatmul_cluster(fmt, m, tile_m, tiled=False, table=None):
    """CTAs per cluster of the wgmma kernel: 2 (x multicast) at tile_m = 256 from
    multicast_min_m[fmt] rows of x (multicast_min_m_tiled for a prepared weight), else 1."""
    t = _table(table)
    min_m = (t.multicast_min_m_tiled if tiled else t.multicast_min_m)[fmt]
    return 2 if tile_m == 256 and min_m is not None and m >= min_m else 1


def wmatmul_tile_m(m, wgmma):
    """Activation rows per CTA of the wgmma kernel for M rows of x: 8, 16, 32, 64, 128 or
    256, the smallest that holds M (256 beyond); 0 (the mma.sync kernels) where the wgmma
    kernel cannot run (`wgmma`: whether it can)."""
    if not wgmma:
        return 0
    return 8 if m <= 8 else 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128 if m <= 128 else 256


def _fill(items, slots):
    """Fraction of `slots` resident CTA slots that `items` CTAs keep busy over their waves."""
    return items / (-(-items // slots) * slots)


def splits_fill_steps(n_steps, splits):
    """Whether `splits` K-splits of ceil(n_steps / splits) whole steps each leave none of
    them empty (the kernels split K in whole super-steps)."""
    return -(-n_steps // -(-n_steps // splits)) == splits


def wmatmul_splits(m, n, k, sms, tile_m=0, partials=0.25, min_steps=None, per_sm=None,
                   table=None):
    """K-splits S of the fused kernel (grid = ceil(N / rows) x M-chunks x S CTAs) on a GPU
    of `sms` SMs.

    The smallest S whose CTAs fill their waves to >= wave_fill of the resident slots
    (`per_sm` per SM, default the kernel's), with no empty split, at least `min_steps`
    super-steps per split (default the kernel's: 1 direct, 2 staged, 12 wgmma) and the
    float32 partial sums (S x M x N x 4 bytes) at most `partials` times the 4-bit codes'
    bytes; if none, the S of best wave efficiency (a split count past one full wave costs
    a second, mostly idle one)."""
    t = _table(table)
    direct = m <= t.direct_max_m
    kind = tile_m or ("direct" if direct else "staged")
    rows, step, kernel_per_sm, default_min_steps = t.geometry[kind]
    per_sm = per_sm or kernel_per_sm
    min_steps = min_steps or default_min_steps
    slots = per_sm * sms
    n_steps = -(-k // step)
    m_tile = tile_m or (m if direct else 64)
    ctas = -(-n // rows) * -(-m // m_tile)
    best, best_eff = 1, 0.0
    for s in range(1, max(1, min(n_steps // min_steps, int(partials * k / (8 * m)))) + 1):
        if not splits_fill_steps(n_steps, s):
            continue
        eff = _fill(ctas * s, slots)
        if eff >= t.wave_fill:
            return s
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


def _wave_fill(m, n, tile_m, splits, sms, table=None):
    """Fraction of the resident CTA slots the wgmma kernel's grid (ceil(N / 128) weight tiles
    x ceil(M / tile_m) activation tiles x splits) keeps busy over its waves."""
    rows, _, per_sm, _ = _table(table).geometry[tile_m]
    return _fill(-(-n // rows) * -(-m // tile_m) * splits, per_sm * sms)


def wmatmul_grid(m, n, k, wgmma, sms, table=None):
    """(tile_m, K-splits) of the fused kernel for M rows of x and a (K, N) weight:
    wmatmul_tile_m's tile and wmatmul_splits' splits, unless that wgmma grid keeps
    less than grid_min_fill (half) of the GPU's CTA slots busy (weights of few 128-row
    tiles: on the Llama shapes 4096 x 4096 at M <= 512, 14336 x 4096 at 150-512, 8192 x
    8192 at 129-256, the K / V projections 4096 x 1024 and 8192 x 1024 at every M). Then
    the splits may leave float32 partial sums of up to twice the codes' bytes and be as
    short as grid_min_steps steps, and aim at one CTA per SM (the kernels of two CTAs per
    SM too: at a few steps per split the second CTA on an SM did not pay), and a 256-row
    tile may become 128-row tiles: the grid that fills most of a wave (_wave_fill) wins,
    then the one with fewer splits, then the larger tile (on these shapes the filled grid
    was faster: benchmarks/RESULTS.md)."""
    t = _table(table)
    tile = wmatmul_tile_m(m, wgmma)
    splits = wmatmul_splits(m, n, k, sms, tile_m=tile, table=t)
    if tile == 0 or _wave_fill(m, n, tile, splits, sms, t) >= t.grid_min_fill:
        return tile, splits
    best = None
    for tm in ((256, 128) if tile == 256 else (tile,)):
        s = wmatmul_splits(m, n, k, sms, tile_m=tm, partials=2.0, min_steps=t.grid_min_steps,
                           per_sm=1, table=t)
        key = (round(_wave_fill(m, n, tm, s, sms, t), 2), -s, tm)
        best = max(best or key, key)
    return best[2], -best[1]


def wmatmul_head_rows(m, n, k, tile_m, sms, table=None):
    """Rows of x for a first launch when M = 256 q + r (q >= 1, 0 < r <= 128) at tile_m =
    256: the last r rows then take a second launch with the tile the size rule gives r
    (16-128 rows, or the mma.sync kernel) instead of a whole 256-row tile, which costs
    about as much as 256 rows. Only where the first launch alone fills >= wave_fill of a
    wave (ceil(N / 128) x q CTAs x its K-splits), so the second does not idle the GPU's
    other half. 0: one launch."""
    t = _table(table)
    r = m % 256
    if tile_m != 256 or m < 256 or r == 0 or r > 128:
        return 0
    head = m - r
    rows, _, per_sm, _ = t.geometry[256]
    items = -(-n // rows) * (head // 256) * wmatmul_splits(head, n, k, sms, tile_m=256, table=t)
    return head if items >= t.wave_fill * per_sm * sms else 0


def _is_16bit_float(dtype):
    return np.dtype(dtype).name in ("bfloat16", "float16")


def wmatmul_applies(m, n, k, *, fmt, block_size, x_dtype, scale_dtype, two_level, tiled,
                    gpu: GpuProps, table=None) -> bool:
    """Whether the fused kernel covers this call: x bf16/f16 with 1 <= M <= the size
    limit (wgmma_max_m where the wgmma kernel runs, by decode path: any M for a prepared
    weight; max_m_mma_sync elsewhere), a fused weight format, N >= 1, K % 32 == 0 and a
    power-of-two block_size >= 16. Raises nothing (a call it does not cover takes
    dequantize + dot)."""
    t = _table(table)
    if fmt not in t.formats:
        return False
    max_m = (wgmma_max_m(fmt, wmatmul_folded(fmt, x_dtype, two_level), tiled,
                         wmatmul_decode(fmt, x_dtype, two_level, scale_dtype), x_dtype, t)
             if wmatmul_tile_m(m, gpu.wgmma) else t.max_m_mma_sync)
    bs = block_size
    return (_is_16bit_float(x_dtype) and 1 <= m <= max_m
            and n >= 1 and k % 32 == 0 and bs >= 16 and bs & (bs - 1) == 0)


def _launches(row0, m, n, k, fmt, x_dtype, out_dtype, decode, tiled, gpu, t):
    tile_m, splits = wmatmul_grid(m, n, k, gpu.wgmma, gpu.sm_count, t)
    head = wmatmul_head_rows(m, n, k, tile_m, gpu.sm_count, t)
    if head:
        return (_launches(row0, head, n, k, fmt, x_dtype, out_dtype, decode, tiled, gpu, t)
                + _launches(row0 + head, m - head, n, k, fmt, x_dtype, out_dtype, decode,
                            tiled, gpu, t))
    cluster = wmatmul_cluster(fmt, m, tile_m, tiled, t)
    # K-splits leave float32 partials that XLA sums: summing them in the kernel, the
    # splits of a tile as one thread-block cluster, was slower on every shape measured
    # (clusters are placed per GPC and wait for their slowest split; benchmarks/log/NOTES.md)
    final = splits == 1 and np.dtype(out_dtype) in (np.dtype(x_dtype), np.dtype(np.float32))
    return (Launch(row0, m, tile_m, splits, cluster, final,
                   bool(tile_m) and decode != "table"),)


def wmatmul_plan(m, n, k, *, fmt, block_size, x_dtype, scale_dtype, out_dtype, two_level,
                 tiled, gpu: GpuProps, table=None) -> Optional[WmatmulPlan]:
    """The fused kernel's launch plan for y (M, N) = x (M, K) @ W (N, K)^T, or None where
    the fused kernel does not cover the call (:func:`wmatmul_applies`: dequantize + dot).

    fmt / block_size / two_level: the weight's format, block size and whether it has a
    per-tensor scale; x_dtype, scale_dtype, out_dtype: dtypes of x, the block-scale buffer
    and y; tiled: the weight is in the prepared layout (jax_fp4.prepare); gpu: the target
    GPU; table: the tuning table (default :data:`TUNING`). Pure: the same arguments give
    the same plan on every machine."""
    t = _table(table)
    if not wmatmul_applies(m, n, k, fmt=fmt, block_size=block_size, x_dtype=x_dtype,
                           scale_dtype=scale_dtype, two_level=two_level, tiled=tiled, gpu=gpu,
                           table=t):
        return None
    decode = wmatmul_decode(fmt, x_dtype, two_level, scale_dtype)
    untile = bool(tiled) and not gpu.wgmma  # the mma.sync kernels read the linear layout
    tiled = bool(tiled) and not untile
    return WmatmulPlan(decode, untile, tiled,
                       _launches(0, m, n, k, fmt, x_dtype, out_dtype, decode, tiled, gpu, t))
