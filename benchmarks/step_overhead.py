"""Where a decoder step's wall time goes outside the kernels (diagnostic for bench_model).

For bf16 and each format at one M: the host's dispatch time of one call (until the call
returns, before the GPU finishes), the blocked wall time, steps back to back, the kernel
sum (profiler) and how many command buffers (CUDA graphs) XLA formed in the compiled step.
Run it under different XLA_FLAGS to compare (e.g. --xla_gpu_enable_command_buffer=).

  python benchmarks/step_overhead.py [--m 1] [--formats nvfp4 int4] [--layers 8]
"""
import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import bench_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--formats", nargs="+", default=["nvfp4"])
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    cfg = bench_model.Config(layers=args.layers)
    params = bench_model.init_params(cfg, jax.random.key(0))
    b, t = cfg.batch(args.m)
    cache = bench_model.init_cache(cfg, b, jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (b, t, cfg.hidden), jnp.bfloat16)
    fn = jax.jit(lambda p, c, x: bench_model.step(cfg, p, c, x))
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} M={args.m}")
    for fmt in ["bf16", *args.formats]:
        p = bench_model.quantized(params, fmt)
        fa = (p, cache, x)
        text = fn.lower(*fa).compile().as_text()
        n_cb = text.count("command_buffer")
        wall, piped = bench_model.wall_times(fn, fa, 30)
        ds = []
        for _ in range(30):
            jax.block_until_ready(fn(*fa))
            t0 = time.perf_counter()
            r = fn(*fa)
            ds.append(time.perf_counter() - t0)
            jax.block_until_ready(r)
        ksum = bench_model.kernel_sum(fn, fa)
        print(f"{fmt:8s} dispatch {statistics.median(ds) * 1e3:7.3f} ms  wall {wall * 1e3:7.3f} ms  "
              f"back-to-back {piped * 1e3:7.3f} ms  kernels {ksum * 1e3:7.3f} ms  "
              f"'command_buffer' in HLO: {n_cb}", flush=True)


if __name__ == "__main__":
    main()
