"""LightX2V NVFP4 layers (``MMWeightNvfp4``; SEEDS_API.md 000, ``lightx2v_kernel``).

Per Linear ``p``: ``p.weight`` uint8 (out, in/2), element 2j in the low nibble;
``p.weight_scale`` float8_e4m3fn (ru(out, 128), ru(in/16, 4)) in the 128x4 swizzled
layout (SWZ of SEEDS_API.md, padding 0); ``p.weight_global_scale`` float32 (1,), the
*encode* scale 2688/amax; activation scales ``p.input_global_scale`` + ``p.alpha``
(= 1/(input_global_scale * weight_global_scale)) or ``p.input_absmax``, kept as plain
tensors. Decoded ``e2m1 * s / weight_global_scale``; the nvfp4 QArray holds
``tensor_scale = f32(1 / weight_global_scale)`` (within one unit in the last place) and
linear scales (the swizzle is undone on load and redone on save).
"""
from __future__ import annotations


import ml_dtypes
import numpy as np

from ... import layout
from ._common import (host_parts, model_dtype, module_of, pack_nibbles, packed_fp4_weight,
                      qarray, require)

NAME = "lightx2v"
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def _ru(a, b):
    return -(-a // b) * b


def detect(ckpt) -> bool:
    return any(n.endswith(".weight_global_scale") and n[:-20] + ".weight" in ckpt.tensors
               for n in ckpt.tensors)


def load(ckpt) -> dict:
    out = {}
    for p in ckpt.prefixes(".weight_global_scale"):
        w, rows, k = packed_fp4_weight(ckpt, p + ".weight")
        nb = k // 16
        s = ckpt.take(p + ".weight_scale", E4M3, (_ru(rows, 128), _ru(nb, 4)))
        gs = ckpt.take(p + ".weight_global_scale", np.float32)
        if gs.size != 1 or not (np.isfinite(gs).all() and (gs > 0).all()):
            ckpt.fail(p + ".weight_global_scale", f"expected one finite positive float32, got "
                                                  f"{gs}")
        lin = np.asarray(layout.from_blocked(s.view(np.uint8).reshape(-1), (rows, nb)))
        ts = np.float32(np.float32(1) / np.float32(gs.reshape(())))
        out[p + ".weight"] = qarray("nvfp4", w, lin.view(E4M3), shape=(rows, k),
                                    dtype=model_dtype(ckpt), block_size=16, tensor_scale=ts)
    return out


def save(flat) -> tuple:
    tensors, n = {}, 0
    for name, v in flat.items():
        if not hasattr(v, "fmt"):
            tensors[name] = np.asarray(v)
            continue
        require(name, v, ("nvfp4",), tensor_scale=True, convention=NAME)
        p = module_of(name, NAME)
        rows, k = v.shape
        codes, scales, _, ts = host_parts(v)
        sw = np.asarray(layout.to_blocked(scales.view(np.uint8)))
        tensors[p + ".weight"] = pack_nibbles(codes)
        tensors[p + ".weight_scale"] = sw.view(E4M3).reshape(_ru(rows, 128), _ru(k // 16, 4))
        wgs = np.float32(np.float32(1) / ts)
        tensors[p + ".weight_global_scale"] = np.float32([wgs])
        igs = flat.get(p + ".input_global_scale")
        if igs is not None and p + ".alpha" not in flat:
            tensors[p + ".alpha"] = np.float32([np.float32(1) / (
                np.float32(np.asarray(igs).reshape(())) * wgs)])
        n += 1
    return tensors, None, {}
