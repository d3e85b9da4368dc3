"""The jax-fp4 primitives, one per module (the shape of jax/_src/cudnn/*_stablehlo.py):
each module holds its primitive's abstract evaluation, batching rule, JVP / transpose and
per-platform lowering; sharding rules: :mod:`jax_fp4.partitioning`.

- :mod:`.quantize`: ``quantize_p`` (x -> codes, block scales, INT4 zero points);
- :mod:`.dequantize`: ``dequantize_p``;
- :mod:`.fake_quantize`: ``fake_quantize_p`` and its straight-through estimator;
- :mod:`.tensor_scale`: ``auto_tensor_scale_p`` (NVFP4 per-tensor scale from amax);
- :mod:`.wmatmul`: ``wmatmul_p`` (W4A16 matmul, the fused CUDA kernel);
- :mod:`.wmatmul_group`: ``wmatmul_group_p`` (several W4A16 matmuls of one activation as
  one call; :func:`jax_fp4.group_matmuls` binds it);
- :mod:`.scaled_matmul`: ``scaled_matmul_p`` (block-scaled matmul of two quantized
  operands);
- :mod:`._common`: the backend switch and the helpers every primitive registers with;
- :mod:`._gpu`: the target GPU's properties; :mod:`._launch_plan`: the fused W4A16
  kernel's launch policy (private: a pure function of the problem and the GPU).

Every primitive works on the canonical 2-D view (csrc/README.md): rows x K with the
blocked axis last; :mod:`jax_fp4.ops` moves axes and reshapes around them.
"""
