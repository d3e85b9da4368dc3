"""Driver for compute-sanitizer (memcheck / racecheck): every CUDA kernel variant once on
small ragged shapes. Run on a GPU machine:

  XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck \
      python benchmarks/cuda_sanitize.py [quant] [matmul | matmul8 | grouped] [bf16] [-v]

(bf16: quantize kernels for bfloat16 inputs only, a shorter run; matmul8: the W4A16 cases
at M = 1 and 4 only (the 8-row wgmma tile), a shorter run than matmul's M = 1-300;
grouped: only the grouped calls of jax_fp4.group_matmuls; -v: print
each case before it runs.)

(the platform allocator gives every buffer its own cudaMalloc, so out-of-bounds accesses
are not hidden inside XLA's memory pool; set it for racecheck too: without it racecheck
of compute-sanitizer 2025.3.1 segfaulted at start under jax 0.11.2; benchmarks/RESULTS.md
has the run).
"""
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp4 as jf
from jax_fp4 import layout
from jax_fp4.prims import _launch_plan

jf.set_backend("kernels")
rng = np.random.default_rng(0)
cases = [("nvfp4", 16, {}), ("nvfp4", 16, {"tensor_scale": "auto"}), ("mxfp4", 32, {}),
         ("mxfp6_e2m3", 32, {}), ("mxfp6_e3m2", 32, {"scale_rounding": "rceil"}),
         ("mxfp8_e4m3", 32, {}), ("mxfp8_e5m2", 32, {}), ("nf4", 64, {}), ("nf4", 4096, {}),
         ("bnb_fp4", 1024, {}), ("int4", 128, {}), ("int4", 16, {})]
verbose = "-v" in sys.argv[1:]
parts = [a for a in sys.argv[1:] if a != "-v"] or ["quant", "matmul"]
dtypes = (jnp.bfloat16,) if "bf16" in parts else (jnp.float32, jnp.bfloat16, jnp.float16)
n = 0


def progress(case):
    """-v: name each case before it runs (flushed), so a crash under a sanitizer shows where."""
    if verbose:
        print(case, flush=True)


for fmt, bs, kw in cases if "quant" in parts else []:
    for dtype in dtypes:
        for rows in (1, 3, 129):
            progress(f"quant {fmt} bs={bs} {kw} {dtype.__name__} rows={rows}")
            x = jnp.asarray(rng.standard_normal((rows, 2 * bs)), dtype)
            q = jf.quantize(x, fmt, block_size=bs, **kw)
            y = q.dequantize()
            f = jf.fake_quantize(x, fmt, block_size=bs,
                                 **{k: v for k, v in kw.items() if k != "scale_dtype"})
            # 128x4 scales written by the kernel, padding (rows, columns) zero-filled
            s = jf.quantize(x, fmt, block_size=bs, scale_layout="swizzled", **kw).scales
            jax.block_until_ready((q, y, f, s))
            n += 4
# fused W4A16: ragged M (wgmma tiles of 8 (M = 1, 4), 16 (13), 64, 128, 256, two of them
# at 300; the mma.sync kernels where wgmma cannot run),
# K not a multiple of 128 (the lanes load the scales), and K = 2048 (the wgmma kernel's
# scale boxes), N not a multiple of 128; M = 200 and 300 on the grid that
# _launch_plan.wmatmul_grid picks for this small weight (128-row tiles: it fills under half
# of the GPU) besides the plain tiles (Tuning.grid_min_fill = 0)
mm_cases = [("nvfp4", 16, {}), ("nvfp4", 16, {"tensor_scale": "auto"}), ("mxfp4", 32, {}),
            ("nf4", 64, {}), ("bnb_fp4", 32, {}), ("int4", 32, {}), ("int4", 128, {}),
            ("int4", 128, {"scale_dtype": jnp.bfloat16}), ("int4", 16, {"scale_dtype": jnp.float16})]
tuning = _launch_plan.TUNING
grid_fill = tuning.grid_min_fill
small = "matmul8" in parts
mm_parts = mm_cases if "matmul" in parts or small else []
linear_ms = ((1, 0), (4, 0)) if small else ((1, 0), (4, 0), (13, 0), (33, 0), (100, 0), (300, 0),
                                            (200, grid_fill), (300, grid_fill))
for fmt, bs, kw in mm_parts:
    for k in (3 * max(bs, 64), 2048):
        q = jf.quantize(jnp.asarray(rng.standard_normal((k, 136)), jnp.float32), fmt, axis=0,
                        block_size=bs, **kw)
        for dtype in (jnp.bfloat16, jnp.float16):
            for m, fill in linear_ms:
                if fill != _launch_plan.TUNING.grid_min_fill:  # the grid is chosen at lowering time
                    _launch_plan.TUNING = dataclasses.replace(tuning, grid_min_fill=fill)
                    jax.clear_caches()
                progress(f"matmul {fmt} bs={bs} {kw} K={k} {dtype.__name__} M={m} fill={fill}")
                jax.block_until_ready(jf.matmul(jnp.asarray(rng.standard_normal((m, k)), dtype), q))
                n += 1
            _launch_plan.TUNING = tuning
# the prepared layout (jax_fp4.prepare: 1-D bulk copies) of every case it applies to: N =
# 256, K = 1152 (9 steps: a stage of two reaching past K) and 2048, every tile width from 8
# to 256
for fmt, bs, kw in mm_parts:
    if not layout.tileable(fmt, bs, kw.get("scale_dtype", jnp.float32), 256, 1152):
        continue
    for k in (1152, 2048):
        q = jf.prepare(jf.quantize(jnp.asarray(rng.standard_normal((k, 256)), jnp.float32), fmt,
                                   axis=0, block_size=bs, **kw))
        assert q.scale_layout == "tiled"
        for dtype in (jnp.bfloat16, jnp.float16):
            for m in (1, 4) if small else (1, 13, 33, 100, 300):
                progress(f"prepared {fmt} bs={bs} {kw} K={k} {dtype.__name__} M={m}")
                jax.block_until_ready(jf.matmul(jnp.asarray(rng.standard_normal((m, k)), dtype), q))
                n += 1
# grouped calls (jax_fp4.group_matmuls): three prepared weights of 256, 128 and 384 rows
# read by one launch, K = 1152
for fmt, bs, kw in mm_cases if mm_parts or "grouped" in parts else []:
    if not layout.tileable(fmt, bs, kw.get("scale_dtype", jnp.float32), 128, 1152):
        continue
    qs = [jf.prepare(jf.quantize(jnp.asarray(rng.standard_normal((1152, r)), jnp.float32), fmt,
                                 axis=0, block_size=bs, **kw)) for r in (256, 128, 384)]
    grouped = jax.jit(jf.group_matmuls(lambda x, qs: [jf.matmul(x, q) for q in qs]))
    for m in (1, 4) if small else (1, 13, 100, 300):
        progress(f"grouped {fmt} bs={bs} {kw} K=1152 M={m}")
        jax.block_until_ready(grouped(jnp.asarray(rng.standard_normal((m, 1152)), jnp.bfloat16), qs))
        n += 1
print(f"cuda_sanitize: {n} kernel launches checked")
