"""Driver for Nsight Compute: one call of each CUDA kernel.

Quantize / dequantize / fake-quantize of a 256 MiB bf16 input:

  ncu --clock-control none --kernel-name regex:"quantize|dequantize" --launch-skip 0 \
      --section SpeedOfLight --section WarpStateStats python benchmarks/cuda_profile.py nf4

W4A16 matmul of a (K, N) = (8192, 28672) weight at M = 1 and 16, and the bf16 dot of the
same shapes (XLA's GEMM kernel):

  ncu --clock-control none --kernel-name regex:"wmatmul|gemm|gemv" \
      --section SpeedOfLight --section WarpStateStats --section Occupancy \
      python benchmarks/cuda_profile.py wmatmul nvfp4

Under jax 0.11.2 Nsight Compute crashed at the exit of the profiled process (after the
kernels' data was collected, before the report was written); for the W4A16 kernels,
benchmarks/wmatmul_harness.cu runs the same kernels without JAX and profiles cleanly.
"""
import sys

import jax
import jax.numpy as jnp

import jax_fp4 as jf

mode = sys.argv[1] if len(sys.argv) > 1 else "nvfp4"
jf.set_backend("kernels")
if mode == "wmatmul":
    fmt = sys.argv[2] if len(sys.argv) > 2 else "nvfp4"
    w = jax.random.normal(jax.random.key(0), (8192, 28672), jnp.bfloat16)
    q = jax.jit(lambda v: jf.quantize(v, fmt, axis=0))(w)
    for m in (1, 16):
        x = jax.random.normal(jax.random.key(m), (m, 8192), jnp.bfloat16)
        jax.block_until_ready(jax.jit(jf.matmul)(x, q))
        jax.block_until_ready(jax.jit(jnp.dot)(x, w))
    print("profiled wmatmul", fmt)
else:
    x = jax.random.normal(jax.random.key(0), (16384, 8192), jnp.bfloat16)
    q = jax.jit(lambda v: jf.quantize(v, mode))(x)
    if jf.get_format(mode).family in ("nvfp4", "mx"):
        jax.block_until_ready(jax.jit(lambda v: jf.quantize(v, mode, scale_layout="swizzled"))(x))
    y = jax.jit(jf.dequantize)(q)
    z = jax.jit(lambda v: jf.fake_quantize(v, mode))(x)
    jax.block_until_ready((y, z))
    print("profiled", mode)
