"""AutoAWQ GEMM (``version: "gemm"``), as read by transformers / vLLM ``awq``.

Source: casper-hansen/AutoAWQ ``awq/utils/packing_utils.py`` (``unpack_awq``,
``reverse_awq_order``, ``dequantize_gemm``) and ``awq/modules/linear/gemm.py``
(``WQLinear_GEMM.from_linear``); SEEDS_API.md 001 (InfiniCore's kernel reads the same).

Per Linear ``p``: ``p.qweight`` int32 (in, out/8); ``p.qzeros`` int32 (in/group, out/8);
``p.scales`` float16 (in/group, out). Eight 4-bit values per word in AWQ's interleaved
order: nibble i (bits 4i..4i+3) of word j holds column 8j + [0, 2, 4, 6, 1, 3, 5, 7][i].
Decoded ``(q - z) * s`` in float16 (one rounding): the int4 QArray (out, in) with the
transposed codes, zero points and scales, bit for bit.
"""
from __future__ import annotations

import numpy as np

from ._common import host_parts, int4_from_kn, module_of, pack_int32, require, unpack_int32

NAME = "awq"
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def detect(ckpt) -> bool:
    qc = ckpt.quantization_config
    if qc:
        return qc.get("quant_method") == "awq"
    for p in ckpt.prefixes(".qweight"):
        s = ckpt.tensors.get(p + ".scales")
        q = ckpt.tensors[p + ".qweight"]
        if s is not None and p + ".g_idx" not in ckpt.tensors and s.shape[-1] == 8 * q.shape[-1]:
            return True
    return False


def load(ckpt) -> dict:
    qc = ckpt.quantization_config
    if qc and (qc.get("bits", qc.get("w_bit", 4)) != 4
               or str(qc.get("version", "gemm")).lower() != "gemm"):
        from ..safetensors import CheckpointError
        raise CheckpointError(f"{ckpt.where}: only 4-bit AWQ GEMM is supported; the config "
                              f"says bits={qc.get('bits')}, version={qc.get('version')!r}")
    out = {}
    for p in ckpt.prefixes(".qweight"):
        qw = ckpt.take(p + ".qweight", np.int32)
        n = 8 * qw.shape[1]
        s = ckpt.take(p + ".scales", np.float16)
        ckpt.check(p + ".scales", s, None, (s.shape[0], n))
        qz = ckpt.take(p + ".qzeros", np.int32, (s.shape[0], n // 8))
        out[p + ".weight"] = int4_from_kn(ckpt, p, unpack_int32(qw, ORDER),
                                          unpack_int32(qz, ORDER), s)
    return out


def save(flat) -> tuple:
    tensors, groups = {}, set()
    for name, v in flat.items():
        if not hasattr(v, "fmt"):
            tensors[name] = np.asarray(v)
            continue
        require(name, v, ("int4",), scale_dtype=np.float16, convention=NAME)
        p = module_of(name, NAME)
        if v.shape[0] % 8:
            raise ValueError(f"tree: {NAME} packs 8 output rows per int32; {name!r} has "
                             f"{v.shape[0]}")
        codes, scales, zeros, _ = host_parts(v)
        tensors[p + ".qweight"] = pack_int32(codes.T, ORDER)
        tensors[p + ".qzeros"] = pack_int32(zeros.T, ORDER)
        tensors[p + ".scales"] = np.ascontiguousarray(scales.T)
        groups.add(v.block_size)
    if not groups:
        return tensors, None, {}
    if len(groups) > 1:
        raise ValueError(f"tree: one {NAME} checkpoint has one group size; got {sorted(groups)}")
    qc = {"quant_method": NAME, "bits": 4, "group_size": groups.pop(), "zero_point": True,
          "version": "gemm", "modules_to_not_convert": None}
    return tensors, qc, {}
