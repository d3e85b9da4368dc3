"""Device time of quantize / dequantize / fake-quantize on the GPU vs the copy roof.

Method (docs/benchmarks.md): one jitted function runs the op on R distinct inputs
(together larger than L2). Its device time is what the GPU spent in kernels (and
memsets/copies) during 5 calls, read from the JAX profiler's device trace (CUPTI), divided
by 5 * R: no Python dispatch, allocation or synchronisation gap counts (they cost ~0.1-0.2 ms
a call, as much as the op itself at 16 MiB). In the same run: the memory-copy roof (a
device-to-device cudaMemcpyAsync of >= 1 GiB through torch, CUDA events, read + written,
the best of three measurements spread over the run), XLA's own elementwise kernel (x * 3
in the input dtype, same method, first and last) and the jitted jnp reference. Prints a
markdown table and appends it to RESULTS.md.

  python benchmarks/bench_quant.py [--sizes 16MiB 1GiB] [--formats nvfp4 mxfp4 ...]
"""
from __future__ import annotations

import argparse
import datetime
import glob
import os
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp

import jax_fp4 as jf

L2_BYTES = 60 << 20


def profile(run):
    """(result of run(), the planes of a JAX profiler trace taken around it (host threads
    and, on GPUs, "/device:GPU:k" planes whose "Stream" lines hold the kernels), the
    trace's .xplane.pb path)."""
    from jax.profiler import ProfileData

    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        result = run()
    path = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0]
    return result, list(ProfileData.from_file(path).planes), path


def kernel_times(fn, args, calls=5):
    """{kernel name (first 80 characters): seconds per call} of fn(*args): the durations
    of the kernel, memset and memcpy events on the device's stream lines of a JAX profiler
    trace of `calls` calls (every GPU of the trace together)."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    _, planes, path = profile(lambda: [jax.block_until_ready(fn(*args)) for _ in range(calls)])
    per_kernel = {}
    for plane in planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:  # "Stream #k(...)": the CUPTI activity of one stream
            if line.name.startswith("Stream"):
                for e in line.events:
                    per_kernel[e.name[:80]] = per_kernel.get(e.name[:80], 0.0) + e.duration_ns
    if not per_kernel:
        lines = [(pl.name, [ln.name for ln in pl.lines]) for pl in planes]
        raise RuntimeError(f"no GPU stream events in the profile {path}: {lines}")
    return {name: ns * 1e-9 / calls for name, ns in per_kernel.items()}


def device_time(fn, args, calls=5):
    """Seconds of GPU work per call of fn(*args) (:func:`kernel_times`, summed);
    BENCH_BREAKDOWN=1 prints the time per kernel."""
    per_kernel = kernel_times(fn, args, calls)
    if os.environ.get("BENCH_BREAKDOWN"):
        for name, t in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
            print(f"#   {t * 1e6:9.1f} us  {name}", file=sys.stderr)
    return sum(per_kernel.values())


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
    roofs = [copy_roof()]
    roof = roofs[0]  # for the progress lines; the table uses the best of the run
    rows = []
    for size in args.sizes:
        nbytes = int(size[:-3]) << (20 if size.endswith("MiB") else 30)
        n = nbytes // dtype.itemsize
        k = 8192 if n >= 8192 * 128 else 1024
        shape = (n // k, k)
        r = max(2, -(-4 * L2_BYTES // nbytes)) if nbytes < (1 << 30) else 2
        key = jax.random.key(0)
        xs = [jax.random.normal(jax.random.fold_in(key, i), shape, dtype) for i in range(r)]
        def xla_baseline(when):
            """XLA's own elementwise kernel, first and last (shows drift over the run)."""
            t = device_time(jax.jit(lambda *a: [v * 3 for v in a]), xs) / r
            gbs = 2 * n * dtype.itemsize / t / 1e9
            rows.append((f"xla x*3 ({when})", "-", size, f"{shape[0]}x{shape[1]}", t * 1e3,
                         gbs, float("nan")))
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
                        times[backend] = device_time(make_fn(op, fmt, r), inputs) / r
                    except Exception as e:  # a reference that does not fit: say so
                        times[backend] = float("nan")
                        print(f"# {backend} {op} {fmt} {size}: {type(e).__name__}: {e}",
                              file=sys.stderr)
                jf.set_backend("auto")
                moved = op_bytes(op, base, n, dtype)
                t = times["kernels"]
                gbs = moved / t / 1e9
                ref = times.get("reference", float("nan"))
                rows.append((op, fmt, size, f"{shape[0]}x{shape[1]}", t * 1e3, gbs, ref / t))
                print(f"{op:14s} {fmt:11s} {size:6s} {t * 1e3:8.3f} ms {gbs:7.0f} GB/s "
                      f"{100 * gbs / roof:5.1f}% roof  x{ref / t:6.1f} vs ref", flush=True)
                del inputs
        xla_baseline("last")
        roofs.append(copy_roof())
    roof = max(roofs)  # the best of the measurements: the first one can be cold
    head = ("| op | format | input | shape | time (ms) | GB/s | % copy roof | x jnp reference |\n"
            "|---|---|---|---|---:|---:|---:|---:|\n")
    table = head + "".join(
        f"| {o} | {f} | {s} | {sh} | {t:.3f} | {g:.0f} | {100 * g / roof:.1f} | {x:.1f} |\n"
        for o, f, s, sh, t, g, x in rows)
    note = (f"\n## CUDA quantize / dequantize / fake-quantize ({datetime.date.today()})\n\n"
            f"Command: `python benchmarks/bench_quant.py {' '.join(argv or sys.argv[1:])}`; "
            f"GPU: {dev.device_kind}; jax {jax.__version__}; input dtype {dtype.name}; "
            f"copy roof (torch D2D cudaMemcpyAsync of 1 GiB, read + write; the best of "
            f"{', '.join(f'{v:.0f}' for v in roofs)} GB/s measured at the start and after each "
            f"size) {roof:.0f} GB/s. "
            "Device time per op = GPU kernel/memset/memcpy time in the JAX profiler's device "
            "trace of 5 calls of one jitted function running the op on R distinct inputs "
            "(together > L2), / (5 R). Bytes = input read + outputs written (codes, scales, "
            "zero points). `xla x*3`: XLA's own elementwise kernel, same method.\n\n")
    print("\n" + note + table)
    with open(args.results, "a") as fh:
        fh.write(note + table)


if __name__ == "__main__":
    main()
