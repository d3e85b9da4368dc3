"""The in-graph all-reduce (jax_fp4.prims.all_reduce) against XLA's psum on two GPUs.

One jitted shard_map step does CH rounds of (y * 0.5, sum over the two GPUs) on float32
vectors of N values per GPU: the row-parallel matmul's partial sums at decode sizes
(N = 4096: M = 1 of a 4096-wide output; 65536: M = 16). The step runs back to back, as a
decode loop does (best of 3 loops of 100 steps); the same step without the sums is
subtracted, and the rest divided by CH is the time per all-reduce. Then the profiler's
kernel durations of the in-graph kernel (median over 5 steps, per GPU).

    python3 benchmarks/bench_all_reduce.py [--n 4096 65536] [--rounds 16]
"""
import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_fp4.prims import all_reduce

sys.path.insert(0, os.path.dirname(__file__))
import bench_quant  # noqa: E402


def step(kind, mesh, rounds):
    def body(y):
        for _ in range(rounds):
            y = y * np.float32(0.5)
            if kind == "in-graph":
                s = all_reduce.in_graph_sum(y, mesh, ("model",), jnp.float32)
                if s is None:
                    raise SystemExit("the in-graph all-reduce does not apply on these GPUs")
                y = s
            elif kind == "psum":
                y = jax.lax.psum(y, "model")
        return y
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("model"), out_specs=P("model")))


def loop_seconds(f, y, steps=100):
    y = jax.block_until_ready(f(y))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        z = y
        for _ in range(steps):
            z = f(z)
        jax.block_until_ready(z)
        best = min(best, (time.perf_counter() - t) / steps)
    return best


def kernel_us(f, y, calls=5):
    jax.block_until_ready(f(y))

    def run(y=y):
        for _ in range(calls):
            y = f(y)
        return jax.block_until_ready(y)

    _, planes, _ = bench_quant.profile(run)
    out = {}
    for plane in planes:
        if plane.name.startswith("/device:GPU"):
            ns = [e.duration_ns for line in plane.lines if line.name.startswith("Stream")
                  for e in line.events if "all_reduce_kernel" in e.name]
            out[plane.name] = float(np.median(ns)) / 1e3 if ns else float("nan")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", nargs="+", type=int, default=[4096, 65536])
    ap.add_argument("--rounds", type=int, default=16)
    args = ap.parse_args(argv)
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        raise SystemExit(f"needs 2 GPUs, found {len(gpus)}")
    mesh = Mesh(np.array(gpus[:2]), ("model",))
    print(f"# {gpus[0].device_kind} x2, jax {jax.__version__}, {args.rounds} sums per step")
    for n in args.n:
        y = jax.device_put(np.ones(2 * n, np.float32), NamedSharding(mesh, P("model")))
        t = {k: loop_seconds(step(k, mesh, args.rounds), y) for k in ("none", "in-graph", "psum")}
        per = {k: (t[k] - t["none"]) / args.rounds * 1e6 for k in ("in-graph", "psum")}
        kern = kernel_us(step("in-graph", mesh, args.rounds), y)
        print(f"N = {n}: per all-reduce in-graph {per['in-graph']:.1f} us, psum {per['psum']:.1f} us"
              f" (step without sums {t['none'] * 1e6:.1f} us); in-graph kernel (median) "
              + ", ".join(f"{k[-5:]} {v:.1f} us" for k, v in kern.items()), flush=True)


if __name__ == "__main__":
    main()
