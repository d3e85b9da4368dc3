"""jax-fp4: 4-bit and micro-scaled number formats as first-class JAX citizens.

Formats (docs/spec.md section 3): nvfp4, mxfp4, mxfp6_e2m3, mxfp6_e3m2, mxfp8_e4m3,
mxfp8_e5m2, nf4, bnb_fp4, int4. The pure-jnp :mod:`jax_fp4.reference` defines the
semantics; CPU (C++) and CUDA kernels registered as XLA FFI targets match it bit for bit.
"""
from . import _ext, formats, reference, sharding
from .formats import FORMAT_NAMES, Format, get_format
from .grouping import group_matmuls
from .ops import (dequantize, dot_general, fake_quantize, from_blocked, matmul, prepare,
                  quantize, scaled_matmul, scaled_matmul_operands, tensor_scale_from_amax,
                  to_blocked, unprepare)
from .prims._common import get_backend, set_backend
from .qarray import QArray

__version__ = "0.1.0"


def capabilities() -> dict:
    """What this install can run.

    Returns:
      dict with ``backend`` (current backend name), ``kernels`` ({"cpu": bool,
      "cuda": bool}), ``targets`` ({ffi target: [platforms]}), ``build`` (the extension's
      build info) and ``load_error`` (why the extension did not load, or None).
    """
    return {
        "backend": get_backend(),
        "kernels": {p: _ext.has_kernels(p) for p in ("cpu", "cuda")},
        "targets": _ext.registered_targets(),
        "build": _ext.build_info(),
        "load_error": _ext.load_error(),
        "formats": FORMAT_NAMES,
    }


def export_disabled_checks() -> list:
    """``disabled_checks`` for ``jax.export.export`` of functions that call our kernels.

    jax.export refuses custom calls without a compatibility guarantee; ours carry a
    versioned, stable name (``jax_fp4_<op>_v<N>``) whose meaning never changes, so callers
    opt in with ``jax.export.export(f, disabled_checks=jax_fp4.export_disabled_checks())``.
    The deserialized artifact needs jax_fp4 imported (to register the targets) to run.
    """
    import jax.export

    return [jax.export.DisabledSafetyCheck.custom_call(name)
            for name in sorted(_ext.registered_targets())]


__all__ = [
    "QArray", "Format", "FORMAT_NAMES", "get_format", "quantize", "dequantize",
    "fake_quantize", "tensor_scale_from_amax", "dot_general", "matmul", "prepare",
    "unprepare", "scaled_matmul", "group_matmuls",
    "scaled_matmul_operands",
    "to_blocked", "from_blocked", "set_backend", "get_backend", "capabilities", "formats",
    "export_disabled_checks",
    "reference", "sharding",
]
