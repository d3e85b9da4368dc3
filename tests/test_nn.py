"""Quantized layers (Flax NNX, Flax Linen, Equinox), quantize_params and calibration."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4 as jf
from jax_fp4.nn import params as P
from jax_fp4.nn import quantize_params

nnx = pytest.importorskip("flax.nnx")
jff = pytest.importorskip("jax_fp4.nn.flax")

# worst relative error of x @ W for random normal data, per weight format (generous bounds
# that a wrong axis / wrong scale / transposed layout would break by far)
REL_ERR = {"nvfp4": 0.15, "mxfp4": 0.2, "mxfp6_e2m3": 0.06, "mxfp6_e3m2": 0.1,
           "mxfp8_e4m3": 0.04, "mxfp8_e5m2": 0.08, "nf4": 0.15, "bnb_fp4": 0.2, "int4": 0.15}


def _x(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


# ----------------------------------------------------------------------------- NNX layer
@pytest.mark.parametrize("fmt", jf.FORMAT_NAMES)
def test_nnx_quantized_linear_weight_only(fmt):
    lin = nnx.Linear(128, 48, rngs=nnx.Rngs(0))
    lin.bias.set_value(_x((48,), 3))
    q = jff.QuantizedLinear.from_linear(lin, fmt)
    k = q.kernel.get_value()
    assert isinstance(k, jf.QArray) and k.format == fmt
    assert k.shape == (128, 48) and k.axis == 0  # Flax (in, out): blocked along in
    x = _x((2, 5, 128), 1)
    y = q(x)
    assert y.shape == (2, 5, 48) and y.dtype == jnp.float32
    # exactly the dense layer on the dequantized kernel
    want = x @ k.dequantize(jnp.float32) + lin.bias.get_value()
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert _rel(y, lin(x)) < REL_ERR[fmt]
    # jit and grad with respect to the input
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, x: m(x))(q, x)), np.asarray(y))
    g = jax.grad(lambda x: q(x).sum())(x)
    np.testing.assert_allclose(np.asarray(g[0, 0]), np.asarray(k.dequantize().sum(1)),
                               rtol=1e-5, atol=1e-5)


def test_nnx_constructor_is_drop_in():
    q = jff.QuantizedLinear(64, 32, rngs=nnx.Rngs(0), format="mxfp8_e4m3", use_bias=False)
    ref = nnx.Linear(64, 32, rngs=nnx.Rngs(0), use_bias=False)
    assert q.bias is None and q.in_features == 64 and q.out_features == 32
    # same initializer and the same random stream as nnx.Linear, then quantized
    want = jf.quantize(ref.kernel.get_value(), "mxfp8_e4m3", axis=0)
    np.testing.assert_array_equal(np.asarray(q.kernel.get_value().data), np.asarray(want.data))
    qb = jff.QuantizedLinear(64, 32, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    assert qb(_x((3, 64))).dtype == jnp.bfloat16
    # nvfp4 default is two-level (per-tensor scale)
    assert jff.QuantizedLinear(64, 32, rngs=nnx.Rngs(0)).kernel.get_value().tensor_scale \
        is not None


def test_nnx_constructor_errors():
    with pytest.raises(ValueError, match="not a multiple of block_size 16"):
        jff.QuantizedLinear(24, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="act_mode"):
        jff.QuantizedLinear(64, 8, rngs=nnx.Rngs(0), act_format="mxfp8_e4m3",
                            act_mode="scaled")  # nvfp4 weights cannot pair with MX
    with pytest.raises(ValueError, match="act_format"):
        jff.QuantizedLinear(128, 8, rngs=nnx.Rngs(0), act_format="int4")
    with pytest.raises(ValueError, match="act_mode"):
        jff.QuantizedLinear(64, 8, rngs=nnx.Rngs(0), act_mode="int")
    with pytest.raises(TypeError, match="rngs"):
        jff.QuantizedLinear(64, 8)
    with pytest.raises(ValueError, match="kernel: expected shape"):
        jff.QuantizedLinear(64, 8, kernel=jnp.zeros((8, 64)), bias=jnp.zeros(8))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8_e4m3"])
def test_nnx_activation_modes(fmt):
    x = _x((6, 64), 2) * 3
    lin = nnx.Linear(64, 32, rngs=nnx.Rngs(1))
    fake = jff.QuantizedLinear.from_linear(lin, fmt, act_format=fmt, act_mode="fake")
    scaled = jff.QuantizedLinear.from_linear(lin, fmt, act_format=fmt, act_mode="scaled")
    wonly = jff.QuantizedLinear.from_linear(lin, fmt)
    k = wonly.kernel.get_value()
    ts = jf.tensor_scale_from_amax(jnp.abs(x).max()) if fmt == "nvfp4" else None
    xq = jf.fake_quantize(x, fmt, tensor_scale=ts)
    want = xq @ k.dequantize() + lin.bias.get_value()
    # fake-quantized activations == block-scaled matmul (both accumulate in float32)
    np.testing.assert_allclose(np.asarray(fake(x)), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(scaled(x)), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(fake(x) - wonly(x)).max()) > 1e-3  # activations really quantized


def test_nnx_calibrate_sets_tensor_scale():
    lin = nnx.Linear(64, 16, rngs=nnx.Rngs(0))
    q = jff.QuantizedLinear.from_linear(lin, "nvfp4", act_format="nvfp4", name="fc")
    b1, b2 = _x((4, 64), 1), _x((4, 64), 2) * 5
    # before calibration: a dynamic per-call scale
    dyn = P.linear(b1, q.kernel.get_value(), q.bias.get_value(), act_format="nvfp4",
                   act_scale=None)
    np.testing.assert_array_equal(np.asarray(q(b1)), np.asarray(dyn))
    amax = jff.calibrate(q, [b1, b2])
    want_amax = float(jnp.maximum(jnp.abs(b1).max(), jnp.abs(b2).max()))
    assert amax == {"fc": pytest.approx(want_amax, rel=0, abs=0)}
    scale = float(q.act_scale.get_value())
    assert scale == float(jf.tensor_scale_from_amax(jnp.float32(want_amax)))
    assert not q.calibrating
    # after calibration: the calibrated scale (b1's own amax is 5x smaller)
    cal = P.linear(b1, q.kernel.get_value(), q.bias.get_value(), act_format="nvfp4",
                   act_scale=jnp.float32(scale))
    np.testing.assert_array_equal(np.asarray(q(b1)), np.asarray(cal))
    assert not np.array_equal(np.asarray(cal), np.asarray(dyn))
    assert jff.activation_amax(q)["fc"] == (want_amax, scale)
    with pytest.raises(ValueError, match="empty"):
        jff.calibrate(q, [])
    with pytest.raises(ValueError, match="nothing to calibrate"):
        jff.calibrate(jff.QuantizedLinear.from_linear(lin, "nvfp4"), [b1])


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(50, 64, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(64, 64, rngs=rngs) for _ in range(2)])
        self.odd = nnx.Linear(64, 24, rngs=rngs)
        self.head = nnx.Linear(24, 8, rngs=rngs)  # K=24: not a multiple of 16
        self.norm = nnx.LayerNorm(64, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = jax.nn.gelu(b(x))
        return self.head(self.odd(self.norm(x)))


def test_quantize_model_nnx():
    net = _Net(nnx.Rngs(0))
    ids = jnp.arange(10)
    with pytest.warns(UserWarning, match=r"head\.kernel \(K=24"):
        q = jf.nn.quantize_params(net, "nvfp4")  # dispatches to quantize_model
    assert type(net.blocks[0]) is nnx.Linear  # not in place
    assert isinstance(q.blocks[0], jff.QuantizedLinear) and q.blocks[1].name == "blocks.1"
    assert isinstance(q.odd, jff.QuantizedLinear)
    assert type(q.head) is nnx.Linear and type(q.embed) is nnx.Embed
    assert _rel(q(ids), net(ids)) < 0.2
    with pytest.raises(ValueError, match="head.kernel: in_features 24"):
        jff.quantize_model(net, "nvfp4", strict=True)
    only = jff.quantize_model(net, "mxfp8_e4m3", filter=r"^blocks\.0\.")
    assert isinstance(only.blocks[0], jff.QuantizedLinear)
    assert type(only.blocks[1]) is nnx.Linear and type(only.odd) is nnx.Linear
    jff.quantize_model(net, "int4", filter=lambda p, x: p == "odd.kernel", block_size=32,
                       inplace=True)
    assert isinstance(net.odd, jff.QuantizedLinear) and net.odd.kernel.get_value().block_size == 32


def test_quantize_params_nnx_state_merges_into_quantized_graph():
    net = _Net(nnx.Rngs(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qnet = jff.quantize_model(net, "nf4", filter=r"^blocks")
        qstate = quantize_params(nnx.state(net), "nf4", filter=r"^blocks.*kernel$")
    graphdef, _ = nnx.split(qnet)
    merged = nnx.merge(graphdef, qstate)
    ids = jnp.arange(7)
    np.testing.assert_array_equal(np.asarray(merged(ids)), np.asarray(qnet(ids)))
    k = qstate["blocks"][0]["kernel"].get_value()
    assert isinstance(k, jf.QArray) and k.axis == 0
    assert not isinstance(qstate["embed"]["embedding"].get_value(), jf.QArray)


def test_quantize_params_plain_tree_conventions():
    tree = {
        "dense": {"kernel": _x((64, 32)), "bias": _x((32,))},       # Flax (in, out)
        "proj": {"weight": _x((32, 64)), "bias": _x((32,))},        # PyTorch (out, in)
        "tok_embeddings": {"weight": _x((100, 64))},               # embedding: left alone
        "norm": {"scale": _x((64,))},
        "w": _x((64, 64)),                                         # no convention name
        "ints": jnp.ones((64, 64), jnp.int32),
        "already": jf.quantize(_x((64, 32)), "mxfp4", axis=0),
    }
    q = quantize_params(tree, "mxfp4")
    assert q["dense"]["kernel"].axis == 0 and q["dense"]["kernel"].shape == (64, 32)
    assert q["proj"]["weight"].axis == 1 and q["proj"]["weight"].shape == (32, 64)
    for path in (("dense", "bias"), ("tok_embeddings", "weight"), ("norm", "scale"), ("w",),
                 ("ints",)):
        a, b = tree, q
        for p in path:
            a, b = a[p], b[p]
        assert b is a, path
    assert q["already"] is tree["already"]
    # the blocks run along the contraction axis: same codes as quantizing the transpose
    np.testing.assert_array_equal(
        np.asarray(q["proj"]["weight"].data),
        np.asarray(jf.quantize(tree["proj"]["weight"].T, "mxfp4", axis=0).data))
    with pytest.raises(ValueError, match=r"cannot tell the contraction axis of 'w'"):
        quantize_params(tree, "nvfp4", filter=r"^w$")
    qw = quantize_params(tree, "nvfp4", filter=r"^w$", axis=1)
    assert qw["w"].axis == 1 and qw["w"].tensor_scale is not None
    assert quantize_params(tree, "nvfp4", filter=r"^w$", axis=1,
                           tensor_scale=None)["w"].tensor_scale is None
    with pytest.raises(TypeError, match="filter"):
        quantize_params(tree, "nvfp4", filter=3)
    with pytest.raises(ValueError, match="regular expression"):
        quantize_params(tree, "nvfp4", filter="(")
    with pytest.raises(ValueError, match="unknown format|format"):
        quantize_params(tree, "fp3")
    with pytest.raises(ValueError, match="act_format"):
        quantize_params(tree, "nvfp4", act_format="nvfp4")
    with pytest.raises(ValueError, match="not a multiple"):
        quantize_params({"k": {"kernel": _x((24, 8))}}, "nvfp4", strict=True)
    with pytest.warns(UserWarning, match="left 1 kernel"):
        out = quantize_params({"k": {"kernel": _x((24, 8))}}, "nvfp4")
    assert not isinstance(out["k"]["kernel"], jf.QArray)


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_quantize_params_stacked_layers(fmt):
    """stacked=True: a scanned model's (L, in, out) kernels and (L1, L2, out, in) weights
    become one QArray each whose layer i is bit for bit jf.quantize of layer i (nvfp4: its
    own tensor scale), and lax.scan over them computes each layer's W4A16 product."""
    tree = {"layers": {"mlp": {"kernel": _x((3, 128, 64), 1), "bias": _x((3, 64), 2)},
                       "attn": {"weight": _x((2, 2, 64, 128), 3)}},
            "head": {"kernel": _x((128, 32), 4)}}
    q = quantize_params(tree, fmt, stacked=True, prepare=False)
    k, wt = q["layers"]["mlp"]["kernel"], q["layers"]["attn"]["weight"]
    assert isinstance(k, jf.QArray) and isinstance(wt, jf.QArray)
    assert q["layers"]["mlp"]["bias"] is tree["layers"]["mlp"]["bias"]
    kw = {"tensor_scale": "auto"} if fmt == "nvfp4" else {}  # quantize_params' default
    for i in range(3):
        r = jf.quantize(tree["layers"]["mlp"]["kernel"][i], fmt, axis=0, **kw)
        for a, b in zip(jax.tree.leaves(jax.tree.map(lambda v: v[i], k)), jax.tree.leaves(r)):
            np.testing.assert_array_equal(np.atleast_1d(np.asarray(a)).view(np.uint8),
                                          np.atleast_1d(np.asarray(b)).view(np.uint8))
    r = jf.quantize(tree["layers"]["attn"]["weight"][1, 0], fmt, axis=1, **kw)  # (out, in)
    np.testing.assert_array_equal(np.asarray(wt.data[1, 0]), np.asarray(r.data))
    if fmt == "nvfp4":
        assert k.tensor_scale.shape == (3,) and wt.tensor_scale.shape == (2, 2)

    def layers(x, stack):
        return jax.lax.scan(lambda h, w: (jf.matmul(h, w)[:, :128], None),
                            x, stack)[0]

    x = _x((4, 128), 5)
    w_sq = jax.vmap(lambda w: jnp.pad(w, ((0, 0), (0, 64))))(tree["layers"]["mlp"]["kernel"])
    q_sq = quantize_params({"kernel": w_sq}, fmt, stacked=True, prepare=False)["kernel"]
    y = jax.jit(layers)(x, q_sq)
    want = x
    for i in range(3):
        want = jf.matmul(want, jf.quantize(w_sq[i], fmt, axis=0, **kw))[:, :128]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


