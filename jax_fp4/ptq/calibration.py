"""Calibration statistics of the inputs of each dense layer, for GPTQ and AWQ.

A layer is described by its input activations x (..., K) through :class:`LayerStats`:
the Hessian ``sum x x^T`` (K, K), the per-channel ``sum |x|`` (K,) and the token count,
all float32 sums (so batches and sources add up). Three ways to get them:

* a Flax NNX model: :func:`collect_stats` runs ``forward(model, batch)`` jitted over the
  batches (tqdm progress bar) with every ``nnx.Linear`` wrapped by a recorder, and keys the
  statistics by the kernel's dotted path (``"layers.0.query.kernel"``), the names
  :func:`jax_fp4.nn.quantize_params` uses; pass it as ``calibration=Calibration(batches,
  forward, mask)`` and quantize_params collects them itself;
* any other model: capture the input of each Linear yourself (e.g. a hook of your model,
  ``flax.linen`` ``capture_intermediates``, a PyTorch forward hook) and pass
  ``calibration={kernel path: activations (..., K)}`` or ``{kernel path: LayerStats}``;
  :func:`stats_from_activations` does the conversion;
* padding tokens: ``mask(batch)`` returns weights shaped like the activations' leading
  axes (e.g. the (batch, seq) attention mask) so padded positions do not count.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Iterable, Optional

import jax
import jax.numpy as jnp

__all__ = ["LayerStats", "Calibration", "collect_stats", "stats_from_activations"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerStats:
    """Sums over the calibration tokens of a layer's input x (K features).

    Attributes:
      hessian: (K, K) float32, sum of x x^T (GPTQ's H up to a factor 2/count).
      abs_sum: (K,) float32, sum of |x| (AWQ's activation magnitude, times count).
      count: float32 scalar, number of (weighted) tokens.
    """

    hessian: Any
    abs_sum: Any
    count: Any

    @classmethod
    def zeros(cls, k: int) -> "LayerStats":
        return cls(jnp.zeros((k, k), jnp.float32), jnp.zeros((k,), jnp.float32),
                   jnp.zeros((), jnp.float32))

    @classmethod
    def of(cls, x, weights=None) -> "LayerStats":
        """Statistics of activations x (..., K), optionally weighted per token by
        ``weights`` shaped like x.shape[:-1] (0 drops a token)."""
        x = jnp.asarray(x, jnp.float32)
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        if weights is None:
            wt = jnp.ones((x2.shape[0],), jnp.float32)
        else:
            weights = jnp.asarray(weights, jnp.float32)
            if weights.shape != x.shape[:-1]:
                raise ValueError(f"mask: expected weights shaped like the activations' "
                                 f"leading axes {x.shape[:-1]}, got {weights.shape}")
            wt = weights.reshape(-1)
        xw = x2 * wt[:, None]
        return cls(xw.T @ x2, jnp.abs(xw).sum(0), wt.sum())

    def __add__(self, other: "LayerStats") -> "LayerStats":
        return LayerStats(self.hessian + other.hessian, self.abs_sum + other.abs_sum,
                          self.count + other.count)

    @property
    def abs_mean(self):
        """(K,) mean |x| per input channel."""
        return self.abs_sum / jnp.maximum(self.count, 1.0)

    def scaled_inputs(self, s) -> "LayerStats":
        """Statistics of x / s (s (K,) per-channel): H -> D^-1 H D^-1 with D = diag(s)."""
        r = 1.0 / jnp.asarray(s, jnp.float32)
        return LayerStats(self.hessian * r[:, None] * r[None, :], self.abs_sum * r,
                          self.count)


@dataclasses.dataclass
class Calibration:
    """Calibration data for an NNX model: what :func:`collect_stats` needs.

    Attributes:
      batches: iterable of model inputs (any pytree ``forward`` takes); a list is reused
        as is, any other iterable is consumed once.
      forward: ``(model, batch) -> anything`` (default ``model(batch)``).
      mask: optional ``batch -> weights`` shaped like the Linear inputs' leading axes.
    """

    batches: Iterable
    forward: Optional[Callable] = None
    mask: Optional[Callable] = None


def stats_from_activations(acts: dict) -> dict:
    """{path: activations (..., K) or LayerStats} -> {path: LayerStats}."""
    out = {}
    for k, v in acts.items():
        out[k] = v if isinstance(v, LayerStats) else LayerStats.of(v)
    return out


_MASK = []  # the current batch's token weights while a recording forward is traced


def collect_stats(model, batches: Iterable, forward: Optional[Callable] = None,
                  mask: Optional[Callable] = None, *, progress: bool = True,
                  paths: Optional[Iterable[str]] = None) -> dict:
    """Input statistics of every ``nnx.Linear`` of an NNX model over calibration batches.

    The model is cloned and each ``nnx.Linear`` of the clone wrapped by a recorder that
    adds :meth:`LayerStats.of` of its input to float32 sums; ``forward`` runs under
    ``nnx.jit`` (one compilation when all batches share a shape). ``model`` is unchanged.

    Args:
      model: a ``flax.nnx.Module``.
      batches: iterable of inputs of ``forward``.
      forward: ``(model, batch) -> anything``; default ``model(batch)``.
      mask: ``batch -> weights`` of the tokens (see the module docstring), or None.
      progress: tqdm progress bar on stderr (if tqdm is installed).
      paths: record only these ``"<module path>.kernel"`` (default: every Linear).
    Returns:
      {f"{path}.kernel": LayerStats} for every recorded Linear that saw input, in the
      order the forward pass first calls them.
    Raises:
      ValueError: no batch, or no Linear layer in the model.
    """
    from flax import nnx

    class Stat(nnx.Variable):
        pass

    class Recorder(nnx.Module):
        def __init__(self, inner, k, key):
            self.inner, self.key = inner, key
            z = LayerStats.zeros(k)
            self.h, self.a, self.n = Stat(z.hessian), Stat(z.abs_sum), Stat(z.count)

        def __call__(self, x, *args, **kwargs):
            order.setdefault(self.key, len(order))  # at trace time: the call order
            st = LayerStats.of(x, _MASK[-1] if _MASK and _MASK[-1] is not None else None)
            self.h.set_value(self.h.get_value() + st.hessian)
            self.a.set_value(self.a.get_value() + st.abs_sum)
            self.n.set_value(self.n.get_value() + st.count)
            return self.inner(x, *args, **kwargs)

    from ..nn.flax import _set_module

    model = nnx.clone(model)
    rec, order = {}, {}
    wanted = None if paths is None else set(paths)
    for path, m in list(nnx.iter_modules(model)):
        key = ".".join(map(str, path)) + ".kernel"
        if type(m) is nnx.Linear and path and (wanted is None or key in wanted):
            rec[key] = Recorder(m, m.in_features, key)
            _set_module(model, path, rec[key])
    if not rec:
        raise ValueError("model: no flax.nnx.Linear layer to calibrate")
    fwd = forward or (lambda m, b: m(b))

    def step(m, batch):
        _MASK.append(None if mask is None else mask(batch))
        try:
            return fwd(m, batch)
        finally:
            _MASK.pop()

    jstep = nnx.jit(step)
    it = batches
    if progress:
        try:
            from tqdm.auto import tqdm

            it = tqdm(batches, desc="calibration", unit="batch", file=sys.stderr,
                      leave=False)
        except ImportError:
            pass
    n = 0
    for batch in it:
        jax.block_until_ready(jstep(model, batch))
        n += 1
    if n == 0:
        raise ValueError("batches: empty; calibration needs at least one batch")
    keys = sorted(rec, key=lambda k: order.get(k, len(order)))
    return {k: LayerStats(rec[k].h.get_value(), rec[k].a.get_value(), rec[k].n.get_value())
            for k in keys if float(rec[k].n.get_value()) > 0}
