"""Sharding rules (jax_fp4.partitioning) on 8 virtual CPU devices (tests/conftest.py).

Every op under column (N of a weight), row (K, the blocked / contracted axis) and batch
(rows of activations) sharding, on a 2x4 mesh and a 1-D mesh of 8: the result equals the
unsharded op (bit for bit for quantize / dequantize / fake_quantize, within float32
rounding of the partial sums for the matmuls), and the compiled HLO moves no weight or
activation between devices: no all-gather, all-to-all or collective-permute; all-reduces
only of the scalar amax (NVFP4 tensor_scale="auto", u32 bit patterns) and of the output
of a K-sharded matmul.
"""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jax_fp4 as jf
import jax_fp4.nn  # noqa: F401  (jf.nn.quantize_params)
from jax_fp4.sharding import (Collective, fsdp_specs, gather_weights, named_shardings,
                              qarray_partition_specs, quantized_specs, shard_qarray,
                              tensor_parallel_specs)
from jax_fp4.sharding import collectives as jsh_collectives

_CPUS = jax.devices("cpu")
if len(_CPUS) < 8:
    raise RuntimeError(f"test_sharding: expected 8 CPU devices "
                       f"(XLA_FLAGS=--xla_force_host_platform_device_count=8, set by "
                       f"tests/conftest.py before jax starts), got {len(_CPUS)}")

MESH = Mesh(np.array(_CPUS[:8]).reshape(2, 4), ("data", "model"),
            axis_types=(AxisType.Auto,) * 2)
MESH_1D = Mesh(np.array(_CPUS[:8]), ("model",), axis_types=(AxisType.Auto,))

def collectives(fn, *args):
    """[(kind, result type)] of the collectives in fn's compiled HLO
    (jax_fp4.sharding.collectives)."""
    return [(c.kind, c.type) for c in jsh_collectives(fn.lower(*args).compile())]


def assert_only_amax(found):
    """No data moved: at most all-reduces of u32 scalars (the NVFP4 amax bit patterns)."""
    bad = [c for c in found
           if c[0] != "all-reduce" or set(re.findall(r"\w+\[[^\]]*\]", c[1])) - {"u32[]"}]
    assert not bad, f"unexpected collectives: {found}"


def put(tree, specs, mesh=MESH):
    return jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                             is_leaf=lambda x: isinstance(x, P)))


def on_cpu(tree):
    """The unsharded reference input: every leaf on one CPU device."""
    return jax.device_put(jax.device_get(tree), _CPUS[0])


def bits(a):
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind != "b" else a


def assert_bit_equal(got, want):
    gl, wl = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(gl) == len(wl)
    for g, w in zip(gl, wl):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(bits(g), bits(w))


def _x(shape, seed):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    x.flat[::97] *= 300.0  # a few large values: saturating blocks, varied block scales
    x.flat[5::101] = 0.0
    return jnp.asarray(x)


# format, block_size, tensor_scale: every family, block sizes that divide K / 8 = 64
FORMATS = [("nvfp4", None, "auto"), ("nvfp4", None, None), ("mxfp4", None, None),
           ("mxfp6_e2m3", None, None), ("mxfp8_e4m3", None, None), ("nf4", 64, None),
           ("int4", 64, None)]
FORMAT_IDS = [f"{f}-{bs}-{ts}" for f, bs, ts in FORMATS]

# (mesh, spec of a (K, N) = (512, 64) weight blocked along K) and (mesh, spec of (M, K) =
# (32, 512) activations blocked along K)
ELEMENTWISE_CASES = {
    "column": (MESH, P(None, "model"), "weight"),
    "row": (MESH, P("model", None), "weight"),
    "batch": (MESH, P("data", None), "act"),
    "batch-and-K": (MESH, P("data", "model"), "act"),
    "column-1d": (MESH_1D, P(None, "model"), "weight"),
    "row-1d": (MESH_1D, P("model", None), "weight"),
}


# every format on the 2x4 mesh; on the 1-D mesh of 8 the formats whose blocks are least
# like the others' (two-level nvfp4, 24-byte mxfp6 blocks, int4 with zero points)
_ON_1D = ("nvfp4-None-auto", "mxfp6_e2m3-None-None", "int4-64-None")
ELEMENTWISE_PARAMS = [pytest.param(*f, case, id=f"{fid}-{case}")
                      for f, fid in zip(FORMATS, FORMAT_IDS) for case in ELEMENTWISE_CASES
                      if not case.endswith("-1d") or fid in _ON_1D]


@pytest.mark.parametrize("fmt,block_size,ts,case", ELEMENTWISE_PARAMS)
def test_quantize_dequantize_fake_quantize_stay_sharded(fmt, block_size, ts, case):
    mesh, spec, kind = ELEMENTWISE_CASES[case]
    axis = 0 if kind == "weight" else 1
    shape = (512, 64) if kind == "weight" else (32, 512)
    x = _x(shape, seed=len(case) + 7 * len(fmt))
    kw = dict(axis=axis, block_size=block_size, tensor_scale=ts)
    q_in = jf.quantize(x, fmt, **kw)  # a QArray sharded as the ops would leave it

    def ops(x, q):
        return jf.quantize(x, fmt, **kw), jf.fake_quantize(x, fmt, **kw), jf.dequantize(q)

    f = jax.jit(ops)
    args = (put(x, spec, mesh), put(q_in, qarray_partition_specs(spec, q_in), mesh))
    assert_only_amax(collectives(f, *args))
    got = f(*args)
    assert_bit_equal(got, f(*on_cpu((x, q_in))))
    q, fq, dq = got
    # results stay sharded as their input, the QArray as qarray_partition_specs says
    want = jax.tree.leaves(qarray_partition_specs(spec, q), is_leaf=lambda v: isinstance(v, P))
    for leaf, s in zip(jax.tree.leaves(q), want):
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, s), leaf.ndim), (leaf.sharding, s)
    for y in (fq, dq):
        assert y.sharding.is_equivalent_to(NamedSharding(mesh, spec), 2), y.sharding


