"""AWQ-style activation-aware scaling (Lin et al. 2024, arXiv:2306.00978), for every format.

For a group of dense layers that read the same input x (K channels), AWQ multiplies the
input channels of their weights by s (K,) and divides the producer of x by s, so the float
model computes the same function while the channels with large activations get relatively
finer quantization:

  s = mean|x|^alpha / sqrt(max(mean|x|^alpha) * min(mean|x|^alpha))   (AutoAWQ's rule)

with alpha searched on a grid 0, 0.05, ..., 1 for the least output error on the
calibration data, sum over the group of tr(dW H dW^T), dW = W - Q(W diag s) diag(s)^-1,
H = sum x x^T (the Hessian of :class:`~jax_fp4.ptq.LayerStats`; alpha = 0 is plain RTN).

Folding needs a producer that is linear per channel and feeds only the group: a preceding
dense layer's output channels (kernel columns and bias), or a LayerNorm whose output goes
only to the group (pre-LN transformers). A :class:`ScaleGroup` names both sides; groups
are model-specific (:func:`bert_groups` for the post-LN BERT of jax_fp4.models.minilm,
where only value -> attention-output folds: each LayerNorm output also feeds a residual).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from ._common import QuantSpec, fast_qdq, to_rows
from .calibration import LayerStats
from .mse import candidate_scales
from .. import reference as R

__all__ = ["ScaleGroup", "ALPHA_GRID", "search_scales", "apply_scales", "bert_groups"]

ALPHA_GRID = tuple(float(a) for a in np.round(np.linspace(0.0, 1.0, 21), 3))


@dataclasses.dataclass(frozen=True)
class ScaleGroup:
    """One AWQ scaling site.

    Attributes:
      kernels: dotted paths of the 2-D weights that read x; their contraction axis is
        multiplied by s (axis 0 of a ``kernel`` (in, out), axis 1 of a ``weight`` (out, in)).
      producers: ((path, axis), ...) of the parameters divided by s along ``axis``: the
        previous layer's kernel columns (axis 1 of a Flax kernel, 0 of a PyTorch weight)
        and bias (axis 0), or a LayerNorm's scale and bias (axis 0).
    """

    kernels: Tuple[str, ...]
    producers: Tuple[Tuple[str, int], ...]


def _rtn_qdq(rows, spec, row_ts):
    xb = R._blocks(rows, spec.block_size)
    sd = jnp.float32
    scales, zeros = candidate_scales(xb, spec, row_ts, sd)
    z = None if zeros is None else zeros[0]
    ts = None if row_ts is None else row_ts[:, None]
    return fast_qdq(R._float(xb), spec, scales[0], z, ts).reshape(rows.shape)


@jax.jit(static_argnames=("spec",))
def _group_losses(rows_list, hessian, absmean, *, spec):
    """Output error of each alpha of ALPHA_GRID for kernels (N_i, K) sharing H (K, K)."""
    a = jnp.maximum(absmean, 1e-8)

    def loss(alpha):
        s = jnp.maximum(a ** alpha, 1e-4)
        s = s / jnp.sqrt(s.max() * s.min())
        tot = 0.0
        for rows in rows_list:
            scaled = rows * s[None, :]
            row_ts = spec.row_tensor_scale(scaled)
            d = rows - _rtn_qdq(scaled, spec, row_ts) / s[None, :]
            tot = tot + jnp.sum((d @ hessian) * d)
        return tot

    return jax.lax.map(loss, jnp.asarray(ALPHA_GRID, jnp.float32))


def search_scales(kernels: Sequence, axes: Sequence[int], stats: LayerStats,
                  spec: QuantSpec):
    """AWQ scale of one group (module docstring).

    Args:
      kernels: the group's 2-D weights; axes: the contraction axis of each.
      stats: the group's input statistics (one LayerStats: they read the same x).
      spec: the weight format.
    Returns:
      (s, alpha, losses): s (K,) float32 (all ones when alpha = 0 wins), the chosen
      alpha, and the loss of every alpha of :data:`ALPHA_GRID` (numpy).
    """
    rows = [to_rows(w, ax) for w, ax in zip(kernels, axes)]
    losses = np.asarray(_group_losses(rows, stats.hessian, stats.abs_mean, spec=spec))
    i = int(np.nanargmin(losses))
    alpha = ALPHA_GRID[i]
    a = np.maximum(np.asarray(stats.abs_mean, np.float64), 1e-8)
    s = np.maximum(a ** alpha, 1e-4)
    s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
    return jnp.asarray(s), alpha, losses


def apply_scales(flat: Dict[str, object], group: ScaleGroup, s, axes: Dict[str, int]):
    """Fold s into a flat {path: array} dict (new dict): the group's kernels multiplied
    along their contraction axis (``axes[path]``), the producers divided along theirs."""
    out = dict(flat)
    s = jnp.asarray(s, jnp.float32)

    def along(x, ax):
        shape = [1] * x.ndim
        shape[ax] = -1
        return s.reshape(shape).astype(x.dtype)

    for p in group.kernels:
        x = jnp.asarray(out[p])
        out[p] = x * along(x, axes[p])
    for p, ax in group.producers:
        x = jnp.asarray(out[p])
        out[p] = x / along(x, ax)
    return out


def bert_groups(num_layers: int, naming: str = "flax") -> Tuple[ScaleGroup, ...]:
    """The AWQ groups of a post-LN BERT encoder: value -> attention output per layer.

    Args:
      num_layers: encoder layers.
      naming: "flax" (jax_fp4.models.minilm paths, ``layers.{i}.value.kernel``) or "hf"
        (Hugging Face ``encoder.layer.{i}.attention.self.value.weight``).
    """
    groups = []
    for i in range(num_layers):
        if naming == "flax":
            v, o = f"layers.{i}.value", f"layers.{i}.attn_out"
            groups.append(ScaleGroup((f"{o}.kernel",), ((f"{v}.kernel", 1), (f"{v}.bias", 0))))
        elif naming == "hf":
            v = f"encoder.layer.{i}.attention.self.value"
            o = f"encoder.layer.{i}.attention.output.dense"
            groups.append(ScaleGroup((f"{o}.weight",), ((f"{v}.weight", 0), (f"{v}.bias", 0))))
        else:
            raise ValueError(f"naming: expected 'flax' or 'hf', got {naming!r}")
    return tuple(groups)
