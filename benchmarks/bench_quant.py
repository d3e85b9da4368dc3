"""Device time of quantize / dequantize / fake-quantize on the GPU vs the copy roof.

Method (DESIGN.md section 7): one jitted function runs the op on R distinct inputs
(together larger than L2), median of repeats; the time per op is the slope
(t(2R) - t(R)) / R, which removes the fixed cost of one call (dispatch, output allocation,
synchronisation: ~0.1-0.2 ms, as much as the op itself at 16 MiB). In the same run: the
memory-copy roof (a device-to-device cudaMemcpyAsync of >= 1 GiB through torch, bytes
read + written), XLA's own elementwise kernel (x * 3 in the input dtype, same method)
and the jitted jnp reference. Prints a markdown table and appends it to RESULTS.md.

  python benchmarks/bench_quant.py [--sizes 16MiB 1GiB] [--formats nvfp4 mxfp4 ...]
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp4 as jf

L2_BYTES = 60 << 20


def median_time(fn, args, repeats=9):
    jax.block_until_ready(fn(*args))  # compile + warm up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def slope_time(make, inputs, r):
    """Device time per op: (t(2r) - t(r)) / r of jitted functions over r and 2r inputs."""
    return (median_time(make(2 * r), inputs[:2 * r]) - median_time(make(r), inputs[:r])) / r


def copy_roof(nbytes=1 << 30):
    """GB/s of a device-to-device cudaMemcpyAsync (read + write counted)."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_(0, 255)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for _ in range(10):
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        ms.append(start.elapsed_time(end))
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / (statistics.median(ms) * 1e-3) / 1e9


def op_bytes(op, fmt, n, dtype):
    f = jf.get_format(fmt)
    bs = f.default_block
    esize = jnp.dtype(dtype).itemsize
    sbytes = 4 if f.family == "codebook" else (esize if f.family == "int4" else 1)
    packed = n * f.bits // 8 + (n // bs) * sbytes + (n // bs if f.family == "int4" else 0)
    return {"quantize": n * esize + packed, "dequantize": packed + n * esize,
            "fake_quantize": 2 * n * esize}[op]


def make_fn(op, spec, r):
    """spec: a format name with optional ":auto" (NVFP4 with the per-tensor scale computed
    in the op: one amax pass + one quantize pass) and ":swizzled" (scales written in the
    128x4 layout) suffixes."""
    fmt, *opts = spec.split(":")
    kw = {}
    if "auto" in opts:
        kw["tensor_scale"] = "auto"
    if "swizzled" in opts and op == "quantize":
        kw["scale_layout"] = "swizzled"

    def one(x):
        if op == "quantize":
            q = jf.quantize(x, fmt, **kw)
            return q.data, q.scales
        if op == "fake_quantize":
            return jf.fake_quantize(x, fmt, **kw)
        return jf.dequantize(x)

    return jax.jit(lambda *xs: [one(x) for x in xs])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", nargs="+", default=["16MiB", "1GiB"])
    ap.add_argument("--formats", nargs="+", default=[
        "nvfp4", "nvfp4:auto", "nvfp4:swizzled", "mxfp4", "mxfp8_e4m3", "nf4", "int4",
        "mxfp6_e2m3", "bnb_fp4"])
    ap.add_argument("--ops", nargs="+", default=["quantize", "dequantize", "fake_quantize"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "RESULTS.md"))
    args = ap.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    dev = jax.devices()[0]
    roof = copy_roof()
    rows = []
    for size in args.sizes:
        nbytes = int(size[:-3]) << (20 if size.endswith("MiB") else 30)
        n = nbytes // dtype.itemsize
        k = 8192 if n >= 8192 * 128 else 1024
        shape = (n // k, k)
        r = max(2, -(-4 * L2_BYTES // nbytes)) if nbytes < (1 << 30) else 2
        key = jax.random.key(0)
        xs = [jax.random.normal(jax.random.fold_in(key, i), shape, dtype) for i in range(2 * r)]
        def xla_baseline(when):
            """XLA's own elementwise kernel, first and last (shows drift over the run)."""
            t = slope_time(lambda m: jax.jit(lambda *a: [v * 3 for v in a]), xs, r)
            gbs = 2 * n * dtype.itemsize / t / 1e9
            rows.append((f"xla x*3 ({when})", "-", size, f"{shape[0]}x{shape[1]}", t * 1e3,
                         gbs, 100 * gbs / roof, float("nan")))
            print(f"{'xla x*3':14s} {when:11s} {size:6s} {t * 1e3:8.3f} ms {gbs:7.0f} GB/s "
                  f"{100 * gbs / roof:5.1f}% roof", flush=True)

        xla_baseline("first")
        for fmt in args.formats:
            for op in args.ops:
                inputs = xs
                base = fmt.partition(":")[0]
                if op == "fake_quantize" and "swizzled" in fmt:
                    continue  # fake-quantize has no scales
                if op == "dequantize":
                    if fmt != base:
                        continue  # dequantize does not depend on how the scale was chosen
                    inputs = [jf.quantize(x, base) for x in xs]
                times = {}
                for backend in ("kernels",) + (() if args.no_reference else ("reference",)):
                    jf.set_backend(backend)
                    try:
                        times[backend] = slope_time(lambda m: make_fn(op, fmt, m), inputs, r)
                    except Exception as e:  # a reference that does not fit: say so
                        times[backend] = float("nan")
                        print(f"# {backend} {op} {fmt} {size}: {type(e).__name__}: {e}",
                              file=sys.stderr)
                jf.set_backend("auto")
                moved = op_bytes(op, base, n, dtype)
                t = times["kernels"]
                gbs = moved / t / 1e9
                ref = times.get("reference", float("nan"))
                rows.append((op, fmt, size, f"{shape[0]}x{shape[1]}", t * 1e3, gbs,
                             100 * gbs / roof, ref / t))
                print(f"{op:14s} {fmt:11s} {size:6s} {t * 1e3:8.3f} ms {gbs:7.0f} GB/s "
                      f"{100 * gbs / roof:5.1f}% roof  x{ref / t:6.1f} vs ref", flush=True)
                del inputs
        xla_baseline("last")
    head = ("| op | format | input | shape | time (ms) | GB/s | % copy roof | x jnp reference |\n"
            "|---|---|---|---|---:|---:|---:|---:|\n")
    table = head + "".join(f"| {o} | {f} | {s} | {sh} | {t:.3f} | {g:.0f} | {p:.1f} | {x:.1f} |\n"
                           for o, f, s, sh, t, g, p, x in rows)
    note = (f"\n## CUDA quantize / dequantize / fake-quantize ({datetime.date.today()})\n\n"
            f"Command: `python benchmarks/bench_quant.py {' '.join(argv or sys.argv[1:])}`; "
            f"GPU: {dev.device_kind}; jax {jax.__version__}; input dtype {dtype.name}; "
            f"copy roof (torch D2D cudaMemcpyAsync of 1 GiB, read + write) {roof:.0f} GB/s. "
            "Device time per op = (t(2R) - t(R)) / R, t = median over 9 calls of one jitted "
            "function running the op on R (2R) distinct inputs (together > L2). Bytes = "
            "input read + outputs written (codes, scales, zero points). `xla x*3`: XLA's own "
            "elementwise kernel, same method.\n\n")
    print("\n" + note + table)
    with open(args.results, "a") as fh:
        fh.write(note + table)


if __name__ == "__main__":
    main()