def test_each_shard_runs_the_cpu_kernels():
    # the per-shard body lowers as on one device: our FFI kernels, on each device's block
    if not jf.capabilities()["kernels"]["cpu"]:
        pytest.fail(f"CPU kernels are not built: {jf.capabilities()['load_error']}")
    x, w = _x((32, 512), 1), _x((512, 64), 2)
    q = jf.quantize(w, "nvfp4", axis=0)
    f = jax.jit(lambda x, q: jf.matmul(jf.fake_quantize(x, "mxfp4"), q))
    args = (put(x, P("data", None)), put(q, qarray_partition_specs(P(None, "model"), q)))
    text = f.lower(*args).compile().as_text()
    for target in ("jax_fp4_fake_quantize_v1", "jax_fp4_dequantize_v1"):
        assert target in text, target
    assert "f32[16,512]" in text and "u8[16,256]" in text  # per-device blocks of x and W


def test_auto_tensor_scale_all_reduces_one_scalar():
    x = _x((64, 512), 3)
    f = jax.jit(lambda x: jf.quantize(x, "nvfp4", tensor_scale="auto").tensor_scale)
    found = collectives(f, put(x, P("data", "model")))
    assert found == [("all-reduce", "u32[]")], found
    assert_bit_equal(f(put(x, P("data", "model"))), f(on_cpu(x)))


def test_amax_is_exact_across_shards_for_nan_inf_and_subnormals():
    x = np.zeros((64, 512), np.float32)
    x[3, 7] = np.float32(1e-40)  # a subnormal amax, only on one device
    f = jax.jit(lambda x: jf.quantize(x, "nvfp4", tensor_scale="auto").tensor_scale)
    for special in (None, np.inf, np.nan):
        if special is not None:
            x[60, 500] = special
        got, want = f(put(jnp.asarray(x), P("data", "model"))), f(on_cpu(jnp.asarray(x)))
        assert_bit_equal(got, want)


def test_swizzled_scales_shard_rows_in_whole_128_row_tiles():
    x = _x((512, 256), 4)
    f = jax.jit(lambda x: jf.quantize(x, "mxfp4", scale_layout="swizzled"))
    xs = put(x, P("model", None))
    assert_only_amax(collectives(f, xs))
    q = f(xs)
    assert_bit_equal(q, f(on_cpu(x)))
    assert q.scales.sharding.spec[0] == "model"


def test_k_sharding_off_block_boundaries_is_resharded_correctly():
    # int4 groups of 128 over K = 512 on 8 devices: 64 per device is not a whole group,
    # so the rule drops K's sharding (the partitioner moves data) and stays correct
    x = _x((16, 512), 5)
    f = jax.jit(lambda x: jf.fake_quantize(x, "int4", block_size=128))
    xs = put(x, P(None, "model"), MESH_1D)
    assert_bit_equal(f(xs), f(on_cpu(x)))
    # int4 groups of 3: a group's codes are not whole bytes, so K never shards
    x = _x((16, 384), 6)
    g = jax.jit(lambda x: jf.quantize(x, "int4", block_size=3))
    xs = put(x, P("data", "model"))
    assert_bit_equal(g(xs), g(on_cpu(x)))


# ------------------------------------------------------------------------ matmuls
def _close(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def _expect(found, all_reduce_shape):
    """Only the amax scalars plus, for a K-sharded matmul, the one output all-reduce."""
    outputs = [c for c in found if c != ("all-reduce", "u32[]")]
    want = [] if all_reduce_shape is None else [("all-reduce", all_reduce_shape)]
    assert outputs == want, found


# (mesh, x spec, weight spec (K, N), per-device output all-reduce or None)
MATMUL_CASES = {
    "column": (MESH, P(), P(None, "model"), None),
    "row": (MESH, P(None, "model"), P("model", None), "f32[16,128]{1,0}"),
    "batch": (MESH, P("data", None), P(), None),
    "batch-and-column": (MESH, P("data", None), P(None, "model"), None),
    "batch-and-row": (MESH, P("data", "model"), P("model", None), "f32[8,128]{1,0}"),
    "row-1d": (MESH_1D, P(None, "model"), P("model", None), "f32[16,128]{1,0}"),
}
MATMUL_FORMATS = [("nvfp4", None, "auto"), ("mxfp4", None, None), ("nf4", 64, None),
                  ("int4", 64, None), ("mxfp8_e4m3", None, None)]


@pytest.mark.parametrize("case", list(MATMUL_CASES))
@pytest.mark.parametrize("fmt,block_size,ts", MATMUL_FORMATS,
                         ids=[f"{f}-{bs}-{ts}" for f, bs, ts in MATMUL_FORMATS])
def test_w4a16_matmul_column_row_batch(fmt, block_size, ts, case):
    mesh, xspec, wspec, reduce_shape = MATMUL_CASES[case]
    x, w = _x((16, 512), 1), _x((512, 128), 2)
    q = jf.quantize(w, fmt, axis=0, block_size=block_size, tensor_scale=ts)
    f = jax.jit(lambda x, q: jf.matmul(x, q))
    args = (put(x, xspec, mesh), put(q, qarray_partition_specs(wspec, q), mesh))
    _expect(collectives(f, *args), reduce_shape)
    y = f(*args)
    _close(y, f(*on_cpu((x, q))))
    m_axes = xspec[0] if len(xspec) else None
    n_axes = None if reduce_shape else (wspec[1] if len(wspec) > 1 else None)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(m_axes, n_axes)), 2), y.sharding


