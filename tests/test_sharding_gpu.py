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
import collections
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jax_fp4 as jf
from jax_fp4 import _ext
from jax_fp4.prims import all_reduce
from jax_fp4.sharding import collectives as jsh_collectives, qarray_partition_specs

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


def collectives(fn, *args):
    """{kind: count} of the collectives in fn's compiled HLO (jax_fp4.sharding.collectives:
    each op once, jax-fp4's in-graph all-reduce as "in-graph all-reduce")."""
    return dict(collections.Counter(c.kind for c in jsh_collectives(fn.lower(*args).compile())))


def in_graph_all_reduce(mesh) -> bool:
    """Whether row-parallel sums on this mesh take the in-graph all-reduce
    (jax_fp4.prims.all_reduce): GPUs of this process with peer access, and
    JAX_FP4_ALL_REDUCE not "xla"."""
    if mesh.devices.flat[0].platform == "cpu" or os.environ.get("JAX_FP4_ALL_REDUCE") == "xla":
        return False
    return _peer_access(tuple(d.local_hardware_id for d in mesh.devices.flat))


@functools.lru_cache(maxsize=None)
def _peer_access(ordinals) -> bool:
    # the probe allocates one small channel: once per set of GPUs
    return _ext.all_reduce_setup([list(ordinals)], 1) > 0


def expected_collectives(mesh, want):
    """`want` with its all-reduces moved to the in-graph all-reduce's custom calls
    ("jax_fp4_all_reduce_v1") where the mesh takes it."""
    if not in_graph_all_reduce(mesh) or "all-reduce" not in want:
        return dict(want)
    want = dict(want)
    want["in-graph all-reduce"] = want.pop("all-reduce")
    return want


def assert_only_u32_all_reduces(fn, *args, amaxes=2):
    """Some all-reduces of the NVFP4 amax bit patterns (u32 scalars; XLA may merge the same
    amax of two ops, or combine the `amaxes` scalars into one u32 vector), and no other
    collective."""
    found = jsh_collectives(fn.lower(*args).compile())
    assert found and {c.kind for c in found} == {"all-reduce"}, found
    for c in found:
        assert all(dt == "u32" and (shape == () or (len(shape) == 1 and shape[0] <= amaxes))
                   for dt, shape in c.arrays), c


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
    assert collectives(f, *args) == expected_collectives(mesh, want)
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
        assert collectives(f, *args) == expected_collectives(mesh, want)
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
    assert_only_u32_all_reduces(f, xs, amaxes=1)
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
    found = jsh_collectives(f.lower(*args).compile())
    assert {c.kind for c in found} == {"all-gather"}, found
    gathered = [a for c in found for a in c.arrays]
    # the codes: u8, two per byte; never the float weight
    assert ("u8", (512, 512)) in gathered, gathered
    assert not [a for a in gathered if a[0] in ("bf16", "f32")
                and a[1] in ((512, 1024), (1024, 512))], gathered
    y = f(*args)
    assert y.sharding.spec[0] == "fsdp"
    assert_w4a16(y, x, q, "fsdp")


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_in_graph_all_reduce_equals_psum(out_dtype):
    """The in-graph all-reduce alone, under shard_map on two GPUs: on every device, bit
    for bit psum's float32 sum (a + b: two ranks leave no order to differ in) cast to
    out_dtype, for one element, parts of a block, several blocks with a ragged end and
    the largest message; called repeatedly with fresh values, so that both buffer phases
    and the epoch counters are exercised, and both devices hold the same bits."""
    gpus = jax.devices("gpu") if jax.default_backend() == "gpu" else []
    if len(gpus) < 2:
        pytest.skip(f"needs >= 2 GPUs, found {len(gpus)}")
    mesh = Mesh(np.array(gpus[:2]), ("model",), axis_types=(AxisType.Auto,))
    if not in_graph_all_reduce(mesh):
        pytest.skip("the two GPUs have no peer access (XLA's psum runs instead)")

    def local(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("model"), out_specs=P("model")))

    def ours(y):
        s = all_reduce.in_graph_sum(y, mesh, ("model",), out_dtype)
        assert s is not None, "the in-graph all-reduce did not apply"
        return s

    f = local(ours)
    g = local(lambda y: jax.lax.psum(y, "model").astype(out_dtype))
    rng = np.random.default_rng(0)
    for n in (1, 1000, 3 * 2048 + 5, all_reduce.MAX_ELEMENTS):
        y = jax.device_put(rng.standard_normal(2 * n).astype(np.float32) * 100,
                           NamedSharding(mesh, P("model")))
        assert all_reduce.TARGET in f.lower(y).compile().as_text()
        for i in range(5):
            y = y * np.float32(1.5) - np.float32(i)
            got, want = np.asarray(f(y)), np.asarray(g(y))
            assert got.dtype == np.dtype(out_dtype)
            assert_bit_equal(got, want)
            assert_bit_equal(got[:n], got[n:])
