"""The headline benchmark (benchmarks/bench_model.py) runs end to end on a small model, and
its decoder step with 4-bit weights stays close to the bf16 step."""
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4 as jf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_model  # noqa: E402


def test_bench_model_tiny_runs(tmp_path):
    out = tmp_path / "RESULTS.md"
    rows = bench_model.main(["--tiny", "--ms", "8", "--iters", "2", "--formats", "int4",
                             "--results", str(out)])
    assert {(r["fmt"], r["m"]) for r in rows} == {("bf16", 8), ("int4", 8)}
    assert all(r["wall"] > 0 and r["loop"] > 0 for r in rows)
    # the loop's dispatch is timed inside the loop, before its block
    assert all(0 < r["host"] <= r["loop"] for r in rows)
    text = out.read_text()
    assert "| M | bf16 | int4 |" in text and "bench_model.py" in text
    # the bytes a step reads: bf16 weights (2 bytes a parameter) and the bf16 KV cache
    cfg = bench_model.TINY
    b, _ = cfg.batch(8)
    n_params = sum(x.size for x in jax.tree.leaves(bench_model.init_params(cfg, jax.random.key(0))))
    cache = 2 * cfg.layers * b * cfg.kv_heads * cfg.context * cfg.head_dim * 2
    by = {r["fmt"]: r["step_bytes"] for r in rows}
    assert by["bf16"] == 2 * n_params + cache
    assert cache < by["int4"] < cache + 0.6 * n_params  # 4-bit codes and their scales
    assert f"| 8 | {by['bf16'] / 1e6:.1f} MB | {by['int4'] / 1e6:.1f} MB (" in text


def test_bench_model_heading_carries_xla_flags(tmp_path, monkeypatch):
    # XLA_FLAGS change the step's graph (docs/benchmarks.md): a result must say which it ran
    # with. (Read when the results are written, after the backend started: no effect here.)
    out = tmp_path / "RESULTS.md"
    flags = "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
    monkeypatch.setenv("XLA_FLAGS", flags)
    bench_model.main(["--tiny", "--ms", "1", "--iters", "1", "--formats", "int4",
                      "--no-kernel-sum", "--results", str(out)])
    assert f"`XLA_FLAGS={flags} python3 benchmarks/bench_model.py --tiny" in out.read_text()


def _tiny():
    """The tiny model at M = 8: (cfg, bf16 params, KV cache, x, the jitted step)."""
    cfg = bench_model.TINY
    params = bench_model.init_params(cfg, jax.random.key(0))
    b, t = cfg.batch(8)
    cache = bench_model.init_cache(cfg, b, jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (b, t, cfg.hidden), jnp.bfloat16)
    return cfg, params, cache, x, jax.jit(lambda p, c, x: bench_model.step(cfg, p, c, x))


def test_decoder_step_quantized_close_to_bf16():
    cfg, params, cache, x, step = _tiny()
    ref = np.asarray(step(params, cache, x), np.float32)
    q = bench_model.quantized(params, "nvfp4")
    assert isinstance(q["layers"][0]["wq"]["kernel"], jf.QArray)
    got = np.asarray(step(q, cache, x), np.float32)
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    # RTN nvfp4 moves each projection by ~10%; a wrong layout or scale would move the
    # output by ~100% (the distance between unrelated outputs)
    assert np.isfinite(got).all() and rel < 0.3, rel


