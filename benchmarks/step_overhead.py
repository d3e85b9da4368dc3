"""Where a decoder step's wall time goes outside the kernels (diagnostic for bench_model).

For bf16 and each format at one M: the host's dispatch time of one call (until the call
returns, before the GPU finishes), the blocked wall time, a decode loop
(bench_model.wall_times), steps on the same inputs back to back with every output kept,
the kernel sum, the longest kernels, the GPU events per step, and the profiler's host-side events that name a command
buffer or CUDA graph (XLA converts thunk sequences into command buffers after HLO
optimisation, so the compiled HLO text never shows them). Run it under different XLA_FLAGS
to compare, e.g. `--xla_gpu_enable_command_buffer=` (none) against XLA's default.

  python benchmarks/step_overhead.py [--m 1] [--formats nvfp4 int4] [--layers 8] [--no-trace]
      [--jit-loop] [--loop-trace] [--group] [--launches]

`--group`: every step under `jax_fp4.group_matmuls` (q / k / v and gate / up of each layer
as one W4A16 call each; bf16's step is unchanged by it). `--launches`: each W4A16 launch
of a layer in stream order, its kernel time and the GPU's idle time before it, averaged
over the layers (per-shape efficiency against the bytes it reads).

`--jit-loop` adds the decode loop written inside the jit (`lax.fori_loop` over the steps:
one call, one host dispatch, per 30 tokens): the GPU's pace, and by difference the host's
part of a Python decode loop. `--loop-trace` adds each call's return time in a Python
decode loop (calls returning at the loop's pace: the host sets it) and a profiler trace
of that loop with XLA's command buffers kept on (under a profiler XLA otherwise runs the
thunks one by one): the host's events per step, XLA's command-buffer update and launch
(`cuGraphLaunch`) and the argument handling among them.
"""
import argparse
import collections
import functools
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import jax_fp4 as jf

sys.path.insert(0, os.path.dirname(__file__))
import bench_model  # noqa: E402
import bench_quant  # noqa: E402

_GRAPH = re.compile(r"graph|command.?buffer", re.I)
# GPU kernels that compute a projection's matmul (cuBLAS / cuBLASLt, XLA's Triton GEMMs,
# jax-fp4's W4A16 kernels); everything else (attention, norms, layouts, copies) is "other"
_MATMUL = re.compile(r"gemm|gemv|nvjet|cutlass|wmatmul|sm90_xmma|triton_gemm", re.I)


def trace_events(fn, args, calls=5):
    """(GPU stream events per call, seconds per call of the GPU events that are matmul
    kernels (_MATMUL), {host event name matching _GRAPH: count per call}, {host event
    name: microseconds per call} of the longest host events, {GPU kernel name: (count,
    microseconds) per call} of the longest kernels) from a JAX profiler trace of `calls`
    blocked calls."""
    jax.block_until_ready(fn(*args))
    _, planes, _ = bench_quant.profile(
        lambda: [jax.block_until_ready(fn(*args)) for _ in range(calls)])
    n_gpu, mm_ns, graph, host_us = 0, 0.0, collections.Counter(), collections.Counter()
    kern_us, kern_n = collections.Counter(), collections.Counter()
    for plane in planes:
        gpu = plane.name.startswith("/device:GPU")
        for line in plane.lines:
            for e in line.events:
                if gpu and line.name.startswith("Stream"):
                    n_gpu += 1
                    mm_ns += e.duration_ns if _MATMUL.search(e.name) else 0
                    kern_us[e.name[:60]] += e.duration_ns / 1e3 / calls
                    kern_n[e.name[:60]] += 1 / calls
                elif not gpu:
                    host_us[e.name[:70]] += e.duration_ns / 1e3 / calls
                    if _GRAPH.search(e.name):
                        graph[e.name[:60]] += 1
    return (n_gpu / calls, mm_ns * 1e-9 / calls, {k: v / calls for k, v in graph.most_common(6)},
            dict(host_us.most_common(14)),
            {k: (kern_n[k], us) for k, us in kern_us.most_common(16)})


def w4a16_launches(fn, args, per_layer, calls=5):
    """[(microseconds, gap in microseconds)] per W4A16 launch of one layer, in stream order,
    averaged over the layers and `calls` blocked calls of a profiler trace: each launch's
    kernel time and the GPU's idle time between the end of the stream's previous kernel and
    its start (what a launch costs beyond its own work)."""
    jax.block_until_ready(fn(*args))
    _, planes, _ = bench_quant.profile(
        lambda: [jax.block_until_ready(fn(*args)) for _ in range(calls)])
    got = []
    for plane in planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            events = sorted(line.events, key=lambda e: e.start_ns)
            for prev, e in zip(events, events[1:]):
                if "wmatmul" in e.name:
                    got.append((e.duration_ns / 1e3, max(0.0, (e.start_ns - prev.end_ns) / 1e3)))
    sums = [[0.0, 0.0, 0] for _ in range(per_layer)]
    for i, (us, gap) in enumerate(got):
        acc = sums[i % per_layer]
        acc[0] += us
        acc[1] += gap
        acc[2] += 1
    return [(us / n, gap / n) for us, gap, n in sums if n]


