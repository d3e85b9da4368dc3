"""jax_fp4.group_matmuls: W4A16 calls of one activation as one grouped call (CPU; the
kernel's one launch is tested in tests/test_cuda_matmul.py).

On CPU the grouped call lowers each weight as the ungrouped call does, so results are
compared bit for bit; the jaxpr is checked for which calls were grouped."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jax_fp4 as jf
from jax_fp4.prims.wmatmul_group import wmatmul_group_p
from jax_fp4.sharding import collectives, qarray_partition_specs

K = 256


@pytest.fixture(autouse=True)
def _on_cpu():
    """On CPU, where a grouped call runs each weight as the ungrouped call does (so results
    compare bit for bit), also on a machine with a GPU."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _weights(rng, ns, fmt="nvfp4", **kw):
    return [jf.quantize(jnp.asarray(rng.standard_normal((K, n)), jnp.float32), fmt, axis=0, **kw)
            for n in ns]


def _x(rng, m=3, dtype=jnp.bfloat16):
    return jnp.asarray(rng.standard_normal((m, K)), dtype)


def _group_sizes(fn, *args):
    """The number of weights of each grouped call in fn's jaxpr, nested jaxprs included."""
    sizes = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive is wmatmul_group_p:
                sizes.append((len(eqn.invars) - 1) // 4)
            for v in eqn.params.values():
                for item in v if isinstance(v, (tuple, list)) else (v,):
                    if isinstance(item, jax.extend.core.ClosedJaxpr):
                        walk(item.jaxpr)
                    elif isinstance(item, jax.extend.core.Jaxpr):
                        walk(item)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return sizes


def _equal(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert u.shape == v.shape and u.dtype == v.dtype
        np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))


