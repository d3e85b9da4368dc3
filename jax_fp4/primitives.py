"""JAX primitives for jax-fp4: abstract eval, batching, autodiff and per-platform lowering.

Every primitive works on the canonical 2-D view (csrc/README.md): rows x K with the
blocked axis last; :mod:`jax_fp4.ops` moves axes and reshapes around them.

Lowering (docs/spec.md section 6): on CPU our C++ FFI targets, on CUDA our CUDA targets where
the extension has one for the op, everywhere else (and whenever the backend is
"reference") ``mlir.lower_fun`` of :mod:`jax_fp4.reference`. The backend choice is a
primitive parameter, so ``jit`` caches a separate executable per backend.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _ext, layout, partitioning, reference
from .formats import decode_table, get_format

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


def _scale_dtype(f, scale_dtype):
    if f.family == "int4":
        return np.dtype(scale_dtype)
    return np.dtype(np.float32) if f.family == "codebook" else np.dtype(np.uint8)


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
      context's GpuProps (gpu_props), never a device query of the machine that lowers.

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
            gpu = gpu_props(ctx) if _platform == "cuda" and cuda_impl is not None else None
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


# ------------------------------------------------------------------------ quantize
quantize_p = Primitive("jax_fp4_quantize")
quantize_p.multiple_results = True


def _quantize_abstract(x, ts, *, fmt, block_size, rceil, two_level, scale_dtype, swizzled,
                       impl):
    f = get_format(fmt)
    r, k = x.shape
    nb = k // block_size
    codes = jax.core.ShapedArray((r, k * f.bits // 8), np.uint8)
    scales = jax.core.ShapedArray(layout.swizzled_shape(r, nb) if swizzled else (r, nb),
                                  _scale_dtype(f, scale_dtype))
    zeros = jax.core.ShapedArray((r, nb) if f.family == "int4" else (0,), np.uint8)
    return codes, scales, zeros


def _swizzle(scales):
    """(R, nb) linear scales -> the 2-D 128x4 layout (layout.swizzled_shape)."""
    return layout.to_blocked(scales).reshape(layout.swizzled_shape(*scales.shape))


def _quantize_ref(x, ts, *, fmt, block_size, rceil, two_level, scale_dtype, swizzled, impl):
    codes, scales, zeros = reference.quantize_2d(
        x, fmt, block_size, tensor_scale=ts if two_level else None, rceil=rceil,
        scale_dtype=scale_dtype)
    return codes, _swizzle(scales) if swizzled else scales, zeros


def _quantize_batch(args, dims, *, swizzled, **params):
    """Rows of all batch members go to one call; swizzled scales are tiled per member."""
    x, ts = args
    b = x.shape[dims[0]] if dims[0] is not None else ts.shape[dims[1]]
    x, ts = _at_front(x, dims[0], b), _at_front(ts, dims[1], b)
    outs = [_unfold(o, b) for o in
            quantize_p.bind(_fold(x), _fold(ts), swizzled=False, **params)]
    if swizzled:
        outs[1] = jax.vmap(_swizzle)(outs[1])
    return outs, [0, 0, 0]


def _quantize_ffi_attrs(*, fmt, block_size, rceil, two_level, swizzled=False, **_):
    return _attrs(fmt, block_size, rceil=rceil, two_level=two_level, swizzled=swizzled)


_def_impl(quantize_p)
quantize_p.def_abstract_eval(_quantize_abstract)
batching.primitive_batchers[quantize_p] = _quantize_batch
_register_lowerings(quantize_p, "jax_fp4_quantize_v2", _quantize_ref,
                    ffi_attrs=_quantize_ffi_attrs, multiple_results=True)


# ------------------------------------------------------------------------ dequantize
dequantize_p = Primitive("jax_fp4_dequantize")


def _dequantize_abstract(codes, scales, zeros, ts, *, fmt, block_size, k, dtype, two_level,
                         impl):
    return jax.core.ShapedArray((codes.shape[0], k), np.dtype(dtype))


def _dequantize_ref(codes, scales, zeros, ts, *, fmt, block_size, k, dtype, two_level, impl):
    return reference.dequantize_2d(codes, scales, zeros, fmt, block_size, k, dtype,
                                   tensor_scale=ts if two_level else None)


def _dequantize_batch(args, dims, **params):
    b = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    f = get_format(params["fmt"])
    folded = []
    for i, (a, d) in enumerate(zip(args, dims)):
        if i == 2 and f.family != "int4":  # the empty zeros buffer stays (0,)
            folded.append(a if d is None else jnp.zeros((0,), jnp.uint8))
        else:
            folded.append(_fold(_at_front(a, d, b)))
    return _unfold(dequantize_p.bind(*folded, **params), b), 0


def _dequantize_jvp(primals, tangents, **params):
    """Dequantize is linear in float scales (nf4/bnb_fp4 absmax, int4 scales) and in the
    NVFP4 tensor scale; codes and zero points are integers (no tangent)."""
    codes, scales, zeros, ts = primals
    _, dscales, _, dts = tangents
    y = dequantize_p.bind(*primals, **params)
    f = get_format(params["fmt"])
    r, k, bs = codes.shape[0], params["k"], params["block_size"]
    unit_params = dict(params, dtype=np.dtype(np.float32))
    dy = jnp.zeros((r, k), jnp.float32)
    if f.family in ("codebook", "int4") and type(dscales) is not ad.Zero:
        unit = dequantize_p.bind(codes, jnp.ones_like(scales), zeros, ts, **unit_params)
        ds = dscales.astype(jnp.float32)[..., None]
        dy = dy + (unit.reshape(r, k // bs, bs) * ds).reshape(r, k)
    if f.family == "nvfp4" and params["two_level"] and type(dts) is not ad.Zero:
        unit = dequantize_p.bind(codes, scales, zeros, jnp.ones_like(ts), **unit_params)
        dy = dy + unit * dts.astype(jnp.float32)[:, None]
    return y, dy.astype(y.dtype)


def _dequantize_ffi_attrs(*, fmt, block_size, two_level, **_):
    return _attrs(fmt, block_size, two_level=two_level)


_def_impl(dequantize_p)
dequantize_p.def_abstract_eval(_dequantize_abstract)
batching.primitive_batchers[dequantize_p] = _dequantize_batch
ad.primitive_jvps[dequantize_p] = _dequantize_jvp
_register_lowerings(dequantize_p, "jax_fp4_dequantize_v1", _dequantize_ref,
                    ffi_attrs=_dequantize_ffi_attrs)


# ------------------------------------------------------------------------ fake quantize
fake_quantize_p = Primitive("jax_fp4_fake_quantize")


def _fake_quantize_ref(x, ts, *, fmt, block_size, rceil, two_level, scale_dtype, impl,
                       ste="identity"):
    return reference.fake_quantize_2d(x, fmt, block_size, rceil=rceil, scale_dtype=scale_dtype,
                                      tensor_scale=ts if two_level else None)


def _fake_quantize_batch(args, dims, **params):
    x, ts = args
    b = x.shape[dims[0]] if dims[0] is not None else ts.shape[dims[1]]
    x, ts = _at_front(x, dims[0], b), _at_front(ts, dims[1], b)
    return _unfold(fake_quantize_p.bind(_fold(x), _fold(ts), **params), b), 0


def _fake_quantize_ffi_attrs(*, fmt, block_size, rceil, two_level, **_):
    return _attrs(fmt, block_size, rceil=rceil, two_level=two_level)


def ste_mask(x, ts, *, ste="identity", **params):
    """Where the straight-through estimator passes the gradient.

    ste="identity" (default; torchao / TransformerEngine): wherever x is finite.
    ste="clipped": finite x inside the representable range of its block,
    |x| <= max_elem * block scale (* tensor scale); codebook and INT4 blocks cover their own
    range, so there too only non-finite x is cut."""
    f = get_format(params["fmt"])
    xf = x.astype(jnp.float32)
    if ste == "identity" or f.family not in ("nvfp4", "mx"):
        return jnp.isfinite(xf)
    _, scales, _ = quantize_p.bind(x, ts, swizzled=False, **params)
    r, k = x.shape
    bs = params["block_size"]
    if f.family == "nvfp4":
        s = lax.bitcast_convert_type(scales, jnp.float8_e4m3fn).astype(jnp.float32)
        if params["two_level"]:
            s = s * ts[:, None]
    else:
        s = lax.bitcast_convert_type(scales, jnp.float8_e8m0fnu).astype(jnp.float32)
    limit = jnp.float32(f.elem.max_value) * s
    ok = jnp.abs(xf).reshape(r, k // bs, bs) <= limit[..., None]
    return ok.reshape(r, k)


def _fake_quantize_jvp(primals, tangents, **params):
    x, ts = primals
    dx, _ = tangents
    y = fake_quantize_p.bind(x, ts, **params)
    if type(dx) is ad.Zero:
        return y, jnp.zeros_like(y)
    return y, jnp.where(ste_mask(x, ts, **params), dx, jnp.zeros_like(dx))


_def_impl(fake_quantize_p)
fake_quantize_p.def_abstract_eval(lambda x, ts, **_: jax.core.ShapedArray(x.shape, x.dtype))
batching.primitive_batchers[fake_quantize_p] = _fake_quantize_batch
ad.primitive_jvps[fake_quantize_p] = _fake_quantize_jvp
_register_lowerings(fake_quantize_p, "jax_fp4_fake_quantize_v1", _fake_quantize_ref,
                    ffi_attrs=_fake_quantize_ffi_attrs, fixed_scale_dtype=True)


# ------------------------------------------------------------------------ tensor scale
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


# ------------------------------------------------------------------------ W4A16 matmul
wmatmul_p = Primitive("jax_fp4_weight_matmul")


def _wmatmul_abstract(x, codes, scales, zeros, ts, *, out_dtype, **_):
    return jax.core.ShapedArray((x.shape[0], codes.shape[0]), np.dtype(out_dtype))


def _untiled(codes, scales, zeros, block_size, tiled):
    """The linear layout of a weight's codes, scales and zero points given in the prepared
    ("tiled") layout of jax_fp4.prepare (jax_fp4.layout.tile_rows), or them as they are."""
    return layout.untile_weight(codes, scales, zeros, block_size) if tiled else (codes, scales, zeros)


def _wmatmul_compose(dequantize, x, codes, scales, zeros, ts, *, fmt, block_size, two_level,
                     out_dtype, precision, tiled, impl):
    """y (M, N) = x (M, K) @ W(N, K)^T: W decoded in float32, rounded to x.dtype (the
    compute dtype of a W4A16 kernel), products accumulated in float32. `tiled`: the codes,
    scales and zero points come in the prepared layout (jax_fp4.prepare). ts: the
    per-tensor scale per weight row (N,) or one for all (1,)."""
    codes, scales, zeros = _untiled(codes, scales, zeros, block_size, tiled)
    ts = jnp.broadcast_to(ts, (codes.shape[0],))
    w = dequantize(codes, scales, zeros, ts, fmt=fmt, block_size=block_size, k=x.shape[1],
                   dtype=x.dtype, two_level=two_level, impl=impl)
    y = lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


_wmatmul_ref = functools.partial(_wmatmul_compose, _dequantize_ref)
_wmatmul_kernels = functools.partial(_wmatmul_compose, dequantize_p.bind)


def _wmatmul_batch(args, dims, **params):
    if all(d is None for d in dims[1:]):  # only activations batched: fold into M
        b = args[0].shape[dims[0]]
        x = _fold(_at_front(args[0], dims[0], b))
        return _unfold(wmatmul_p.bind(x, *args[1:], **params), b), 0
    fn = functools.partial(_wmatmul_kernels, **params)
    return jax.vmap(fn, in_axes=dims)(*args), 0


def _wmatmul_transpose(ct, x, codes, scales, zeros, ts, **params):
    """Linear in x: x_bar = y_bar @ W (through the dequantized weight)."""
    if not ad.is_undefined_primal(x) or any(ad.is_undefined_primal(a)
                                            for a in (codes, scales, zeros, ts)):
        raise NotImplementedError("jax_fp4 matmul differentiates w.r.t. the activations only")
    if type(ct) is ad.Zero:
        return [None] * 5
    codes, scales, zeros = _untiled(codes, scales, zeros, params["block_size"], params["tiled"])
    ts = jnp.broadcast_to(ts, (codes.shape[0],))
    w = dequantize_p.bind(codes, scales, zeros, ts, fmt=params["fmt"],
                          block_size=params["block_size"], k=x.aval.shape[1],
                          dtype=x.aval.dtype, two_level=params["two_level"],
                          impl=params["impl"])
    ctx = lax.dot_general(ct.astype(x.aval.dtype), w, (((1,), (0,)), ((), ())),
                          precision=params["precision"], preferred_element_type=jnp.float32,
                          out_sharding=partitioning.explicit_sharding(x.aval))
    return [ctx.astype(x.aval.dtype), None, None, None, None]


# Fused W4A16 CUDA kernel (csrc/cuda/wmatmul.cu) and the size rule. Every choice below
# satisfies the W4A16 contract (docs/spec.md section 5); they are tuning data, each limit
# the M up to which the fused kernel was faster than the CUDA dequantize kernel + XLA's
# bf16 dot on H100 / H200 (the measurements: benchmarks/RESULTS.md and the log,
# benchmarks/log/NOTES.md):
# - sm_90a: the wgmma kernel from M = 1 up to wgmma_max_m, by format and decode path
#   (the table decode stops earlier than the bit path; a prepared weight never stops,
#   since dequantize + dot would first have to restore the linear layout, a copy);
# - other GPUs: the mma.sync kernels up to FUSED_MAX_M;
# - beyond: dequantize + dot.
FUSED_FORMATS = ("nvfp4", "mxfp4", "nf4", "bnb_fp4", "int4")
FUSED_MAX_M = 64
FUSED_MAX_M_WGMMA = {"nvfp4": 2048, "mxfp4": 4096, "nf4": 2048, "bnb_fp4": 2048, "int4": 4096}
FUSED_MAX_M_WGMMA_FOLDED = 4096
# (format, wmatmul_decode, x dtype) -> its limit, where a format decodes otherwise than its
# FUSED_MAX_M_WGMMA entry was measured on (bf16 x and the bit path).
FUSED_MAX_M_WGMMA_DECODE = {("mxfp4", "bits", "float16"): 2048,
                            ("int4", "split", "bfloat16"): 2048,
                            ("int4", "table", "bfloat16"): 1024, ("int4", "table", "float16"): 1024}
# Prepared weights (jax_fp4.prepare, the "tiled" layout): the wgmma kernel at every M.
FUSED_MAX_M_WGMMA_TILED = float("inf")
_FUSED_TARGET = "jax_fp4_wmatmul_v3"
# The most K-splits the wgmma kernel sums in one cluster (csrc/cuda/wmatmul.cu,
# kWgMaxClusterSplits: the portable cluster size); more take XLA's sum of the partials.
_CLUSTER_MAX_SPLITS = 8
# (rows per CTA, k per super-step, resident CTAs per SM, fewest super-steps per split) of
# the direct kernel (M <= 16), the staged kernel and the wgmma kernel by tile_m
# (csrc/cuda/wmatmul.cu). The wgmma kernel splits K into runs of >= 12 steps (the smallest
# split count that fills the GPU was fastest); weights of few tiles: >= _GRID_MIN_STEPS
# (wmatmul_grid).
_FUSED_DIRECT_MAX_M = 16
# The wgmma kernel from M = 1 wherever it runs (tile_m = 8 up to M = 8, 16 up to 16): it
# was as fast as the direct kernel or faster at M = 1-8 for every format; the direct
# kernel only where wgmma does not run.
_FUSED_GEOMETRY = {"direct": (128, 256, 4, 1), "staged": (128, 128, 4, 2),
                   8: (128, 128, 2, 12), 16: (128, 128, 2, 12), 32: (128, 128, 2, 12),
                   64: (128, 128, 2, 12),
                   128: (128, 128, 1, 12), 256: (128, 128, 1, 12)}


@dataclasses.dataclass(frozen=True)
class GpuProps:
    """What the CUDA launch policy needs of the GPU a computation is lowered for.

    compute_capability: the major version (0: unknown, which picks the kernels every sm_80+
    GPU runs); sm_count: streaming multiprocessors (132, an H100 SXM / H200, if unknown)."""
    compute_capability: int = 0
    sm_count: int = 132

    @property
    def wgmma(self) -> bool:
        """Whether the sm_90a wgmma kernel runs: compute capability 9 and a build for 90a."""
        archs = str(_ext.build_info().get("cuda_archs", "")).replace(";", ",").split(",")
        return self.compute_capability == 9 and "90a" in archs


@functools.lru_cache(maxsize=None)
def _device_props(device) -> GpuProps:
    cc = int(str(getattr(device, "compute_capability", "0")).split(".")[0] or 0)
    return GpuProps(cc, int(getattr(device, "core_count", 0) or 132))


def gpu_props(ctx=None) -> GpuProps:
    """The properties of the GPU that lowering context `ctx` compiles for (its backend's
    first GPU), cached per device; without a context or a GPU backend in it (e.g.
    ``jax.export`` on a machine with no GPU), the default GPU, or GpuProps() if none: the
    portable choice."""
    backend = getattr(getattr(ctx, "module_context", None), "backend", None)
    try:
        devices = backend.local_devices() if backend is not None else jax.devices("gpu")
    except RuntimeError:
        devices = []
    gpus = [d for d in devices if d.platform in ("gpu", "cuda")]
    return _device_props(gpus[0]) if gpus else GpuProps()


def _sm_count():
    return gpu_props().sm_count


def _fill(items, slots):
    """Fraction of `slots` resident CTA slots that `items` CTAs keep busy over their waves."""
    return items / (-(-items // slots) * slots)


def splits_fill_steps(n_steps, splits):
    """Whether `splits` K-splits of ceil(n_steps / splits) whole steps each leave none of
    them empty (the kernels split K in whole super-steps)."""
    return -(-n_steps // -(-n_steps // splits)) == splits


def wmatmul_splits(m, n, k, sms=None, tile_m=0, partials=0.25, min_steps=None, per_sm=None):
    """K-splits S of the fused kernel (grid = ceil(N / rows) x M-chunks x S CTAs).

    The smallest S whose CTAs fill their waves to >= 90% of the resident slots (`per_sm`
    per SM, default the kernel's), with no empty split, at least `min_steps` super-steps
    per split (default 1 for the direct kernel, 2 staged, 12 wgmma) and the float32 partial
    sums (S x M x N x 4 bytes) at most `partials` times the 4-bit codes' bytes; if none, the
    S of best wave efficiency (a split count past one full wave costs a second, mostly
    idle one)."""
    direct = m <= _FUSED_DIRECT_MAX_M
    kind = tile_m or ("direct" if direct else "staged")
    rows, step, kernel_per_sm, default_min_steps = _FUSED_GEOMETRY[kind]
    per_sm = per_sm or kernel_per_sm
    min_steps = min_steps or default_min_steps
    slots = per_sm * (sms or _sm_count())
    n_steps = -(-k // step)
    m_tile = tile_m or (m if direct else 64)
    ctas = -(-n // rows) * -(-m // m_tile)
    best, best_eff = 1, 0.0
    for s in range(1, max(1, min(n_steps // min_steps, int(partials * k / (8 * m)))) + 1):
        if not splits_fill_steps(n_steps, s):
            continue
        eff = _fill(ctas * s, slots)
        if eff >= 0.9:
            return s
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


def _wave_fill(m, n, tile_m, splits, sms=None):
    """Fraction of the resident CTA slots the wgmma kernel's grid (ceil(N / 128) weight tiles
    x ceil(M / tile_m) activation tiles x splits) keeps busy over its waves."""
    rows, _, per_sm, _ = _FUSED_GEOMETRY[tile_m]
    return _fill(-(-n // rows) * -(-m // tile_m) * splits, per_sm * (sms or _sm_count()))


_GRID_MIN_FILL = 0.5  # wmatmul_grid: the wave fill under which other grids are considered
_GRID_MIN_STEPS = 2  # ... and the fewest 128-k steps per K-split they may have


def wmatmul_grid(m, n, k, wgmma=None, sms=None):
    """(tile_m, K-splits) of the fused kernel for M rows of x and a (K, N) weight:
    wmatmul_tile_m's tile and wmatmul_splits' splits, unless that wgmma grid keeps
    less than _GRID_MIN_FILL (half) of the GPU's CTA slots busy (weights of few 128-row
    tiles: on the Llama shapes 4096 x 4096 at M <= 512, 14336 x 4096 at 150-512, 8192 x
    8192 at 129-256, the K / V projections 4096 x 1024 and 8192 x 1024 at every M). Then
    the splits may leave float32 partial sums of up to twice the codes' bytes and be as
    short as _GRID_MIN_STEPS steps, and aim at one CTA per SM (the kernels of two CTAs per
    SM too: at a few steps per split the second CTA on an SM did not pay), and a 256-row
    tile may become 128-row tiles: the grid that fills most of a wave (_wave_fill) wins,
    then the one with fewer splits, then the larger tile (on these shapes the filled grid
    was about twice as fast; benchmarks/log/NOTES.md rounds 8 and 12)."""
    tile = wmatmul_tile_m(m, wgmma=wgmma)
    splits = wmatmul_splits(m, n, k, sms=sms, tile_m=tile)
    if tile == 0 or _wave_fill(m, n, tile, splits, sms) >= _GRID_MIN_FILL:
        return tile, splits
    best = None
    for t in ((256, 128) if tile == 256 else (tile,)):
        s = wmatmul_splits(m, n, k, sms=sms, tile_m=t, partials=2.0, min_steps=_GRID_MIN_STEPS,
                           per_sm=1)
        key = (round(_wave_fill(m, n, t, s, sms), 2), -s, t)
        best = max(best or key, key)
    return best[2], -best[1]


def fused_wmatmul_applies(avals_in, params, gpu=None):
    """Whether the fused kernel covers this call: x bf16/f16 with 1 <= M <= FUSED_MAX_M
    (wgmma_max_m where the wgmma kernel runs, by decode path: any M for a prepared weight),
    a 4-bit weight format, K % 32 == 0 and a power-of-two block_size >= 16.

    avals_in: the primitive's operand avals (x (M, K), codes (N, K / 2) uint8, scales,
    ...); params: its parameters (fmt, block_size, two_level, tiled); gpu: the target's
    GpuProps (default gpu_props()). Returns a bool, raises nothing (a call it does not
    cover takes dequantize + dot)."""
    wgmma = gpu.wgmma if gpu is not None else None
    x, codes, scales = avals_in[0], avals_in[1], avals_in[2]
    m, k = x.shape
    bs = params["block_size"]
    fmt, two_level = params["fmt"], params["two_level"]
    if fmt not in FUSED_FORMATS:
        return False
    max_m = (wgmma_max_m(fmt, wmatmul_folded(fmt, x.dtype, two_level), params["tiled"],
                         wmatmul_decode(fmt, x.dtype, two_level, scales.dtype), x.dtype)
             if wmatmul_tile_m(m, wgmma=wgmma) else FUSED_MAX_M)
    return (np.dtype(x.dtype) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
            and 1 <= m <= max_m
            and codes.shape[0] >= 1 and k % 32 == 0 and bs >= 16 and bs & (bs - 1) == 0)


# The table path's x permutation moves 32-bit pairs of elements where x needs no padding
# or has at least this many elements (padded), else bf16 elements: XLA moves pairs as
# words several times faster, except for tiny padded x, where the bitcasts cost more.
_X_PAIRS_MIN_SIZE = 1 << 19


def wmatmul_x_layout(x, bit_path, tile_m=1):
    """x (M, K) -> (M', K128) as the wgmma kernel stages it: K zero-padded to a multiple of
    128 and permuted within each 128-k block into the k order of the kernel's A fragments
    (csrc/cuda/wmatmul.cu, "wgmma kernel"); M' = M rounded up to a multiple of `tile_m`
    with zero rows, so that no activation box of the tensor memory accelerator reaches past
    x's rows (boxes partly out of bounds made the kernel markedly slower at tile_m >= 64).
    Block position 32 s2 + 16 hh + 8 sec + 2 tt + e holds element 32 tt + 8 s2 + 4 e +
    2 hh + sec (bit path: a register pairs elements p, p + 4 of a code word) or 32 tt +
    8 s2 + 4 hh + 2 sec + e (table path: elements 2 i, 2 i + 1); tt is the lane's k
    quarter, s2 the code word, hh / sec the two MMA steps a word feeds and the two pairs
    of each. The table path's permutation moves each pair e as one 32-bit word where that
    is faster (_X_PAIRS_MIN_SIZE): the same result."""
    m, k = x.shape
    kp = -(-k // 128) * 128
    mp = -(-m // tile_m) * tile_m
    if (mp, kp) != (m, k):
        x = jnp.pad(x, ((0, mp - m), (0, kp - k)))
    if bit_path:  # (tt, s2, e, hh, sec) -> (s2, hh, sec, tt, e)
        x = x.reshape(mp, kp // 128, 4, 4, 2, 2, 2).transpose(0, 1, 3, 5, 6, 2, 4)
    elif (mp, kp) == (m, k) or mp * kp >= _X_PAIRS_MIN_SIZE:
        # (tt, s2, hh, sec) -> (s2, hh, sec, tt) of 32-bit words: each pair e stays
        # together, so XLA moves words (_X_PAIRS_MIN_SIZE)
        w = lax.bitcast_convert_type(x.reshape(mp, kp // 2, 2), jnp.uint32)
        w = w.reshape(mp, kp // 128, 4, 4, 2, 2).transpose(0, 1, 3, 4, 5, 2)
        x = lax.bitcast_convert_type(w.reshape(mp, kp // 2), x.dtype)
    else:  # (tt, s2, hh, sec, e) -> (s2, hh, sec, tt, e)
        x = x.reshape(mp, kp // 128, 4, 4, 2, 2, 2).transpose(0, 1, 3, 4, 5, 2, 6)
    return x.reshape(mp, kp)


def wmatmul_decode(fmt, x_dtype, two_level, scale_dtype):
    """How the kernels decode this weight (the Python mirror of csrc/cuda/wmatmul.cu's
    use_bit_path, which also picks x's pairing, wmatmul_x_layout): "bits" (bit placement
    and exact packed multiplies: one-level nvfp4, mxfp4, int4 with scales in x's dtype),
    "split" (int4 with f16 scales and bf16 x, AWQ's scales in a bf16 model: the bit path
    with each scale split into two bf16 factors) or "table" (a shared-memory table and
    float32 arithmetic: everything else)."""
    x_dtype, s = np.dtype(x_dtype), np.dtype(scale_dtype)
    if fmt in ("nvfp4", "mxfp4"):  # nvfp4's per-tensor scale multiplies the accumulator
        return "bits"
    if fmt == "int4" and s == x_dtype:
        return "bits"
    if fmt == "int4" and s == np.dtype(jnp.float16) and x_dtype == np.dtype(jnp.bfloat16):
        return "split"
    return "table"


def wgmma_available():
    """Whether the sm_90a wgmma kernel can run on the default GPU: compute capability 9.0
    and a build whose CUDA architectures include 90a (GpuProps.wgmma)."""
    return gpu_props().wgmma


def wmatmul_folded(fmt, x_dtype, two_level):
    """Whether the kernels decode with one multiply per pair by folding the bit placement's
    factor into the block scale and the accumulator: nvfp4 (one or two levels: the
    per-tensor scale multiplies the accumulator) with bf16 or f16 `x_dtype`
    (csrc/cuda/wmatmul.cu, kFold)."""
    return fmt == "nvfp4"


def wgmma_max_m(fmt, folded=False, tiled=False, decode="bits", x_dtype=jnp.bfloat16):
    """The most rows of x for which the wgmma kernel runs for weight format `fmt` (where
    available; beyond it, dequantize + dot): FUSED_MAX_M_WGMMA_TILED (no limit) for a
    weight in the prepared layout (`tiled`); FUSED_MAX_M_WGMMA_DECODE[fmt, decode, x dtype
    name] where the format decodes otherwise than its other limits were measured on
    (`decode`: wmatmul_decode's path, `x_dtype`: x's dtype); FUSED_MAX_M_WGMMA_FOLDED where
    nvfp4's decode is one multiply per pair (`folded`, wmatmul_folded); else
    FUSED_MAX_M_WGMMA[fmt]."""
    if tiled:
        return FUSED_MAX_M_WGMMA_TILED
    key = (fmt, decode, np.dtype(x_dtype).name)
    if key in FUSED_MAX_M_WGMMA_DECODE:
        return FUSED_MAX_M_WGMMA_DECODE[key]
    return FUSED_MAX_M_WGMMA_FOLDED if folded else FUSED_MAX_M_WGMMA[fmt]


# The wgmma kernel at tile_m = 256 in clusters of two CTAs on adjacent weight tiles that
# share x's tile, each copying half of it into both (TMA multicast): half the L2 reads of
# x, at the cost of the pair waiting for each other every step. From _MULTICAST_MIN_M rows
# of x, where that paid (for nvfp4 only at M >= 2048, where the copies rather than the
# MMAs bound it; never for the table decode, bound by its lookups).
_MULTICAST_MIN_M = {"nvfp4": 2048, "mxfp4": 512, "int4": 512, "nf4": None, "bnb_fp4": None}
# A prepared weight (one 1-D bulk copy per stage for its codes, scales and zero points)
# runs faster without.
_MULTICAST_MIN_M_TILED = dict.fromkeys(_MULTICAST_MIN_M)


def wmatmul_cluster(fmt, m, tile_m, tiled=False):
    """CTAs per cluster of the wgmma kernel (attribute `cluster`): 2 (x multicast) at
    tile_m = 256 from _MULTICAST_MIN_M[fmt] rows of x (_MULTICAST_MIN_M_TILED for a
    weight in the prepared layout: never), else 1."""
    min_m = (_MULTICAST_MIN_M_TILED if tiled else _MULTICAST_MIN_M)[fmt]
    return 2 if tile_m == 256 and min_m is not None and m >= min_m else 1


def wmatmul_tile_m(m, wgmma=None):
    """Activation rows per CTA of the wgmma kernel for M rows of x: 8, 16, 32, 64, 128 or
    256, the smallest that holds M (256 beyond); 0 (the mma.sync kernels) where the wgmma
    kernel cannot run (`wgmma`: whether it can; None: wgmma_available())."""
    if not (wgmma_available() if wgmma is None else wgmma):
        return 0
    return 8 if m <= 8 else 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128 if m <= 128 else 256


def wmatmul_head_rows(m, n, k, tile_m, sms=None):
    """Rows of x for a first launch when M = 256 q + r (q >= 1, 0 < r <= 128) at tile_m =
    256: the last r rows then take a second launch with the tile the size rule gives r
    (16-128 rows, or the mma.sync kernel) instead of a whole 256-row tile, which costs
    about as much as 256 rows. Only where the first launch alone fills >= 90% of a wave
    (ceil(N / 128) x q CTAs x its K-splits), so the second does not idle the GPU's other
    half. 0: one launch."""
    r = m % 256
    if tile_m != 256 or m < 256 or r == 0 or r > 128:
        return 0
    head = m - r
    rows, _, per_sm, _ = _FUSED_GEOMETRY[256]
    items = -(-n // rows) * (head // 256) * wmatmul_splits(head, n, k, sms=sms, tile_m=256)
    return head if items >= 0.9 * per_sm * (sms or _sm_count()) else 0


def _wmatmul_fused(x, codes, scales, zeros, ts, *, fmt, block_size, two_level, out_dtype,
                   precision, tiled, impl, gpu=None):
    """The fused kernel: one split, or up to _CLUSTER_MAX_SPLITS K-splits summed in the
    wgmma kernel (tiles up to 128 rows), write the output in x's dtype (or float32)
    themselves; otherwise the K-splits leave float32 partial sums that XLA adds and casts. A ragged last 256-row tile
    becomes a second launch (wmatmul_head_rows). A weight in the prepared layout goes to
    the wgmma kernel as it is (attribute `tiled`), to the mma.sync kernels linear."""
    m, k = x.shape
    gpu = gpu or gpu_props()
    tile_m, splits = wmatmul_grid(m, codes.shape[0], k, wgmma=gpu.wgmma, sms=gpu.sm_count)
    if tiled and not tile_m:
        codes, scales, zeros = _untiled(codes, scales, zeros, block_size, tiled)
        tiled = False
    head = wmatmul_head_rows(m, codes.shape[0], k, tile_m, sms=gpu.sm_count)
    if head:
        part = functools.partial(_wmatmul_fused, codes=codes, scales=scales, zeros=zeros, ts=ts,
                                 fmt=fmt, block_size=block_size, two_level=two_level,
                                 out_dtype=out_dtype, precision=precision, tiled=tiled,
                                 impl=impl, gpu=gpu)
        return jnp.concatenate([part(x[:head]), part(x[head:])], axis=0)
    # the kernel sums the K-splits itself (one cluster per tile, csrc/cuda/wmatmul.cu
    # wg_reduce_splits) where its tile allows: one launch, no partial sums in HBM
    cluster = wmatmul_cluster(fmt, m, tile_m, tiled)
    reduce = 1 < splits <= _CLUSTER_MAX_SPLITS and 0 < tile_m <= 128 and cluster == 1
    final = ((splits == 1 or reduce)
             and np.dtype(out_dtype) in (np.dtype(x.dtype), np.dtype(np.float32)))
    if tile_m:
        x = wmatmul_x_layout(x, wmatmul_decode(fmt, x.dtype, two_level, scales.dtype) != "table", tile_m)
    part = jax.ffi.ffi_call(
        _FUSED_TARGET,
        jax.ShapeDtypeStruct((1 if reduce else splits, m, codes.shape[0]),
                             out_dtype if final else jnp.float32))(
        x, codes, scales, zeros, ts, **_attrs(fmt, block_size, two_level=two_level),
        splits=np.int64(splits), tile_m=np.int64(tile_m), cluster=np.int64(cluster),
        tiled=np.int32(bool(tiled)))
    return part[0] if final else part.sum(0).astype(out_dtype)


_def_impl(wmatmul_p)
wmatmul_p.def_abstract_eval(_wmatmul_abstract)
batching.primitive_batchers[wmatmul_p] = _wmatmul_batch
ad.defjvp(wmatmul_p, lambda g, x, *w, **p: wmatmul_p.bind(g, *w, **p), None, None, None, None)
ad.primitive_transposes[wmatmul_p] = _wmatmul_transpose
_register_lowerings(wmatmul_p, None, _wmatmul_ref, kernel_impl=_wmatmul_kernels,
                    cuda_impl=(_FUSED_TARGET, fused_wmatmul_applies, _wmatmul_fused))


# ------------------------------------------------------------------------ block-scaled matmul
scaled_matmul_p = Primitive("jax_fp4_scaled_matmul")


def _scaled_matmul_abstract(a_codes, a_scales, a_ts, b_codes, b_scales, b_ts, alpha, bias, *,
                            out_dtype, **_):
    return jax.core.ShapedArray((a_codes.shape[0], b_codes.shape[0]), np.dtype(out_dtype))


def _scaled_matmul_compose(dequantize, a_codes, a_scales, a_ts, b_codes, b_scales, b_ts,
                           alpha, bias, *, a_fmt, b_fmt, k, out_dtype, impl):
    """D (M, N) = alpha * A (M, K) @ B (N, K)^T + bias: both operands decoded exactly to
    float32, float32 accumulation (precision HIGHEST), then alpha, bias, cast."""
    empty = jnp.zeros((0,), jnp.uint8)

    def dq(codes, scales, ts, fmt):
        f = get_format(fmt)
        return dequantize(codes, scales, empty, ts, fmt=fmt, block_size=f.default_block, k=k,
                          dtype=np.dtype(np.float32), two_level=f.family == "nvfp4", impl=impl)

    a = dq(a_codes, a_scales, a_ts, a_fmt)
    b = dq(b_codes, b_scales, b_ts, b_fmt)
    d = lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32)
    return (d * alpha + bias[None, :]).astype(out_dtype)


_scaled_matmul_ref = functools.partial(_scaled_matmul_compose, _dequantize_ref)
_scaled_matmul_kernels = functools.partial(_scaled_matmul_compose, dequantize_p.bind)


def scaled_matmul_bf16(a_codes, a_scales, a_ts, b_codes, b_scales, b_ts, alpha, bias, *,
                       a_fmt, b_fmt, k, out_dtype, impl):
    """The GPU path: both operands decoded to bfloat16 without their NVFP4 per-tensor
    scales -- exact, since an E2M1/E2M3/E3M2/E4M3/E5M2 element times an E4M3 or E8M0
    block scale has at most 8 significant bits (results below 2^-133, bfloat16's least
    subnormal, are the exception: the reference keeps them in float32) -- then a bf16
    tensor-core dot with float32 accumulation and an epilogue of the per-row / per-column
    tensor scales, alpha and bias. Equal to the reference up to float32 rounding of the
    accumulation and of the tensor-scale products."""
    empty = jnp.zeros((0,), jnp.uint8)

    def dq(codes, scales, ts, fmt):
        return dequantize_p.bind(codes, scales, empty, ts, fmt=fmt,
                                 block_size=get_format(fmt).default_block, k=k,
                                 dtype=np.dtype(jnp.bfloat16), two_level=False, impl=impl)

    d = lax.dot_general(dq(a_codes, a_scales, a_ts, a_fmt), dq(b_codes, b_scales, b_ts, b_fmt),
                        (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if get_format(a_fmt).family == "nvfp4":
        d = d * a_ts[:, None]
    if get_format(b_fmt).family == "nvfp4":
        d = d * b_ts[None, :]
    return (d * alpha + bias[None, :]).astype(out_dtype)


def _scaled_matmul_batch(args, dims, **params):
    fn = functools.partial(_scaled_matmul_kernels, **params)
    return jax.vmap(fn, in_axes=dims)(*args), 0


# cuDNN's block-scaled GEMM (jax.nn.scaled_matmul on sm_100+) takes these operand pairs.
CUDNN_SCALED_PAIRS = {("nvfp4", "nvfp4"), ("mxfp8_e4m3", "mxfp8_e4m3"),
                      ("mxfp8_e4m3", "mxfp8_e5m2"), ("mxfp8_e5m2", "mxfp8_e4m3"),
                      ("mxfp8_e5m2", "mxfp8_e5m2")}
# element dtype of each format in jax.nn.scaled_matmul (MXFP6 widened exactly to FP8)
_SCALED_ELEM_DTYPES = {"nvfp4": jnp.float4_e2m1fn, "mxfp4": jnp.float4_e2m1fn,
                       "mxfp6_e2m3": jnp.float8_e4m3fn, "mxfp6_e3m2": jnp.float8_e5m2,
                       "mxfp8_e4m3": jnp.float8_e4m3fn, "mxfp8_e5m2": jnp.float8_e5m2}


def scaled_matmul_operand(codes, scales, fmt, k):
    """FFI-layout buffers of an (R, K) nvfp4 / MX operand -> (data (1, R, K), scales
    (1, R, K/block)) as ``jax.nn.scaled_matmul`` takes them: elements as float4_e2m1fn /
    float8 (E2M3 and E3M2 widened exactly to E4M3 / E5M2), linear float8_e4m3fn (nvfp4) or
    float8_e8m0fnu (MX) block scales. jax swizzles the scales to cuBLASLt's 128x4 tiles
    itself (jax/_src/cudnn/scaled_matmul_stablehlo.py); the NVFP4 per-tensor scale is not
    part of that API and is applied to the result."""
    f = get_format(fmt)
    r = codes.shape[0]
    c = layout.unpack(codes, f.bits).reshape(r, k)
    data = jnp.asarray(decode_table(f.elem))[c.astype(jnp.int32)]
    data = data.astype(_SCALED_ELEM_DTYPES[fmt])
    sdt = jnp.float8_e4m3fn if f.family == "nvfp4" else jnp.float8_e8m0fnu
    return data[None], lax.bitcast_convert_type(scales, sdt)[None]


def scaled_matmul_cudnn(a_codes, a_scales, a_ts, b_codes, b_scales, b_ts, alpha, bias, *,
                        a_fmt, b_fmt, k, out_dtype, impl):
    """Blackwell path: ``jax.nn.scaled_matmul`` (cuDNN block-scaled GEMM) on the operands
    of :func:`scaled_matmul_operand`, then tensor scales, alpha, bias."""
    a, sa = scaled_matmul_operand(a_codes, a_scales, a_fmt, k)
    b, sb = scaled_matmul_operand(b_codes, b_scales, b_fmt, k)
    d = jax.nn.scaled_matmul(a, b, sa, sb, preferred_element_type=jnp.float32)[0]
    if get_format(a_fmt).family == "nvfp4":
        d = d * a_ts[:, None]
    if get_format(b_fmt).family == "nvfp4":
        d = d * b_ts[None, :]
    return (d * alpha + bias[None, :]).astype(out_dtype)


def _scaled_matmul_cuda(*args, gpu, **params):
    """sm_100+ and a cuDNN pair: jax.nn.scaled_matmul; else the exact-bf16 path."""
    if gpu.compute_capability >= 10 and (params["a_fmt"], params["b_fmt"]) in CUDNN_SCALED_PAIRS:
        return scaled_matmul_cudnn(*args, **params)
    return scaled_matmul_bf16(*args, **params)


_def_impl(scaled_matmul_p)
scaled_matmul_p.def_abstract_eval(_scaled_matmul_abstract)
batching.primitive_batchers[scaled_matmul_p] = _scaled_matmul_batch
_register_lowerings(scaled_matmul_p, None, _scaled_matmul_ref,
                    kernel_impl=_scaled_matmul_kernels,
                    cuda_impl=("jax_fp4_dequantize_v1", lambda avals, params, gpu: True,
                               _scaled_matmul_cuda))
