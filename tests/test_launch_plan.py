"""The fused W4A16 kernel's launch plan (jax_fp4.prims._launch_plan.wmatmul_plan), a pure
function of the problem and the GPU's properties: its invariants on CPU, for the GPUs the
kernels target, without a device query."""
import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from jax_fp4.prims import _gpu, _launch_plan as LP
from jax_fp4.prims._gpu import GpuProps

BF16, F16 = jnp.bfloat16, jnp.float16
GPUS = {"H100": GpuProps(9, 132, ("80", "90a")), "H200": GpuProps(9, 132, ("90a",)),
        "H100 PCIe": GpuProps(9, 114, ("80", "90a")), "A100": GpuProps(8, 108, ("80", "90a")),
        "B200": GpuProps(10, 148, ("80", "90a", "100a")),
        "H100 without an sm_90a build": GpuProps(9, 132, ("80", "90"))}
WEIGHTS = [("nvfp4", 16, np.uint8, False), ("nvfp4", 16, np.uint8, True), ("mxfp4", 32, np.uint8, False),
           ("nf4", 64, np.float32, False), ("bnb_fp4", 64, np.float32, False),
           ("int4", 128, BF16, False), ("int4", 128, F16, False), ("int4", 32, np.float32, False)]
MS = (1, 5, 8, 16, 17, 64, 100, 128, 129, 256, 300, 512, 700, 1024, 1100, 2048, 3000, 4096)
NKS = ((200, 384), (1024, 4096), (4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192),
       (16896, 256))


@pytest.fixture(autouse=True)
def _no_device_query(monkeypatch):
    """The plan reads only its arguments: a device query fails the test."""
    def query(ctx=None):
        raise AssertionError("the launch plan queried the device")
    monkeypatch.setattr(_gpu, "gpu_props", query)


def _plan(m, n, k, w, gpu, x_dtype=BF16, out_dtype=None, tiled=False, table=None):
    fmt, bs, sd, two = w
    return LP.wmatmul_plan(m, n, k, fmt=fmt, block_size=bs, x_dtype=x_dtype, scale_dtype=sd,
                           out_dtype=out_dtype or x_dtype, two_level=two, tiled=tiled, gpu=gpu,
                           table=table)