def loop_trace(fn, args, iters=20):
    """({host event name: (count, microseconds) per step}, longest first, of a profiler
    trace of a decode loop (bench_model.wall_times' loop: each step's output the next one's
    x, one block at the end), the loop's wall time per step under the trace, the seconds
    each call of an untraced loop took to return: whether the host runs ahead of the GPU
    or is held to its pace)."""
    p, c, x = args
    y = x
    for _ in range(3):
        y = fn(p, c, y)
    jax.block_until_ready(y)
    returns, y = [], x
    for _ in range(iters):
        t0 = time.perf_counter()
        y = fn(p, c, y)
        returns.append(time.perf_counter() - t0)
    jax.block_until_ready(y)
    def loop():
        t0, y = time.perf_counter(), x
        for _ in range(iters):
            y = fn(p, c, y)
        jax.block_until_ready(y)
        return (time.perf_counter() - t0) / iters

    wall, planes, _ = bench_quant.profile(loop)
    us, n = collections.Counter(), collections.Counter()
    for plane in planes:
        if plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            for e in line.events:
                us[e.name[:70]] += e.duration_ns / 1e3 / iters
                n[e.name[:70]] += 1 / iters
    return {k: (n[k], v) for k, v in us.most_common()}, wall, returns


def jit_loop(step, args, iters=30, loops=3):
    """Seconds per step of `iters` decode steps (step(params, cache, x)) inside one jitted
    `lax.fori_loop` (each step's output the next one's x), median of `loops` calls: the
    GPU's pace without a host dispatch per step."""
    p, c, x = args
    fn = jax.jit(lambda p, c, x: jax.lax.fori_loop(0, iters, lambda i, y: step(p, c, y), x))
    jax.block_until_ready(fn(p, c, x))
    ts = []
    for _ in range(loops):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(p, c, x))
        ts.append((time.perf_counter() - t0) / iters)
    return statistics.median(ts)


def back_to_back(fn, args, iters=30):
    """Wall time per step of `iters` calls on the same inputs dispatched back to back, every
    output kept alive until the end (unlike bench_model's decode loop, where only two
    outputs are alive)."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready([fn(*args) for _ in range(iters)])
    return (time.perf_counter() - t0) / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--formats", nargs="+", default=["nvfp4"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--no-trace", action="store_true",
                    help="skip the profiler (kernel sum, events): wall times only")
    ap.add_argument("--jit-loop", action="store_true",
                    help="also time the decode loop inside the jit (lax.fori_loop)")
    ap.add_argument("--loop-trace", action="store_true",
                    help="also trace the decode loop's host events, command buffers on")
    ap.add_argument("--group", action="store_true",
                    help="the step under jax_fp4.group_matmuls (q/k/v, gate/up one call each)")
    ap.add_argument("--launches", action="store_true",
                    help="also each W4A16 launch of a layer: kernel time and the idle gap before it")
    args = ap.parse_args()
    if args.loop_trace:  # read when the GPU client starts, i.e. at the first computation
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_enable_command_buffers_during_profiling=true")
    cfg = bench_model.Config(layers=args.layers)
    params = bench_model.init_params(cfg, jax.random.key(0))
    b, t = cfg.batch(args.m)
    cache = bench_model.init_cache(cfg, b, jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (b, t, cfg.hidden), jnp.bfloat16)
    step = functools.partial(bench_model.step, cfg)
    if args.group:
        step = jf.group_matmuls(step)
    fn = jax.jit(step)
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} M={args.m}"
          + (" (jax_fp4.group_matmuls)" if args.group else ""))
    for fmt in ["bf16", *args.formats]:
        fa = (bench_model.quantized(params, fmt), cache, x)
        wall, loop, _ = bench_model.wall_times(fn, fa, 30)
        piped = back_to_back(fn, fa)
        ds = []
        for _ in range(30):
            jax.block_until_ready(fn(*fa))
            t0 = time.perf_counter()
            r = fn(*fa)
            ds.append(time.perf_counter() - t0)
            jax.block_until_ready(r)
        ksum, n_gpu, mm, graph, host, kern = (float("nan"),) * 3 + ({}, {}, {})
        if not args.no_trace:
            ksum = bench_model.kernel_sum(fn, fa)
            try:
                n_gpu, mm, graph, host, kern = trace_events(fn, fa)
            except Exception as e:  # no profiler trace on this backend
                graph = {type(e).__name__: 0}
        print(f"{fmt:8s} dispatch {statistics.median(ds) * 1e3:7.3f} ms  wall {wall * 1e3:7.3f} ms  "
              f"back-to-back {piped * 1e3:7.3f} ms  decode loop {loop * 1e3:7.3f} ms  "
              f"kernels {ksum * 1e3:7.3f} ms (matmuls {mm * 1e3:.3f})  "
              f"GPU events/step {n_gpu:.0f}  graph events/step {graph}", flush=True)
        for name, us in host.items():
            print(f"#   host {us:9.1f} us/step  {name}", flush=True)
        for name, (n, us) in kern.items():
            print(f"#   kernel {us:8.1f} us/step  {n:5.1f}x  {name}", flush=True)
        if args.launches and fmt != "bf16":
            per_layer = 4 if args.group else 7  # q k v o gate up down; grouped: qkv o gu down
            for i, (us, gap) in enumerate(w4a16_launches(fn, fa, per_layer)):
                print(f"#   W4A16 launch {i} of each layer: {us:7.2f} us, idle before it "
                      f"{gap:6.2f} us", flush=True)
        if args.jit_loop:
            print(f"{fmt:8s} decode loop inside the jit {jit_loop(step, fa) * 1e3:7.3f} ms/step",
                  flush=True)
        if args.loop_trace:
            events, traced, returns = loop_trace(fn, fa)
            print(f"{fmt:8s} decode loop under the trace {traced * 1e3:7.3f} ms/step; each call of "
                  f"an untraced loop returned after (ms): "
                  + " ".join(f"{r * 1e3:.2f}" for r in returns), flush=True)
            for name, (n, us) in list(events.items())[:45]:  # the longest
                print(f"#   loop host {us:9.1f} us/step  {n:6.1f}x  {name}", flush=True)


if __name__ == "__main__":
    main()
