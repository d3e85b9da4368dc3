"""MSE-optimal block scales: per block, the candidate scale with the least (optionally
weighted) squared error, the element codes being exactly the format's for that scale.

The candidates of each block (its RTN scale first, so a tie keeps RTN):

* nvfp4: the E4M3 block-scale code of amax/6 (RTN) and its neighbours -3 .. +2, plus the
  code of amax/4 and its neighbours ("4-over-6": mapping the block's amax to the E2M1 code
  4 instead of 6 trades saturation of nothing for a finer grid near zero);
* MX: the E8M0 exponent of RTN (floor or rceil) and its neighbours -2, -1, +1;
* nf4 / bnb_fp4: absmax * c for c in 1, 0.95, ..., 0.6 (clipping the block);
* int4: the group range [min, max] shrunk to [c*min, c*max] for the same c, its scale and
  zero point by the AutoAWQ rule (:func:`jax_fp4.reference.int4_scale_zero`).

The stored QArray has the usual layout, so every kernel and checkpoint path reads it.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import reference as R
from ..formats import E4M3
from ._common import QuantSpec, fast_qdq

__all__ = ["candidate_scales", "mse_block_scales", "SHRINK_GRID"]

#: multipliers of the block range tried for nf4, bnb_fp4 and int4
SHRINK_GRID = tuple(float(c) for c in np.round(np.linspace(1.0, 0.6, 9), 4))


def _nvfp4_codes(amax, row_ts, divisor, exact):
    """E4M3 code of clip(amax / divisor / row_ts, 2**-6, 448) (the RTN rule for
    divisor 6), by the reference's exact division or by XLA's float division."""
    div = R._div if exact else (lambda a, b: a / b)
    s = div(amax, divisor)
    if row_ts is not None:
        s = div(s, row_ts[..., :, None])
    s = jnp.clip(s, jnp.float32(2.0 ** -6), jnp.float32(448.0))
    return R.encode(R._bits(s), E4M3).astype(jnp.int32)


def _int4_scale_zero_fast(mn, mx, scale_dtype):
    s = R.round_f32_to(jnp.maximum(mx - mn, jnp.float32(1e-5)) / 15.0, scale_dtype)
    z = jnp.clip(-jnp.round(mn / s.astype(jnp.float32)), 0, 15)
    return s, z.astype(jnp.uint8)


def candidate_scales(xb, spec: QuantSpec, row_ts=None, scale_dtype=None, exact=True):
    """Candidate block scales of (R, nb, bs) float32-bit blocks, RTN's first.

    Args:
      exact: compute the nvfp4 / int4 candidates with the reference's exact division, so
        the first candidate is bit for bit the scale :func:`jax_fp4.quantize` picks;
        False uses XLA's float division (much faster to compile; the RTN-rule candidate
        may then differ by one code where the quotient is within an ulp of a rounding
        boundary). MX and codebook candidates need no division.
    Returns:
      (scales, zeros): (C, R, nb) in the buffer dtype of
      :func:`jax_fp4.reference.quantize_2d`, and (C, R, nb) uint8 zero points (int4) or
      None.
    """
    f = spec.format
    amax_b = jnp.max(xb & 0x7FFFFFFF, axis=-1)
    amax = R._float(amax_b)
    if f.family == "nvfp4":
        # one vectorised computation for both divisors (one copy of the division)
        c6, c4 = _nvfp4_codes(amax[None], row_ts, jnp.float32([6.0, 4.0])[:, None, None],
                              exact)
        cands = [c6 + d for d in (0, -3, -2, -1, 1, 2)] + [c4 + d for d in (-1, 0, 1)]
        return jnp.stack([jnp.clip(c, 1, E4M3.max_code) for c in cands]).astype(jnp.uint8), None
    if f.family == "mx":
        c0 = (R._e8m0_rceil(amax_b, f.elem) if spec.rceil
              else R._e8m0_floor(amax_b, f.elem.emax))
        return jnp.stack([jnp.clip(c0 + d, 0, 254) for d in (0, -2, -1, 1)]).astype(jnp.uint8), None
    if f.family == "codebook":
        return amax[None] * jnp.float32(SHRINK_GRID)[:, None, None], None
    key = R._ordered_key(xb)
    mn = R._float(R._from_ordered_key(jnp.min(key, axis=-1)))
    mx = R._float(R._from_ordered_key(jnp.max(key, axis=-1)))
    c = jnp.float32(SHRINK_GRID)[:, None, None]
    rule = R.int4_scale_zero if exact else _int4_scale_zero_fast
    return rule(mn[None] * c, mx[None] * c, scale_dtype)


def block_errors(xb, spec: QuantSpec, scales, zeros, row_ts, weight=None):
    """(R, nb) sum over each block of weight * (x - Q(x))**2 for the given scales."""
    x = R._float(xb)
    ts = None if row_ts is None else row_ts[:, None]
    d = x - fast_qdq(x, spec, scales, zeros, ts)
    d2 = d * d if weight is None else d * d * weight
    return jnp.sum(d2, axis=-1)


def _argmin_candidates(xb, spec, scales, zeros, row_ts, weight):
    """Per block, the candidate of least error (the first on ties: RTN)."""
    def step(best, cand):
        s, z = cand
        err = block_errors(xb, spec, s, z, row_ts, weight)
        bs_, bz, be = best
        take = err < be  # NaN (non-finite blocks) never wins: RTN stays
        bz = None if z is None else jnp.where(take, z, bz)
        return (jnp.where(take, s, bs_), bz, jnp.where(take, err, be)), None

    z0 = None if zeros is None else zeros[0]
    e0 = block_errors(xb, spec, scales[0], z0, row_ts, weight)
    rest = (scales[1:], None if zeros is None else zeros[1:])
    (s, z, _), _ = lax.scan(step, (scales[0], z0, e0), rest)
    return s, z


def mse_block_scales(w_rows, spec: QuantSpec, row_ts=None, weight=None, scale_dtype=None):
    """MSE-optimal block scales of a (R, K) float32 weight (blocked along K).

    Args:
      w_rows: (R, K) float32.
      spec: the format (:class:`~jax_fp4.ptq._common.QuantSpec`).
      row_ts: nvfp4 two-level: (R,) float32 decode scale (fixed), else None.
      weight: optional (K,) float32 non-negative importance of each input channel (e.g.
        the diagonal of the GPTQ Hessian): the error is sum weight * (x - Q(x))**2.
      scale_dtype: int4 scale dtype (default float32).
    Returns:
      (scales, zeros): (R, K/bs) in the buffer dtype of quantize_2d; zeros (R, K/bs)
      uint8 for int4, else None.
    """
    bs = spec.block_size
    r, k = w_rows.shape
    xb = R._blocks(w_rows.astype(jnp.float32), bs)
    wb = None if weight is None else jnp.asarray(weight, jnp.float32).reshape(1, k // bs, bs)
    sd = scale_dtype if scale_dtype is not None else jnp.float32
    scales, zeros = candidate_scales(xb, spec, row_ts, sd)
    return _argmin_candidates(xb, spec, scales, zeros, row_ts, wb)
