"""Every bad input of docs/spec.md section 5 raises a clear error naming the argument."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4 as jf

X = jnp.ones((4, 64), jnp.float32)


def test_unknown_format():
    with pytest.raises(ValueError, match=r"format: unknown format 'fp3'.*nvfp4"):
        jf.quantize(X, "fp3")


def test_axis_not_divisible_by_block():
    with pytest.raises(ValueError, match=r"x: the blocked axis has length 48.*block_size 32"):
        jf.quantize(jnp.ones((4, 48)), "mxfp4")


def test_axis_out_of_range():
    with pytest.raises(ValueError, match=r"axis: expected an axis in \[-2, 2\).*got 2"):
        jf.quantize(X, "nvfp4", axis=2)


def test_block_size_not_allowed():
    with pytest.raises(ValueError, match="block_size: nvfp4 uses blocks of 16, got 32"):
        jf.quantize(X, "nvfp4", block_size=32)
    with pytest.raises(ValueError, match=r"block_size: nf4 needs a power of two"):
        jf.quantize(X, "nf4", block_size=48)
    with pytest.raises(TypeError, match="block_size: expected an int"):
        jf.quantize(X, "nf4", block_size=64.0)


def test_wrong_dtype():
    with pytest.raises(TypeError, match="x: expected dtype float32, bfloat16 or float16, got int32"):
        jf.quantize(jnp.ones((4, 64), jnp.int32), "nvfp4")
    with pytest.raises(TypeError, match="x: expected dtype .* got float8_e4m3fn"):
        jf.fake_quantize(jnp.ones((4, 64), jnp.float8_e4m3fn), "nvfp4")
    with pytest.raises(TypeError, match="dtype: expected float32, bfloat16 or float16"):
        jf.dequantize(jf.quantize(X, "nvfp4"), jnp.int8)
    with pytest.raises(TypeError, match="q: expected a QArray, got ArrayImpl"):
        jf.dequantize(X)


def test_scalar_input():
    with pytest.raises(ValueError, match="x: expected an array with at least one axis"):
        jf.quantize(jnp.float32(1.0), "nvfp4")


def test_tensor_scale_errors():
    with pytest.raises(ValueError, match=r"tensor_scale: expected a scalar, got shape \(2,\)"):
        jf.quantize(X, "nvfp4", tensor_scale=jnp.ones(2))
    with pytest.raises(ValueError, match="tensor_scale: expected a finite value >= 2\\*\\*-120, got nan"):
        jf.quantize(X, "nvfp4", tensor_scale=float("nan"))
    with pytest.raises(ValueError, match="tensor_scale: expected a finite value .* got -1.0"):
        jf.quantize(X, "nvfp4", tensor_scale=-1.0)
    with pytest.raises(ValueError, match="tensor_scale: only nvfp4 has a per-tensor scale"):
        jf.quantize(X, "mxfp4", tensor_scale="auto")
    with pytest.raises(ValueError, match="tensor_scale: expected None, 'auto'"):
        jf.quantize(X, "nvfp4", tensor_scale="max")


def test_traced_invalid_tensor_scale_gives_nan_scales():
    q = jax.jit(lambda x, t: jf.quantize(x, "nvfp4", tensor_scale=t))(X, jnp.float32(np.inf))
    assert (np.asarray(q.scales).view(np.uint8) == 0x7F).all()
    assert np.isnan(np.asarray(q.dequantize())).all()


def test_option_errors():
    with pytest.raises(ValueError, match="scale_rounding: 'rceil' applies to MX formats only"):
        jf.quantize(X, "nvfp4", scale_rounding="rceil")
    with pytest.raises(ValueError, match="scale_rounding: expected one of"):
        jf.quantize(X, "mxfp4", scale_rounding="ceil")
    with pytest.raises(ValueError, match="scale_layout: expected one of"):
        jf.quantize(X, "mxfp4", scale_layout="tiled")
    with pytest.raises(ValueError, match="scale_dtype: only int4"):
        jf.quantize(X, "nf4", scale_dtype=jnp.bfloat16)
    with pytest.raises(TypeError, match="scale_dtype: expected float32, bfloat16 or float16"):
        jf.quantize(X, "int4", block_size=32, scale_dtype=jnp.int8)
    with pytest.raises(ValueError, match="format: only nvfp4 has a per-tensor scale"):
        jf.tensor_scale_from_amax(1.0, "mxfp4")


def test_qarray_contracted_along_non_blocked_axis():
    q = jf.quantize(jnp.ones((64, 32)), "nvfp4", axis=0)
    with pytest.raises(ValueError, match=r"rhs: a QArray must be contracted along its blocked axis 0"):
        jf.dot_general(jnp.ones((4, 32)), q, (((1,), (1,)), ((), ())))
    qb = jf.quantize(jnp.ones((64, 32)), "nvfp4", axis=1)
    with pytest.raises(ValueError, match=r"w: expected a 2-D \(K, N\) QArray blocked along axis 0"):
        jf.matmul(jnp.ones((4, 64)), qb)
    with pytest.raises(TypeError, match="lhs, rhs: both are QArrays"):
        jf.dot_general(q, q, (((0,), (0,)), ((), ())))


def test_scaled_matmul_errors():
    a = jf.quantize(jnp.ones((4, 64)), "nvfp4")
    b = jf.quantize(jnp.ones((8, 64)), "mxfp4")
    with pytest.raises(ValueError, match="b: mismatched formats: a is 'nvfp4', b is 'mxfp4'"):
        jf.scaled_matmul(a, b)
    n = jf.quantize(jnp.ones((8, 64)), "nf4")
    with pytest.raises(ValueError, match="b: scaled_matmul takes nvfp4 or MX formats"):
        jf.scaled_matmul(a, n)
    c = jf.quantize(jnp.ones((8, 32)), "nvfp4")
    with pytest.raises(ValueError, match="b: K mismatch: a has K=64, b has K=32"):
        jf.scaled_matmul(a, c)
    a0 = jf.quantize(jnp.ones((64, 4)), "nvfp4", axis=0)
    with pytest.raises(ValueError, match="a: expected a 2-D QArray blocked along axis 1"):
        jf.scaled_matmul(a0, a)
    with pytest.raises(ValueError, match=r"bias: expected shape \(4,\)"):
        jf.scaled_matmul(a, a, bias=jnp.ones(3))
    with pytest.raises(ValueError, match="alpha: expected a scalar"):
        jf.scaled_matmul(a, a, alpha=jnp.ones(2))


def test_from_blocked_wrong_size():
    with pytest.raises(ValueError, match=r"blocked: expected 512 elements"):
        jf.from_blocked(jnp.zeros(100, jnp.uint8), (5, 3))
    with pytest.raises(ValueError, match="scales: expected a 2-D"):
        jf.to_blocked(jnp.zeros(10))


def test_odd_k_for_packed_formats():
    with pytest.raises(ValueError, match="x: the blocked axis has length 3"):
        jf.quantize(jnp.ones((2, 3)), "int4", block_size=3)
