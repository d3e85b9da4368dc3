"""jax_fp4.prepare: the fused W4A16 kernel's weight layout ("tiled"), bit-identical to the
linear layout through every op (CPU here; the CUDA kernel in test_cuda_matmul.py)."""
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4 as jf
from jax_fp4 import layout
from jax_fp4.prims import _gpu
from jax_fp4.io import safetensors as st
from jax_fp4.nn.params import transpose_2d
from jax_fp4.nn.quantize import quantize_params

CASES = [("nvfp4", {}), ("nvfp4", {"tensor_scale": "auto"}), ("mxfp4", {}),
         ("int4", {}), ("int4", {"block_size": 32, "scale_dtype": jnp.bfloat16}),
         ("int4", {"block_size": 64, "scale_dtype": jnp.float32}),
         ("nf4", {}), ("bnb_fp4", {"block_size": 32}), ("nf4", {"block_size": 128})]


def _bits(a):
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _weight(rng, k, n):
    return jnp.asarray(rng.standard_normal((k, n)) * 10.0 ** rng.integers(-3, 3, size=(1, n)),
                       jnp.float32)


def test_tile_rows_puts_each_tile_contiguous(rng):
    a = jnp.asarray(rng.integers(0, 255, size=(3, 256, 192)), jnp.uint8)
    t = np.asarray(layout.tile_rows(a, 64)).reshape(3, -1)
    a = np.asarray(a)
    for lead, i, j in ((0, 0, 0), (2, 1, 2), (1, 0, 1)):
        tile = a[lead, 128 * i:128 * (i + 1), 64 * j:64 * (j + 1)]
        start = (i * 3 + j) * tile.size
        np.testing.assert_array_equal(t[lead, start:start + tile.size], tile.reshape(-1))
    np.testing.assert_array_equal(layout.untile_rows(layout.tile_rows(a, 64), 64), a)


@pytest.mark.parametrize("fmt,kw", CASES, ids=str)
def test_prepare_is_bit_identical(fmt, kw, rng):
    k, n = 384, 256
    q = jf.quantize(_weight(rng, k, n), fmt, axis=0, **kw)
    p = jf.prepare(q)
    assert p.scale_layout == "tiled" and p.shape == q.shape and p.axis == q.axis
    assert p.data.shape == q.data.shape and p.scales.shape == q.scales.shape
    assert p.nbytes == q.nbytes
    # the bytes moved (tile (0, 1)'s first row sits right after tile (0, 0)'s 128 rows)
    np.testing.assert_array_equal(np.asarray(p.data).reshape(-1)[128 * 64:129 * 64],
                                  np.asarray(q.data)[0, 64:128])
    assert jf.prepare(p) is p
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        np.testing.assert_array_equal(_bits(jf.dequantize(p, dtype)), _bits(jf.dequantize(q, dtype)))
    u = jf.unprepare(p)
    assert u.scale_layout == "linear"
    np.testing.assert_array_equal(np.asarray(u.data), np.asarray(q.data))
    np.testing.assert_array_equal(_bits(u.scales), _bits(q.scales))
    if q.zeros is not None:  # int4: zero points tiled as the scales
        assert p.zeros.shape == q.zeros.shape
        assert not np.array_equal(np.asarray(p.zeros), np.asarray(q.zeros))
        np.testing.assert_array_equal(np.asarray(u.zeros), np.asarray(q.zeros))
    assert jf.unprepare(q) is q


@pytest.mark.parametrize("backend", ["reference", "kernels"])
@pytest.mark.parametrize("fmt,kw", CASES, ids=str)
def test_prepared_matmul_equals_linear(fmt, kw, backend, rng):
    if backend == "kernels" and not jf.capabilities()["kernels"]["cpu"]:
        pytest.skip("no CPU kernels in this install")
    k, n = 256, 384
    q = jf.quantize(_weight(rng, k, n), fmt, axis=0, **kw)
    p = jf.prepare(q)
    jf.set_backend(backend)
    try:
        for m in (1, 5, 33):
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            want = jax.jit(jf.matmul)(x, q)
            np.testing.assert_array_equal(_bits(jax.jit(jf.matmul)(x, p)), _bits(want))
        # vmap over x, and the gradient w.r.t. x (through the dequantized weight)
        xb = jnp.asarray(rng.standard_normal((3, 4, k)), jnp.float32)
        f = jax.vmap(jf.matmul, in_axes=(0, None))
        np.testing.assert_array_equal(_bits(jax.jit(f)(xb, p)), _bits(jax.jit(f)(xb, q)))
        g = jax.grad(lambda x, w: jf.matmul(x, w).sum())
        np.testing.assert_array_equal(_bits(jax.jit(g)(xb[0], p)), _bits(jax.jit(g)(xb[0], q)))
    finally:
        jf.set_backend("auto")


