"""GPTQ (AutoGPTQ / GPTQModel / transformers / vLLM ``gptq``), 4-bit.

Source: AutoGPTQ ``auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py`` (pack / forward) and
ModelCloud/GPTQModel ``gptqmodel/nn_modules/qlinear/__init__.py`` (``dequantize_weight``,
``checkpoint_format`` gptq vs gptq_v2).

Per Linear ``p``: ``p.qweight`` int32 (in/8, out), packed along *in*: nibble i of word
[r, c] is row 8r + i; ``p.qzeros`` int32 (groups, out/8), nibble i of word [g, j] is column
8j + i; ``p.scales`` float16 (groups, out); ``p.g_idx`` int32 (in,): the group of each input
column (act-order / desc_act makes it a permutation of the contiguous one). The stored
zero point is z - 1 in the classic ``gptq`` checkpoint format (z = stored + 1, so z is in
[1, 16]) and z itself in ``gptq_v2``. Decoded ``scales[g_idx] * (q - z[g_idx])`` in
float16 (one rounding): an int4 QArray, bit for bit; act-order g_idx is handled by
:func:`~jax_fp4.io.conventions._common.blocks_from_g_idx`.
"""
from __future__ import annotations

import numpy as np

from ._common import host_parts, int4_from_kn, module_of, pack_int32, require, unpack_int32

NAME = "gptq"


def detect(ckpt) -> bool:
    qc = ckpt.quantization_config
    if qc:
        return qc.get("quant_method") == "gptq"
    return any(n.endswith(".qweight") for n in ckpt.tensors)


def load(ckpt) -> dict:
    qc = ckpt.quantization_config
    if qc.get("bits", 4) != 4:
        from ..safetensors import CheckpointError
        raise CheckpointError(f"{ckpt.where}: only 4-bit GPTQ is supported; the config says "
                              f"bits={qc.get('bits')}")
    v2 = str(qc.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
    out = {}
    for p in ckpt.prefixes(".qweight"):
        qw = ckpt.take(p + ".qweight", np.int32)
        n = qw.shape[1]
        s = ckpt.take(p + ".scales", np.float16)
        ckpt.check(p + ".scales", s, None, (s.shape[0], n))
        qz = ckpt.take(p + ".qzeros", np.int32, (s.shape[0], -(-n // 8)))
        zeros = unpack_int32(qz)[:, :n] + np.uint8(0 if v2 else 1)
        g_idx = ckpt.take(p + ".g_idx", (np.int32, np.int64)) if p + ".g_idx" in ckpt.tensors \
            else None
        out[p + ".weight"] = int4_from_kn(ckpt, p, unpack_int32(qw.T).T, zeros, s, g_idx)
    return out


def save(flat) -> tuple:
    tensors, groups = {}, set()
    for name, v in flat.items():
        if not hasattr(v, "fmt"):
            tensors[name] = np.asarray(v)
            continue
        require(name, v, ("int4",), scale_dtype=np.float16, convention=NAME)
        p = module_of(name, NAME)
        out, k = v.shape
        if k % 8 or out % 8:
            raise ValueError(f"tree: {NAME} packs 8 values per int32 along both axes; "
                             f"{name!r} has shape {v.shape}")
        codes, scales, zeros, _ = host_parts(v)
        if (zeros == 0).any():
            raise ValueError(f"tree: {NAME} stores zero point - 1 in 4 bits, so zero points "
                             f"must be in [1, 15]; {name!r} has a zero point 0")
        tensors[p + ".qweight"] = np.ascontiguousarray(pack_int32(codes).T)
        tensors[p + ".qzeros"] = pack_int32((zeros - 1).T)
        tensors[p + ".scales"] = np.ascontiguousarray(scales.T)
        tensors[p + ".g_idx"] = (np.arange(k, dtype=np.int32) // v.block_size).astype(np.int32)
        groups.add(v.block_size)
    if not groups:
        return tensors, None, {}
    if len(groups) > 1:
        raise ValueError(f"tree: one {NAME} checkpoint has one group size; got {sorted(groups)}")
    qc = {"quant_method": NAME, "bits": 4, "group_size": groups.pop(), "desc_act": False,
          "sym": False, "checkpoint_format": "gptq", "true_sequential": True}
    return tensors, qc, {}
