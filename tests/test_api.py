"""Public API: any rank / axis / dtype, QArray behaviour, layouts, matmuls, transforms."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4 as jf
from jax_fp4 import reference
from jax_fp4.formats import FORMAT_NAMES, get_format

from edge import assert_bits_equal, assert_matmul_close


def _bs(fmt):
    return 32 if fmt == "int4" else get_format(fmt).default_block


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("axis,shape", [(0, (1, 3, 2)), (1, (3, 2, 5)), (-1, (2, 3, 2))])
def test_quantize_any_axis_matches_canonical_reference(fmt, axis, shape, rng):
    bs = _bs(fmt)
    shape = tuple(d * bs if i == axis % 3 else d for i, d in enumerate(shape))
    x = rng.standard_normal(shape).astype(np.float32)
    q = jf.quantize(x, fmt, axis=axis, block_size=bs)
    ax = axis % 3
    assert q.shape == x.shape and q.axis == ax and q.dtype == np.float32
    xm = np.moveaxis(x, ax, -1)
    c, s, z = reference.quantize_2d(jnp.asarray(xm.reshape(-1, xm.shape[-1])), fmt, bs)
    data = np.asarray(q.data)
    assert data.shape[:-1] == xm.shape[:-1]
    assert_bits_equal(data.view(np.uint8).reshape(c.shape), np.asarray(c), "codes")
    assert_bits_equal(np.asarray(q.scales).view(np.asarray(s).dtype).reshape(s.shape),
                      np.asarray(s), "scales")
    y = jf.dequantize(q)
    want = reference.dequantize_2d(c, s, z, fmt, bs, xm.shape[-1], jnp.float32)
    assert_bits_equal(np.asarray(y), np.moveaxis(np.asarray(want).reshape(xm.shape), -1, ax),
                      "dequantize")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dtypes_round_trip(dtype, rng):
    x = jnp.asarray(rng.standard_normal((4, 64)), dtype)
    for fmt in ("nvfp4", "mxfp8_e4m3", "nf4", "int4"):
        q = jf.quantize(x, fmt, block_size=32 if fmt == "int4" else None)
        y = q.dequantize()
        assert y.dtype == dtype and y.shape == x.shape
        assert q.dequantize(jnp.float32).dtype == jnp.float32
        rel = float(jnp.linalg.norm((y - x).astype(jnp.float32)) /
                    jnp.linalg.norm(x.astype(jnp.float32)))
        assert rel < (0.2 if fmt != "mxfp8_e4m3" else 0.05), (fmt, rel)
        assert_bits_equal(np.asarray(jf.fake_quantize(x, fmt, block_size=q.block_size)),
                          np.asarray(y), fmt)


def test_qarray_storage_dtypes_and_nbytes():
    x = jnp.ones((8, 64))
    q = jf.quantize(x, "nvfp4", tensor_scale="auto")
    assert q.data.dtype == jnp.uint8 and q.data.shape == (8, 32)
    assert q.scales.dtype == jnp.float8_e4m3fn and q.scales.shape == (8, 4)
    assert q.tensor_scale.shape == () and q.tensor_scale.dtype == jnp.float32
    assert q.nbytes == 8 * 32 + 8 * 4 + 4
    q = jf.quantize(x, "mxfp8_e5m2")
    assert q.data.dtype == jnp.float8_e5m2 and q.scales.dtype == jnp.float8_e8m0fnu
    q = jf.quantize(x, "mxfp6_e3m2")
    assert q.data.shape == (8, 48)
    q = jf.quantize(x, "int4", block_size=32, scale_dtype=jnp.bfloat16)
    assert q.scales.dtype == jnp.bfloat16 and q.zeros.shape == (8, 2)
    assert "int4" in repr(q) and "(8, 64)" in repr(q)


def test_tensor_scale_auto_equals_explicit(rng):
    x = jnp.asarray(rng.standard_normal((16, 64)) * 5, jnp.float32)
    q1 = jf.quantize(x, "nvfp4", tensor_scale="auto")
    ts = jf.tensor_scale_from_amax(jnp.max(jnp.abs(x)))
    q2 = jf.quantize(x, "nvfp4", tensor_scale=ts)
    assert float(q1.tensor_scale) == float(ts)
    np.testing.assert_array_equal(np.asarray(q1.data), np.asarray(q2.data))
    np.testing.assert_array_equal(np.asarray(q1.scales).view(np.uint8),
                                  np.asarray(q2.scales).view(np.uint8))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8_e4m3"])
def test_swizzled_scales(fmt, rng):
    x = jnp.asarray(rng.standard_normal((3, 130, 96)), jnp.float32)
    ql = jf.quantize(x, fmt)
    qs = jf.quantize(x, fmt, scale_layout="swizzled")
    nb = 96 // ql.block_size
    assert qs.scales.shape == (((390 + 127) // 128) * 32, ((nb + 3) // 4) * 16)
    want = jf.to_blocked(ql.scales.reshape(390, nb)).reshape(qs.scales.shape)
    np.testing.assert_array_equal(np.asarray(qs.scales).view(np.uint8),
                                  np.asarray(want).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(qs.dequantize()), np.asarray(ql.dequantize()))


def test_swizzled_scales_under_vmap(rng):
    """vmap of quantize with swizzled scales tiles each member's scales on its own."""
    x = jnp.asarray(rng.standard_normal((2, 130, 64)), jnp.bfloat16)
    got = jax.vmap(lambda v: jf.quantize(v, "nvfp4", scale_layout="swizzled").scales)(x)
    for i in range(2):
        want = jf.quantize(x[i], "nvfp4", scale_layout="swizzled").scales
        np.testing.assert_array_equal(np.asarray(got[i]).view(np.uint8),
                                      np.asarray(want).view(np.uint8))