def test_w4a16_bf16_row_parallel_psums_float32_partials():
    x = _x((16, 512), 1).astype(jnp.bfloat16)
    q = jf.quantize(_x((512, 128), 2).astype(jnp.bfloat16), "nvfp4", axis=0)
    f = jax.jit(lambda x, q: jf.matmul(x, q))
    args = (put(x, P(None, "model")), put(q, qarray_partition_specs(P("model", None), q)))
    _expect(collectives(f, *args), "f32[16,128]{1,0}")  # partial sums in float32
    y = f(*args)
    assert y.dtype == jnp.bfloat16
    want = np.asarray(f(*on_cpu((x, q))), np.float64)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-2,
                               atol=1e-2 * np.abs(want).max())


def test_prepared_weight_shards_whole_128_row_tiles():
    x, w = _x((8, 512), 1), _x((512, 256), 2)
    q = jf.prepare(jf.quantize(w, "int4", axis=0, block_size=64))
    assert q.scale_layout == "tiled"
    f = jax.jit(lambda x, q: jf.matmul(x, q))
    # N = 256 on the 2 devices of "data": one 128-row tile each
    args = (put(x, P()), put(q, qarray_partition_specs(P(None, "data"), q)))
    _expect(collectives(f, *args), None)
    _close(f(*args), f(*on_cpu((x, q))))


@pytest.mark.parametrize("fmt,block_size", [("nvfp4", None), ("int4", 64)])
def test_prepared_row_parallel_weight_is_placed_linear_and_psums(fmt, block_size):
    """shard_qarray of a prepared weight split on K (row parallel) stores it in the linear
    layout, so each device multiplies its K block and one all-reduce sums them; kept
    tiled (K replicated), every device would gather the layer's input instead."""
    x, w = _x((16, 512), 1), _x((512, 256), 2)
    q = jf.prepare(jf.quantize(w, fmt, axis=0, block_size=block_size))
    assert q.scale_layout == "tiled"
    qs = shard_qarray(q, MESH_1D, P("model", None))
    assert qs.scale_layout == "linear"
    assert qs.data.sharding.is_equivalent_to(NamedSharding(MESH_1D, P(None, "model")), 2)
    f = jax.jit(lambda x, q: jf.matmul(x, q))
    args = (put(x, P(None, "model"), MESH_1D), qs)
    _expect(collectives(f, *args), "f32[16,256]{1,0}")
    np.testing.assert_array_equal(np.asarray(jf.dequantize(qs)), np.asarray(jf.dequantize(q)))
    _close(f(*args), f(*on_cpu((x, q))))
    # column parallel keeps the prepared layout (N at whole 128-row tiles)
    assert shard_qarray(q, MESH, P(None, "data")).scale_layout == "tiled"


# (mesh, a (M, K) spec, b (N, K) spec, per-device output all-reduce or None)
SCALED_CASES = {
    "column": (MESH, P(), P("model", None), None),
    "row": (MESH, P(None, "model"), P(None, "model"), "f32[32,64]{1,0}"),
    "batch": (MESH, P("data", None), P(), None),
    "batch-and-column": (MESH, P("data", None), P("model", None), None),
    "row-1d": (MESH_1D, P(None, "model"), P(None, "model"), "f32[32,64]{1,0}"),
}


@pytest.mark.parametrize("case", list(SCALED_CASES))
@pytest.mark.parametrize("fmts", [("nvfp4", "nvfp4"), ("mxfp8_e4m3", "mxfp4")],
                         ids=["nvfp4", "mxfp8xmxfp4"])
def test_scaled_matmul_column_row_batch(fmts, case):
    mesh, aspec, bspec, reduce_shape = SCALED_CASES[case]
    ts = "auto" if fmts[0] == "nvfp4" else None
    a = jf.quantize(_x((32, 512), 1), fmts[0], axis=1, tensor_scale=ts)
    b = jf.quantize(_x((64, 512), 2), fmts[1], axis=1, tensor_scale=ts)
    bias = _x((64,), 3)
    f = jax.jit(lambda a, b, bias: jf.scaled_matmul(a, b, alpha=0.5, bias=bias,
                                                    out_dtype=jnp.float32))
    bias_spec = P(bspec[0]) if reduce_shape is None and len(bspec) else P()
    args = (put(a, qarray_partition_specs(aspec, a), mesh),
            put(b, qarray_partition_specs(bspec, b), mesh), put(bias, bias_spec, mesh))
    _expect(collectives(f, *args), reduce_shape)
    _close(f(*args), f(*on_cpu((a, b, bias))))


# Row-parallel with the output asked split (Megatron sequence parallelism: rows over the
# tensor-parallel axis): the partial sums are reduce-scattered, not all-reduced and sliced.
# (mesh, x spec, weight (K, N) spec, output spec, expected collectives besides the amax)
def _no_layouts(found):
    """Collectives with their shapes' layouts ({1,0}) dropped: XLA picks the layout."""
    return [(kind, re.sub(r"\{[^}]*\}", "", shape)) for kind, shape in found]


SCATTER_CASES = {
    "rows": (MESH, P(None, "model"), P("model", None), P("model", None),
             [("reduce-scatter", "f32[4,128]")]),
    "columns": (MESH, P(None, "model"), P("model", None), P(None, "model"),
                [("reduce-scatter", "f32[16,32]")]),
    "rows-over-2-axes": (MESH, P(None, ("data", "model")), P(("data", "model"), None),
                         P(("data", "model"), None), [("reduce-scatter", "f32[2,128]")]),
    # K over both axes, rows asked over "model" only: scatter over it, sum over "data"
    "rows-over-1-of-2-axes": (MESH, P(None, ("data", "model")), P(("data", "model"), None),
                              P("model", None), [("reduce-scatter", "f32[4,128]"),
                                                 ("all-reduce", "f32[4,128]")]),
    "rows-1d": (MESH_1D, P(None, "model"), P("model", None), P("model", None),
                [("reduce-scatter", "f32[2,128]")]),
}


@pytest.mark.parametrize("case", list(SCATTER_CASES))
@pytest.mark.parametrize("fmt,block_size,ts", [("nvfp4", None, "auto"), ("int4", 64, None)],
                         ids=["nvfp4-auto", "int4-64"])
