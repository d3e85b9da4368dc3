"""GPTQ (Frantar et al. 2023, arXiv:2210.17323) for every jax-fp4 weight format, in JAX.

For a linear layer y = x W^T with W (N, K) (blocked along K, the contraction axis) and
calibration inputs x, GPTQ quantizes W one input column at a time and spreads each
column's quantization error over the columns not yet quantized, weighted by the inverse
Hessian H = sum x x^T (K, K) of the layer's squared output error:

  H += damp * mean(diag H) * I                  (dampening)
  U = cholesky(H^-1) (upper)                    (the "Cholesky reformulation")
  for column j:  q_j = Q(w_j);  e_j = (w_j - q_j) / U[j, j];  w_{>j} -= e_j U[j, >j]

processed in lazy batches of 128 columns (the reformulation of the paper's section 3.3,
same result). Q is the format's own quantizer with the block's scale fixed *before* any of
the block's columns is quantized:

* in column order (``act_order=False``): when GPTQ reaches the first column of a block,
  the block's scale (and int4 zero point; the E4M3 scale of NVFP4 under its per-tensor
  scale, which is fixed from the original weight's amax) is chosen from the block's
  *current*, error-updated weights: by the RTN rule (``scale_search="rtn"``) or the MSE
  search of :mod:`jax_fp4.ptq.mse` (``"mse"``, each channel's error weighted by diag H),
  in float arithmetic (:func:`~jax_fp4.ptq.mse.candidate_scales` with ``exact=False``);
* with ``act_order=True`` columns are quantized in order of decreasing diag(H) (most
  active input channels first). Blocks are contiguous in the stored layout, so a block's
  columns are no longer processed together; its scale is fixed up front from the original
  weights (the "static groups" of AutoGPTQ), RTN or MSE, and every column uses its own
  block's scale.

The stored codes are exactly the format's encode (:func:`jax_fp4.reference.encode_blocks`)
of each column's value at the moment it was quantized, with the chosen scales; the QArray
has the usual layout. Input channels never seen (diag H = 0) get H[j, j] = 1 and keep
their weights.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .. import reference as R
from ._common import QuantSpec, fast_qdq
from .mse import _argmin_candidates, candidate_scales

__all__ = ["gptq_rows", "inverse_hessian_factor", "SCALE_SEARCHES"]

SCALE_SEARCHES = ("rtn", "mse")
LAZY_BATCH = 128


def inverse_hessian_factor(h, damp: float = 0.01):
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1 (U^T U = H^-1).

    Args:
      h: (K, K) float32 symmetric positive semi-definite (sum of x x^T).
      damp: relative dampening (GPTQ's ``percdamp``).
    Returns:
      (K, K) float32 upper-triangular U.
    """
    h = jnp.asarray(h, jnp.float32)
    d = jnp.diag(h)
    dead = d <= 0
    h = jnp.where(jnp.diag(dead), 1.0, h)
    d = jnp.diag(h)
    h = h + jnp.eye(h.shape[0], dtype=h.dtype) * (damp * jnp.mean(d))
    lower = jnp.linalg.cholesky(h)
    hinv = jax.scipy.linalg.cho_solve((lower, True), jnp.eye(h.shape[0], dtype=h.dtype))
    return jnp.linalg.cholesky(hinv).T


def _block_scales(cols, spec, row_ts, sd, scale_search, weight=None, exact=False):
    """Scales of (N, nb, bs) blocks (as bits) by RTN or MSE: (N, nb), zeros or None."""
    scales, zeros = candidate_scales(cols, spec, row_ts, sd, exact)
    if scale_search == "rtn":
        return scales[0], None if zeros is None else zeros[0]
    return _argmin_candidates(cols, spec, scales, zeros, row_ts, weight)


