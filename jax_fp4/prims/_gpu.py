"""The properties of the GPU a computation is lowered for (the launch policy's input)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax

from .. import _ext


@dataclasses.dataclass(frozen=True)
class GpuProps:
    """What the CUDA launch policy needs of the GPU a computation is lowered for.

    compute_capability: the major version (0: unknown, which picks the kernels every sm_80+
    GPU runs); sm_count: streaming multiprocessors (132, an H100 SXM / H200, if unknown);
    cuda_archs: the CUDA architectures the extension was built for (e.g. ("80", "90a");
    None: this install's, from ``jax_fp4._ext.build_info()``)."""
    compute_capability: int = 0
    sm_count: int = 132
    cuda_archs: Optional[tuple] = None

    @property
    def wgmma(self) -> bool:
        """Whether the sm_90a wgmma kernel runs: compute capability 9 and a build for 90a."""
        archs = self.cuda_archs
        if archs is None:
            archs = str(_ext.build_info().get("cuda_archs", "")).replace(";", ",").split(",")
        return self.compute_capability == 9 and "90a" in archs


@functools.lru_cache(maxsize=None)
def _device_props(device) -> GpuProps:
    cc = int(str(getattr(device, "compute_capability", "0")).split(".")[0] or 0)
    return GpuProps(cc, int(getattr(device, "core_count", 0) or 132))


def gpu_props(ctx=None) -> GpuProps:
    """The properties of the GPU that lowering context `ctx` compiles for (its backend's
    first GPU), cached per device; without a context or a GPU backend in it (e.g.
    ``jax.export`` on a machine with no GPU), the default GPU, or GpuProps() if none: the
    portable choice."""
    backend = getattr(getattr(ctx, "module_context", None), "backend", None)
    try:
        devices = backend.local_devices() if backend is not None else jax.devices("gpu")
    except RuntimeError:
        devices = []
    gpus = [d for d in devices if d.platform in ("gpu", "cuda")]
    return _device_props(gpus[0]) if gpus else GpuProps()


def wgmma_available() -> bool:
    """Whether the sm_90a wgmma kernel can run on the default GPU: compute capability 9.0
    and a build whose CUDA architectures include 90a (GpuProps.wgmma)."""
    return gpu_props().wgmma
