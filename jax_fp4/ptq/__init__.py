"""Post-training quantization beyond round-to-nearest, for every jax-fp4 weight format.

* :mod:`~jax_fp4.ptq.mse`: MSE-optimal block scales (incl. NVFP4's "4-over-6");
* :mod:`~jax_fp4.ptq.gptq`: GPTQ with each format's own quantizer;
* :mod:`~jax_fp4.ptq.awq`: AWQ-style activation-aware channel scaling, folded into the
  producer of a layer's input;
* :mod:`~jax_fp4.ptq.calibration`: the per-layer input statistics they need.

Every method stores the usual :class:`~jax_fp4.QArray` (codes exactly the format's
quantizer's for the chosen scales), so kernels and checkpoints work unchanged. The usual
entry point is ``jax_fp4.nn.quantize_params(..., method=..., calibration=...)``; see
docs/ptq.md.
"""
from .api import CALIBRATED, METHODS
from .awq import ALPHA_GRID, ScaleGroup, bert_groups
from .calibration import Calibration, LayerStats, collect_stats, stats_from_activations
from .gptq import inverse_hessian_factor
from .group import gptq_quantize, quantize_group, quantize_mse

__all__ = ["METHODS", "CALIBRATED", "quantize_group", "quantize_mse", "gptq_quantize",
           "inverse_hessian_factor", "Calibration", "LayerStats", "collect_stats",
           "stats_from_activations", "ScaleGroup", "bert_groups", "ALPHA_GRID"]
