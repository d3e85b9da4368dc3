"""Device time of W4A16 matmul and block-scaled matmul on the GPU vs bf16 ``jnp.dot``.

Method (docs/benchmarks.md): one jitted function runs the op on R distinct weights
(together larger than L2); its GPU time (the kernels' durations in the JAX profiler's
device trace over 5 calls, bench_quant.device_time) / R; in the same run the baselines:
bf16 ``jnp.dot`` on bf16 weights, the jitted jnp reference (dequantize + dot), the
weight-bytes floor (weight + scale bytes / the measured copy roof) and, for the
block-scaled matmul, ``jax.nn.scaled_dot_general`` (nvfp4, mxfp8; it quantizes its bf16
operands itself, as its users call it). Prints markdown tables and appends them to
RESULTS.md.

  python benchmarks/bench_matmul.py [--shapes 8192x28672 28672x8192] [--ms 1 16 64]
      [--formats nvfp4 mxfp4 nf4 int4] [--scaled 4096 8192] [--rule-ms 256 512 1024]
      [--x-dtype float16] [--tensor-scale] [--fresh-x]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re
import sys

import jax
import jax.numpy as jnp

import jax_fp4 as jf
from jax_fp4.prims import _gpu, _launch_plan

sys.path.insert(0, os.path.dirname(__file__))
from bench_quant import L2_BYTES, copy_roof, device_time  # noqa: E402

LLAMA_SHAPES = ["4096x4096", "4096x14336", "14336x4096", "8192x8192", "8192x28672",
                "28672x8192"]


def weight_bytes(fmt, k, n, int4_scale_bytes=2):
    if fmt == "bf16":
        return 2 * k * n
    f = jf.get_format(fmt)
    nb = k * n // f.default_block
    sbytes = 4 if f.family == "codebook" else (int4_scale_bytes if f.family == "int4" else 1)
    return k * n * f.bits // 8 + nb * sbytes + (nb if f.family == "int4" else 0)


def path_of(fn, args):
    """Which W4A16 path the lowered computation takes (fused: which kernel family)."""
    text = fn.lower(*args).as_text()
    if "jax_fp4_wmatmul_v3" in text:
        m = re.search(r"tile_m = (\d+)", text)
        return "fused mma" if m is None or m.group(1) == "0" else f"fused wgmma{m.group(1)}"
    return "dequant+dot" if "jax_fp4_dequantize_v1" in text else "reference"


def timed(fn, args, r):
    try:
        return device_time(fn, args) / r
    except Exception as e:  # e.g. a reference that does not fit: say so, go on
        print(f"#   {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return float("nan")


def per_weight(op, nx):
    """One jitted function applying op(x, w) to each weight of (*xs, *ws): the nx
    activations in turn (nx = 1: one x shared by every weight)."""
    return jax.jit(lambda *a: [op(a[i % nx], w) for i, w in enumerate(a[nx:])])


def bench_w4a16(args, roof, rows):
    key = jax.random.key(0)
    int4_sbytes = jnp.dtype(args.int4_scale_dtype or args.x_dtype).itemsize

    def options(fmt):  # quantize's options for fmt from the command line
        if fmt == "nvfp4" and args.tensor_scale:
            return {"tensor_scale": "auto"}
        if fmt == "int4" and args.int4_scale_dtype:
            return {"scale_dtype": args.int4_scale_dtype}
        return {}

    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        r = min(32, max(4, -(-4 * L2_BYTES // weight_bytes("nvfp4", k, n))))
        ws = [jax.random.normal(jax.random.fold_in(key, i), (k, n), args.x_dtype) * 0.02
              for i in range(r)]
        qs = {fmt: [jf.quantize(w, fmt, axis=0, **options(fmt)) for w in ws] for fmt in args.formats}
        if args.prepare:  # the same weights in the prepared layout, where it applies
            for fmt in args.formats:
                prep = [jf.prepare(q) for q in qs[fmt]]
                if prep[0].scale_layout == "tiled":
                    qs[f"{fmt} prepared"] = prep
        for m in args.ms:
            # one x for all R weights (XLA lays it out for the wgmma kernel once), or with
            # --fresh-x one per weight, as consecutive layers see: each pays its own layout
            xs = [jax.random.normal(jax.random.fold_in(key, 1000 * m + i), (m, k), args.x_dtype)
                  for i in range(r if args.fresh_x else 1)]
            nx = len(xs)
            t_bf16 = timed(per_weight(jnp.matmul, nx), (*xs, *ws), r)
            floor_bf16 = weight_bytes("bf16", k, n) / roof
            print(f"{shape:11s} M={m:5d} bf16 {t_bf16 * 1e6:9.1f} us", flush=True)
            for fmt in qs:
                fn = per_weight(jf.matmul, nx)
                t = timed(fn, (*xs, *qs[fmt]), r)
                path = path_of(fn, (*xs, *qs[fmt]))
                t_ref = float("nan")
                if fmt in args.reference_formats and m in args.reference_ms:
                    jf.set_backend("reference")
                    t_ref = timed(per_weight(jf.matmul, nx), (*xs, *qs[fmt]), r)
                    jf.set_backend("auto")
                floor = weight_bytes(fmt.split()[0], k, n, int4_sbytes) / roof
                rows.append((shape, m, fmt, path, t * 1e6, t_bf16 * 1e6, t_bf16 / t,
                             floor_bf16 / floor, t_ref / t, 100 * floor / t))
                print(f"{shape:11s} M={m:5d} {fmt:8s} {path:11s} {t * 1e6:9.1f} us  "
                      f"x{t_bf16 / t:5.2f} vs bf16 (ideal x{floor_bf16 / floor:4.2f})  "
                      f"x{t_ref / t:6.1f} vs ref  {100 * floor / t:5.1f}% of floor", flush=True)
            # the size rule: the W4A16 paths side by side at this M, each forced
            if m in args.rule_ms:
                for fmt in qs:
                    bench_rule(shape, m, fmt, xs, qs[fmt], r, t_bf16, rows)
        del ws, qs


def bench_rule(shape, m, fmt, xs, q, r, t_bf16, rows):
    """One format at one M on each W4A16 path: wgmma kernel, mma.sync kernel, dequantize
    + dot (rows labelled 'FMT (rule)')."""
    tuning, props = _launch_plan.TUNING, _gpu.gpu_props
    real = props()
    try:
        for label, limit, wgmma in (("fused wgmma", 1 << 30, True), ("fused mma", 1 << 30, False),
                                    ("dequant+dot", 0, False)):
            if wgmma and not real.wgmma:
                continue
            _launch_plan.TUNING = dataclasses.replace(
                tuning, max_m_mma_sync=limit, max_m_wgmma_folded=limit,
                max_m_wgmma=dict.fromkeys(tuning.formats, limit), max_m_wgmma_decode={})
            _gpu.gpu_props = lambda ctx=None, cc=9 if wgmma else 8: _gpu.GpuProps(cc, real.sm_count)
            t = timed(per_weight(jf.matmul, len(xs)), (*xs, *q), r)
            rows.append((shape, m, f"{fmt} (rule)", label, t * 1e6, t_bf16 * 1e6,
                         t_bf16 / t, float("nan"), float("nan"), float("nan")))
            print(f"{shape:11s} M={m:5d} {fmt} rule {label:11s} {t * 1e6:9.1f} us "
                  f"x{t_bf16 / t:5.2f} vs bf16", flush=True)
    finally:
        _launch_plan.TUNING, _gpu.gpu_props = tuning, props


def bench_scaled(args, rows):
    key = jax.random.key(1)
    dn = (((1,), (1,)), ((), ()))
    for size in args.scaled:
        m = n = k = size
        r = 2
        xs = [jax.random.normal(jax.random.fold_in(key, i), (m, k), jnp.bfloat16) for i in range(r)]
        ws = [jax.random.normal(jax.random.fold_in(key, 100 + i), (n, k), jnp.bfloat16)
              for i in range(r)]
        flops = 2.0 * m * n * k
        t_bf16 = timed(jax.jit(lambda *v: [a @ b.T for a, b in zip(v[:r], v[r:])]),
                       (*xs, *ws), r)
        for a_fmt, b_fmt, sdg in (("nvfp4", "nvfp4", "nvfp4"), ("mxfp8_e4m3", "mxfp8_e4m3", "mxfp8"),
                                  ("mxfp4", "mxfp4", None), ("mxfp6_e2m3", "mxfp8_e4m3", None)):
            kw = {"tensor_scale": "auto"} if a_fmt == "nvfp4" else {}
            qa = [jf.quantize(x, a_fmt, axis=1, **kw) for x in xs]
            qb = [jf.quantize(w, b_fmt, axis=1, **kw) for w in ws]
            t = timed(jax.jit(lambda *q: [jf.scaled_matmul(a, b) for a, b in zip(q[:r], q[r:])]),
                      (*qa, *qb), r)
            t_sdg = float("nan")
            if sdg:
                cfg = jax.nn.get_scaled_dot_general_config(sdg)
                t_sdg = timed(jax.jit(lambda *v: [
                    jax.nn.scaled_dot_general(a, b, dn, preferred_element_type=jnp.bfloat16,
                                              configs=[cfg, cfg, cfg])
                    for a, b in zip(v[:r], v[r:])]), (*xs, *ws), r)
            rows.append((f"{m}x{n}x{k}", f"{a_fmt} x {b_fmt}", t * 1e6, flops / t / 1e12,
                         100 * t_bf16 / t, flops / t_bf16 / 1e12, t_sdg / t))
            print(f"{size:6d}^3 {a_fmt} x {b_fmt}: {t * 1e6:9.1f} us {flops / t / 1e12:6.0f} "
                  f"TFLOP/s = {100 * t_bf16 / t:5.1f}% of bf16 ({flops / t_bf16 / 1e12:.0f}); "
                  f"x{t_sdg / t:5.2f} vs scaled_dot_general", flush=True)
            del qa, qb


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="+", default=LLAMA_SHAPES, help="KxN weight shapes")
    ap.add_argument("--ms", nargs="+", type=int, default=[1, 4, 16, 64, 256, 1024, 4096])
    ap.add_argument("--formats", nargs="+", default=["nvfp4", "mxfp4", "nf4", "bnb_fp4", "int4"])
    ap.add_argument("--reference-formats", nargs="*", default=["nvfp4"])
    ap.add_argument("--reference-ms", nargs="*", type=int, default=[1, 16])
    ap.add_argument("--rule-ms", nargs="*", type=int, default=[256, 512, 1024])
    ap.add_argument("--scaled", nargs="*", type=int, default=[2048, 4096, 8192],
                    help="M = N = K sizes of the block-scaled matmul")
    ap.add_argument("--x-dtype", default="bfloat16", choices=["bfloat16", "float16"],
                    help="dtype of x and of the baseline's weights (W4A16)")
    ap.add_argument("--fresh-x", action="store_true",
                    help="a distinct x per weight (W4A16), so each call lays out its own x")
    ap.add_argument("--tensor-scale", action="store_true",
                    help="nvfp4 weights with their fp32 per-tensor scale (two-level)")
    ap.add_argument("--int4-scale-dtype", choices=["float32", "bfloat16", "float16"],
                    help="int4 scale dtype (default x's dtype: the bit decode; float16 with "
                         "bfloat16 x: the split-scale bit decode; another: the table decode)")
    ap.add_argument("--prepare", action="store_true",
                    help="also each format's weights through jax_fp4.prepare (W4A16), where "
                         "it applies (jax_fp4.layout.tileable)")
    ap.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "RESULTS.md"))
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    roof = copy_roof() * 1e9  # bytes / s
    w_rows, s_rows = [], []
    bench_w4a16(args, roof, w_rows)
    bench_scaled(args, s_rows)
    note = (f"\n## W4A16 and block-scaled matmul ({datetime.date.today()})\n\n"
            f"Command: `python benchmarks/bench_matmul.py {' '.join(argv or sys.argv[1:])}`; "
            f"GPU: {dev.device_kind}; jax {jax.__version__}; copy roof {roof / 1e9:.0f} GB/s. "
            "Device time per call = GPU kernel time (JAX profiler device trace, 5 calls) of one "
            "jitted function running the op on R distinct weights (together > L2), divided by "
            f"R. x {args.x_dtype} (M, K), {'one per weight' if args.fresh_x else 'one for all R'}; weight "
            "(K, N) blocked along K. 'ideal' = bf16 weight bytes / 4-bit weight + scale bytes; "
            "'% of floor' = (weight + scale bytes / copy roof) / time.\n\n")
    table = ("| K x N | M | weight | path | time (us) | bf16 dot (us) | x vs bf16 | ideal x | "
             "x vs jnp ref | % of bytes floor |\n|---|---:|---|---|---:|---:|---:|---:|---:|---:|\n")
    table += "".join(f"| {s} | {m} | {f} | {p} | {t:.1f} | {b:.1f} | {x:.2f} | {i:.2f} | "
                     f"{xr:.1f} | {fl:.0f} |\n".replace("nan", "-")
                     for s, m, f, p, t, b, x, i, xr, fl in w_rows)
    if s_rows:  # --scaled with no sizes: no block-scaled table
        table += ("\n| M x N x K | A x B | time (us) | TFLOP/s | % of bf16 jnp.dot | "
                  "bf16 TFLOP/s | x vs jax.nn.scaled_dot_general |\n"
                  "|---|---|---:|---:|---:|---:|---:|\n")
    table += "".join(f"| {s} | {f} | {t:.1f} | {tf:.0f} | {p:.1f} | {bt:.0f} | {xs:.2f} |\n"
                     .replace("nan", "-") for s, f, t, tf, p, bt, xs in s_rows)
    print("\n" + note + table)
    with open(args.results, "a") as fh:
        fh.write(note + table)


if __name__ == "__main__":
    main()
