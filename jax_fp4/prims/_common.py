"""What every jax-fp4 primitive registers with: the backend switch, the per-platform
lowering rule (:func:`_register_lowerings`), eager evaluation, FFI attributes and the
batching helpers that fold a batch dimension into rows.

Lowering (docs/spec.md section 6): on CPU our C++ FFI targets, on CUDA our CUDA targets where
the extension has one for the op, everywhere else (and whenever the backend is
"reference") ``mlir.lower_fun`` of :mod:`jax_fp4.reference`. The backend choice is a
primitive parameter, so ``jit`` caches a separate executable per backend.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from .. import _ext, partitioning
from ..formats import get_format
from . import _gpu

BACKENDS = ("auto", "reference", "kernels")
_backend = [None]


def set_backend(name: str) -> None:
    """Choose how primitives lower: "auto" (kernels where this install has them, else the
    reference), "reference" (pure jnp everywhere) or "kernels" (our FFI kernels; lowering
    raises RuntimeError on a platform without them). Default: $JAX_FP4_BACKEND or "auto".
    Affects functions traced after the call.

    Raises:
      ValueError: unknown name.
    """
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {name!r}")
    _backend[0] = name


def get_backend() -> str:
    """The current backend name (see :func:`set_backend`)."""
    if _backend[0] is None:
        env = os.environ.get("JAX_FP4_BACKEND", "auto")
        if env not in BACKENDS:
            raise ValueError(f"JAX_FP4_BACKEND: expected one of {BACKENDS}, got {env!r}")
        _backend[0] = env
    return _backend[0]


# ------------------------------------------------------------------------ helpers
def _at_front(x, d, size):
    """Move batch dim ``d`` of ``x`` to the front, or broadcast an unbatched ``x``."""
    if d is None:
        return jnp.broadcast_to(x, (size,) + x.shape)
    return jnp.moveaxis(x, d, 0)


def _fold(x):
    """(B, R, ...) -> (B*R, ...)."""
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def _unfold(x, b):
    return x.reshape((b, x.shape[0] // b) + x.shape[1:]) if x.shape[0] else x.reshape(
        (b, 0) + x.shape[1:])


def _attrs(fmt, block_size, **flags):
    attrs = dict(fmt=np.int32(get_format(fmt).fid), block_size=np.int64(block_size))
    attrs.update({k: np.int32(bool(v)) for k, v in flags.items()})
    return attrs


def _def_impl(prim):
    """Eager evaluation: run the primitive through a jitted call (cached per params)."""

    @functools.lru_cache(maxsize=256)
    def compiled(params):
        return jax.jit(lambda *args: prim.bind(*args, **dict(params)))

    prim.def_impl(lambda *args, **params: compiled(tuple(sorted(params.items())))(*args))


def _has_target(target, platform):
    platforms = _ext.registered_targets().get(target, ())
    return platform.lower() in {p.lower() for p in platforms}


def _kernel_ok(platform, avals, params):
    """Whether our FFI kernels cover this call (else it lowers to the reference).

    CUDA kernels need block_size = 16 * 2**k <= 4096 (every format's allowed blocks but
    odd INT4 group sizes); fake-quantize kernels keep INT4 scales in x's dtype."""
    if "block_size" not in params:
        return True
    if platform == "cuda":
        g, rem = divmod(params["block_size"], 16)
        if rem or g > 256 or g & (g - 1):
            return False
    sd = params.get("scale_dtype")
    if params.get("scale_dtype_follows_x") and sd is not None and np.dtype(sd) != avals[0].dtype:
        return False
    return True


def _register_lowerings(prim, target, reference_impl, kernel_impl=None, ffi_attrs=None,
                        multiple_results=False, fixed_scale_dtype=False, cuda_impl=None):
    """Lower ``prim`` per platform.

    target: FFI target name for a direct custom call (None: no direct kernel).
    reference_impl: pure-jnp implementation (any platform).
    kernel_impl: composite built from other primitives (used instead of ``target``).
    ffi_attrs: params -> FFI attribute dict.
    fixed_scale_dtype: the kernel has no scale_dtype attribute (INT4 scales in x.dtype).
    cuda_impl: (target, applies(avals_in, params, gpu), impl): on CUDA, when the extension
      has ``target`` and ``applies`` says so, lower ``impl(*args, gpu=gpu, **params)`` (a
      composite that calls the target) instead of ``kernel_impl``; ``gpu`` is the lowering
      context's GpuProps (_gpu.gpu_props), never a device query of the machine that lowers.

    The rules go to ``prim``'s shard-local twin; ``prim`` lowers through its sharding rule
    to per-shard calls of the twin (jax_fp4.partitioning).
    """
    local = partitioning.shard_local(prim)
    ref_rule = mlir.lower_fun(reference_impl, multiple_results=multiple_results)
    mlir.register_lowering(local, ref_rule)

    for platform in ("cpu", "cuda"):
        def rule(ctx, *args, _platform=platform, **params):
            impl = params["impl"]
            if impl == "reference":
                return ref_rule(ctx, *args, **params)
            gpu = _gpu.gpu_props(ctx) if _platform == "cuda" and cuda_impl is not None else None
            if (gpu is not None and _has_target(cuda_impl[0], "cuda")
                    and cuda_impl[1](ctx.avals_in, params, gpu)):
                impl = functools.partial(cuda_impl[2], gpu=gpu)
                return mlir.lower_fun(impl, multiple_results=multiple_results)(ctx, *args, **params)
            if kernel_impl is not None:
                available = _ext.has_kernels(_platform)
            else:
                available = _has_target(target, _platform) and _kernel_ok(
                    _platform, ctx.avals_in, dict(params, scale_dtype_follows_x=fixed_scale_dtype))
            if not available:
                if impl == "kernels":
                    why = _ext.load_error() or (
                        "the INT4 fake-quantize kernels keep the group scale in x's dtype: "
                        "pass scale_dtype=None, or use the 'auto' or 'reference' backend"
                        if fixed_scale_dtype and params.get("scale_dtype") is not None
                        and np.dtype(params["scale_dtype"]) != ctx.avals_in[0].dtype
                        else "not built for this platform")
                    raise RuntimeError(
                        f"JAX_FP4_BACKEND=kernels, but this jax-fp4 install has no "
                        f"{_platform} kernel for {prim.name} with these parameters ({why})")
                return ref_rule(ctx, *args, **params)
            if kernel_impl is not None:
                return mlir.lower_fun(kernel_impl, multiple_results=multiple_results)(
                    ctx, *args, **params)
            return jax.ffi.ffi_lowering(target)(ctx, *args, **ffi_attrs(**params))

        mlir.register_lowering(local, rule, platform=platform)
    partitioning.register(prim, local)
