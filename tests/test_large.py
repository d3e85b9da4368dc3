"""CPU kernels past 2**31 elements (64-bit indexing). Marked slow: about 5.5 GiB of
memory and minutes of CPU; not run in CI. Run with
``JAX_FP4_SLOW=1 python3 -m pytest -q tests/test_large.py`` (or ``--runslow``)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4 as jf
from jax_fp4 import _ext

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not _ext.build_info(), reason="compiled extension unavailable")]


def _pattern(rows, k, row0=0):
    """A deterministic bf16 test pattern, generated without a 2**31-element temporary."""
    r = jax.lax.broadcasted_iota(jnp.int32, (rows, k), 0) + row0
    c = jax.lax.broadcasted_iota(jnp.int32, (rows, k), 1)
    v = ((r * 7 + c * 13) % 251 - 125).astype(jnp.float32) * jnp.float32(0.03125)
    return v.astype(jnp.bfloat16)


def test_cpu_kernels_above_2_31_elements():
    rows, k = (1 << 17) + (1 << 6), 1 << 14
    assert rows * k > 2 ** 31
    old = jf.get_backend()
    jf.set_backend("kernels")
    try:
        x = jax.jit(lambda: _pattern(rows, k))()
        q = jax.jit(lambda v: jf.quantize(v, "nvfp4"))(x)
        del x
        y = jax.jit(lambda qq: qq.dequantize())(q)
        tail_codes, tail_scales = np.asarray(q.data[-3:]), np.asarray(q.scales[-3:])
        tail_y = np.asarray(y[-3:])
        del q, y
    finally:
        jf.set_backend(old)
    jf.set_backend("reference")
    try:
        tail = jax.jit(lambda: _pattern(3, k, rows - 3))()
        want = jax.jit(lambda v: jf.quantize(v, "nvfp4"))(tail)
        want_y = jax.jit(lambda qq: qq.dequantize())(want)
    finally:
        jf.set_backend(old)
    np.testing.assert_array_equal(tail_codes, np.asarray(want.data))
    np.testing.assert_array_equal(tail_scales.view(np.uint8), np.asarray(want.scales).view(np.uint8))
    np.testing.assert_array_equal(tail_y.view(np.uint16), np.asarray(want_y).view(np.uint16))
