"""NVIDIA ModelOpt NVFP4 (TensorRT-LLM, vLLM ``modelopt_fp4``, SGLang).

Source: NVIDIA/TensorRT-Model-Optimizer ``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``
and ``modelopt/torch/export/unified_export_hf.py``; vLLM ``nvfp4_emulation_utils``
(SEEDS_API.md 004, ``dequantize_to_dtype``).

Per Linear ``p``: ``p.weight`` uint8 (out, in/2), element 2j in the low nibble;
``p.weight_scale`` float8_e4m3fn (out, in/16); ``p.weight_scale_2`` float32 scalar, the
per-tensor *decode* scale amax/(6*448) (a multiplier); optional ``p.input_scale`` float32
(kept as a plain tensor). ``hf_quant_config.json``: ``{"producer": {"name": "modelopt"},
"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": [...]}}``;
recent exports also put ``{"quant_method": "modelopt", "quant_algo": "NVFP4"}`` under
config.json's ``quantization_config``.

Decoded ``e2m1 * f32(f32(weight_scale) * weight_scale_2)``, which is exactly the nvfp4
QArray with ``tensor_scale = weight_scale_2``: bit for bit.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ._common import (host_parts, model_dtype, module_of, pack_nibbles, packed_fp4_weight,
                      qarray, require)

NAME = "modelopt"
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def detect(ckpt) -> bool:
    qc = ckpt.quantization_config
    if qc.get("quant_method") == "modelopt" or ckpt.hf_quant.get("quantization"):
        return True
    return any(n.endswith(".weight_scale_2") for n in ckpt.tensors)


def load(ckpt) -> dict:
    algo = (ckpt.hf_quant.get("quantization") or {}).get("quant_algo") \
        or ckpt.quantization_config.get("quant_algo") or "NVFP4"
    if algo != "NVFP4":
        from ..safetensors import CheckpointError
        raise CheckpointError(f"{ckpt.where}: ModelOpt quant_algo {algo!r} is not supported "
                              "(expected 'NVFP4')")
    out = {}
    for p in ckpt.prefixes(".weight_scale_2"):
        w, rows, k = packed_fp4_weight(ckpt, p + ".weight")
        s = ckpt.take(p + ".weight_scale", E4M3, (rows, k // 16))
        ws2 = ckpt.take(p + ".weight_scale_2", np.float32)
        if ws2.size != 1:
            ckpt.fail(p + ".weight_scale_2", f"expected 1 element, got shape {ws2.shape}")
        out[p + ".weight"] = qarray("nvfp4", w, s, shape=(rows, k), dtype=model_dtype(ckpt),
                                    block_size=16, tensor_scale=ws2.reshape(()))
    return out


def save(flat) -> tuple:
    tensors, excluded, n = {}, [], 0
    for name, v in flat.items():
        if not hasattr(v, "fmt"):
            tensors[name] = np.asarray(v)
            continue
        require(name, v, ("nvfp4",), tensor_scale=True, convention=NAME)
        p = module_of(name, NAME)
        codes, scales, _, ts = host_parts(v)
        tensors[p + ".weight"] = pack_nibbles(codes)
        tensors[p + ".weight_scale"] = scales
        tensors[p + ".weight_scale_2"] = np.float32(ts).reshape(())
        n += 1
    if not n:
        return tensors, None, {}
    qc = {"quant_method": NAME, "quant_algo": "NVFP4", "group_size": 16,
          "kv_cache_quant_algo": None, "exclude_modules": excluded}
    hf = {"producer": {"name": "modelopt", "version": "jax-fp4"},
          "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                           "group_size": 16, "exclude_modules": excluded}}
    return tensors, qc, {"hf_quant_config.json": hf}