def test_auto_tensor_scale_primitive(rng):
    """auto_tensor_scale == reference.tensor_scale_from_amax(reference.amax(x))
    (NaN wins, subnormals exact, zeros give 1.0), per member under vmap, no tangent;
    tensor_scale="auto" uses it and stays differentiable (STE)."""
    from jax_fp4.prims.tensor_scale import auto_tensor_scale
    x = rng.standard_normal((4, 40, 64)).astype(np.float32)
    x[1, 2, 3] = -1e-40
    x[2] *= 1e-38
    x[2, 5, 7] = np.nan
    x[3] = 0.0
    xs = jnp.asarray(x)
    want = [np.asarray(reference.tensor_scale_from_amax(reference.amax(xs[i]))) for i in range(4)]
    assert want[3] == 1.0
    for i in range(4):
        assert_bits_equal(jax.jit(auto_tensor_scale)(xs[i]), want[i], f"member {i}")
    assert_bits_equal(jax.vmap(auto_tensor_scale)(xs), np.stack(want), "vmap")
    g = jax.grad(lambda t: jnp.sum(jf.fake_quantize(t, "nvfp4", tensor_scale="auto")))(xs[0])
    assert np.asarray(g).shape == x[0].shape and np.isfinite(np.asarray(g)).all()


def test_qarray_through_jit_pytree_and_device_put(rng):
    x = jnp.asarray(rng.standard_normal((8, 64)), jnp.bfloat16)
    q = jax.jit(lambda v: jf.quantize(v, "nf4"))(x)
    assert isinstance(q, jf.QArray)
    leaves, tree = jax.tree_util.tree_flatten(q)
    q2 = jax.tree_util.tree_unflatten(tree, leaves)
    q3 = jax.device_put(q2)
    y = jax.jit(lambda qq: qq.dequantize())(q3)
    np.testing.assert_array_equal(np.asarray(y, np.float32),
                                  np.asarray(jf.dequantize(q), np.float32))


@pytest.mark.parametrize("in_axes", [0, 1])
def test_vmap_over_non_blocked_axis(in_axes, rng):
    x = jnp.asarray(rng.standard_normal((3, 5, 64)), jnp.float32)
    for fmt, kw in [("nvfp4", {"tensor_scale": "auto"}), ("mxfp4", {}), ("int4", {"block_size": 32})]:
        f = jax.vmap(lambda v: jf.fake_quantize(v, fmt, **kw), in_axes=in_axes)
        got = f(x)
        xs = jnp.moveaxis(x, in_axes, 0)
        want = jnp.stack([jf.fake_quantize(v, fmt, **kw) for v in xs])
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        qv = jax.vmap(lambda v: jf.quantize(v, fmt, **kw), in_axes=in_axes)(x)
        yv = jax.vmap(jf.dequantize)(qv)
        np.testing.assert_array_equal(np.asarray(yv), np.asarray(want))


def test_scan_over_stacked_qarray(rng):
    w = jnp.asarray(rng.standard_normal((4, 64, 32)), jnp.float32)  # 4 layers, (K, N)
    qs = jax.vmap(lambda m: jf.quantize(m, "nvfp4", axis=0))(w)
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)

    def layer(h, q):
        return h, jf.matmul(h, q)

    _, ys = jax.lax.scan(layer, x, qs)
    for i in range(4):
        qi = jf.quantize(w[i], "nvfp4", axis=0)
        assert_matmul_close(ys[i], x, qi.dequantize(), msg=f"layer {i}")


