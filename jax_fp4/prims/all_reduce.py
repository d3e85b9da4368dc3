"""The in-graph all-reduce of row-parallel matmuls' float32 partial sums on the GPUs of one
process (FFI target ``jax_fp4_all_reduce_v1``, csrc/cuda/collective/all_reduce.cu).

A row-parallel W4A16 or block-scaled matmul (K sharded) leaves float32 partial sums that
its sharding rule (:mod:`jax_fp4.partitioning`) adds over the mesh axes K was sharded on.
XLA's ``psum`` is an NCCL all-reduce that XLA runs outside its command buffer (CUDA
graph): at decode sizes each one costs more than the matmul before it. Where every GPU of
the mesh belongs to this process and each pair has peer access, the sum is instead one
kernel in the graph: every GPU pushes its partials into its peers' memory, waits for
theirs and adds all of them in rank order (so every GPU holds the same bits), then writes
the output dtype (the cast XLA would fuse after the ``psum``).

``JAX_FP4_ALL_REDUCE=xla`` (read when a program is partitioned) keeps XLA's ``psum``
everywhere, and so does a persistent compilation cache (``jax_compilation_cache_dir``): a
cached executable skips the partitioning that sets the call sites' buffers up. Messages
over :data:`MAX_ELEMENTS` values keep it too. Each compiled call site owns 2 x ranks x
its message's values x 8 bytes on every GPU of its mesh for the life of the process.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import jax
import numpy as np

from .. import _ext

__all__ = ["MAX_ELEMENTS", "device_groups", "in_graph_sum"]

TARGET = "jax_fp4_all_reduce_v1"
# float32 values per message (1 MiB; the kernel's kMaxElements), past which XLA's psum
# (NCCL) runs: large messages are bandwidth-bound, where NCCL's algorithms are the better
# choice, and each call site holds 2 x ranks x 8 bytes per value on every GPU.
MAX_ELEMENTS = 1 << 18
MAX_RANKS = 8


def device_groups(mesh, axes) -> list[list]:
    """The devices that sum together when a value is reduced over mesh ``axes``: one list
    per combination of the other axes' coordinates, each in the order of ``axes``'
    coordinates (row-major in the order ``axes`` are given: the rank order)."""
    names = list(mesh.axis_names)
    order = [names.index(a) for a in names if a not in axes] + [names.index(a) for a in axes]
    size = math.prod(mesh.shape[a] for a in axes)
    return [list(g) for g in np.transpose(mesh.devices, order).reshape(-1, size)]


def _local_gpus(groups) -> bool:
    me = jax.process_index()
    return all(d.platform in ("gpu", "cuda") and d.process_index == me
               for g in groups for d in g)


def in_graph_sum(y, mesh, axes, out_dtype) -> Optional[jax.Array]:
    """``lax.psum(y, axes).astype(out_dtype)`` as one kernel in XLA's command buffer, or
    None where it does not apply (the caller then uses ``lax.psum``).

    y: this device's float32 partial sums (any shape, at most :data:`MAX_ELEMENTS`
    values); mesh, axes: the mesh and the axes summed over (2 to 8 devices per group, all
    GPUs of this process, each pair with peer access); out_dtype: float32, bfloat16 or
    float16. Called while the program is partitioned: it allocates this call site's
    buffers (its channel) on every GPU of the mesh then, so that no two call sites share
    them and XLA may run them concurrently. Raises RuntimeError (the CUDA error) where
    they cannot be allocated."""
    if (os.environ.get("JAX_FP4_ALL_REDUCE", "").lower() == "xla"
            or jax.config.jax_compilation_cache_dir):
        return None
    if y.dtype != np.float32 or np.dtype(out_dtype).name not in ("float32", "bfloat16", "float16"):
        return None
    if not 0 < y.size <= MAX_ELEMENTS or mesh.empty:
        return None
    groups = device_groups(mesh, axes)
    if not 2 <= len(groups[0]) <= MAX_RANKS or not _local_gpus(groups):
        return None
    channel = _ext.all_reduce_setup([[d.local_hardware_id for d in g] for g in groups],
                                    int(y.size))
    if not channel:
        return None
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(y.shape, np.dtype(out_dtype)))(
        y, channel=np.int64(channel))