def test_quantize_params_stacked_leaves_warn_and_bad_use():
    tree = {"layers": {"kernel": _x((2, 64, 32))}, "conv": {"kernel": _x((3, 3, 16, 32))}}
    with pytest.warns(UserWarning, match=r"left 2 selected .* stacked=True.*layers\.kernel "
                                         r"\(2, 64, 32\)"):
        out = quantize_params(tree, "nvfp4")
    assert out["layers"]["kernel"] is tree["layers"]["kernel"]
    with warnings.catch_warnings():  # a callable filter is never asked about other leaves
        warnings.simplefilter("error")
        quantize_params(tree, "nvfp4", filter=lambda p, x: x.shape[1] == 64)
    with pytest.raises(ValueError, match="stacked: .*rounded to nearest.*'gptq', a calibration"):
        quantize_params(tree, "nvfp4", stacked=True, method="gptq",
                        calibration={"layers.kernel": _x((8, 64))})
    with pytest.raises(ValueError, match="not a multiple"):
        quantize_params({"kernel": _x((2, 24, 8))}, "nvfp4", stacked=True, strict=True)
    with pytest.raises(ValueError, match="stacked.*NNX module"):
        quantize_params(nnx.Linear(64, 32, rngs=nnx.Rngs(0)), "nvfp4", stacked=True)


