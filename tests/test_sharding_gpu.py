"""The partitioned lowering (jax_fp4.partitioning) on two devices of one platform.

Each test runs on two CPU devices (the virtual ones of tests/conftest.py) and, marked
``gpu``, on two GPUs, where each shard runs the CUDA kernels: column-parallel,
row-parallel (all-reduce, and reduce-scatter when the output is asked split) and
batch-sharded W4A16 matmuls, a row-parallel scaled_matmul, batch-sharded quantize /
dequantize / fake_quantize, the NVFP4 ``tensor_scale="auto"`` amax, and an FSDP layer
(the 4-bit weight gathered as its packed codes). Each result is
compared with the same op on one device of the platform -- bit for bit for quantize /
dequantize / fake_quantize, and for the matmuls both results are checked against a
float64 sum within the W4A16 contract (docs/spec.md, section 5), since a shard may take
another kernel path or sum in another order -- and the compiled HLO holds exactly the
expected collectives. The GPU variants skip where fewer than two GPUs are visible.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jax_fp4 as jf
from jax_fp4.sharding import qarray_partition_specs

PLATFORMS = [pytest.param("cpu", id="cpu"),
             pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)]


@pytest.fixture(params=PLATFORMS)
def mesh(request):
    """A 1-D mesh ("model",) of two devices of the platform."""
    try:
        devices = jax.devices(request.param)
    except RuntimeError:  # no such backend
        devices = []
    if len(devices) < 2:
        pytest.skip(f"needs >= 2 {request.param} devices, found {len(devices)}")
    return Mesh(np.array(devices[:2]), ("model",), axis_types=(AxisType.Auto,))


_COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(-start)?\(")


def collectives(fn, *args):
    """{kind: count} of the collectives in fn's compiled HLO. An asynchronous one prints as
    ``X-start`` (XLA's async syntax) or as an ``async-start`` of a computation holding
    ``X``: per kind the larger of the two counts, so that each is counted once."""
    text = fn.lower(*args).compile().as_text()
    found = {}
    for kind, start in _COLLECTIVE.findall(text):
        plain, starts = found.get(kind, (0, 0))
        found[kind] = (plain + (not start), starts + bool(start))
    return {k: max(v) for k, v in found.items()}


def assert_only_u32_all_reduces(fn, *args):
    """Some all-reduces (XLA may merge the same amax of two ops), each of u32 scalars (the
    NVFP4 amax bit patterns), and no other collective."""
    text = fn.lower(*args).compile().as_text()
    kinds = collectives(fn, *args)
    assert set(kinds) == {"all-reduce"}, kinds
    for shapes in re.findall(r"= (\([^)]*\)|\S+) all-reduce(?:-start)?\(", text):
        assert set(re.findall(r"\w+\[[^\]]*\]", shapes)) == {"u32[]"}, shapes


def put(tree, spec, mesh):
    if isinstance(tree, jf.QArray):
        specs = qarray_partition_specs(spec, tree)
        return jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                                 is_leaf=lambda x: isinstance(x, P)))
    return jax.device_put(tree, NamedSharding(mesh, spec))


def on_one(tree, mesh):
    """tree on the first device of the mesh: the unsharded run."""
    return jax.device_put(jax.device_get(tree), mesh.devices.flat[0])


def assert_bit_equal(got, want):
    gl, wl = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(gl) == len(wl)
    for g, w in zip(gl, wl):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(g.view(f"u{g.dtype.itemsize}"),
                                      w.view(f"u{w.dtype.itemsize}"))


_U = {np.dtype(jnp.bfloat16): 2.0**-8, np.dtype(jnp.float16): 2.0**-11,
      np.dtype(np.float32): 2.0**-24}


def assert_w4a16(got, x, q, what):
    """The W4A16 contract: |y - y*| <= (u + K 2^-24) sum_k |x w*| (u of x's dtype), plus
    half an ulp of y's dtype for the final rounding; y* exact in float64, w* the decoded
    weight (float32 dequantize: exact but for the rounding of the per-tensor-scale
    product, 2^-24 relative, one more K term)."""
    x64 = np.asarray(jax.device_get(x), np.float64)
    w64 = np.asarray(jax.device_get(jf.dequantize(on_one(q, _CPU), dtype=jnp.float32)),
                     np.float64)
    exact = x64 @ w64
    k = x64.shape[1]
    fi = jnp.finfo(got.dtype)
    bound = ((_U[np.dtype(x.dtype)] + (k + 1) * 2.0**-24) * (np.abs(x64) @ np.abs(w64))
             + float(fi.smallest_subnormal))
    bound += 0.5 * float(fi.eps) * 2.0 ** np.floor(np.log2(np.maximum(np.abs(exact) + bound,
                                                                       float(fi.tiny))))
    err = np.abs(np.asarray(jax.device_get(got), np.float64) - exact)
    bad = ~(err <= bound)
    assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} outside the W4A16 contract"


_CPU = Mesh(np.array(jax.devices("cpu")[:1]), ("one",))


def _x(shape, seed, dtype=jnp.float32):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    x.flat[::97] *= 300.0  # saturating blocks, varied block scales
    x.flat[5::101] = 0.0
    return jnp.asarray(x).astype(dtype)


FORMATS = [("nvfp4", None, "auto"), ("mxfp4", None, None), ("int4", 64, None)]
FORMAT_IDS = ["nvfp4-auto", "mxfp4", "int4-64"]

# (x (M, K) spec, weight (K, N) spec, output constraint or None, expected collectives)
MATMUL_CASES = {
    "column": (P(), P(None, "model"), None, {}),
    "row-all-reduce": (P(None, "model"), P("model", None), None, {"all-reduce": 1}),
    "row-reduce-scatter": (P(None, "model"), P("model", None), P("model", None),
                           {"reduce-scatter": 1}),
    "batch": (P("model", None), P(), None, {}),
}


@pytest.mark.parametrize("case", list(MATMUL_CASES))
@pytest.mark.parametrize("fmt,block_size,ts", FORMATS, ids=FORMAT_IDS)
def test_w4a16_matmul_partitioned(mesh, fmt, block_size, ts, case):
    xspec, wspec, ospec, want = MATMUL_CASES[case]
    x = _x((16, 1024), 1, jnp.bfloat16)
    q = jf.quantize(_x((1024, 512), 2, jnp.bfloat16), fmt, axis=0, block_size=block_size,
                    tensor_scale=ts)
    out = None if ospec is None else NamedSharding(mesh, ospec)
    f = jax.jit(lambda x, q: jf.dot_general(x, q, (((1,), (0,)), ((), ())),
                                            out_sharding=out))
    args = (put(x, xspec, mesh), put(q, wspec, mesh))
    assert collectives(f, *args) == want
    y = f(*args)
    if out is not None:
        assert y.sharding.is_equivalent_to(out, 2), y.sharding
    one = jax.jit(jf.matmul)(on_one(x, mesh), on_one(q, mesh))
    assert y.dtype == one.dtype == jnp.bfloat16
    assert_w4a16(one, x, q, "one device")
    assert_w4a16(y, x, q, case)


def test_scaled_matmul_row_parallel(mesh):
    a = jf.quantize(_x((32, 1024), 1), "nvfp4", axis=1, tensor_scale="auto")
    b = jf.quantize(_x((256, 1024), 2), "nvfp4", axis=1, tensor_scale="auto")
    bias = _x((256,), 3)

    def fn(a, b, bias):
        return jf.scaled_matmul(a, b, alpha=0.5, bias=bias, out_dtype=jnp.float32)

    for ospec, want in ((None, {"all-reduce": 1}), (P(None, "model"), {"reduce-scatter": 1})):
        out = None if ospec is None else NamedSharding(mesh, ospec)
        f = jax.jit(fn) if out is None else jax.jit(
            lambda a, b, bias: jax.lax.with_sharding_constraint(fn(a, b, bias), out))
        args = (put(a, P(None, "model"), mesh), put(b, P(None, "model"), mesh),
                put(bias, P(), mesh))
        assert collectives(f, *args) == want
        got = np.asarray(f(*args), np.float64)
        # both operands decode exactly; float32 sums over K (docs/spec.md, section 5)
        ad = np.asarray(jf.dequantize(on_one(a, _CPU), dtype=jnp.float32), np.float64)
        bd = np.asarray(jf.dequantize(on_one(b, _CPU), dtype=jnp.float32), np.float64)
        exact = 0.5 * ad @ bd.T + np.asarray(bias, np.float64)[None]
        bound = 1024 * 2.0**-22 * (0.5 * np.abs(ad) @ np.abs(bd).T
                                   + np.abs(np.asarray(bias, np.float64))[None])
        one = np.asarray(jax.jit(fn)(*on_one((a, b, bias), mesh)), np.float64)
        for y, what in ((one, "one device"), (got, f"sharded {ospec}")):
            assert (np.abs(y - exact) <= bound).all(), what


@pytest.mark.parametrize("fmt,block_size,ts", FORMATS, ids=FORMAT_IDS)
def test_batch_sharded_quantize_dequantize_fake_quantize_bit_exact(mesh, fmt, block_size, ts):
    x = _x((64, 1024), 4, jnp.bfloat16)
    kw = dict(axis=1, block_size=block_size, tensor_scale=ts)
    q_in = jf.quantize(x, fmt, **kw)

    def ops(x, q):
        return jf.quantize(x, fmt, **kw), jf.fake_quantize(x, fmt, **kw), jf.dequantize(q)

    f = jax.jit(ops)
    args = (put(x, P("model", None), mesh), put(q_in, P("model", None), mesh))
    if ts == "auto":  # the NVFP4 per-tensor scales of quantize and fake_quantize
        assert_only_u32_all_reduces(f, *args)
    else:
        assert collectives(f, *args) == {}
    got = f(*args)
    assert_bit_equal(got, jax.jit(ops)(*on_one((x, q_in), mesh)))
    assert got[1].sharding.is_equivalent_to(NamedSharding(mesh, P("model", None)), 2)


def test_nvfp4_auto_tensor_scale_all_reduces_one_scalar(mesh):
    x = np.array(_x((64, 1024), 5))
    x[3, 7] = 1e-40   # subnormal
    x[60, 900] = 7e4  # the amax, on the second device
    f = jax.jit(lambda x: jf.quantize(x, "nvfp4", tensor_scale="auto"))
    xs = put(jnp.asarray(x), P("model", None), mesh)
    assert collectives(f, xs) == {"all-reduce": 1}
    assert_only_u32_all_reduces(f, xs)
    assert_bit_equal(f(xs), f(on_one(jnp.asarray(x), mesh)))


def test_fsdp_gathers_the_packed_weight(mesh):
    # weights stored sharded, gathered at use as their packed leaves; the batch stays split
    from jax_fp4.sharding import fsdp_specs, gather_weights, named_shardings

    fsdp = Mesh(mesh.devices, ("fsdp",), axis_types=(AxisType.Auto,))
    x = _x((16, 1024), 1, jnp.bfloat16)
    q = jf.quantize(_x((1024, 512), 2, jnp.bfloat16), "nvfp4", axis=0, tensor_scale="auto")
    params = {"up": {"kernel": q}}
    placed = jax.device_put(params, named_shardings(fsdp, fsdp_specs(params, fsdp)))
    assert placed["up"]["kernel"].data.sharding.spec == P("fsdp", None)
    f = jax.jit(lambda p, x: jf.matmul(x, gather_weights(p, fsdp)["up"]["kernel"]))
    args = (placed, put(x, P("fsdp", None), fsdp))
    text = f.lower(*args).compile().as_text()
    assert set(collectives(f, *args)) == {"all-gather"}
    gathered = re.findall(r"= (\([^)]*\)|\S+) all-gather(?:-start|-done)?\(", text)
    # the codes: u8, two per byte (a -start's result pairs the shard with the gathered)
    assert any("u8[512,512]" in g for g in gathered), gathered
    assert not re.search(r"(bf16|f32)\[(512,1024|1024,512)\]", " ".join(gathered)), gathered
    y = f(*args)
    assert y.sharding.spec[0] == "fsdp"
    assert_w4a16(y, x, q, "fsdp")