def test_grad_fake_quantize_default_ste_is_identity_where_finite(rng):
    """Default STE (torchao / TransformerEngine): d fake_quantize(x).sum() / dx == 1 wherever
    x is finite, in every format, including a block's largest elements that the E4M3 /
    E8M0 scale saturates; zero at NaN / Inf."""
    x = jnp.asarray(rng.standard_normal((8, 128)), jnp.float32)
    for fmt in FORMAT_NAMES:
        g = jax.grad(lambda v: jf.fake_quantize(v, fmt).sum())(x)
        np.testing.assert_array_equal(np.asarray(g), np.ones(x.shape, np.float32), err_msg=fmt)
    xn = x.at[0, 3].set(jnp.nan).at[1, 5].set(jnp.inf).at[2, 7].set(-jnp.inf)
    for fmt in ("nvfp4", "mxfp4", "nf4"):
        g = np.asarray(jax.grad(lambda v: jf.fake_quantize(v, fmt).sum())(xn))
        want = np.isfinite(np.asarray(xn)).astype(np.float32)
        np.testing.assert_array_equal(g, want, err_msg=fmt)
    # the clipped rule cuts some saturated elements here, so the two really differ
    gc = jax.grad(lambda v: jf.fake_quantize(v, "nvfp4", ste="clipped").sum())(x)
    assert (np.asarray(gc) == 0).sum() > 0
    with pytest.raises(ValueError, match="ste"):
        jf.fake_quantize(x, ste="round")


def test_grad_fake_quantize_clipped_ste(rng):
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    for fmt in ("nvfp4", "mxfp4", "nf4"):
        g = jax.grad(lambda v: jnp.sum(jf.fake_quantize(v, fmt, ste="clipped") * 3.0))(x)
        q = jf.quantize(x, fmt)
        if fmt == "nf4":
            want = np.full(x.shape, 3.0, np.float32)
        else:
            s = np.asarray(q.scales).astype(np.float32)
            limit = get_format(fmt).elem.max_value * np.repeat(s, q.block_size, axis=-1)
            want = np.where(np.abs(np.asarray(x)) <= limit, 3.0, 0.0)
        np.testing.assert_array_equal(np.asarray(g), want)
    # MX floor saturates the block maximum when it is above max_elem * scale: cut there
    x = jnp.zeros((1, 32)).at[0, 0].set(7.9)
    g = jax.grad(lambda v: jnp.sum(jf.fake_quantize(v, "mxfp4", ste="clipped")))(x)
    assert float(g[0, 0]) == 0.0 and float(g[0, 1]) == 1.0
    g = jax.grad(lambda v: jnp.sum(jf.fake_quantize(v, "mxfp4")))(x)
    assert float(g[0, 0]) == 1.0


def test_grad_matmul_wrt_activations(rng):
    w = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    q = jf.quantize(w, "nf4", axis=0)
    wd = q.dequantize()
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    loss = lambda v, f: jnp.sum(jnp.tanh(f(v)))
    g = jax.grad(loss)(x, lambda v: jf.matmul(v, q))
    want = jax.grad(loss)(x, lambda v: v @ wd)
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-5, atol=1e-6)
    dn = (((1,), (0,)), ((), ()))
    g2 = jax.grad(loss)(x, lambda v: jf.dot_general(v, q, dn))
    np.testing.assert_allclose(np.asarray(g2), np.asarray(want), rtol=1e-5, atol=1e-6)
    # vmap of the gradient (batched cotangents through the transpose rule)
    gv = jax.vmap(jax.grad(lambda v: jnp.sum(jf.matmul(v, q) ** 2)))(x)
    np.testing.assert_allclose(np.asarray(gv), np.asarray(2 * (x @ wd) @ wd.T), rtol=1e-4,
                               atol=1e-4)


def test_grad_dequantize_linear_in_scales(rng):
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
    q = jf.quantize(x, "nf4")
    g = jax.grad(lambda s: jnp.sum(jf.dequantize(
        jf.QArray(q.data, s, None, None, format="nf4", axis=1, shape=(2, 64),
                  dtype=jnp.float32, block_size=64))))(q.scales)
    unit = np.asarray(jf.QArray(q.data, jnp.ones_like(q.scales), None, None, format="nf4",
                                axis=1, shape=(2, 64), dtype=jnp.float32,
                                block_size=64).dequantize())
    # d/ds sum(code * s) = sum(code); the sum cancels, so bound the error by the
    # float32 rounding of a 64-term sum of |code| (XLA's reduction order is its own).
    tol = 64 * np.finfo(np.float32).eps * np.abs(unit).sum(1)
    assert np.all(np.abs(np.asarray(g)[:, 0] - unit.sum(1)) <= tol)