def test_w4a16_row_parallel_reduce_scatters_a_split_output(fmt, block_size, ts, case):
    mesh, xspec, wspec, ospec, want = SCATTER_CASES[case]
    x, w = _x((16, 512), 1), _x((512, 128), 2)
    q = jf.quantize(w, fmt, axis=0, block_size=block_size, tensor_scale=ts)
    out = NamedSharding(mesh, ospec)
    f = jax.jit(lambda x, q: jax.lax.with_sharding_constraint(jf.matmul(x, q), out))
    args = (put(x, xspec, mesh), put(q, qarray_partition_specs(wspec, q), mesh))
    found = _no_layouts(c for c in collectives(f, *args) if c != ("all-reduce", "u32[]"))
    assert sorted(found) == sorted(want), found
    y = f(*args)
    assert y.sharding.is_equivalent_to(out, 2), y.sharding
    _close(y, jax.jit(jf.matmul)(*on_cpu((x, q))))


def test_reduce_scatter_via_out_sharding_bf16_and_explicit_axes():
    x = _x((16, 512), 1).astype(jnp.bfloat16)
    q = jf.quantize(_x((512, 128), 2).astype(jnp.bfloat16), "mxfp4", axis=0)
    dims = (((1,), (0,)), ((), ()))
    want = np.asarray(jf.matmul(*on_cpu((x, q))), np.float64)
    explicit = Mesh(MESH.devices, MESH.axis_names, axis_types=(AxisType.Explicit,) * 2)
    for mesh in (MESH, explicit):
        with jax.set_mesh(mesh):
            f = jax.jit(lambda x, q: jf.dot_general(x, q, dims, out_sharding=P("model", None)))
            args = (put(x, P(None, "model"), mesh),
                    put(q, qarray_partition_specs(P("model", None), q), mesh))
            assert _no_layouts(collectives(f, *args)) == [("reduce-scatter", "f32[4,128]")]
            y = f(*args)
        assert y.dtype == jnp.bfloat16 and y.sharding.spec[0] == "model"
        np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-2,
                                   atol=1e-2 * np.abs(want).max())


@pytest.mark.parametrize("ospec,want", [(P("model", None), "f32[8,64]"),
                                        (P(None, "model"), "f32[32,16]")],
                         ids=["rows", "columns"])
def test_scaled_matmul_row_parallel_reduce_scatters(ospec, want):
    a = jf.quantize(_x((32, 512), 1), "nvfp4", axis=1, tensor_scale="auto")
    b = jf.quantize(_x((64, 512), 2), "nvfp4", axis=1, tensor_scale="auto")
    bias = _x((64,), 3)
    out = NamedSharding(MESH, ospec)
    f = jax.jit(lambda a, b, bias: jax.lax.with_sharding_constraint(
        jf.scaled_matmul(a, b, alpha=0.5, bias=bias, out_dtype=jnp.float32), out))
    args = (put(a, qarray_partition_specs(P(None, "model"), a)),
            put(b, qarray_partition_specs(P(None, "model"), b)), put(bias, P()))
    found = _no_layouts(c for c in collectives(f, *args) if c != ("all-reduce", "u32[]"))
    assert found == [("reduce-scatter", want)], found
    y = f(*args)
    assert y.sharding.is_equivalent_to(out, 2), y.sharding
    ref = jax.jit(lambda a, b, bias: jf.scaled_matmul(a, b, alpha=0.5, bias=bias,
                                                      out_dtype=jnp.float32))
    _close(y, ref(*on_cpu((a, b, bias))))  # the bias added once, to each device's slice


def test_gspmd_partitioner_takes_the_same_rules():
    # infer_sharding_from_operands serves XLA's GSPMD partitioner (Shardy is the default)
    x, w = _x((16, 512), 1), _x((512, 128), 2)
    q = jf.quantize(w, "nvfp4", axis=0, tensor_scale="auto")
    shardy = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        f = jax.jit(lambda x, q: jf.matmul(jf.fake_quantize(x, "nvfp4", tensor_scale="auto"), q))
        args = (put(x, P(None, "model")), put(q, qarray_partition_specs(P("model", None), q)))
        _expect(collectives(f, *args), "f32[16,128]{1,0}")
        _close(f(*args), f(*on_cpu((x, q))))
    finally:
        jax.config.update("jax_use_shardy_partitioner", shardy)


# ------------------------------------------------------------------------ FSDP
MESH_FSDP = Mesh(np.array(_CPUS[:8]), ("fsdp",), axis_types=(AxisType.Auto,))


def _gathers(found):
    """[(dtype, elements)] of each all-gather's (per-device, gathered) result."""
    out = []
    for kind, shape in found:
        if kind == "all-gather":
            for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
                out.append((dt, math.prod(int(d) for d in dims.split(",") if d)))
    return out


def _scales_gathered(gathered, n):
    """The scales: n elements gathered as themselves, or (XLA's CPU backend widens float8
    for its collectives) as f16."""
    return [g for g in gathered if g[0] != "u8" or g[1] != n]