def test_prepared_stacked_weights_scan_and_vmap(rng):
    """A stacked (L, K, N) QArray prepared once: scan and vmap slice it into prepared
    layers (the tiles are on the last two axes of the buffers)."""
    ws = jnp.stack([_weight(rng, 256, 128) for _ in range(3)])
    q = jf.quantize(ws, "nvfp4", axis=1)
    p = jf.prepare(q)
    assert p.scale_layout == "tiled"
    x = jnp.asarray(rng.standard_normal((2, 256)), jnp.float32)

    def run(w):
        def body(h, wl):
            return h, jf.matmul(h, wl)
        return jax.lax.scan(body, x, w)[1]

    np.testing.assert_array_equal(_bits(jax.jit(run)(p)), _bits(jax.jit(run)(q)))
    f = jax.vmap(lambda w: jf.dequantize(w))
    np.testing.assert_array_equal(_bits(f(p)), _bits(f(q)))


def test_prepare_leaves_other_qarrays_alone(rng):
    w = _weight(rng, 256, 256)
    for q in (jf.quantize(w[:, :200], "nvfp4", axis=0),      # N not a multiple of 128
              jf.quantize(w[:96], "mxfp4", axis=0),         # K not a multiple of 128
              jf.quantize(w, "nf4", axis=0, block_size=256),   # blocks longer than 128 k
              jf.quantize(w, "int4", axis=0, block_size=16),   # 24 bytes a row and step
              jf.quantize(w, "int4", axis=0, block_size=32, scale_dtype=jnp.float32),  # 20
              jf.quantize(w, "mxfp8_e4m3", axis=0),
              jf.quantize(w, "nvfp4", axis=0, scale_layout="swizzled"),
              jf.quantize(w[0], "nvfp4")):                   # 1-D
        assert jf.prepare(q) is q, q
    with pytest.raises(TypeError, match="q: expected a QArray"):
        jf.prepare(w)
    with pytest.raises(ValueError, match="jax_fp4.prepare"):
        jf.quantize(w, "nvfp4", scale_layout="tiled")


def test_prepared_transpose_and_scaled_matmul(rng):
    """transpose_2d keeps the buffers (the layout is defined on them); scaled_matmul and
    its operands read the prepared layout as the linear one."""
    q = jf.quantize(_weight(rng, 256, 128), "nvfp4", axis=0)
    p = jf.prepare(q)
    pt, qt = transpose_2d(p), transpose_2d(q)
    assert pt.scale_layout == "tiled" and pt.shape == (128, 256)
    np.testing.assert_array_equal(_bits(jf.dequantize(pt)), _bits(jf.dequantize(qt)))
    a = jf.quantize(jnp.asarray(rng.standard_normal((8, 256)), jnp.float32), "nvfp4")
    np.testing.assert_array_equal(_bits(jf.scaled_matmul(a, pt)), _bits(jf.scaled_matmul(a, qt)))
    for x, y in zip(jf.scaled_matmul_operands(pt)[:2], jf.scaled_matmul_operands(qt)[:2]):
        np.testing.assert_array_equal(_bits(x), _bits(y))


