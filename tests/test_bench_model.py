"""The headline benchmark (benchmarks/bench_model.py) runs end to end on a small model, and
its decoder step with 4-bit weights stays close to the bf16 step."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp4 as jf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_model  # noqa: E402


def test_bench_model_tiny_runs(tmp_path):
    out = tmp_path / "RESULTS.md"
    rows = bench_model.main(["--tiny", "--ms", "8", "--iters", "2", "--formats", "int4",
                             "--results", str(out)])
    assert {(r["fmt"], r["m"]) for r in rows} == {("bf16", 8), ("int4", 8)}
    assert all(r["wall"] > 0 and r["piped"] > 0 for r in rows)
    text = out.read_text()
    assert "| M | bf16 | int4 |" in text and "bench_model.py" in text


def test_decoder_step_quantized_close_to_bf16():
    cfg = bench_model.TINY
    params = bench_model.init_params(cfg, jax.random.key(0))
    b, t = cfg.batch(8)
    cache = bench_model.init_cache(cfg, b, jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (b, t, cfg.hidden), jnp.bfloat16)
    step = jax.jit(lambda p, c, x: bench_model.step(cfg, p, c, x))
    ref = np.asarray(step(params, cache, x), np.float32)
    q = bench_model.quantized(params, "nvfp4")
    assert isinstance(q["layers"][0]["wq"]["kernel"], jf.QArray)
    got = np.asarray(step(q, cache, x), np.float32)
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    # RTN nvfp4 moves each projection by ~10%; a wrong layout or scale would move the
    # output by ~100% (the distance between unrelated outputs)
    assert np.isfinite(got).all() and rel < 0.3, rel
