"""compressed-tensors (llm-compressor, vLLM): ``nvfp4-pack-quantized`` and
``pack-quantized`` (int4 W4A16).

Source: neuralmagic/compressed-tensors 0.20, ``compressors/nvfp4/{base,helpers}.py`` and
``compressors/pack_quantized/{base,helpers}.py``, ``quantization/lifecycle/forward_helpers.py``
(``_dequantize``).

nvfp4-pack-quantized, per Linear ``p``:
  ``p.weight_packed`` uint8 (out, in/2), element 2j in the low nibble (E2M1 codes);
  ``p.weight_scale`` float8_e4m3fn (out, in/16); ``p.weight_global_scale`` float32 (1,),
  a *divisor*: 448*6/amax; optional ``p.input_global_scale`` float32 (1,) (kept as a plain
  tensor). compressed-tensors decodes ``bf16(e2m1 * f32(scale / global_scale))`` (bfloat16
  whatever the model dtype); the QArray (dtype bfloat16) holds
  ``tensor_scale = f32(1 / global_scale)`` and decodes ``e2m1 * f32(scale * tensor_scale)``,
  which can differ by one unit in the last place.
pack-quantized (int4), per Linear ``p``:
  ``p.weight_packed`` int32 (out, ceil(in/8)), eight 4-bit values per word, value i in bits
  4i..4i+3, each stored as q + 8 (q signed in [-8, 7]); ``p.weight_shape`` int (2,) = (out,
  in); ``p.weight_scale`` (out, in/group) in the model dtype (strategy "channel": (out, 1));
  asymmetric: ``p.weight_zero_point`` int32 (ceil(out/8), groups), packed the same way along
  axis 0; optional ``p.weight_g_idx`` (in,) (act-order, see
  :func:`~jax_fp4.io.conventions._common.blocks_from_g_idx`). Decoded as
  ``(q - zp) * scale`` in the scale dtype: the int4 QArray holds codes q + 8 and zero
  points zp + 8 (8 when symmetric), one rounding, bit for bit.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ._common import (blocks_from_g_idx, host_parts, module_of, pack_int32,
                      pack_nibbles, qarray, require, unpack_int32)

NAME = "compressed-tensors"
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_FLOATS = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


def detect(ckpt) -> bool:
    qc = ckpt.quantization_config
    if qc:
        return qc.get("quant_method") == "compressed-tensors"
    return any(n.endswith(".weight_packed") for n in ckpt.tensors)


def _weights_args(ckpt):
    groups = ckpt.quantization_config.get("config_groups") or {}
    for g in groups.values():
        if isinstance(g, dict) and g.get("weights"):
            return g["weights"]
    return {}


def load(ckpt) -> dict:
    out = {}
    args = _weights_args(ckpt)
    if args and args.get("num_bits", 4) != 4:
        raise ckpt_error(ckpt, f"only 4-bit weights are supported, the config says "
                               f"num_bits={args.get('num_bits')}")
    for p in ckpt.prefixes(".weight_packed"):
        packed = ckpt.tensors[p + ".weight_packed"]
        if packed.dtype == np.uint8:
            out[p + ".weight"] = _load_nvfp4(ckpt, p)
        else:
            out[p + ".weight"] = _load_int4(ckpt, p)
    return out


def ckpt_error(ckpt, msg):
    from ..safetensors import CheckpointError

    return CheckpointError(f"{ckpt.where}: {msg}")


def _load_nvfp4(ckpt, p):
    packed = ckpt.take(p + ".weight_packed", np.uint8)
    out, k = packed.shape[0], 2 * packed.shape[1]
    if p + ".weight_zero_point" in ckpt.tensors:
        ckpt.fail(p + ".weight_zero_point", "asymmetric NVFP4 has no jax-fp4 format")
    scale = ckpt.take(p + ".weight_scale", E4M3, (out, k // 16))
    gs = ckpt.take(p + ".weight_global_scale", np.float32)
    if gs.size != 1:
        ckpt.fail(p + ".weight_global_scale", f"expected 1 element, got shape {gs.shape}")
    gs = np.float32(gs.reshape(()))
    if not (np.isfinite(gs) and gs > 0):
        ckpt.fail(p + ".weight_global_scale", f"expected a finite positive divisor, got {gs}")
    ts = np.float32(np.float32(1) / gs)
    # compressed-tensors decompresses NVFP4 to bfloat16 whatever the model dtype
    # (unpack_fp4_from_uint8's default dtype), so that is the QArray's dtype too
    return qarray("nvfp4", packed, scale, shape=(out, k), dtype=ml_dtypes.bfloat16,
                  block_size=16, tensor_scale=ts)


def _load_int4(ckpt, p):
    packed = ckpt.take(p + ".weight_packed", np.int32)
    shp = ckpt.take(p + ".weight_shape", (np.int64, np.int32), (2,))
    out, k = (int(v) for v in shp)
    ckpt.check(p + ".weight_packed", packed, None, (out, -(-k // 8)))
    scale = ckpt.take(p + ".weight_scale", _FLOATS)
    if scale.ndim != 2 or scale.shape[0] != out or k % scale.shape[1]:
        ckpt.fail(p + ".weight_scale", f"expected shape ({out}, in/group) with in = {k}, got "
                                       f"{scale.shape}")
    n_groups = scale.shape[1]
    codes = unpack_int32(packed)[:, :k]
    zname = p + ".weight_zero_point"
    if zname in ckpt.tensors:
        zp = ckpt.take(zname, np.int32, (-(-out // 8), n_groups))
        zeros = unpack_int32(zp.T)[:, :out].T
    else:
        zeros = np.full((out, n_groups), 8, np.uint8)
    block = k // n_groups
    if p + ".weight_g_idx" in ckpt.tensors:
        block, grp = blocks_from_g_idx(ckpt, p + ".weight_g_idx",
                                       ckpt.take(p + ".weight_g_idx"), k, n_groups)
        scale, zeros = scale[:, grp], zeros[:, grp]
    if k % 2:
        ckpt.fail(p + ".weight_shape", f"in = {k} is odd; int4 QArrays pack codes in pairs")
    return qarray("int4", pack_nibbles(codes), np.ascontiguousarray(scale),
                  shape=(out, k), dtype=scale.dtype, block_size=block,
                  zeros=np.ascontiguousarray(zeros))


def save(flat) -> tuple:
    """{name: QArray | array} -> ({tensor: array}, quantization_config, {file: dict})."""
    tensors, fmts, modules, gsize, sym = {}, set(), [], set(), True
    for name, v in flat.items():
        if not hasattr(v, "fmt"):
            tensors[name] = np.asarray(v)
            continue
        require(name, v, ("nvfp4", "int4"), convention=NAME)
        p = module_of(name, NAME)
        modules.append(p)
        codes, scales, zeros, ts = host_parts(v)
        fmts.add(v.format)
        gsize.add(v.block_size)
        if v.format == "nvfp4":
            require(name, v, ("nvfp4",), tensor_scale=True, convention=NAME)
            tensors[p + ".weight_packed"] = pack_nibbles(codes)
            tensors[p + ".weight_scale"] = scales
            tensors[p + ".weight_global_scale"] = np.float32([np.float32(1) / ts])
        else:
            out, k = v.shape
            pad = -k % 8
            tensors[p + ".weight_packed"] = pack_int32(np.pad(codes, ((0, 0), (0, pad))))
            tensors[p + ".weight_shape"] = np.array([out, k], np.int64)
            tensors[p + ".weight_scale"] = scales
            if (zeros != 8).any():
                sym = False
            tensors[p + ".weight_zero_point"] = pack_int32(
                np.pad(zeros.T, ((0, 0), (0, -out % 8)))).T.copy()
    if len(fmts) > 1 or len(gsize) > 1:
        raise ValueError(f"tree: one {NAME} checkpoint holds one scheme; got formats "
                         f"{sorted(fmts)} with group sizes {sorted(gsize)}")
    if sym:  # symmetric schemes carry no zero points
        for p in modules:
            tensors.pop(p + ".weight_zero_point", None)
    if not modules:
        return tensors, None, {}
    nv = fmts == {"nvfp4"}
    fmt = "nvfp4-pack-quantized" if nv else "pack-quantized"
    weights = {"num_bits": 4, "type": "float" if nv else "int", "symmetric": sym,
               "strategy": "tensor_group" if nv else "group", "group_size": gsize.pop(),
               "dynamic": False, "actorder": None, "observer": "minmax",
               "block_structure": None, "observer_kwargs": {}}
    qc = {"quant_method": NAME, "format": fmt, "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": sorted(modules), "weights": weights,
                                        "input_activations": None,
                                        "output_activations": None, "format": fmt}},
          "ignore": [], "kv_cache_scheme": None}
    return tensors, qc, {}