def test_linen_scanned_layers_quantize_with_stacked():
    """A Linen model scanned over its layers (nn.scan, params stacked on axis 0): its float
    params quantized with stacked=True load into the same model with QuantizedDense."""
    import flax.linen as nn

    class Block(nn.Module):
        dense: type = nn.Dense
        kw: tuple = ()

        @nn.compact
        def __call__(self, h, _):
            return nn.relu(self.dense(64, name="fc", **dict(self.kw))(h)), None

    class Stack(nn.Module):
        dense: type = nn.Dense
        kw: tuple = ()

        @nn.compact
        def __call__(self, x):
            scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=3)
            return scan(self.dense, self.kw)(x, None)[0]

    x = _x((4, 64), 6)
    v = Stack().init(jax.random.key(0), x)
    assert v["params"]["ScanBlock_0"]["fc"]["kernel"].shape == (3, 64, 64)
    qv = quantize_params(v, "nvfp4", stacked=True, prepare=False)
    qm = Stack(dense=jff.QuantizedDense, kw=(("format", "nvfp4"),))
    jax.tree.map(lambda a, b: np.testing.assert_equal(a.shape, b.shape),
                 qm.init(jax.random.key(0), x), qv)  # the structure Linen checks
    y = Stack().apply(v, x)
    yq = jax.jit(qm.apply)(qv, x)
    assert _rel(yq, y) < 0.3  # three 4-bit layers


