"""``auto_tensor_scale_p``: NVFP4's per-tensor scale of x, from its amax (the reference:
:func:`jax_fp4.reference.tensor_scale_from_amax` of :func:`jax_fp4.reference.amax`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .. import partitioning, reference
from ._common import _def_impl, _has_target, get_backend

auto_tensor_scale_p = Primitive("jax_fp4_auto_tensor_scale")


def _auto_tensor_scale_ref(x, *, impl):
    return reference.tensor_scale_from_amax(reference.amax(x))


def _auto_tensor_scale_batch(args, dims, *, impl):
    """Per batch member: the reference's scale of that member."""
    return jax.vmap(lambda v: _auto_tensor_scale_ref(v, impl=impl), in_axes=dims[0])(args[0]), 0


def _auto_tensor_scale_jvp(primals, tangents, *, impl):
    """No tangent, like the reference (an integer max of the bit patterns)."""
    y = auto_tensor_scale_p.bind(*primals, impl=impl)
    return y, jnp.zeros_like(y)


def _auto_tensor_scale_cuda_rule(ctx, x, *, impl):
    if impl != "reference" and _has_target("jax_fp4_tensor_scale_v1", "cuda"):
        return jax.ffi.ffi_lowering("jax_fp4_tensor_scale_v1")(ctx, x)
    return _auto_tensor_scale_ref_rule(ctx, x, impl=impl)


def auto_tensor_scale(x):
    """NVFP4 tensor_scale="auto" of a 2-D (R, K) float32/bfloat16/float16 array: the
    float32 scalar reference.tensor_scale_from_amax(reference.amax(x)). On CUDA one read
    of x and the scale computed on the device (jax_fp4_tensor_scale_v1), so that
    quantize(..., tensor_scale="auto") is one reduction pass and one quantize pass."""
    return auto_tensor_scale_p.bind(x, impl=get_backend())


_def_impl(auto_tensor_scale_p)
auto_tensor_scale_p.def_abstract_eval(lambda x, **_: jax.core.ShapedArray((), np.float32))
batching.primitive_batchers[auto_tensor_scale_p] = _auto_tensor_scale_batch
ad.primitive_jvps[auto_tensor_scale_p] = _auto_tensor_scale_jvp
_auto_tensor_scale_ref_rule = mlir.lower_fun(_auto_tensor_scale_ref, multiple_results=False)
_auto_tensor_scale_local = partitioning.shard_local(auto_tensor_scale_p)
mlir.register_lowering(_auto_tensor_scale_local, _auto_tensor_scale_ref_rule)
mlir.register_lowering(_auto_tensor_scale_local, _auto_tensor_scale_cuda_rule, platform="cuda")
partitioning.register(auto_tensor_scale_p, _auto_tensor_scale_local)