def gptq_rows(w_rows, h, spec: QuantSpec, *, damp=0.01, act_order=False, scale_search="rtn",
              row_ts=None, scale_dtype=None):
    """GPTQ on the canonical (N, K) view (jittable; module docstring).

    Args:
      w_rows: (N, K) float32 weight, blocked along K.
      h: (K, K) float32 Hessian, sum of x x^T over the calibration inputs.
      spec: the format; row_ts: nvfp4 two-level (N,) decode scale or None;
      scale_dtype: int4 scale dtype (default float32).
    Returns:
      (w_q, scales, zeros): w_q (N, K) float32 values handed to the quantizer (column j
      as it stood when quantized), and the block scales / zero points (reference buffer
      dtypes); the codes are ``reference.quantize_2d_with_scales(w_q, scales, zeros)``.
    """
    n, k = w_rows.shape
    bs = spec.block_size
    nb = k // bs
    sd = scale_dtype if scale_dtype is not None else jnp.float32
    w = w_rows.astype(jnp.float32)
    h = jnp.asarray(h, jnp.float32)
    diag_h = jnp.diag(h)
    if act_order:
        perm = jnp.argsort(-diag_h, stable=True)
        xb = R._blocks(w, bs)
        scales, zeros = _block_scales(xb, spec, row_ts, sd, scale_search,
                                      diag_h.reshape(1, nb, bs), exact=True)
        w = w[:, perm]
        h = h[perm][:, perm]
    else:
        perm = jnp.arange(k)
        scales = zeros = None
    u = inverse_hessian_factor(h, damp)
    bsz = bs * max(1, LAZY_BATCH // bs)
    if k % bsz:
        bsz = bs
    nbatch = k // bsz
    ts_col = row_ts  # per-row, like the (N,) scales of one column

    def quant_col(wc, s, z):
        return fast_qdq(wc[:, None], spec, s, z, ts_col)[:, 0]

    def batch_step(carry, b):
        w, wq_all, sc_all, z_all = carry
        i1 = b * bsz
        w1 = lax.dynamic_slice(w, (0, i1), (n, bsz))
        u1 = lax.dynamic_slice(u, (i1, i1), (bsz, bsz))

        def block_step(bcarry, t):
            w1, err1, wq1, sc_all, z_all = bcarry
            j0 = t * bs
            if act_order:
                blk = lax.dynamic_slice(perm, (i1 + j0,), (bs,)) // bs
                s_cols = scales[:, blk]
                z_cols = None if zeros is None else zeros[:, blk]
            else:
                cols = R._bits(lax.dynamic_slice(w1, (0, j0), (n, bs)))[:, None, :]
                dh = lax.dynamic_slice(diag_h, (i1 + j0,), (bs,)).reshape(1, 1, bs)
                s_blk, z_blk = _block_scales(cols, spec, row_ts, sd, scale_search, dh)
                blk_idx = (i1 + j0) // bs
                sc_all = lax.dynamic_update_slice(sc_all, s_blk, (0, blk_idx))
                s_cols = jnp.broadcast_to(s_blk, (n, bs))
                if z_blk is not None:
                    z_all = lax.dynamic_update_slice(z_all, z_blk, (0, blk_idx))
                    z_cols = jnp.broadcast_to(z_blk, (n, bs))
                else:
                    z_cols = None

            def col_step(ccarry, c):
                w1, err1, wq1 = ccarry
                j = j0 + c
                wc = lax.dynamic_index_in_dim(w1, j, axis=1, keepdims=False)
                s = lax.dynamic_index_in_dim(s_cols, c, axis=1, keepdims=False)
                z = None if z_cols is None else lax.dynamic_index_in_dim(
                    z_cols, c, axis=1, keepdims=False)
                q = quant_col(wc, s, z)
                urow = lax.dynamic_index_in_dim(u1, j, axis=0, keepdims=False)
                e = (wc - q) / urow[j]
                w1 = w1 - e[:, None] * urow[None, :]
                err1 = lax.dynamic_update_index_in_dim(err1, e, j, axis=1)
                wq1 = lax.dynamic_update_index_in_dim(wq1, wc, j, axis=1)
                return (w1, err1, wq1), None

            (w1, err1, wq1), _ = lax.scan(col_step, (w1, err1, wq1), jnp.arange(bs))
            return (w1, err1, wq1, sc_all, z_all), None

        zero = jnp.zeros((n, bsz), jnp.float32)
        (w1, err1, wq1, sc_all, z_all), _ = lax.scan(
            block_step, (w1, zero, zero, sc_all, z_all), jnp.arange(bsz // bs))
        # lazy batch update of the columns after this batch (U is upper triangular, so
        # columns before it are untouched; the batch's own columns are done already)
        urows = lax.dynamic_slice(u, (i1, 0), (bsz, k))
        w = w - err1 @ urows
        wq_all = lax.dynamic_update_slice(wq_all, wq1, (0, i1))
        return (w, wq_all, sc_all, z_all), None

    if act_order:
        sc0, z0 = scales, zeros
    else:  # filled block by block
        f = spec.format
        sc_dtype = {"nvfp4": jnp.uint8, "mx": jnp.uint8, "codebook": jnp.float32}.get(
            f.family, sd)
        sc0, z0 = jnp.zeros((n, nb), sc_dtype), None
    z0 = jnp.zeros((n, nb), jnp.uint8) if z0 is None else z0
    (w, wq, sc, z), _ = lax.scan(batch_step, (w, jnp.zeros((n, k), jnp.float32), sc0, z0),
                                 jnp.arange(nbatch))
    wq = wq[:, jnp.argsort(perm)]
    return wq, sc, (z if spec.format.has_zeros else None)