def test_fused_projections_is_the_same_model():
    # --fused: q / k / v and gate / up concatenated into one kernel each; the step must
    # compute the same function (bf16: the same dots over the same columns)
    cfg, params, cache, x, step = _tiny()
    fused = bench_model.fuse_projections(params)
    layer = fused["layers"][0]
    assert {"wq", "wk", "wv", "w_gate", "w_up"}.isdisjoint(layer)
    assert layer["wqkv"]["kernel"].shape == (cfg.hidden, (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim)
    assert layer["w_gate_up"]["kernel"].shape == (cfg.hidden, 2 * cfg.ffn)
    ref = np.asarray(step(params, cache, x), np.float32)
    got = np.asarray(step(fused, cache, x), np.float32)
    # bf16 outputs of differently tiled dots differ by an ulp here and there (~0.4%); a
    # wrong split of the fused outputs moves the result by ~100%
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-2
    # and a fused 4-bit model runs through jax_fp4's matmul
    q = bench_model.quantized(fused, "int4")
    assert isinstance(q["layers"][0]["wqkv"]["kernel"], jf.QArray)
    got = np.asarray(step(q, cache, x), np.float32)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.3


def test_grouped_step_is_the_same_model(tmp_path):
    # --group: the step under jax_fp4.group_matmuls: q / k / v and gate / up of each layer
    # one grouped call each (o and down stay single); on CPU each weight of a group runs
    # as before, so the step's output is the same bit for bit
    cfg, params, cache, x, _ = _tiny()
    q = bench_model.quantized(params, "nvfp4")
    step = lambda p, c, x: bench_model.step(cfg, p, c, x)  # noqa: E731
    grouped = jf.group_matmuls(step)
    eqns = jax.make_jaxpr(grouped)(q, cache, x).jaxpr.eqns
    sizes = [(len(e.invars) - 1) // 4 for e in eqns if e.primitive.name == "jax_fp4_weight_matmul_group"]
    assert sizes == [3, 2] * cfg.layers
    assert sum(e.primitive.name == "jax_fp4_weight_matmul" for e in eqns) == 2 * cfg.layers
    np.testing.assert_array_equal(np.asarray(jax.jit(grouped)(q, cache, x), np.float32),
                                  np.asarray(jax.jit(step)(q, cache, x), np.float32))
    rows = bench_model.main(["--tiny", "--ms", "4", "--iters", "2", "--formats", "int4",
                             "--group", "--no-kernel-sum", "--results", str(tmp_path / "R.md")])
    assert [r["fmt"] for r in rows] == ["bf16", "int4", "int4+group"]
    assert "| M | bf16 | int4 | int4+group |" in (tmp_path / "R.md").read_text()


def test_scanned_layers_is_the_same_model():
    # --scan: the layers' parameters and caches stacked and run under lax.scan; the same
    # function per layer (bf16 and 4-bit: quantize_params(stacked=True) quantizes each
    # layer as the list's quantize_params does), and far fewer arrays to dispatch
    cfg, params, cache, x, step = _tiny()
    b = x.shape[0]
    stacked, scache = bench_model.stack_layers(params), bench_model.stack_cache(cache)
    assert stacked["layers"]["wq"]["kernel"].shape == (cfg.layers, cfg.hidden,
                                                       cfg.heads * cfg.head_dim)
    assert scache[0].shape == (cfg.layers, b, cfg.kv_heads, cfg.context, cfg.head_dim)
    for fmt in ("bf16", "nvfp4"):
        listed, scanned = bench_model.quantized(params, fmt), bench_model.quantized(stacked, fmt)
        ref = np.asarray(step(listed, cache, x), np.float32)
        got = np.asarray(step(scanned, scache, x), np.float32)
        # the same dots per layer; bf16 roundings of differently fused code may differ by
        # an ulp here and there, a wrong layer or cache order moves the output by ~100%
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-2, fmt
        assert (len(jax.tree.leaves((scanned, scache))) * cfg.layers // 2
                < len(jax.tree.leaves((listed, cache))))
    q = bench_model.quantized(stacked, "nvfp4")["layers"]["wq"]["kernel"]
    assert isinstance(q, jf.QArray) and q.tensor_scale.shape == (cfg.layers,)


def test_bench_model_scan_runs_and_rejects_several_devices(tmp_path, capsys):
    rows = bench_model.main(["--tiny", "--scan", "--ms", "4", "--iters", "2", "--formats",
                             "int4", "--no-kernel-sum", "--results", str(tmp_path / "r.md")])
    assert {(r["fmt"], r["m"]) for r in rows} == {("bf16", 4), ("int4", 4)}
    with pytest.raises(SystemExit) as e:
        bench_model.main(["--tiny", "--scan", "--tp", "2", "--no-append"])
    assert e.value.code == 2
    assert "--scan runs on one device: got --tp [2]" in capsys.readouterr().err


def test_bench_model_fused_rejects_several_devices(capsys):
    with pytest.raises(SystemExit) as e:
        bench_model.main(["--tiny", "--fused", "--tp", "1", "2", "--no-append"])
    assert e.value.code == 2
    assert "--fused runs on one device: got --tp [1, 2]" in capsys.readouterr().err


def test_attention_is_softmax_over_cache_and_new_tokens():
    # the two-part softmax against one softmax over the concatenated keys (float32, CPU):
    # new token i sees the whole cache and new tokens 0..i
    cfg = bench_model.TINY
    b, t, s, d = 3, 4, cfg.context, cfg.head_dim
    k = jax.random.split(jax.random.key(3), 5)
    q = jax.random.normal(k[0], (b, t, cfg.heads, d))
    k_new, v_new = (jax.random.normal(kk, (b, t, cfg.kv_heads, d)) for kk in k[1:3])
    k_cache, v_cache = (jax.random.normal(kk, (b, cfg.kv_heads, s, d)) for kk in k[3:5])
    got = bench_model.attention(cfg, q, k_new, v_new, k_cache, v_cache)
    r = cfg.heads // cfg.kv_heads
    keys = jnp.repeat(jnp.concatenate([k_cache, k_new.transpose(0, 2, 1, 3)], 2), r, 1)
    vals = jnp.repeat(jnp.concatenate([v_cache, v_new.transpose(0, 2, 1, 3)], 2), r, 1)
    scores = jnp.einsum("bthd,bhsd->bhts", q, keys) / np.sqrt(d)
    visible = jnp.arange(s + t)[None, :] <= s + jnp.arange(t)[:, None]
    p = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    want = jnp.einsum("bhts,bhsd->bthd", p, vals).reshape(b, t, -1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs two devices of the default backend "
                    "(CI's CPU run has 8, tests/conftest.py; a one-GPU machine has one)")
def test_bench_model_one_and_two_devices_in_one_run(tmp_path):
    # --tp 1 2 --fsdp 2: every layout measured in the same run, each with its collectives
    out = tmp_path / "RESULTS.md"
    rows = bench_model.main(["--tiny", "--ms", "4", "--iters", "1", "--formats", "nvfp4",
                             "--tp", "1", "2", "--fsdp", "2", "--no-kernel-sum",
                             "--results", str(out)])
    by = {(r["layout"], r["fmt"]): r for r in rows}
    assert set(by) == {(lay, f) for lay in (("tp", 1), ("tp", 2), ("fsdp", 2))
                       for f in ("bf16", "nvfp4")}
    assert by[("tp", 1), "nvfp4"]["coll"] == {}
    # Megatron: one all-reduce per attention block and one per MLP, nothing else (the 4-bit
    # step's in jax-fp4's in-graph all-reduce on GPUs with peer access)
    layers = bench_model.TINY.layers
    for f in ("bf16", "nvfp4"):
        coll = by[("tp", 2), f]["coll"]
        assert set(coll) in ({"all-reduce"}, {"in-graph all-reduce"}), coll
        assert sum(n for n, _ in coll.values()) == 2 * layers
        assert set(by[("fsdp", 2), f]["coll"]) == {"all-gather"}
    assert set(by[("tp", 2), "bf16"]["coll"]) == {"all-reduce"}
    # FSDP gathers the 4-bit weights packed: far fewer bytes than the bf16 ones
    gathered = {f: by[("fsdp", 2), f]["coll"]["all-gather"][1] for f in ("bf16", "nvfp4")}
    assert gathered["nvfp4"] * 3 < gathered["bf16"], gathered
    text = out.read_text()
    for part in ("**1 device**", "**TP=2**", "**FSDP=2**", "**Speed-up over one device**",
                 "| TP=2 | 4 |", "| FSDP=2 | 4 |"):
        assert part in text, part


def test_step_overhead_loop_diagnostics():
    # step_overhead.py's decode loop inside the jit and the loop trace: the per-step times,
    # each call's return time, and the host's events, the executable's run once per step
    import step_overhead

    cfg, params, cache, x, step = _tiny()
    p = bench_model.quantized(params, "int4")
    assert step_overhead.jit_loop(functools.partial(bench_model.step, cfg), (p, cache, x),
                                  iters=3, loops=1) > 0
    events, traced, returns = step_overhead.loop_trace(step, (p, cache, x), iters=4)
    assert traced > 0 and len(returns) == 4 and all(r > 0 for r in returns)
    run = events["CommonPjRtLoadedExecutable::ExecuteHelperOnSingleDevice"]
    assert run[0] == pytest.approx(1.0) and run[1] > 0