def test_quantize_params_prepare_and_checkpoints(rng, tmp_path):
    tree = {"dense": {"kernel": _weight(rng, 256, 128)}, "out": {"kernel": _weight(rng, 128, 100)}}
    plain = quantize_params(tree, "nvfp4", prepare=False)
    prep = quantize_params(tree, "nvfp4", prepare=True)
    assert prep["dense"]["kernel"].scale_layout == "tiled"
    assert prep["out"]["kernel"].scale_layout == "linear"  # N = 100: left linear
    # checkpoints hold the linear layout, which PyTorch peers read
    st.save(str(tmp_path / "w.safetensors"), prep)
    k = st.load(str(tmp_path / "w.safetensors"))["dense.kernel"]
    assert k.scale_layout == "linear"
    np.testing.assert_array_equal(np.asarray(k.data), np.asarray(plain["dense"]["kernel"].data))
    # loaded into a prepared target: prepared again
    back = st.load(str(tmp_path / "w.safetensors"), target=prep)
    assert back["dense"]["kernel"].scale_layout == "tiled"
    np.testing.assert_array_equal(np.asarray(back["dense"]["kernel"].data),
                                  np.asarray(prep["dense"]["kernel"].data))
    # int4: the zero points are written linear and tiled again on load, as the scales
    prep4 = quantize_params(tree, "int4", prepare=True)
    assert prep4["dense"]["kernel"].scale_layout == "tiled"
    st.save(str(tmp_path / "w4.safetensors"), prep4)
    lin4 = st.load(str(tmp_path / "w4.safetensors"))["dense.kernel"]
    want4 = quantize_params(tree, "int4", prepare=False)["dense"]["kernel"]
    np.testing.assert_array_equal(np.asarray(lin4.zeros), np.asarray(want4.zeros))
    back4 = st.load(str(tmp_path / "w4.safetensors"), target=prep4)["dense"]["kernel"]
    for a, b in ((back4.data, prep4["dense"]["kernel"].data),
                 (back4.zeros, prep4["dense"]["kernel"].zeros)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(_bits(back4.scales), _bits(prep4["dense"]["kernel"].scales))
    # Equinox models: the new layers' weights
    lin = eqx.nn.Linear(256, 128, key=jax.random.key(0))
    ql = quantize_params({"l": lin}, "mxfp4", prepare=True)["l"]
    leaves = [x for x in jax.tree_util.tree_leaves(ql, is_leaf=lambda x: isinstance(x, jf.QArray))
              if isinstance(x, jf.QArray)]
    assert leaves and all(x.scale_layout == "tiled" for x in leaves)
    x = jnp.asarray(rng.standard_normal((256,)), jnp.float32)
    want = quantize_params({"l": lin}, "mxfp4", prepare=False)["l"](x)
    np.testing.assert_array_equal(_bits(ql(x)), _bits(want))


@pytest.mark.parametrize("wgmma", [False, True])
def test_quantize_params_prepares_where_wgmma_runs(wgmma, rng, monkeypatch):
    """prepare=None (the default): the prepared layout exactly where the wgmma kernel can
    run (pinned either way, so the test means the same on every machine)."""
    props = _gpu.GpuProps(9 if wgmma else 8, 132, ("80", "90a"))
    monkeypatch.setattr(_gpu, "gpu_props", lambda ctx=None: props)
    tree = {"dense": {"kernel": _weight(rng, 256, 128)}}
    want = "tiled" if wgmma else "linear"
    assert quantize_params(tree, "nvfp4")["dense"]["kernel"].scale_layout == want
    assert quantize_params(tree, "nvfp4", prepare=False)["dense"]["kernel"].scale_layout == "linear"
    assert quantize_params(tree, "nvfp4", prepare=True)["dense"]["kernel"].scale_layout == "tiled"


def test_quantize_params_prepare_nnx(rng):
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self):
            self.proj = nnx.Linear(256, 128, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.proj(x)

    model = Model()
    x = jnp.asarray(rng.standard_normal((2, 256)), jnp.float32)
    want = quantize_params(model, "nvfp4", prepare=False)(x)
    qm = quantize_params(model, "nvfp4", prepare=True)
    leaves = [v for v in jax.tree_util.tree_leaves(nnx.state(qm), is_leaf=lambda v: isinstance(v, jf.QArray))
              if isinstance(v, jf.QArray)]
    assert leaves and all(v.scale_layout == "tiled" for v in leaves)
    np.testing.assert_array_equal(_bits(qm(x)), _bits(want))
