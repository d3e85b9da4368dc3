"""Driver for Nsight Compute: one call of each CUDA kernel on a 256 MiB bf16 input.

  ncu --clock-control none --kernel-name regex:"quantize|dequantize" --launch-skip 0 \
      --section SpeedOfLight --section WarpStateStats python benchmarks/cuda_profile.py nf4
"""
import sys

import jax
import jax.numpy as jnp

import jax_fp4 as jf

fmt = sys.argv[1] if len(sys.argv) > 1 else "nvfp4"
jf.set_backend("kernels")
x = jax.random.normal(jax.random.key(0), (16384, 8192), jnp.bfloat16)
q = jax.jit(lambda v: jf.quantize(v, fmt))(x)
y = jax.jit(jf.dequantize)(q)
jax.block_until_ready(y)
print("profiled", fmt)