def test_dot_general_variants(rng):
    x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 8)), jnp.float32)
    q = jf.quantize(w, "mxfp4", axis=0)
    wd = q.dequantize(jnp.bfloat16)
    dn = (((2,), (0,)), ((), ()))
    got = jf.dot_general(x, q, dn, preferred_element_type=jnp.float32)
    want = jax.lax.dot_general(x, wd, dn, preferred_element_type=jnp.float32)
    assert got.shape == (2, 3, 8) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2, atol=1e-2)
    # QArray on the left, contracted along its blocked axis (axis 0 of a (K, M) QArray)
    ql = jf.quantize(jnp.asarray(rng.standard_normal((64, 5)), jnp.float32), "nvfp4", axis=0)
    r = jnp.asarray(rng.standard_normal((64, 4)), jnp.float32)
    got = jf.dot_general(ql, r, (((0,), (0,)), ((), ())))
    assert_matmul_close(got, np.asarray(ql.dequantize()).T, r, msg="QArray lhs")
    # plain arrays pass through
    np.testing.assert_array_equal(np.asarray(jf.dot_general(r.T, r, (((1,), (0,)), ((), ())))),
                                  np.asarray(r.T @ r))


def test_flax_style_dense_dot_general(rng):
    """nn.Dense(dot_general=jax_fp4.dot_general) contracts x's last axis with kernel axis 0."""
    kernel = jf.quantize(jnp.asarray(rng.standard_normal((32, 6)), jnp.float32), "nvfp4", axis=0)
    x = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    y = jax.jit(lambda a, k: jf.dot_general(a, k, (((a.ndim - 1,), (0,)), ((), ()))))(x, kernel)
    assert_matmul_close(y, x, kernel.dequantize(), msg="dense")


@pytest.mark.parametrize("fa,fb", [("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"),
                                   ("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp6_e2m3", "mxfp8_e4m3")])
def test_scaled_matmul_matches_float64(fa, fb, rng):
    a = jnp.asarray(rng.standard_normal((5, 96)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((7, 96)), jnp.float32)
    kw = {"tensor_scale": "auto"} if fa == "nvfp4" else {}
    qa, qb = jf.quantize(a, fa, **kw), jf.quantize(b, fb)
    bias = jnp.arange(7, dtype=jnp.float32)
    d = jf.scaled_matmul(qa, qb, alpha=0.5, bias=bias, out_dtype=jnp.float32)
    ad = np.asarray(qa.dequantize(), np.float64)
    bd = np.asarray(qb.dequantize(), np.float64)
    assert_matmul_close(d, ad, bd.T, scale=0.5, bias=np.arange(7), msg=f"{fa} x {fb}")
    assert jf.scaled_matmul(qa, qb).dtype == jnp.bfloat16


def test_backend_switch(rng):
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    old = jf.get_backend()
    try:
        jf.set_backend("reference")
        y_ref = jf.fake_quantize(x, "nf4")
        jf.set_backend("auto")
        y_auto = jf.fake_quantize(x, "nf4")
        np.testing.assert_array_equal(np.asarray(y_ref), np.asarray(y_auto))
        jf.set_backend("kernels")
        if jf.capabilities()["kernels"]["cpu"]:
            np.testing.assert_array_equal(np.asarray(jf.fake_quantize(x, "nf4")),
                                          np.asarray(y_ref))
        else:
            with pytest.raises(RuntimeError, match="JAX_FP4_BACKEND=kernels"):
                jf.fake_quantize(x, "nf4")
    finally:
        jf.set_backend(old)
    with pytest.raises(ValueError, match="backend"):
        jf.set_backend("fast")


def test_zero_size_arrays():
    for fmt in ("nvfp4", "mxfp4", "int4"):
        q = jf.quantize(jnp.zeros((0, 32)), fmt, block_size=32 if fmt == "int4" else None)
        assert q.shape == (0, 32) and q.dequantize().shape == (0, 32)


def test_capabilities():
    caps = jf.capabilities()
    assert set(caps["kernels"]) == {"cpu", "cuda"}
    assert caps["backend"] in ("auto", "reference", "kernels")
    assert "nvfp4" in caps["formats"]
