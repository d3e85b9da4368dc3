"""bitsandbytes 4-bit (NF4 / FP4) as transformers serializes ``Linear4bit`` weights.

Source: bitsandbytes 0.50 ``functional.py`` (``QuantState.as_dict(packed=True)`` /
``from_dict``, ``dequantize_4bit``, ``dequantize_blockwise``), SEEDS_API.md 003.

Per Linear ``p`` (``W = p.weight``):
  ``W`` uint8 (ceil(n/2), 1): the codes of the *flattened* (out, in) weight, element 2j in
  the HIGH nibble of byte j; blocks of ``blocksize`` run over the flattened tensor;
  ``W.absmax`` float32 (n/blocksize,), or with double quantization (``compress_statistics``)
  uint8 codes of the absmax plus ``W.nested_absmax`` float32 (per 256 absmax values),
  ``W.nested_quant_map`` float32 (256,) and the float ``nested_offset``; ``W.quant_map``
  float32 (16,), the NF4 or FP4 table; ``W.quant_state.bitsandbytes__{nf4,fp4}`` uint8: the
  JSON of {quant_type, blocksize, dtype, shape, nested_blocksize, nested_dtype,
  nested_offset}.

Decoded ``quant_map[code] * absmax[block]`` in float32, rounded to ``dtype``; the nested
absmax is ``nested_quant_map[code] * nested_absmax[i // nested_blocksize] + nested_offset``
in float32. jax-fp4 stores the float32 absmax that this nested decode produces (our nf4 /
bnb_fp4 QArrays keep float32 absmax), so the weight values are bit for bit bitsandbytes'
own; saving writes plain float32 absmax (no double quantization). When the blocks line up
with rows (in % blocksize == 0, blocksize a power of two in [32, 4096]) the weight becomes
an nf4 / bnb_fp4 QArray (out, in) blocked along axis 1; otherwise it is returned as the
dense array bitsandbytes decodes (exact, not quantized).
"""
from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np

from ...formats import get_format
from ._common import host_parts, module_of, pack_nibbles, qarray, require, swap_nibbles

NAME = "bitsandbytes"
_KEY = ".quant_state.bitsandbytes__"
_FMT = {"nf4": "nf4", "fp4": "bnb_fp4"}


def detect(ckpt) -> bool:
    if ckpt.quantization_config:
        return ckpt.quantization_config.get("quant_method") == "bitsandbytes"
    return any(_KEY in n for n in ckpt.tensors)


def _state(ckpt, name):
    raw = ckpt.take(name, np.uint8)
    try:
        st = json.loads(bytes(raw.reshape(-1)).decode("utf-8"))
        qt, bs, dt, shape = st["quant_type"], int(st["blocksize"]), st["dtype"], st["shape"]
    except (ValueError, KeyError, TypeError) as e:
        ckpt.fail(name, f"corrupt packed quant state: {e}")
    if qt not in _FMT or not name.endswith(qt):
        ckpt.fail(name, f"expected quant_type 'nf4' or 'fp4' matching the key, got {qt!r}")
    return st, qt, bs, np.dtype(getattr(ml_dtypes, dt, None) or dt), tuple(int(d) for d in shape)


def _absmax(ckpt, w, nb, st):
    a = ckpt.take(w + ".absmax", (np.float32, np.uint8), (nb,))
    if a.dtype == np.float32:
        if w + ".nested_absmax" in ckpt.tensors:
            ckpt.fail(w + ".absmax", "float32 absmax with a nested_absmax: expected uint8 codes")
        return a
    if "nested_offset" not in st:
        ckpt.fail(w + ".absmax", "uint8 (double-quantized) absmax without nested_offset in "
                                 "the quant state")
    nbs = int(st.get("nested_blocksize", 256))
    nested = ckpt.take(w + ".nested_absmax", np.float32, (math.ceil(nb / nbs),))
    qmap = ckpt.take(w + ".nested_quant_map", np.float32, (256,))
    prod = qmap[a] * np.repeat(nested, nbs)[:nb]  # float32 products, as bitsandbytes
    return (prod + np.float32(st["nested_offset"])).astype(np.float32)


def load(ckpt) -> dict:
    out = {}
    for key in [n for n in ckpt.tensors if _KEY in n]:
        w = key[: key.index(_KEY)]
        st, qt, bs, dtype, shape = _state(ckpt, key)
        n = math.prod(shape)
        data = ckpt.take(w, np.uint8)
        if data.size != (n + 1) // 2:
            ckpt.fail(w, f"expected {(n + 1) // 2} bytes for a {shape} weight, got {data.size}")
        nb = math.ceil(n / bs)
        absmax = _absmax(ckpt, w, nb, st)
        table = ckpt.take(w + ".quant_map", np.float32, (16,))
        fmt = get_format(_FMT[qt])
        if not np.array_equal(table.view(np.uint32), fmt.table.view(np.uint32)):
            ckpt.fail(w + ".quant_map", f"expected bitsandbytes' {qt} table {fmt.table}, "
                                        f"got {table}")
        data = swap_nibbles(data.reshape(-1))
        rows_ok = len(shape) == 2 and shape[1] % bs == 0 and shape[1] % 2 == 0
        try:
            fmt.check_block_size(bs)
        except ValueError:
            rows_ok = False
        if rows_ok:
            out[w] = qarray(fmt.name, data.reshape(shape[0], shape[1] // 2),
                            absmax.reshape(shape[0], shape[1] // bs), shape=shape,
                            dtype=dtype, block_size=bs)
            continue
        codes = np.stack([data & 0xF, data >> 4], -1).reshape(-1)[:n]
        codes = np.pad(codes, (0, nb * bs - n)).reshape(nb, bs)
        vals = (fmt.table[codes] * absmax[:, None]).reshape(-1)[:n]
        out[w] = vals.astype(dtype).reshape(shape)
    return out


def save(flat) -> tuple:
    tensors, qts, dtypes = {}, set(), set()
    for name, v in flat.items():
        if not hasattr(v, "fmt"):
            tensors[name] = np.asarray(v)
            continue
        require(name, v, ("nf4", "bnb_fp4"), convention=NAME)
        module_of(name, NAME)
        codes, scales, _, _ = host_parts(v)
        qt = "nf4" if v.format == "nf4" else "fp4"
        qts.add(qt)
        dtypes.add(v.dtype.name)
        tensors[name] = swap_nibbles(pack_nibbles(codes)).reshape(-1, 1)
        tensors[name + ".absmax"] = scales.astype(np.float32).reshape(-1)
        tensors[name + ".quant_map"] = v.fmt.table.copy()
        st = {"quant_type": qt, "blocksize": v.block_size, "dtype": v.dtype.name,
              "shape": list(v.shape)}
        tensors[name + _KEY + qt] = np.frombuffer(json.dumps(st).encode(), np.uint8).copy()
    if not qts:
        return tensors, None, {}
    if len(qts) > 1 or len(dtypes) > 1:
        raise ValueError(f"tree: one {NAME} checkpoint holds one quant type and compute "
                         f"dtype; got {sorted(qts)}, {sorted(dtypes)}")
    qc = {"quant_method": NAME, "load_in_4bit": True, "load_in_8bit": False,
          "bnb_4bit_quant_type": qts.pop(), "bnb_4bit_use_double_quant": False,
          "bnb_4bit_compute_dtype": dtypes.pop(), "bnb_4bit_quant_storage": "uint8",
          "llm_int8_skip_modules": None}
    return tensors, qc, {}