@pytest.mark.parametrize("name", list(GPUS))
def test_plan_invariants(name):
    gpu = GPUS[name]
    t = LP.TUNING
    fused = 0
    for w, m, (n, k), x_dtype, tiled in itertools.product(WEIGHTS, MS, NKS, (BF16, F16), (False, True)):
        out = np.float32 if m % 2 else x_dtype
        p = _plan(m, n, k, w, gpu, x_dtype, out, tiled)
        if p is None:
            assert not gpu.wgmma or not tiled, (name, w, m)  # a prepared weight: any M on wgmma
            continue
        fused += 1
        assert p.decode == LP.wmatmul_decode(w[0], x_dtype, w[3], w[2])
        assert p.untile == (tiled and not gpu.wgmma) and p.tiled == (tiled and gpu.wgmma)
        assert 1 <= len(p.launches) <= 2
        row = 0
        for ln in p.launches:
            assert ln.row0 == row and ln.rows >= 1
            row += ln.rows
            if not gpu.wgmma:  # the mma.sync kernels: below sm_90, on sm_100, without sm_90a
                assert ln.tile_m == 0 and ln.cluster == 1
                assert ln.kernel == ("direct" if ln.rows <= t.direct_max_m else "staged")
            else:
                assert ln.kernel == "wgmma" and ln.tile_m in (8, 16, 32, 64, 128, 256)
                assert ln.bit_path == (p.decode != "table")
            kind = ln.tile_m or ln.kernel
            step = t.geometry[kind][1]
            assert LP.splits_fill_steps(-(-k // step), ln.splits), (name, m, n, k, ln)  # no empty split
            assert ln.cluster in (1, 2) and (ln.cluster == 1 or ln.tile_m == 256)
            if ln.final:  # the kernel writes y itself: one split, y in x's dtype or f32
                assert ln.splits == 1
                assert np.dtype(out) in (np.dtype(x_dtype), np.dtype(np.float32))
        assert row == m
        if len(p.launches) == 2:  # a ragged last 256-row tile
            assert p.launches[0].rows % 256 == 0 and 0 < p.launches[1].rows <= 128
    assert fused > 100, name


def test_plan_coverage_limits():
    """None (dequantize + dot) past the size limit, for float32 x, formats without a fused
    decode, K % 32 != 0 and block sizes that are not powers of two >= 16; a prepared
    weight runs the wgmma kernel at any M."""
    h100, a100 = GPUS["H100"], GPUS["A100"]
    nv = WEIGHTS[0]
    lim = LP.wgmma_max_m("nvfp4", folded=True)
    assert _plan(lim, 4096, 4096, nv, h100) is not None
    assert _plan(lim + 1, 4096, 4096, nv, h100) is None
    assert _plan(lim + 1, 4096, 4096, nv, h100, tiled=True) is not None
    mma = LP.TUNING.max_m_mma_sync
    assert _plan(mma, 4096, 4096, nv, a100) is not None and _plan(mma + 1, 4096, 4096, nv, a100) is None
    assert _plan(mma + 1, 4096, 4096, nv, a100, tiled=True) is None
    assert _plan(16, 4096, 4096, nv, h100, x_dtype=np.float32) is None
    assert _plan(16, 4096, 4096, ("mxfp6_e2m3", 32, np.uint8, False), h100) is None
    assert _plan(16, 4096, 4016, nv, h100) is None
    assert _plan(16, 4096, 4096, ("int4", 48, BF16, False), h100) is None
    assert _plan(16, 4096, 4096, ("int4", 8, BF16, False), h100) is None
    assert _plan(0, 4096, 4096, nv, h100) is None


def test_plan_by_gpu():
    """The same problem on each GPU: the wgmma kernel only on sm_90 with an sm_90a build;
    the split count follows the SM count."""
    w = WEIGHTS[0]
    plans = {name: _plan(1, 4096, 4096, w, gpu) for name, gpu in GPUS.items()}
    assert {name for name, p in plans.items() if p.launches[0].tile_m} == {"H100", "H200", "H100 PCIe"}
    assert plans["A100"].launches[0].kernel == plans["B200"].launches[0].kernel == "direct"
    # the grid follows the GPU's SM count (wave fill), not the machine that plans
    p148 = _plan(1, 4096, 4096, w, GpuProps(9, 148, ("90a",)))
    p16 = _plan(1, 4096, 4096, w, GpuProps(9, 16, ("90a",)))
    assert p16.launches[0].splits < p148.launches[0].splits
    # known plans: M = 300 on a wide weight runs 256 rows, then 44 on the 64-row tile
    p = _plan(300, 28672, 8192, w, GPUS["H100"])
    assert [(ln.rows, ln.tile_m) for ln in p.launches] == [(256, 256), (44, 64)]
    # 2-CTA clusters (x multicast) from M = 2048 for nvfp4 at tile_m = 256, linear layout only
    assert _plan(2048, 28672, 8192, w, GPUS["H100"]).launches[0].cluster == 2
    assert _plan(2048, 28672, 8192, w, GPUS["H100"], tiled=True).launches[0].cluster == 1
    assert _plan(1024, 28672, 8192, w, GPUS["H100"]).launches[0].cluster == 1


def test_plan_reads_its_table():
    """The plan follows the tuning table it is given (and TUNING by default)."""
    w, a100 = WEIGHTS[2], GPUS["A100"]
    assert _plan(100, 4096, 4096, w, a100) is None
    table = dataclasses.replace(LP.TUNING, max_m_mma_sync=128)
    assert _plan(100, 4096, 4096, w, a100, table=table) is not None
    never = dataclasses.replace(LP.TUNING, multicast_min_m=dict.fromkeys(LP.TUNING.formats, None))
    assert _plan(4096, 28672, 8192, w, GPUS["H100"]).launches[0].cluster == 2
    assert _plan(4096, 28672, 8192, w, GPUS["H100"], table=never).launches[0].cluster == 1
