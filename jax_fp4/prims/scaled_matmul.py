"""``scaled_matmul_p``: D (M, N) = alpha * A (M, K) @ B (N, K)^T + bias of two block-scaled
operands (NVFP4 / MX), accumulated in float32; on CUDA cuDNN's block-scaled GEMM where the
GPU and operand pair allow (sm_100+), else an exact bf16 decomposition."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import batching

from .. import layout
from ..formats import decode_table, get_format
from ._common import _def_impl, _register_lowerings
from .dequantize import _dequantize_ref, dequantize_p

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
                          dtype=np.dtype(np.float32), two_level=f.has_tensor_scale, impl=impl)

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
    if get_format(a_fmt).has_tensor_scale:
        d = d * a_ts[:, None]
    if get_format(b_fmt).has_tensor_scale:
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
    return data[None], lax.bitcast_convert_type(scales, f.scale_bits_dtype)[None]


def scaled_matmul_cudnn(a_codes, a_scales, a_ts, b_codes, b_scales, b_ts, alpha, bias, *,
                        a_fmt, b_fmt, k, out_dtype, impl):
    """Blackwell path: ``jax.nn.scaled_matmul`` (cuDNN block-scaled GEMM) on the operands
    of :func:`scaled_matmul_operand`, then tensor scales, alpha, bias."""
    a, sa = scaled_matmul_operand(a_codes, a_scales, a_fmt, k)
    b, sb = scaled_matmul_operand(b_codes, b_scales, b_fmt, k)
    d = jax.nn.scaled_matmul(a, b, sa, sb, preferred_element_type=jnp.float32)[0]
    if get_format(a_fmt).has_tensor_scale:
        d = d * a_ts[:, None]
    if get_format(b_fmt).has_tensor_scale:
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
