"""Driver for compute-sanitizer (memcheck / racecheck): every CUDA kernel variant once on
small ragged shapes. Run on a GPU machine:

  XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck \
      python benchmarks/cuda_sanitize.py

(the platform allocator gives every buffer its own cudaMalloc, so out-of-bounds accesses
are not hidden inside XLA's memory pool).
"""
import jax
import jax.numpy as jnp
import numpy as np

import jax_fp4 as jf

jf.set_backend("kernels")
rng = np.random.default_rng(0)
cases = [("nvfp4", 16, {}), ("nvfp4", 16, {"tensor_scale": "auto"}), ("mxfp4", 32, {}),
         ("mxfp6_e2m3", 32, {}), ("mxfp6_e3m2", 32, {"scale_rounding": "rceil"}),
         ("mxfp8_e4m3", 32, {}), ("mxfp8_e5m2", 32, {}), ("nf4", 64, {}), ("nf4", 4096, {}),
         ("bnb_fp4", 1024, {}), ("int4", 128, {}), ("int4", 16, {})]
n = 0
for fmt, bs, kw in cases:
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        for rows in (1, 3, 129):
            x = jnp.asarray(rng.standard_normal((rows, 2 * bs)), dtype)
            q = jf.quantize(x, fmt, block_size=bs, **kw)
            y = q.dequantize()
            f = jf.fake_quantize(x, fmt, block_size=bs,
                                 **{k: v for k, v in kw.items() if k != "scale_dtype"})
            jax.block_until_ready((q, y, f))
            n += 3
print(f"cuda_sanitize: {n} kernel launches checked")
