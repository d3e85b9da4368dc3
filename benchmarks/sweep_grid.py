"""Device time of the fused W4A16 kernel over its grid choices (tile_m, K-splits), forced
one at a time, against the size rule's own choice and bf16 ``jnp.dot`` -- the
measurement behind jax_fp4.prims._launch_plan.wmatmul_grid's split limits.

Same method as bench_matmul.py (one jitted function over R distinct weights, GPU kernel
time from the profiler / R); each row gives the total, which includes XLA's sum of the
float32 partials as a kernel of its own, and the fused kernel's time alone ("kernel"): in a
model XLA fuses that sum into the matmul's consumer (RoPE, SwiGLU, the residual add), so
the kernel's own time is what a K-split costs there. `--prepared`: weights as
`jax_fp4.nn.quantize_params` stores them by default (two-level nvfp4, the prepared
layout). BENCH_BREAKDOWN=1 prints the time per kernel.

  python benchmarks/sweep_grid.py --shapes 4096x4096 8192x8192 --ms 1 16 \
      --formats nvfp4 nf4 --splits 1 2 4 8 16 [--prepared]
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

import jax_fp4 as jf
from jax_fp4.prims import _gpu, _launch_plan

sys.path.insert(0, os.path.dirname(__file__))
from bench_matmul import per_weight, timed, weight_bytes  # noqa: E402
from bench_quant import L2_BYTES, kernel_times  # noqa: E402


def quantized(w, fmt, prepared):
    """w as the sweep's weight: quantize's defaults, or quantize_params' (`prepared`)."""
    if not prepared:
        return jf.quantize(w, fmt, axis=0)
    return jf.prepare(jf.quantize(w, fmt, axis=0, tensor_scale="auto" if fmt == "nvfp4" else None))


def timed_parts(fn, args, r):
    """(all kernels, the fused W4A16 kernel alone) in seconds per weight."""
    times = kernel_times(fn, args)
    return (sum(times.values()) / r,
            sum(t for name, t in times.items() if "wmatmul" in name) / r)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="+", default=["4096x4096", "4096x14336", "14336x4096",
                                                    "8192x8192"])
    ap.add_argument("--ms", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--formats", nargs="+", default=["nvfp4"])
    ap.add_argument("--splits", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--prepared", action="store_true",
                    help="two-level nvfp4 in the prepared layout (quantize_params' defaults)")
    args = ap.parse_args(argv)
    key = jax.random.key(0)
    rule = _launch_plan.wmatmul_grid
    gpu = _gpu.gpu_props()
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        r = min(32, max(4, -(-4 * L2_BYTES // weight_bytes("nvfp4", k, n))))
        ws = [jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.bfloat16) * 0.02
              for i in range(r)]
        for m in args.ms:
            x = jax.random.normal(jax.random.fold_in(key, 1000 + m), (m, k), jnp.bfloat16)
            t_bf16 = timed(per_weight(jnp.matmul, 1), (x, *ws), r)
            tile, s_rule = rule(m, n, k, gpu.wgmma, gpu.sm_count)
            print(f"{shape:11s} M={m:4d} bf16 {t_bf16 * 1e6:8.1f} us; rule: tile {tile}, "
                  f"splits {s_rule}", flush=True)
            steps = -(-k // 128)
            for fmt in args.formats:
                qs = [quantized(w, fmt, args.prepared) for w in ws]
                for s in args.splits:
                    if s > steps or not _launch_plan.splits_fill_steps(steps, s):
                        continue
                    _launch_plan.wmatmul_grid = lambda *a, s=s, **kw: (rule(*a, **kw)[0], s)
                    try:
                        t, t_kernel = timed_parts(per_weight(jf.matmul, 1), (x, *qs), r)
                    finally:
                        _launch_plan.wmatmul_grid = rule
                    mark = " (rule)" if s == s_rule else ""
                    print(f"{shape:11s} M={m:4d} {fmt:6s} S={s:3d} {t * 1e6:8.1f} us "
                          f"(kernel {t_kernel * 1e6:8.1f} us) x{t_bf16 / t:5.2f} vs bf16{mark}",
                          flush=True)
                del qs
        del ws


if __name__ == "__main__":
    main()