@pytest.mark.parametrize("fmt,block_size", [("nvfp4", None), ("int4", 64)])
def test_fsdp_all_gathers_the_packed_4bit_weight(fmt, block_size):
    # weights stored sharded over 8 devices, gathered just before use; activations
    # batch-sharded (data parallel) never move
    params = {"up": {"kernel": _x((512, 256), 2).astype(jnp.bfloat16)}}
    qparams = jf.nn.quantize_params(params, fmt, block_size=block_size)
    x = put(_x((32, 512), 1).astype(jnp.bfloat16), P("fsdp", None), MESH_FSDP)

    def layer(p, x):
        w = p["up"]["kernel"]
        return jf.matmul(x, w) if isinstance(w, jf.QArray) else x @ w

    f = jax.jit(lambda p, x: layer(gather_weights(p, MESH_FSDP), x))
    gathered = {}
    for name, tree in (("bf16", params), (fmt, qparams)):
        placed = jax.device_put(tree, named_shardings(MESH_FSDP, fsdp_specs(tree, MESH_FSDP)))
        w = placed["up"]["kernel"]
        at_rest = w.data if isinstance(w, jf.QArray) else w
        assert at_rest.addressable_shards[0].data.nbytes == at_rest.nbytes // 8  # sharded
        found = collectives(f, placed, x)
        assert {k for k, _ in found} == {"all-gather"}, found
        gathered[name] = _gathers(found)
        y = f(placed, x)
        assert y.sharding.spec[0] == "fsdp"
        _close(y, jax.jit(layer)(*on_cpu((tree, x))))
    q = qparams["up"]["kernel"]
    # the bf16 step gathers the float weight (XLA's CPU dot may widen it to f32 first);
    # the 4-bit one its packed codes (a byte per two weights) and its scales (and INT4
    # zero points), nothing else: no float weight, no activation
    assert [n for _, n in gathered["bf16"]] == [512 * 256]
    codes = 512 * 256 // 2
    assert ("u8", codes) in gathered[fmt], gathered
    side = [leaf for leaf in (q.scales, q.zeros) if leaf is not None]
    rest = _scales_gathered(gathered[fmt], codes)
    assert sorted(n for _, n in rest) == sorted(leaf.size for leaf in side), gathered
    # bytes at their own dtypes: about 4x fewer than the bf16 weight
    packed = sum(leaf.nbytes for leaf in (q.data, *side))
    assert 512 * 256 * 2 / packed > 3.2, packed


def test_fsdp_with_tensor_parallel_gathers_only_the_fsdp_axis():
    # 2x4 mesh: weights at rest over "data" (FSDP) and "model" (tensor parallel);
    # gathered over "data" into the column-parallel layout, which then runs unchanged
    w = _x((512, 256), 2)
    q = jf.quantize(w, "nvfp4", axis=0)
    tp = qarray_partition_specs(P(None, "model"), q)
    rest = qarray_partition_specs(P(None, ("model", "data")), q)
    f = jax.jit(lambda x, q: jf.matmul(x, gather_weights(q, MESH, tp)))
    args = (put(_x((8, 512), 1), P()), put(q, rest))
    found = collectives(f, *args)
    # each device gathers its "model" column block (N/4 = 64 rows) of packed codes and
    # E4M3 scales
    got = _gathers(found)
    assert {k for k, _ in found} == {"all-gather"} and ("u8", 64 * 256) in got, found
    assert [n for _, n in _scales_gathered(got, 64 * 256)] == [64 * 32], found
    y = f(*args)
    assert y.sharding.spec == P(None, "model")
    _close(y, jax.jit(jf.matmul)(*on_cpu((args[0], q))))


def test_fsdp_specs_layout():
    tree = {"a": {"kernel": jnp.zeros((64, 256))}, "b": {"weight": jnp.zeros((256, 64))},
            "odd": {"kernel": jnp.zeros((64, 12))}, "norm": {"scale": jnp.zeros((256,))}}
    specs = fsdp_specs(tree, MESH_FSDP)
    assert specs["a"]["kernel"] == P(None, "fsdp")  # Flax (in, out): out features
    assert specs["b"]["weight"] == P("fsdp", None)  # PyTorch (out, in)
    assert specs["odd"]["kernel"] is None and specs["norm"]["scale"] is None  # 12 % 8
    qspecs = fsdp_specs(jf.nn.quantize_params(tree, "nvfp4"), MESH_FSDP)
    qa = qspecs["a"]["kernel"]
    assert isinstance(qa, jf.QArray) and qa.data == P("fsdp", None) and qa.scales == qa.data
    with pytest.raises(ValueError):
        gather_weights(tree, MESH_FSDP, {"a": None})


# ------------------------------------------------------------------------ autodiff, out_sharding
def test_gradients_stay_sharded():
    x, w = _x((16, 512), 1), _x((512, 128), 2)
    q = jf.quantize(w, "nvfp4", axis=0)

    def loss(x, q):
        y = jf.matmul(jf.fake_quantize(x, "mxfp4"), q)
        return jnp.sum(y * y)

    g = jax.jit(jax.grad(loss))
    args = (put(x, P("data", None)), put(q, qarray_partition_specs(P(None, "model"), q)))
    found = collectives(g, *args)
    # the backward pass of a column-parallel layer sums x's gradient over N's shards
    assert all(kind == "all-reduce" for kind, _ in found), found
    got = g(*args)
    _close(got, g(*on_cpu((x, q))))
    assert got.sharding.spec[0] == "data"


def test_dot_general_out_sharding():
    x = _x((16, 512), 1)
    q = jf.quantize(_x((512, 128), 2), "nf4", axis=0)
    out = NamedSharding(MESH, P("data", "model"))
    f = jax.jit(lambda x, q: jf.dot_general(x, q, (((1,), (0,)), ((), ())), out_sharding=out))
    y = f(put(x, P()), put(q, qarray_partition_specs(P(), q)))
    assert y.sharding.is_equivalent_to(out, 2)
    _close(y, jf.matmul(*on_cpu((x, q))))
    # a PartitionSpec under a mesh with Explicit axes, with and without a QArray (then it
    # is lax.dot_general's own keyword, which takes Explicit axes only)
    explicit = Mesh(MESH.devices, MESH.axis_names, axis_types=(AxisType.Explicit,) * 2)
    w = _x((512, 128), 2)
    with jax.set_mesh(explicit):
        for rhs in (w, q):
            y2 = jax.jit(lambda x, w: jf.dot_general(x, w, (((1,), (0,)), ((), ())),
                                                     out_sharding=P("data", None)))(x, rhs)
            assert y2.sharding.spec == P("data", None)
            assert jax.typeof(y2).sharding.spec == P("data", None)