def test_transpose_2d():
    w = _x((32, 64))
    q = jf.quantize(w, "nvfp4", axis=1, tensor_scale="auto")
    t = P.transpose_2d(q)
    assert t.shape == (64, 32) and t.axis == 0
    np.testing.assert_array_equal(np.asarray(t.dequantize()), np.asarray(q.dequantize()).T)
    with pytest.raises(ValueError, match="swizzled"):
        P.transpose_2d(jf.quantize(w, "nvfp4", scale_layout="swizzled"))


def test_nnx_linear_with_jax_fp4_dot_general():
    # plain nnx.Linear passes out_sharding= to its dot_general: jax_fp4.nn.flax.dot_general
    # accepts it; the QArray kernel is read through QuantizedLinear, so here we check the
    # wrapper alone.
    q = jf.quantize(_x((64, 16)), "nvfp4", axis=0)
    x = _x((3, 64))
    y = jff.dot_general(x, q, (((1,), (0,)), ((), ())), out_sharding=None)
    np.testing.assert_allclose(np.asarray(y), np.asarray(jf.matmul(x, q)), rtol=0, atol=0)


# ----------------------------------------------------------------------------- Linen
def _linen_mlp():
    import flax.linen as nn

    class MLP(nn.Module):
        dense: type = nn.Dense
        kw: tuple = ()

        @nn.compact
        def __call__(self, x):
            kw = dict(self.kw)
            x = nn.relu(self.dense(128, name="fc1", **kw)(x))
            return self.dense(32, name="fc2", **kw)(x)

    return nn, MLP


