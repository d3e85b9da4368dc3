"""jax.export round trip of jitted functions that call the CPU kernels."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4 as jf

pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers "
                    "(pip install -e .[test])")


def test_export_round_trip_calls_cpu_kernels(rng):
    if not jf.capabilities()["kernels"]["cpu"]:
        pytest.fail(f"CPU kernels are not built: {jf.capabilities()['load_error']}")
    x = jnp.asarray(rng.standard_normal((6, 128)), jnp.bfloat16)

    def f(x):
        q = jf.quantize(x, "nvfp4", tensor_scale="auto")
        return jf.dequantize(q), jf.fake_quantize(x, "mxfp4"), q.data

    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
        jax.export.export(jax.jit(f))(x)
    exp = jax.export.export(jax.jit(f), disabled_checks=jf.export_disabled_checks())(x)
    text = exp.mlir_module()
    for target in ("jax_fp4_quantize_v2", "jax_fp4_dequantize_v1", "jax_fp4_fake_quantize_v1"):
        assert f"@{target}" in text, target
    back = jax.export.deserialize(exp.serialize())
    got = back.call(x)
    want = jax.jit(f)(x)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