def test_explicit_axes_results_are_typed_sharded():
    # sharding in types (jax.set_mesh over Explicit axes): each op's result type carries
    # the rule's sharding, so nothing is gathered to match a replicated type
    explicit = Mesh(MESH.devices, MESH.axis_names, axis_types=(AxisType.Explicit,) * 2)
    x, w = _x((32, 512), 1), _x((512, 128), 2)
    q = jf.quantize(w, "nvfp4", axis=0, tensor_scale="auto")

    def fwd(x, qc, qr, relayout=lambda x: x):
        col = jf.matmul(jf.fake_quantize(x, "nvfp4", tensor_scale="auto"), qc)
        row = jf.matmul(relayout(x), qr)
        dx = jax.grad(lambda x: jnp.sum(jf.matmul(x, qc)))(x)
        return col, row, dx

    with jax.set_mesh(explicit):
        args = (put(x, P("data", None), explicit),
                put(q, qarray_partition_specs(P(None, "model"), q), explicit),
                put(q, qarray_partition_specs(P("model", None), q), explicit))
        f = jax.jit(lambda *a: fwd(*a, lambda x: jax.sharding.reshard(x, P("data", "model"))))
        col, row, dx = f(*args)
        found = collectives(f, *args)
    assert jax.typeof(col).sharding.spec == P("data", "model")
    assert jax.typeof(row).sharding.spec == P("data", None)
    assert jax.typeof(dx).sharding.spec == P("data", None)
    assert not [c for c in found if c[0] != "all-reduce"], found
    ref = jax.jit(fwd)(*on_cpu(args))
    for got, want in zip((col, row, dx), ref):
        _close(got, want)


# ------------------------------------------------------------------------ models
def test_nnx_sharded_model_quantizes_into_sharded_model():
    nnx = pytest.importorskip("flax.nnx")
    from jax_fp4.nn import flax as jff
    from jax_fp4.nn import quantize_params

    init = nnx.initializers.lecun_normal()

    class MLP(nnx.Module):
        def __init__(self, rngs):
            part = nnx.with_partitioning
            self.up = nnx.Linear(256, 512, kernel_init=part(init, (None, "model")),
                                 bias_init=part(nnx.initializers.zeros_init(), ("model",)),
                                 rngs=rngs)
            self.down = nnx.Linear(512, 256, kernel_init=part(init, ("model", None)), rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.relu(self.up(x)))

    with jax.set_mesh(MESH):
        net = MLP(nnx.Rngs(0))
    state = nnx.state(net)
    specs = nnx.get_partition_spec(state)
    quantize = jax.jit(lambda s: quantize_params(s, "nvfp4"))
    qspecs = quantized_specs(specs, jax.eval_shape(quantize, state))
    quantize = jax.jit(quantize, out_shardings=jax.tree.map(
        lambda s: NamedSharding(MESH, s), qspecs, is_leaf=lambda x: isinstance(x, P)))
    assert_only_amax(collectives(quantize, state))  # each device quantizes its shard
    qstate = quantize(state)
    assert_bit_equal(qstate, jax.jit(lambda s: quantize_params(s, "nvfp4"))(on_cpu(state)))
    up = qstate["up"]["kernel"].get_value()
    assert isinstance(up, jf.QArray) and up.data.sharding.spec == P("model", None)

    graphdef = nnx.split(jff.quantize_model(net, "nvfp4"))[0]
    fwd = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    x = _x((16, 256), 4)
    xs = put(x, P("data", None))
    # up: column-parallel, no communication; down: row-parallel, one all-reduce of y
    _expect(collectives(fwd, qstate, xs), "f32[8,256]{1,0}")
    _close(fwd(qstate, xs), fwd(on_cpu(qstate), on_cpu(x)))


def test_linen_logical_axis_rules_shard_the_quantized_model():
    nn = pytest.importorskip("flax.linen")
    from jax_fp4.nn import flax as jff
    from jax_fp4.nn import quantize_params
    from jax_fp4.sharding import named_shardings

    init = nn.initializers.lecun_normal()

    class MLP(nn.Module):
        dense: type = nn.Dense
        logical: bool = True

        @nn.compact
        def __call__(self, x):
            def kw(axes):
                return ({"kernel_init": nn.with_logical_partitioning(init, axes)}
                        if self.logical else {"format": "nvfp4"})

            x = nn.relu(self.dense(512, name="up", **kw(("embed", "mlp")))(x))
            return self.dense(256, name="down", **kw(("mlp", "embed")))(x)

    x = _x((16, 256), 4)
    boxed = MLP().init(jax.random.key(0), x)
    rules = (("embed", None), ("mlp", "model"))
    specs = nn.logical_to_mesh(nn.get_partition_spec(boxed), rules)
    params = jax.device_put(nn.meta.unbox(boxed), named_shardings(MESH, specs))
    quantize = lambda v: quantize_params(v, "nvfp4")  # noqa: E731
    qspecs = quantized_specs(specs, jax.eval_shape(quantize, params))
    qv = jax.jit(quantize, out_shardings=named_shardings(MESH, qspecs))(params)
    assert qv["params"]["up"]["kernel"].data.sharding.spec == P("model", None)
    assert qv["params"]["down"]["kernel"].data.sharding.spec == P(None, "model")

    fwd = jax.jit(lambda v, x: MLP(dense=jff.QuantizedDense, logical=False).apply(v, x))
    xs = put(x, P("data", None))
    _expect(collectives(fwd, qv, xs), "f32[8,256]{1,0}")  # the row-parallel "down" only
    _close(fwd(qv, xs), fwd(on_cpu(qv), on_cpu(x)))


