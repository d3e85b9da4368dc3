"""The misuse table: each bad call raises the documented exception type with a message
that names the argument (jax_fp4.validate is the one place these checks live)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4 as jf
from jax_fp4.qarray import QArray

X = jnp.ones((4, 64), jnp.float32)
W = jf.quantize(jnp.ones((64, 8), jnp.float32), "nvfp4", axis=0)
NV = jf.quantize(X, "nvfp4", tensor_scale="auto")
MX = jf.quantize(X, "mxfp4")
I4 = jf.quantize(X, "int4", block_size=32)
NF = jf.quantize(X, "nf4")


def _rebuild(q, **over):
    kids = dict(zip(("data", "scales", "tensor_scale", "zeros"), q.tree_flatten()[0]))
    aux = dict(format=q.format, axis=q.axis, shape=q.shape, dtype=q.dtype,
               block_size=q.block_size, scale_layout=q.scale_layout)
    for k, v in over.items():
        (kids if k in kids else aux)[k] = v
    return lambda: QArray(kids["data"], kids["scales"], kids["tensor_scale"], kids["zeros"],
                          **aux)


def _unflatten(q, aux_over=None, kids_over=None):
    kids, aux = q.tree_flatten()
    kids = list(kids)
    aux = list(aux)
    for i, v in (aux_over or {}).items():
        aux[i] = v
    for i, v in (kids_over or {}).items():
        kids[i] = v
    return lambda: jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(q), kids) \
        if not aux_over else QArray.tree_unflatten(tuple(aux), kids)


def dg(lhs, rhs, dn):
    return lambda: jf.dot_general(lhs, rhs, dn)


A = jnp.ones((3, 64), jnp.float32)
CASES = [
    # quantize / fake_quantize arguments
    ("quantize int x", lambda: jf.quantize(jnp.ones((4, 64), jnp.int32)), TypeError, "x:"),
    ("quantize bool x", lambda: jf.quantize(jnp.ones((4, 64), bool)), TypeError, "x:"),
    ("quantize complex x", lambda: jf.quantize(jnp.ones((4, 64), jnp.complex64)), TypeError, "x:"),
    ("quantize QArray x", lambda: jf.quantize(NV), TypeError, "x:"),
    ("quantize str x", lambda: jf.quantize("abc"), TypeError, "x:"),
    ("quantize scalar", lambda: jf.quantize(jnp.float32(1)), ValueError, "x:"),
    ("quantize format", lambda: jf.quantize(X, "fp3"), ValueError, "format:"),
    ("quantize format int", lambda: jf.quantize(X, 3), ValueError, "format:"),
    ("quantize axis", lambda: jf.quantize(X, axis=2), ValueError, "axis:"),
    ("quantize axis float", lambda: jf.quantize(X, axis=1.0), TypeError, "axis:"),
    ("quantize axis bool", lambda: jf.quantize(X, axis=True), TypeError, "axis:"),
    ("quantize block nvfp4", lambda: jf.quantize(X, "nvfp4", block_size=32), ValueError, "block_size:"),
    ("quantize block float", lambda: jf.quantize(X, "nf4", block_size=64.0), TypeError, "block_size:"),
    ("quantize block bool", lambda: jf.quantize(X, "int4", block_size=True), TypeError, "block_size:"),
    ("quantize block 0", lambda: jf.quantize(X, "int4", block_size=0), ValueError, "block_size:"),
    ("quantize not multiple", lambda: jf.quantize(jnp.ones((4, 48)), "mxfp4"), ValueError, "x:"),
    ("quantize layout", lambda: jf.quantize(X, scale_layout="tiled"), ValueError, "scale_layout:"),
    ("quantize rounding", lambda: jf.quantize(X, "mxfp4", scale_rounding="up"), ValueError, "scale_rounding:"),
    ("quantize rceil nvfp4", lambda: jf.quantize(X, scale_rounding="rceil"), ValueError, "scale_rounding:"),
    ("tensor_scale on mx", lambda: jf.quantize(X, "mxfp4", tensor_scale=1.0), ValueError, "tensor_scale:"),
    ("tensor_scale True", lambda: jf.quantize(X, tensor_scale=True), TypeError, "tensor_scale:"),
    ("tensor_scale complex", lambda: jf.quantize(X, tensor_scale=1 + 2j), TypeError, "tensor_scale:"),
    ("tensor_scale complex arr", lambda: jf.quantize(X, tensor_scale=jnp.complex64(1)), TypeError, "tensor_scale:"),
    ("tensor_scale str", lambda: jf.quantize(X, tensor_scale="max"), ValueError, "tensor_scale:"),
    ("tensor_scale vector", lambda: jf.quantize(X, tensor_scale=jnp.ones(4)), ValueError, "tensor_scale:"),
    ("tensor_scale negative", lambda: jf.quantize(X, tensor_scale=-1.0), ValueError, "tensor_scale:"),
    ("tensor_scale nan", lambda: jf.quantize(X, tensor_scale=float("nan")), ValueError, "tensor_scale:"),
    ("tensor_scale tiny", lambda: jf.quantize(X, tensor_scale=1e-40), ValueError, "tensor_scale:"),
    ("scale_dtype banana", lambda: jf.quantize(X, "int4", block_size=32, scale_dtype="banana"), TypeError, "scale_dtype:"),
    ("scale_dtype int8", lambda: jf.quantize(X, "int4", block_size=32, scale_dtype=jnp.int8), TypeError, "scale_dtype:"),
    ("scale_dtype on nf4", lambda: jf.quantize(X, "nf4", scale_dtype=jnp.float32), ValueError, "scale_dtype:"),
    ("fake_quantize int x", lambda: jf.fake_quantize(jnp.ones((4, 64), jnp.int8)), TypeError, "x:"),
    ("fake_quantize fp8 x", lambda: jf.fake_quantize(jnp.ones((4, 64), jnp.float8_e4m3fn)), TypeError, "x:"),
    ("fake_quantize axis", lambda: jf.fake_quantize(X, axis=-3), ValueError, "axis:"),
    # dequantize
    ("dequantize array", lambda: jf.dequantize(X), TypeError, "q:"),
    ("dequantize dtype int", lambda: jf.dequantize(NV, jnp.int8), TypeError, "dtype:"),
    ("dequantize dtype banana", lambda: jf.dequantize(NV, "banana"), TypeError, "dtype:"),
    ("prepare array", lambda: jf.prepare(X), TypeError, "q:"),
    # tensor_scale_from_amax
    ("amax negative", lambda: jf.tensor_scale_from_amax(-5.0), ValueError, "amax:"),
    ("amax nan", lambda: jf.tensor_scale_from_amax(float("nan")), ValueError, "amax:"),
    ("amax bool", lambda: jf.tensor_scale_from_amax(True), TypeError, "amax:"),
    ("amax complex", lambda: jf.tensor_scale_from_amax(1j), TypeError, "amax:"),
    ("amax format", lambda: jf.tensor_scale_from_amax(1.0, "mxfp4"), ValueError, "format:"),
    # matmul / dot_general
    ("matmul complex x", lambda: jf.matmul(jnp.ones((2, 64), jnp.complex64), W), TypeError, "x:"),
    ("matmul bool x", lambda: jf.matmul(jnp.ones((2, 64), bool), W), TypeError, "x:"),
    ("matmul int x", lambda: jf.matmul(jnp.ones((2, 64), jnp.int32), W), TypeError, "x:"),
    ("matmul 0-d x", lambda: jf.matmul(jnp.float32(1), W), ValueError, "x:"),
    ("matmul K mismatch", lambda: jf.matmul(jnp.ones((2, 32)), W), ValueError, "x:"),
    ("matmul w array", lambda: jf.matmul(A, jnp.ones((64, 8))), TypeError, "w:"),
    ("matmul w axis 1", lambda: jf.matmul(A, NV), ValueError, "w:"),
    ("dot_general complex", dg(jnp.ones((3, 64), jnp.complex64), W, (((1,), (0,)), ((), ()))), TypeError, "lhs:"),
    ("dot_general int rhs", dg(NV, jnp.ones((64, 2), jnp.int32), (((1,), (0,)), ((), ()))), TypeError, "rhs:"),
    ("dot_general dim range", dg(A, W, (((1,), (2,)), ((), ()))), TypeError, "dimension_numbers:.*rhs dimension 2"),
    ("dot_general negative dim", dg(A, W, (((-1,), (0,)), ((), ()))), TypeError, "dimension_numbers:.*lhs dimension -1"),
    ("dot_general repeated", dg(A, W, (((1, 1), (0, 0)), ((), ()))), TypeError, "dimension_numbers:.*distinct"),
    ("dot_general lengths", dg(A, W, (((1,), (0, 1)), ((), ()))), TypeError, "dimension_numbers:.*same length"),
    ("dot_general sizes", dg(jnp.ones((3, 32)), W, (((1,), (0,)), ((), ()))), TypeError, "dimension_numbers:.*sizes"),
    ("dot_general structure", dg(A, W, 5), TypeError, "dimension_numbers:"),
    ("dot_general float dims", dg(A, W, (((1.0,), (0,)), ((), ()))), TypeError, "dimension_numbers"),
    ("dot_general not blocked", dg(jnp.ones((3, 8)), W, (((1,), (1,)), ((), ()))), ValueError, "rhs:"),
    ("dot_general two qarrays", dg(NV, NV, (((1,), (1,)), ((), ()))), TypeError, "lhs, rhs:"),
    # scaled_matmul
    ("scaled_matmul nf4", lambda: jf.scaled_matmul(NF, NF), ValueError, "a:"),
    ("scaled_matmul mixed", lambda: jf.scaled_matmul(NV, MX), ValueError, "b:"),
    ("scaled_matmul alpha bool", lambda: jf.scaled_matmul(MX, MX, alpha=True), TypeError, "alpha:"),
    ("scaled_matmul alpha complex", lambda: jf.scaled_matmul(MX, MX, alpha=1j), TypeError, "alpha:"),
    ("scaled_matmul alpha vector", lambda: jf.scaled_matmul(MX, MX, alpha=jnp.ones(2)), ValueError, "alpha:"),
    ("scaled_matmul bias shape", lambda: jf.scaled_matmul(MX, MX, bias=jnp.ones(3)), ValueError, "bias:"),
    ("scaled_matmul bias complex", lambda: jf.scaled_matmul(MX, MX, bias=jnp.ones(4, jnp.complex64)), TypeError, "bias:"),
    ("scaled_matmul out_dtype", lambda: jf.scaled_matmul(MX, MX, out_dtype="banana"), TypeError, "out_dtype:"),
    ("scaled_matmul out int", lambda: jf.scaled_matmul(MX, MX, out_dtype=jnp.int32), TypeError, "out_dtype:"),
    # QArray construction
    ("QArray format", _rebuild(NV, format="fp3"), ValueError, "format:"),
    ("QArray nvfp4 block 32", _rebuild(NV, block_size=32), ValueError, "QArray block_size"),
    ("QArray axis range", _rebuild(NV, axis=2), ValueError, "QArray axis"),
    ("QArray axis negative", _rebuild(NV, axis=-1), ValueError, "QArray axis"),
    ("QArray axis str", _rebuild(NV, axis="1"), TypeError, "QArray axis"),
    ("QArray shape", _rebuild(NV, shape=(4, 32)), ValueError, "QArray data"),
    ("QArray shape str", _rebuild(NV, shape="4x64"), TypeError, "QArray shape"),
    ("QArray dtype int", _rebuild(NV, dtype=jnp.int8), TypeError, "QArray dtype"),
    ("QArray dtype banana", _rebuild(NV, dtype="banana"), TypeError, "QArray dtype"),
    ("QArray layout", _rebuild(NV, scale_layout="banana"), ValueError, "scale_layout"),
    ("QArray per-row ts", _rebuild(NV, tensor_scale=jnp.ones((4,), jnp.float32)), ValueError, "QArray tensor_scale"),
    ("QArray ts f64", _rebuild(NV, tensor_scale=np.float64(1.0)), TypeError, "QArray tensor_scale"),
    ("QArray ts on mx", _rebuild(MX, tensor_scale=jnp.float32(1.0)), ValueError, "QArray tensor_scale"),
    ("QArray relabel nvfp4->mxfp4", _rebuild(NV, format="mxfp4", block_size=32), ValueError, "QArray tensor_scale"),
    ("QArray relabel mxfp4->nvfp4", _rebuild(MX, format="nvfp4", block_size=16), TypeError, "QArray scales"),
    ("QArray data dtype", _rebuild(NV, data=NV.data.astype(jnp.int8)), TypeError, "QArray data"),
    ("QArray data shape", _rebuild(NV, data=NV.data[:, :8]), ValueError, "QArray data"),
    ("QArray scales shape", _rebuild(NV, scales=NV.scales[:2]), ValueError, "QArray scales"),
    ("QArray scales dtype", _rebuild(NF, scales=NF.scales.astype(jnp.bfloat16)), TypeError, "QArray scales"),
    ("QArray int4 no zeros", _rebuild(I4, zeros=None), ValueError, "QArray zeros"),
    ("QArray int4 zeros dtype", _rebuild(I4, zeros=I4.zeros.astype(jnp.int32)), TypeError, "QArray zeros"),
    ("QArray zeros on nf4", _rebuild(NF, zeros=jnp.zeros((4, 1), jnp.uint8)), ValueError, "QArray zeros"),
    ("QArray int4 scale int", _rebuild(I4, scales=I4.scales.astype(jnp.int32)), TypeError, "QArray scales"),
    # unflattening from user code
    ("unflatten axis -2", _unflatten(NV, {1: -2}), ValueError, "QArray axis"),
    ("unflatten format relabel", _unflatten(MX, {0: "mxfp6_e2m3"}), ValueError, "QArray data"),
    ("unflatten block 32", _unflatten(NV, {4: 32}), ValueError, "QArray block_size"),
    ("unflatten wrong scales", _unflatten(NV, kids_over={1: MX.scales}), TypeError, "QArray scales"),
    ("unflatten per-row ts", _unflatten(NV, kids_over={2: jnp.ones((4,), jnp.float32)}), ValueError, "QArray tensor_scale"),
    ("unflatten data shape", _unflatten(NV, kids_over={0: NV.data[:2]}), ValueError, "QArray data"),
]


@pytest.mark.parametrize("name,fn,exc,match", CASES, ids=[c[0] for c in CASES])
def test_misuse(name, fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


def test_table_is_large():
    assert len(CASES) >= 60


def test_transforms_still_work_with_placeholder_leaves():
    """Validation leaves tracers, float0 tangents and placeholders alone."""
    q = NV
    jax.tree_util.tree_map(lambda _: object(), q)
    jax.tree_util.tree_map(lambda _: None, q)
    shapes = jax.eval_shape(lambda v: jf.quantize(v, "nvfp4", tensor_scale="auto"), X)
    assert isinstance(shapes, QArray) and shapes.shape == (4, 64)
    jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), I4)
    g = jax.grad(lambda qq: jnp.sum(qq.dequantize()), allow_int=True)(NF)
    assert g.scales.shape == NF.scales.shape
    qs = jax.vmap(lambda v: jf.quantize(v, "int4", block_size=32))(jnp.ones((3, 4, 64)))
    assert qs.data.shape == (3, 4, 32)
    y = jax.vmap(jf.dequantize)(qs)
    assert y.shape == (3, 4, 64)
    assert jax.jit(lambda qq: qq.dequantize())(NV).shape == (4, 64)