def test_linen_quantized_dense_and_plain_dense():
    nn, MLP = _linen_mlp()
    x = _x((4, 64))
    v = MLP().init(jax.random.key(1), x)
    y = MLP().apply(v, x)
    qv = quantize_params(v, "nvfp4")
    assert isinstance(qv["params"]["fc1"]["kernel"], jf.QArray)
    yq = MLP(dense=jff.QuantizedDense, kw=(("format", "nvfp4"),)).apply(qv, x)
    assert _rel(yq, y) < 0.25  # two stacked 4-bit layers
    # documented alternative: nn.Dense with jax_fp4.dot_general and a quantized init
    kw = (("dot_general", jf.dot_general), ("promote_dtype", jff.promote_dtype),
          ("kernel_init", jff.quantized_init(nn.initializers.lecun_normal(), "nvfp4")))
    yd = jax.jit(lambda v, x: MLP(kw=kw).apply(v, x))(qv, x)
    np.testing.assert_allclose(np.asarray(yd), np.asarray(yq), rtol=1e-6, atol=1e-6)
    # QuantizedDense initializes its own quantized params too
    v2 = MLP(dense=jff.QuantizedDense, kw=(("format", "mxfp6_e2m3"),)).init(
        jax.random.key(0), x)
    assert v2["params"]["fc2"]["kernel"].format == "mxfp6_e2m3"