def test_tensor_parallel_specs_megatron_layout():
    tree = {"layers": {"0": {
        "self_attn": {n: {"weight": jnp.zeros((128, 64))} for n in ("q_proj", "k_proj", "v_proj")}
        | {"o_proj": {"weight": jnp.zeros((64, 128)), "bias": jnp.zeros((64,))}},
        "mlp": {"gate_proj": {"kernel": jnp.zeros((64, 256)), "bias": jnp.zeros((256,))},
                "up_proj": {"kernel": jnp.zeros((64, 256))},
                "down_proj": {"kernel": jnp.zeros((256, 64))}},
        "input_layernorm": {"weight": jnp.zeros((64,))},
        "attn": {"wq": {"kernel": jnp.zeros((64, 128))}, "wo": {"kernel": jnp.zeros((128, 64))}},
    }}}
    specs = tensor_parallel_specs(tree, "model")
    layer = specs["layers"]["0"]
    # torch layout (out, in): column shards out (axis 0), row shards in (axis 1)
    assert layer["self_attn"]["q_proj"]["weight"] == P("model", None)
    assert layer["self_attn"]["o_proj"]["weight"] == P(None, "model")
    assert layer["self_attn"]["o_proj"]["bias"] is None
    # Flax layout (in, out): column shards out (axis 1), row shards in (axis 0)
    assert layer["mlp"]["gate_proj"]["kernel"] == P(None, "model")
    assert layer["mlp"]["gate_proj"]["bias"] == P("model")
    assert layer["mlp"]["down_proj"]["kernel"] == P("model", None)
    assert layer["input_layernorm"]["weight"] is None
    assert layer["attn"]["wq"]["kernel"] == P(None, "model")
    assert layer["attn"]["wo"]["kernel"] == P("model", None)
    # on a quantized tree: QArrays of specs, the blocked axis last
    qtree = jf.nn.quantize_params(tree, "nvfp4")
    qspecs = tensor_parallel_specs(qtree, "model")
    qo = qspecs["layers"]["0"]["self_attn"]["o_proj"]["weight"]
    assert isinstance(qo, jf.QArray) and qo.data == P(None, "model") and qo.tensor_scale == P()
    qd = qspecs["layers"]["0"]["mlp"]["down_proj"]["kernel"]
    assert qd.data == P(None, "model") and qd.scales == P(None, "model")
    qg = qspecs["layers"]["0"]["mlp"]["gate_proj"]["kernel"]
    assert qg.data == P("model", None)


def test_shard_qarray_and_named_shardings_place_every_leaf():
    from jax_fp4.sharding import named_shardings, shard_qarray

    for ts in (None, "auto"):  # one-level nvfp4 has no tensor-scale leaf
        q = jf.quantize(_x((512, 64), 1), "nvfp4", axis=0, tensor_scale=ts)
        qs = shard_qarray(q, MESH, P(None, "model"))
        assert qs.data.sharding.spec == P("model", None)
        assert qs.scales.sharding.spec == P("model", None)
        assert (qs.tensor_scale is None) == (ts is None)
        assert_bit_equal(qs, q)
    tree = {"w": {"kernel": _x((512, 64), 2)}, "norm": {"scale": jnp.ones((64,))}}
    qtree = jf.nn.quantize_params(tree, "int4", block_size=64)
    placed = jax.device_put(qtree, named_shardings(MESH, tensor_parallel_specs(
        qtree, "model", column=r"^w\.")))
    assert placed["w"]["kernel"].zeros.sharding.spec == P("model", None)
    assert placed["norm"]["scale"].sharding.spec == P()


