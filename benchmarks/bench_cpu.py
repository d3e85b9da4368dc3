"""CPU FFI kernels vs the jitted pure-jnp reference on XLA:CPU.

For quantize / dequantize / fake_quantize of nvfp4, mxfp4, mxfp8_e4m3, nf4 and int4 on a
(4096, 4096) float32 and bfloat16 input: median wall time of repeated jitted calls
(after warm-up, ``block_until_ready``), printed as a markdown table and appended to
benchmarks/RESULTS.md with the date, the command and the CPU model.

    python benchmarks/bench_cpu.py [--shape 4096 4096] [--repeats 5] [--no-append]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_fp4 import _ext
from jax_fp4 import reference as ref

FMT_IDS = {"nvfp4": 0, "mxfp4": 1, "mxfp6_e2m3": 2, "mxfp6_e3m2": 3, "mxfp8_e4m3": 4,
           "mxfp8_e5m2": 5, "nf4": 6, "bnb_fp4": 7, "int4": 8}
BITS = {"nvfp4": 4, "mxfp4": 4, "mxfp6_e2m3": 6, "mxfp6_e3m2": 6, "mxfp8_e4m3": 8,
        "mxfp8_e5m2": 8, "nf4": 4, "bnb_fp4": 4, "int4": 4}
BLOCK = {"nvfp4": 16, "mxfp4": 32, "mxfp8_e4m3": 32, "nf4": 64, "int4": 128}
FORMATS = ("nvfp4", "mxfp4", "mxfp8_e4m3", "nf4", "int4")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def _scale_dtype(fmt, x_dtype):
    if fmt == "int4":
        return x_dtype
    return jnp.float32 if fmt in ("nf4", "bnb_fp4") else jnp.uint8


def ffi_quantize(x, ts, fmt, bs):
    r, k = x.shape
    nb = k // bs
    out = (jax.ShapeDtypeStruct((r, k * BITS[fmt] // 8), jnp.uint8),
           jax.ShapeDtypeStruct((r, nb), _scale_dtype(fmt, x.dtype)),
           jax.ShapeDtypeStruct((r, nb) if fmt == "int4" else (0,), jnp.uint8))
    return jax.ffi.ffi_call("jax_fp4_quantize_v1", out)(
        x, ts, fmt=np.int32(FMT_IDS[fmt]), block_size=np.int64(bs), rceil=np.int32(0),
        two_level=np.int32(0))


def ffi_dequantize(codes, scales, zeros, ts, fmt, bs, k, dtype):
    return jax.ffi.ffi_call("jax_fp4_dequantize_v1", jax.ShapeDtypeStruct((codes.shape[0], k), dtype))(
        codes, scales, zeros, ts, fmt=np.int32(FMT_IDS[fmt]), block_size=np.int64(bs),
        two_level=np.int32(0))


def ffi_fake_quantize(x, ts, fmt, bs):
    return jax.ffi.ffi_call("jax_fp4_fake_quantize_v1", jax.ShapeDtypeStruct(x.shape, x.dtype))(
        x, ts, fmt=np.int32(FMT_IDS[fmt]), block_size=np.int64(bs), rceil=np.int32(0),
        two_level=np.int32(0))


def timeit(fn, args, repeats, warmup=2):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def _loadavg() -> str:
    try:
        return "/".join(f"{v:.1f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=2, default=(4096, 4096), metavar=("R", "K"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(BLOCK))
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--no-append", action="store_true", help="do not append to RESULTS.md")
    args = ap.parse_args(argv)

    if not _ext.has_kernels("cpu"):
        sys.exit(f"jax_fp4 CPU kernels unavailable: {_ext.load_error()}")
    cpu = jax.devices("cpu")[0]
    load_before = _loadavg()
    r, k = args.shape
    rng = np.random.default_rng(0)
    x32 = rng.standard_normal((r, k), dtype=np.float32)
    ts = jax.device_put(np.ones((r,), np.float32), cpu)

    rows = []
    for dname in args.dtypes:
        dt = DTYPES[dname]
        x = jax.device_put(x32.astype(ml_dtypes.bfloat16) if dname == "bfloat16" else x32, cpu)
        for fmt in args.formats:
            bs = BLOCK[fmt]
            kq = jax.jit(lambda x, ts, fmt=fmt, bs=bs: ffi_quantize(x, ts, fmt, bs))
            rq = jax.jit(lambda x, fmt=fmt, bs=bs: ref.quantize_2d(x, fmt, bs))
            codes, scales, zeros = kq(x, ts)
            kd = jax.jit(lambda c, s, z, ts, fmt=fmt, bs=bs, dt=dt: ffi_dequantize(c, s, z, ts, fmt, bs, k, dt))
            rd = jax.jit(lambda c, s, z, fmt=fmt, bs=bs, dt=dt: ref.dequantize_2d(c, s, z, fmt, bs, k, dt))
            kf = jax.jit(lambda x, ts, fmt=fmt, bs=bs: ffi_fake_quantize(x, ts, fmt, bs))
            rf = jax.jit(lambda x, fmt=fmt, bs=bs: ref.fake_quantize_2d(x, fmt, bs))
            for op, kfn, kargs, rfn, rargs in (
                ("quantize", kq, (x, ts), rq, (x,)),
                ("dequantize", kd, (codes, scales, zeros, ts), rd, (codes, scales, zeros)),
                ("fake_quantize", kf, (x, ts), rf, (x,)),
            ):
                t_k = timeit(kfn, kargs, args.repeats)
                t_r = timeit(rfn, rargs, args.repeats)
                rows.append((op, fmt, bs, dname, t_k, t_r))
                print(f"{op:14s} {fmt:11s} {dname:9s} kernel {t_k:9.2f} ms  reference {t_r:9.2f} ms"
                      f"  x{t_r / t_k:6.1f}", flush=True)

    header = ("| op | format | block | x dtype | CPU kernel (ms) | jnp reference (ms) | speedup |\n"
              "|---|---|---|---|---:|---:|---:|")
    lines = [f"| {op} | {fmt} | {bs} | {d} | {tk:.2f} | {tr:.2f} | {tr / tk:.1f}x |"
             for op, fmt, bs, d, tk, tr in rows]
    table = header + "\n" + "\n".join(lines)
    print()
    print(table)
    if not args.no_append:
        cmd = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
        now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        info = _ext.build_info()
        with open(RESULTS, "a") as f:
            if f.tell() == 0:
                f.write("# Benchmark results\n")
            f.write(
                f"\n## bench_cpu — {now}\n\n"
                f"- command: `python {cmd}`\n"
                f"- CPU: {cpu_model()} ({os.cpu_count()} logical CPUs; load average "
                f"{load_before} before, {_loadavg()} after)\n"
                f"- input: ({r}, {k}); jax {jax.__version__}; jax-fp4 {info.get('version')} "
                f"({info.get('compiler')}, {info.get('build_type')}); median of {args.repeats} "
                f"runs after 2 warm-ups, wall time of the jitted call incl. dispatch\n\n"
                f"{table}\n")
        print(f"\nappended to {os.path.relpath(RESULTS)}")


if __name__ == "__main__":
    main()
