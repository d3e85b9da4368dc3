"""Training with 4-bit weights: QLoRA on a frozen quantized base, QAT (jax_fp4.nn.lora,
jax_fp4.nn.qat, jax_fp4.nn.flax_train, jax_fp4.nn.equinox_train)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

optax = pytest.importorskip("optax")

import jax_fp4 as jf  # noqa: E402
from jax_fp4 import nn as jnn  # noqa: E402
from jax_fp4.qarray import QArray  # noqa: E402


def _is_q(x):
    return isinstance(x, QArray)


def _leaf_bytes(tree):
    """Every array leaf (QArray buffers included) as raw bytes, in tree order."""
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


def _data(rng, n=32, k=64):
    x = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
    return x, y


# ----------------------------------------------------------------------------- NNX
def _nnx_mlp(seed=0):
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(64, 128, rngs=rngs)
            self.down = nnx.Linear(128, 64, rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.gelu(self.up(x)))

    return MLP(nnx.Rngs(seed))


@pytest.mark.parametrize("fmt", ["nf4", "nvfp4"])
def test_qlora_nnx_step_trains_adapters_only(fmt, rng):
    from flax import nnx
    from jax_fp4.nn import flax_train as ft

    model = jnn.quantize_params(_nnx_mlp(), fmt, prepare=False)
    model = ft.add_lora(model, rank=4, alpha=8, rngs=nnx.Rngs(1))
    frozen_filter = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
    frozen0 = _leaf_bytes(nnx.state(model, frozen_filter))
    n_q = sum(_is_q(v) for v in jax.tree_util.tree_leaves(nnx.state(model), is_leaf=_is_q))
    assert n_q == 2
    adapters0 = [np.asarray(a) for a in jax.tree_util.tree_leaves(
        nnx.state(model, nnx.LoRAParam))]
    assert len(adapters0) == 4
    x, y = _data(rng)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)

    def loss_fn(m):
        return jnp.mean((m(x) - y) ** 2)

    @nnx.jit
    def step(m, o):
        loss, g = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(m)
        o.update(m, g)
        return loss

    l0 = float(step(model, opt))
    assert float(loss_fn(model)) < l0
    # the 4-bit base and the biases: bit-identical; the adapters: B moves at once (A's
    # gradient is zero while B = 0, as in any LoRA), A from the second step on
    assert _leaf_bytes(nnx.state(model, frozen_filter)) == frozen0
    changed = [not np.array_equal(a0, np.asarray(a1)) for a0, a1 in zip(
        adapters0, jax.tree_util.tree_leaves(nnx.state(model, nnx.LoRAParam)))]
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(
        nnx.state(model, nnx.LoRAParam))]
    assert changed == ["lora_b" in n for n in names], names
    step(model, opt)
    assert _leaf_bytes(nnx.state(model, frozen_filter)) == frozen0
    for a0, a1 in zip(adapters0, jax.tree_util.tree_leaves(nnx.state(model, nnx.LoRAParam))):
        assert not np.array_equal(a0, np.asarray(a1))
    n_lora, n_all = ft.lora_param_count(model)
    assert n_lora == 4 * (64 + 128) + 4 * (128 + 64) and n_all > n_lora


def test_qlora_nnx_merge(rng):
    from flax import nnx
    from jax_fp4.nn import flax_train as ft

    model = ft.add_lora(jnn.quantize_params(_nnx_mlp(), "nf4", prepare=False), rank=4,
                        rngs=nnx.Rngs(1))
    for m in (model.up, model.down):  # a non-zero update to merge
        m.lora_b.set_value(jnp.asarray(rng.standard_normal(m.lora_b.shape) * 0.05,
                                       jnp.float32))
    x, _ = _data(rng)
    want = np.asarray(model(x))
    merged = ft.merge_lora(model)
    assert type(merged.up) is nnx.Linear and type(merged.down) is nnx.Linear
    np.testing.assert_allclose(np.asarray(merged(x)), want, rtol=1e-4, atol=1e-4)
    rq = ft.merge_lora(model, requantize=True)
    assert rq.up.kernel.get_value().format == "nf4"
    # the re-quantized merge is the merged float weight quantized again
    w = np.asarray(merged.up.kernel.get_value())
    np.testing.assert_array_equal(np.asarray(rq.up.kernel.get_value().dequantize()),
                                  np.asarray(jf.fake_quantize(jnp.asarray(w), "nf4", axis=0)))
    assert ft.merge_lora(model, requantize="nvfp4").down.kernel.get_value().format == "nvfp4"
    assert isinstance(model.up, ft.LoRALinear)  # not inplace


def test_qlora_dropout_and_errors():
    from flax import nnx
    from jax_fp4.nn import flax_train as ft

    model = ft.add_lora(jnn.quantize_params(_nnx_mlp(), "nf4", prepare=False), rank=2,
                        dropout=0.5, rngs=nnx.Rngs(params=1, dropout=2))
    for m in (model.up, model.down):
        m.lora_b.set_value(jnp.ones(m.lora_b.shape))
    x = jnp.ones((4, 64))
    a, b = model(x), model(x)
    assert not np.array_equal(np.asarray(a), np.asarray(b))  # dropout active in train mode
    model.eval()
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(model(x)))
    with pytest.raises(ValueError, match="rank"):
        ft.add_lora(_nnx_mlp(), rank=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="dropout"):
        ft.add_lora(_nnx_mlp(), dropout=1.0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no layer"):
        ft.add_lora(_nnx_mlp(), rngs=nnx.Rngs(0))  # float model: no QuantizedLinear


def test_qlora_base_is_never_stored_dequantized():
    """The compiled QLoRA step takes the base as 4-bit codes (what persists between steps);
    its decoded weights are temporaries of the step (XLA:CPU's buffer assignment keeps one
    per layer, so at most one float32 copy of the base during the step)."""
    from flax import nnx
    from jax_fp4.nn import flax_train as ft

    class Deep(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(512, 512, rngs=rngs) for _ in range(4)])

        def __call__(self, x):
            for layer in self.layers:
                x = jax.nn.gelu(layer(x))
            return x

    model = ft.add_lora(jnn.quantize_params(Deep(nnx.Rngs(0)), "nf4", prepare=False),
                        rank=8, rngs=nnx.Rngs(1))
    x = jnp.ones((8, 512))
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)

    def step(lora, rest):
        def loss(lo):
            return jnp.mean(nnx.merge(graphdef, lo, rest)(x) ** 2)
        return jax.grad(loss)(lora)

    mem = jax.jit(step).lower(lora, rest).compile().memory_analysis()
    float_base = 4 * 512 * 512 * 4
    assert mem.argument_size_in_bytes < float_base / 4  # nf4: ~0.53 bytes per weight
    assert mem.temp_size_in_bytes < 1.1 * float_base


# ----------------------------------------------------------------------------- Equinox
def _eqx_mlp(key):
    import equinox as eqx

    class MLP(eqx.Module):
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.up = eqx.nn.Linear(64, 128, key=k1)
            self.down = eqx.nn.Linear(128, 64, key=k2)

        def __call__(self, x):
            return self.down(jax.nn.gelu(self.up(x)))

    return MLP(key)


@pytest.mark.parametrize("fmt", ["nf4", "nvfp4"])
def test_qlora_equinox_step_trains_adapters_only(fmt, rng):
    eqx = pytest.importorskip("equinox")
    from jax_fp4.nn import equinox_train as et

    model = jnn.quantize_params(_eqx_mlp(jax.random.key(0)), fmt, prepare=False)
    model = et.add_lora(model, rank=4, alpha=8, key=jax.random.key(1))
    spec = et.lora_filter(model)
    train, frozen = eqx.partition(model, spec, is_leaf=_is_q)
    assert len(jax.tree_util.tree_leaves(train)) == 4
    x, y = _data(rng)
    tx = optax.adam(1e-2)
    state = tx.init(train)

    def loss_fn(tr):
        return jnp.mean((eqx.combine(tr, frozen, is_leaf=_is_q)(x) - y) ** 2)

    @jax.jit
    def step(tr, st):
        loss, g = jax.value_and_grad(loss_fn)(tr)
        upd, st = tx.update(g, st, tr)
        return optax.apply_updates(tr, upd), st, loss

    new_train, state, l0 = step(train, state)
    assert float(loss_fn(new_train)) < float(l0)
    new_train, state, _ = step(new_train, state)  # A moves from the second step (B was 0)
    new_model = eqx.combine(new_train, frozen, is_leaf=_is_q)
    _, frozen1 = eqx.partition(new_model, et.lora_filter(new_model), is_leaf=_is_q)
    assert _leaf_bytes(frozen1) == _leaf_bytes(frozen)
    assert sum(_is_q(v) for v in jax.tree_util.tree_leaves(new_model, is_leaf=_is_q)) == 2
    for a0, a1 in zip(jax.tree_util.tree_leaves(train), jax.tree_util.tree_leaves(new_train)):
        assert not np.array_equal(np.asarray(a0), np.asarray(a1))
    # merge: float and re-quantized
    merged = et.merge_lora(new_model)
    assert isinstance(merged.up, eqx.nn.Linear)
    np.testing.assert_allclose(np.asarray(jax.vmap(merged)(x)), np.asarray(new_model(x)),
                               rtol=1e-4, atol=1e-4)
    rq = et.merge_lora(new_model, requantize=True)
    assert rq.up.weight.format == fmt and rq.up.weight.axis == 1
    np.testing.assert_array_equal(
        np.asarray(rq.up.weight.dequantize()),
        np.asarray(jf.fake_quantize(merged.up.weight, fmt, axis=1,
                                    **({"tensor_scale": "auto"} if fmt == "nvfp4" else {}))))
    # dropout: only with a key
    d = et.add_lora(jnn.quantize_params(_eqx_mlp(jax.random.key(0)), "nf4", prepare=False),
                    rank=2, dropout=0.5, key=jax.random.key(1))
    d = eqx.tree_at(lambda t: t.up.lora_b, d, jnp.ones_like(d.up.lora_b))
    a = d.up(x[0], key=jax.random.key(3))
    b = d.up(x[0], key=jax.random.key(4))
    assert not np.array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(d.up(x[0])), np.asarray(d.up(x[0])))


# ----------------------------------------------------------------------------- Linen
def test_qlora_linen_trains_adapters_only(rng):
    from jax_fp4.nn import flax_train as ft

    layer = ft.LoRADense(64, rank=4, alpha=8)
    x, y = _data(rng)
    params = layer.init(jax.random.key(0), x)["params"]
    assert params["kernel"].format == "nf4"
    lora, frozen = ft.split_lora(params)
    tx = optax.sgd(0.1)
    st = tx.init(lora)

    def loss_fn(lo):
        return jnp.mean((layer.apply({"params": ft.combine(lo, frozen)}, x) - y) ** 2)

    l0, g = jax.value_and_grad(loss_fn)(lora)
    upd, st = tx.update(g, st, lora)
    lora1 = optax.apply_updates(lora, upd)
    assert float(loss_fn(lora1)) < float(l0)
    assert not np.array_equal(np.asarray(lora1["lora_b"]), np.asarray(lora["lora_b"]))
    assert _leaf_bytes(ft.split_lora(ft.combine(lora1, frozen))[1]) == _leaf_bytes(frozen)
    # dropout draws from the "dropout" rng when not deterministic
    d = ft.LoRADense(64, rank=4, dropout=0.5)
    p = d.init(jax.random.key(0), x)["params"]
    p = dict(p, lora_b=jnp.ones_like(p["lora_b"]))
    o1 = d.apply({"params": p}, x, False, rngs={"dropout": jax.random.key(1)})
    o2 = d.apply({"params": p}, x, False, rngs={"dropout": jax.random.key(2)})
    assert not np.array_equal(np.asarray(o1), np.asarray(o2))


# ----------------------------------------------------------------------------- QAT
QAT_CASES = [("nvfp4", {}), ("mxfp4", {}), ("nf4", {}), ("int4", {"block_size": 32}),
             ("nvfp4", {"act_format": "nvfp4"})]


@pytest.mark.parametrize("fmt,kw", QAT_CASES)
def test_qat_nnx_convert_is_bit_identical(fmt, kw, rng):
    from flax import nnx
    from jax_fp4.nn import flax_train as ft
    from jax_fp4.nn.flax import QuantizedLinear

    model = ft.qat_model(_nnx_mlp(), fmt, **kw)
    assert isinstance(model.up, ft.QATLinear)
    x, y = _data(rng)
    # the value is the fake-quantized forward
    up = model.up
    xin = x if "act_format" not in kw else jf.fake_quantize(x, "nvfp4", tensor_scale="auto")
    fq = jf.fake_quantize(up.kernel.get_value(), fmt, axis=0,
                          **({"tensor_scale": "auto"} if fmt == "nvfp4" else {}),
                          **({"block_size": 32} if fmt == "int4" else {}))
    np.testing.assert_allclose(np.asarray(up(x)), np.asarray(xin @ fq + up.bias.get_value()),
                               rtol=1e-5, atol=1e-5)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(m, o):
        loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(m)
        o.update(m, g)
        return loss

    l0 = float(step(model, opt))
    for _ in range(3):
        step(model, opt)
    assert float(jnp.mean((model(x) - y) ** 2)) < l0
    deployed = ft.convert(model)
    assert isinstance(deployed.up, QuantizedLinear) and isinstance(deployed.down,
                                                                    QuantizedLinear)
    np.testing.assert_array_equal(np.asarray(deployed(x)), np.asarray(model(x)))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: deployed(v))(x)),
                                  np.asarray(jax.jit(lambda v: model(v))(x)))


def test_qat_gradient_is_the_fake_quantize_ste(rng):
    """dL/dW of a QAT layer equals the gradient of the fake-quantized formulation
    x @ fake_quantize(W) (identity STE; clipped when asked)."""
    from jax_fp4.nn.qat import QATConfig, qat_linear

    x = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    for ste in ("identity", "clipped"):
        cfg = QATConfig("mxfp4", ste=ste)
        g = jax.grad(lambda w: jnp.sum(qat_linear(x, w, None, cfg) ** 2))(w)
        want = jax.grad(lambda w: jnp.sum((x @ jf.fake_quantize(w, "mxfp4", axis=0,
                                                                 ste=ste)) ** 2))(w)
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="ste"):
        QATConfig("nvfp4", ste="none")


def test_qat_equinox_and_linen_convert(rng):
    eqx = pytest.importorskip("equinox")
    from jax_fp4.nn import equinox_train as et
    from jax_fp4.nn import flax_train as ft
    from jax_fp4.nn.flax import QuantizedDense

    x, y = _data(rng)
    model = et.qat_model(_eqx_mlp(jax.random.key(0)), "nvfp4")
    assert isinstance(model.up, et.QATLinear)
    tx = optax.adam(1e-2)
    st = tx.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(m, st):
        loss, g = eqx.filter_value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(m)
        upd, st = tx.update(g, st, eqx.filter(m, eqx.is_inexact_array))
        return eqx.apply_updates(m, upd), st, loss

    model, st, l0 = step(model, st)
    model, st, _ = step(model, st)
    assert float(jnp.mean((model(x) - y) ** 2)) < float(l0)
    deployed = et.convert(model)
    np.testing.assert_array_equal(np.asarray(deployed(x)), np.asarray(model(x)))
    # Linen: QATDense params -> QuantizedDense params, same forward bit for bit
    qd = ft.QATDense(32, format="mxfp4")
    p = qd.init(jax.random.key(0), x)["params"]
    dense = QuantizedDense(32, format="mxfp4")
    np.testing.assert_array_equal(
        np.asarray(dense.apply({"params": ft.convert_params(p, qd)}, x)),
        np.asarray(qd.apply({"params": p}, x)))