def test_qarray_partition_specs_errors():
    q = jf.quantize(_x((64, 32), 1), "nvfp4", axis=0)
    with pytest.raises(TypeError, match="q: expected a QArray"):
        qarray_partition_specs(P(), np.zeros((2, 2)))
    with pytest.raises(ValueError, match="spec: expected at most 2 entries"):
        qarray_partition_specs(P(None, None, "model"), q)


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_prepare_leaves_a_k_split_weight_linear(fmt):
    """prepare / quantize_params(prepare=True) keep a weight whose K is split over devices
    (row parallel) in the linear layout, so its matmul sums partial products instead of
    gathering the input; split on N (column parallel) or unsplit it is tiled (eagerly or
    under Auto axes)."""
    w = _x((1024, 256), 3)  # K over 8 devices: whole int4 groups of 128 on each
    row = jax.device_put(w, NamedSharding(MESH_1D, P("model", None)))
    col = jax.device_put(w, NamedSharding(MESH_1D, P(None, "model")))
    for arr, want in ((row, "linear"), (col, "tiled"), (w, "tiled")):
        q = jf.prepare(jf.quantize(arr, fmt, axis=0))
        assert q.scale_layout == want, (arr.sharding, q.data.sharding)
        tree = jf.nn.quantize_params({"d": {"kernel": arr}}, fmt, prepare=True)
        assert tree["d"]["kernel"].scale_layout == want
    # under jit with Explicit mesh axes the traced values carry shardings: a split weight
    # stays linear (the re-layout's reshapes would need shardings of their own)
    mesh = Mesh(np.array(_CPUS[:8]), ("model",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        for spec, want in ((P("model", None), "linear"), (P(None, "model"), "linear"),
                           (P(), "tiled")):
            arr = jax.device_put(w, NamedSharding(mesh, spec))
            q = jax.jit(lambda a: jf.prepare(jf.quantize(a, fmt, axis=0)))(arr)
            assert q.scale_layout == want, spec
    f = jax.jit(lambda x, q: jf.matmul(x, q))
    q = jf.prepare(jf.quantize(row, fmt, axis=0))
    x = put(_x((16, 1024), 4), P(None, "model"), MESH_1D)
    assert [c[0] for c in collectives(f, x, q)] == ["all-reduce"]


def test_k_split_below_one_block_per_device_reshards_instead_of_failing():
    """K = 512 over 8 devices is 4 INT4 groups of 128 for 8 devices: no whole group each.
    Shardy would split the 4 groups over part of the mesh axis, which custom_partitioning
    cannot express (it raised IndivisibleError); the rule keeps such a factor whole, so
    the op reshards its input and gives the unsharded result."""
    w = _x((256, 512), 5)
    sharded = put(w, P(None, "model"), MESH_1D)
    q = jax.jit(lambda a: jf.quantize(a, "int4"))(sharded)
    ref = jf.quantize(on_cpu(w), "int4")
    for a, b in ((q.data, ref.data), (q.scales, ref.scales), (q.zeros, ref.zeros)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the matmul of a (K = 256, N = 512) weight whose K is split the same way: 2 groups
    x = put(_x((8, 256), 6), P(None, "model"), MESH_1D)
    f = jax.jit(lambda x, q: jf.matmul(x, q))
    _close(f(x, jf.quantize(put(w, P("model", None), MESH_1D), "int4", axis=0)),
           f(*on_cpu((x, jf.quantize(on_cpu(w), "int4", axis=0)))))


def test_in_graph_all_reduce_groups_and_where_it_does_not_apply():
    # the groups that sum together over some axes of a 2 x 4 mesh, in rank order
    from jax_fp4.prims import all_reduce

    devs = np.array(jax.devices("cpu")[:8]).reshape(2, 4)
    mesh = Mesh(devs, ("data", "model"))
    ids = lambda groups: [[d.id for d in g] for g in groups]  # noqa: E731
    assert ids(all_reduce.device_groups(mesh, ("model",))) == [[d.id for d in r] for r in devs]
    assert ids(all_reduce.device_groups(mesh, ("data",))) == [[d.id for d in c] for c in devs.T]
    assert ids(all_reduce.device_groups(mesh, ("data", "model"))) == [[d.id for d in devs.flat]]
    assert ids(all_reduce.device_groups(mesh, ("model", "data"))) == [
        [d.id for d in devs.T.flat]]
    # CPU devices, a message past MAX_ELEMENTS, a non-float32 partial: XLA's psum (None)
    y = jnp.zeros((4, 8), jnp.float32)
    assert all_reduce.in_graph_sum(y, mesh, ("model",), jnp.bfloat16) is None
    assert all_reduce.in_graph_sum(jnp.zeros(all_reduce.MAX_ELEMENTS + 1), mesh, ("model",),
                                   jnp.float32) is None
    assert all_reduce.in_graph_sum(y.astype(jnp.bfloat16), mesh, ("model",),
                                   jnp.bfloat16) is None
    from jax_fp4 import _ext

    if not _ext.has_kernels("cuda", all_reduce.TARGET):  # a build without CUDA: no channel
        assert _ext.all_reduce_setup([[0, 1]], 16) == 0


# ------------------------------------------------------- jax_fp4.sharding.collectives
def test_collectives_counts_each_op_once_and_sizes_its_result():
    """XLA's async pairs count once at their -done half (a combined all-gather's nested
    tuple type: the gathered arrays), plain ops once, jax-fp4's in-graph all-reduce by its
    custom-call target; an opcode named only in metadata or a called computation's name
    is not a collective."""
    text = "\n".join([
        "HloModule m",
        "ENTRY %main (a: bf16[4096,2048]) -> f32[4,128] {",
        "  %ag = ((bf16[4096,2048]{1,0}, u8[64]{0}), (bf16[4096,4096]{1,0}, u8[128]{0})) "
        "all-gather-start(%a, %b), dimensions={1}",
        "  %agd = (bf16[4096,4096]{1,0}, u8[128]{0}) all-gather-done(%ag)",
        "  %ar = f32[1,4096]{1,0} all-reduce(%x), to_apply=%add",
        '  %f = f32[8]{0} fusion(%z), kind=kLoop, calls=%all-reduce.fused, '
        'metadata={op_name="jit(f)/all-gather(x)"}',
        "  %ars = f32[4096]{0} all-reduce-start(%y), to_apply=%add",
        "  %ard = f32[4096]{0} all-reduce-done(%ars)",
        '  %cc = bf16[1,4096]{1,0} custom-call(%p), custom_call_target="jax_fp4_all_reduce_v1", '
        "api_version=API_VERSION_TYPED_FFI",
        '  %q = bf16[1,4096]{1,0} custom-call(%p), custom_call_target="jax_fp4_wmatmul_v3"',
        "  %p1 = pred[16]{0} collective-permute(%m), source_target_pairs={{0,1},{1,0}}",
        "  ROOT %rs = f32[4,128]{1,0} reduce-scatter(%z), dimensions={0}",
        "}"])
    got = jsh_collectives(text)
    assert [c.kind for c in got] == ["all-gather", "all-reduce", "all-reduce",
                                     "in-graph all-reduce", "collective-permute",
                                     "reduce-scatter"]
    assert got[0] == Collective("all-gather", "(bf16[4096,4096]{1,0}, u8[128]{0})")
    assert got[0].arrays == (("bf16", (4096, 4096)), ("u8", (128,)))
    assert [c.nbytes for c in got] == [4096 * 4096 * 2 + 128, 4096 * 4, 4096 * 4, 4096 * 2,
                                       16, 4 * 128 * 4]


def test_collectives_of_a_compiled_function_and_bad_input():
    """A compiled row-parallel matmul lists its one all-reduce (CPU: XLA's); anything but
    a compiled function or HLO text is a TypeError naming what it got."""
    x = _x((16, 512), 1).astype(jnp.bfloat16)
    q = jf.quantize(_x((512, 128), 2).astype(jnp.bfloat16), "int4", axis=0, block_size=64)
    f = jax.jit(lambda x, q: jf.matmul(x, q))
    args = (put(x, P(None, "model")), put(q, qarray_partition_specs(P("model", None), q)))
    got = jsh_collectives(f.lower(*args).compile())
    assert got == [Collective("all-reduce", "f32[16,128]{1,0}")]  # float32 partial sums
    with pytest.raises(TypeError, match="compiled function.*got int"):
        jsh_collectives(3)
