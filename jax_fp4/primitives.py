"""The jax-fp4 primitives (a façade): each lives in its own module of :mod:`jax_fp4.prims`
(abstract eval, batching, autodiff and lowering together); this module re-exports the
names the rest of the package used to import from here.

New code imports from the modules themselves: :mod:`jax_fp4.prims.quantize`,
:mod:`~jax_fp4.prims.dequantize`, :mod:`~jax_fp4.prims.fake_quantize`,
:mod:`~jax_fp4.prims.tensor_scale`, :mod:`~jax_fp4.prims.wmatmul`,
:mod:`~jax_fp4.prims.scaled_matmul`, and the registration helpers from
:mod:`jax_fp4.prims._common`.
"""
from __future__ import annotations

from .prims._common import (BACKENDS, _at_front, _attrs, _def_impl, _fold, _has_target,
                            _kernel_ok, _register_lowerings, _unfold, get_backend, set_backend)
from .prims._gpu import GpuProps, gpu_props
from .prims.dequantize import _dequantize_ref, dequantize_p
from .prims.fake_quantize import fake_quantize_p, ste_mask
from .prims.quantize import _quantize_abstract, _quantize_ref, _swizzle, quantize_p
from .prims.scaled_matmul import (CUDNN_SCALED_PAIRS, scaled_matmul_bf16, scaled_matmul_cudnn,
                                  scaled_matmul_operand, scaled_matmul_p)
from .prims.tensor_scale import auto_tensor_scale, auto_tensor_scale_p
from .prims.wmatmul import fused_wmatmul_applies, wmatmul_p, wmatmul_x_layout

__all__ = ["BACKENDS", "_at_front", "_attrs", "_def_impl", "_fold", "_has_target", "_kernel_ok",
           "_register_lowerings", "_unfold", "get_backend", "set_backend", "GpuProps",
           "gpu_props", "_dequantize_ref", "dequantize_p", "fake_quantize_p", "ste_mask",
           "_quantize_abstract", "_quantize_ref", "_swizzle", "quantize_p", "CUDNN_SCALED_PAIRS",
           "scaled_matmul_bf16", "scaled_matmul_cudnn", "scaled_matmul_operand",
           "scaled_matmul_p", "auto_tensor_scale", "auto_tensor_scale_p",
           "fused_wmatmul_applies", "wmatmul_p", "wmatmul_x_layout"]