def test_linen_activation_calibration():
    nn, MLP = _linen_mlp()
    x = _x((4, 64)) * 2
    m = MLP(dense=jff.QuantizedDense, kw=(("format", "nvfp4"), ("act_format", "nvfp4"),
                                          ("act_mode", "scaled")))
    v = m.init(jax.random.key(1), x)
    assert float(v["quant_stats"]["fc1"]["act_amax"]) == 0.0
    _, upd = m.apply(v, x, mutable=["quant_stats"])
    assert float(upd["quant_stats"]["fc1"]["act_amax"]) == float(jnp.abs(x).max())
    y_dyn = m.apply(v, x)
    y_cal = m.apply({**v, **upd}, x)
    # on the calibration batch itself the calibrated scales are (nearly) the dynamic ones
    assert _rel(y_cal, y_dyn) < 0.05
    y_other = m.apply({**v, **upd}, x * 0.25)
    y_other_dyn = m.apply(v, x * 0.25)
    assert not np.array_equal(np.asarray(y_other), np.asarray(y_other_dyn))


# ----------------------------------------------------------------------------- Equinox
def test_equinox_quantized_linear_and_quantize_params():
    eqx = pytest.importorskip("equinox")
    jfe = pytest.importorskip("jax_fp4.nn.equinox")

    class Net(eqx.Module):
        emb: eqx.nn.Embedding
        l1: eqx.nn.Linear
        l2: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.emb = eqx.nn.Embedding(10, 64, key=k1)
            self.l1 = eqx.nn.Linear(64, 128, key=k2)
            self.l2 = eqx.nn.Linear(128, 32, key=k3)

        def __call__(self, i):
            return self.l2(jax.nn.relu(self.l1(self.emb(i))))

    net = Net(jax.random.key(0))
    ids = jnp.arange(6)
    q = quantize_params(net, "mxfp8_e4m3")
    assert isinstance(q.l1, jfe.QuantizedLinear) and isinstance(q.emb, eqx.nn.Embedding)
    assert q.l1.weight.shape == (128, 64) and q.l1.weight.axis == 1  # (out, in), along in
    assert q.l1.name == "l1"
    y = eqx.filter_jit(lambda m, i: jax.vmap(m)(i))(q, ids)
    assert _rel(y, jax.vmap(net)(ids)) < 0.1  # two stacked mxfp8 layers
    x = _x((64,))
    np.testing.assert_allclose(np.asarray(q.l1(x)),
                               np.asarray(q.l1.weight.dequantize() @ x + net.l1.bias),
                               rtol=1e-5, atol=1e-5)
    # constructor drop-in
    lay = jfe.QuantizedLinear(64, 16, key=jax.random.key(1), format="nf4")
    assert lay(x).shape == (16,) and lay(jnp.ones((3, 64))).shape == (3, 16)
    with pytest.raises(TypeError, match="key"):
        jfe.QuantizedLinear(64, 16)
    # activations + calibration (through jax.debug.callback under vmap and jit)
    qa = quantize_params(net, "nvfp4", act_format="nvfp4")
    qa2, amax = jf.nn.calibrate(qa, [ids], lambda m, b: jax.vmap(m)(b))
    h = jax.vmap(net.emb)(ids)
    assert amax["l1"] == pytest.approx(float(jnp.abs(h).max()), rel=1e-7)
    assert jfe.activation_amax(qa2)["l1"] == float(jf.tensor_scale_from_amax(
        jnp.float32(amax["l1"])))
    y2 = eqx.filter_jit(lambda m, i: jax.vmap(m)(i))(qa2, ids)
    assert _rel(y2, jax.vmap(net)(ids)) < 0.25