def _layer(x, ws):
    """q / k / v of one x, then gate / up of another, as a decoder layer calls them."""
    q, k, v = (jf.matmul(x, w) for w in ws[:3])
    h = (q[:, :64] * k[:, :64] + v[:, :64]).astype(x.dtype)
    h = jnp.concatenate([h] * (K // 64), axis=1)
    gate, up = (jf.matmul(h, w) for w in ws[3:5])
    return jax.nn.silu(gate) * up


@pytest.mark.parametrize("fmt,kw", [("nvfp4", {"tensor_scale": "auto"}), ("int4", {}),
                                    ("nf4", {})])
def test_groups_q_k_v_and_gate_up(fmt, kw, rng):
    ws = _weights(rng, (256, 128, 128, 384, 384), fmt, **kw)
    x = _x(rng)
    grouped = jf.group_matmuls(_layer)
    assert sorted(_group_sizes(grouped, x, ws)) == [2, 3]
    assert _group_sizes(_layer, x, ws) == []
    _equal(jax.jit(grouped)(x, ws), jax.jit(_layer)(x, ws))
    # prepared weights (the layout quantize_params gives on Hopper) group the same way
    wp = [jf.prepare(w) for w in ws]
    assert sorted(_group_sizes(grouped, x, wp)) == [2, 3]
    _equal(jax.jit(grouped)(x, wp), jax.jit(_layer)(x, wp))


def test_only_calls_of_one_x_and_one_format_group(rng):
    a, b = _weights(rng, (64, 64)), _weights(rng, (64,), "mxfp4")
    x, x2 = _x(rng), _x(rng)

    def fn(x, x2, a, b):
        return [jf.matmul(x, a[0]), jf.matmul(x2, a[1]), jf.matmul(x, b[0]),
                jf.matmul(x, a[1])]

    assert _group_sizes(jf.group_matmuls(fn), x, x2, a, b) == [2]  # a[0] and a[1] of x
    _equal(jax.jit(jf.group_matmuls(fn))(x, x2, a, b), jax.jit(fn)(x, x2, a, b))


def test_at_most_four_weights_a_group(rng):
    ws = _weights(rng, (64,) * 6)
    x = _x(rng)

    def fn(x, ws):
        return [jf.matmul(x, w) for w in ws]

    assert _group_sizes(jf.group_matmuls(fn), x, ws) == [4, 2]
    _equal(jax.jit(jf.group_matmuls(fn))(x, ws), jax.jit(fn)(x, ws))


def test_a_weight_computed_from_the_group_does_not_join(rng):
    """The second call's weight is quantized from the first call's output: it cannot run
    in the first call's place, so it stays a call of its own."""
    w1 = _weights(rng, (K,))[0]
    x = _x(rng, m=K)

    def fn(x, w1):
        y1 = jf.matmul(x, w1)
        w2 = jf.quantize(y1, "nvfp4", axis=0)
        return jf.matmul(x, w2), y1

    assert _group_sizes(jf.group_matmuls(fn), x, w1) == []
    _equal(jax.jit(jf.group_matmuls(fn))(x, w1), jax.jit(fn)(x, w1))


def test_nested_jit_scan_remat_and_cond(rng):
    ws = _weights(rng, (128, 64, 64))
    x = _x(rng)
    qkv = jax.jit(lambda x, ws: [jf.matmul(x, w) for w in ws])

    def fn(x, ws, flag):
        def body(c, _):
            q, k, v = jax.checkpoint(lambda c: [jf.matmul(c, w) for w in ws])(c)
            return c + q[:, :1].astype(c.dtype), (k.sum(), v.sum())
        c, sums = jax.lax.scan(body, x, None, length=2)
        branch = jax.lax.cond(flag, lambda x: qkv(x, ws)[0][:, :64] * 2,
                              lambda x: qkv(x, ws)[1] + qkv(x, ws)[2], x)
        return c, sums, qkv(x, ws), branch

    grouped = jf.group_matmuls(fn)
    # remat in scan; the jit; the jit in one branch, the two in the other
    assert _group_sizes(grouped, x, ws, True) == [3] * 5
    for flag in (True, False):
        _equal(jax.jit(grouped)(x, ws, flag), jax.jit(fn)(x, ws, flag))


def test_grad_vmap_and_static_arguments(rng):
    ws = _weights(rng, (128, 64, 64, 192, 192))
    x = _x(rng, dtype=jnp.float32)

    def loss(x, ws, scale, *, name="layer"):
        assert isinstance(scale, float) and name == "layer"  # passed through, not traced
        return (_layer(x.astype(jnp.bfloat16), ws).astype(jnp.float32) * scale).sum()

    grouped = jf.group_matmuls(loss)
    # x's cotangent: the grouped transpose sums the weights' parts in float32 and rounds
    # once to bf16, the ungrouped program adds bf16 parts: equal within bf16 rounding
    got = np.asarray(jax.jit(jax.grad(grouped), static_argnums=2)(x, ws, 0.5), np.float64)
    want = np.asarray(jax.jit(jax.grad(loss), static_argnums=2)(x, ws, 0.5), np.float64)
    np.testing.assert_allclose(got, want, rtol=2.0**-6, atol=2.0**-6 * np.abs(want).max())
    xs = jnp.stack([x, 2 * x])
    _equal(jax.vmap(grouped, in_axes=(0, None, None))(xs, ws, 0.5),
           jax.vmap(loss, in_axes=(0, None, None))(xs, ws, 0.5))
    # the transformation inside a jit and around it give the same program's results
    _equal(jax.jit(grouped, static_argnums=2)(x, ws, 0.5),
           jf.group_matmuls(jax.jit(loss, static_argnums=2))(x, ws, 0.5))


def test_not_a_callable():
    with pytest.raises(TypeError, match="fun: expected a callable, got int"):
        jf.group_matmuls(3)


_CPUS = jax.devices("cpu")
MESH = Mesh(np.array(_CPUS[:8]).reshape(2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


@pytest.mark.parametrize("wspec,x_spec,reduce", [
    (P(None, "model"), P("data", None), False),   # column parallel, batch-sharded x
    (P("model", None), P(None, "model"), True)])  # row parallel: one all-reduce per output
def test_grouped_call_stays_sharded(wspec, x_spec, reduce, rng):
    """Every weight of a group split the same way (Megatron's q / k / v on the
    tensor-parallel axis): no weight or activation gathered; row parallel sums each
    output's float32 partials once."""
    ws = _weights(rng, (128, 64, 64), tensor_scale="auto")
    x = _x(rng, m=8, dtype=jnp.float32)

    def fn(x, ws):
        return [jf.matmul(x, w) for w in ws]

    put = lambda a, s: jax.device_put(a, jax.tree.map(  # noqa: E731
        lambda p: NamedSharding(MESH, p), s, is_leaf=lambda v: isinstance(v, P)))
    args = (put(x, x_spec), [put(w, qarray_partition_specs(wspec, w)) for w in ws])
    f = jax.jit(jf.group_matmuls(fn))
    assert _group_sizes(jf.group_matmuls(fn), *args) == [3]
    found = [(c.kind, c.type) for c in collectives(f.lower(*args).compile())]
    data = [c for c in found if c != ("all-reduce", "u32[]")]
    if reduce:
        # (XLA may combine the three into one all-reduce of a tuple)
        assert {kind for kind, _ in data} == {"all-reduce"}, found
        shapes = sorted(re.findall(r"\w+\[[^\]]*\]", " ".join(t for _, t in data)))
        assert shapes == sorted(f"f32[8,{n}]" for n in (128, 64, 64)), found
    else:
        assert data == [], found
    got = f(*args)
    want = jax.jit(fn)(*jax.device_put(jax.device_get((x, ws)), _CPUS[0]))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                                   rtol=2e-5, atol=2e-5 * float(np.abs(w).max()))
        if not reduce:
            assert g.sharding.is_equivalent_to(NamedSharding(MESH, P("data", "model")), 2), g.sharding


def test_flax_nnx_and_equinox_layers_group(rng):
    """Layers that cast x again before each call (Flax's dtype promotion) still group: x
    cast the same way counts as one activation. nnx.jit and eqx.filter_jit around the
    transformation, results bit for bit."""
    import equinox as eqx
    from flax import nnx

    from jax_fp4.nn.equinox import QuantizedLinear as EqxLinear
    from jax_fp4.nn.flax import QuantizedLinear as NnxLinear

    class QKV(nnx.Module):
        def __init__(self, rngs):
            self.q = NnxLinear(K, 256, use_bias=False, rngs=rngs)
            self.k = NnxLinear(K, 128, use_bias=False, rngs=rngs)
            self.v = NnxLinear(K, 128, use_bias=False, rngs=rngs)

        def __call__(self, x):
            return self.q(x), self.k(x), self.v(x)

    x = _x(rng)
    model = QKV(nnx.Rngs(0))
    call = lambda m, x: m(x)  # noqa: E731
    assert _group_sizes(jf.group_matmuls(call), model, x) == [3]
    _equal(nnx.jit(jf.group_matmuls(call))(model, x), nnx.jit(call)(model, x))

    keys = jax.random.split(jax.random.key(0), 2)
    layers = [EqxLinear(K, n, key=k, format="int4") for k, n in zip(keys, (256, 128))]
    call = lambda layers, x: [layer(x) for layer in layers]  # noqa: E731
    assert _group_sizes(jf.group_matmuls(call), layers, x) == [2]
    _equal(eqx.filter_jit(jf.group_matmuls(call))(layers, x), eqx.filter_jit(call)(layers, x))
