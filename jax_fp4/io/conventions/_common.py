"""Shared plumbing of the checkpoint conventions: reading a file or an HF model directory
into host arrays, checked tensor access, nibble and int32 (un)packing, writing.

Everything here works on NumPy arrays on the host: a convention converts the whole
checkpoint before any QArray is built, so a bad tensor raises before anything is returned.
"""
from __future__ import annotations

import json
import math
import os
import struct
from typing import Dict

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ...qarray import QArray
from ..safetensors import CheckpointError, read_header

CONFIG_META_KEY = "quantization_config"  # a single file's stand-in for config.json's entry


class Checkpoint:
    """A checkpoint read into memory.

    Attributes:
      where: the path given (file or directory), used in error messages.
      tensors: {name: numpy array} of every tensor of every shard, in file order.
      config: config.json as a dict ({} if absent); for a single file, the
        ``quantization_config`` stored in its header metadata (written by
        :func:`jax_fp4.io.save` for foreign conventions) is placed under that key.
      hf_quant: hf_quant_config.json (ModelOpt) as a dict ({} if absent).
      metadata: the ``__metadata__`` of the first shard.
    """

    def __init__(self, where, tensors, config, hf_quant, metadata):
        self.where, self.tensors, self.config = where, tensors, config
        self.hf_quant, self.metadata = hf_quant, metadata

    @property
    def quantization_config(self) -> dict:
        return self.config.get("quantization_config") or {}

    def take(self, name, dtype=None, shape=None, what=""):
        """Remove and return tensor ``name``, checking its dtype and shape.

        Raises:
          CheckpointError: missing tensor, or dtype/shape other than expected.
        """
        if name not in self.tensors:
            raise CheckpointError(f"{self.where}: tensor {name!r} is missing{what and ' (' + what + ')'}")
        a = self.tensors.pop(name)
        self.check(name, a, dtype, shape)
        return a

    def check(self, name, a, dtype=None, shape=None):
        if dtype is not None:
            ok = tuple(np.dtype(d) for d in (dtype if isinstance(dtype, tuple) else (dtype,)))
            if a.dtype not in ok:
                raise CheckpointError(
                    f"{self.where}: tensor {name!r}: expected dtype "
                    f"{' or '.join(d.name for d in ok)}, got {a.dtype.name}")
        if shape is not None and tuple(a.shape) != tuple(shape):
            raise CheckpointError(f"{self.where}: tensor {name!r}: expected shape "
                                  f"{tuple(shape)}, got {tuple(a.shape)}")

    def fail(self, name, msg):
        raise CheckpointError(f"{self.where}: tensor {name!r}: {msg}")

    def prefixes(self, suffix):
        """Module names p with a tensor ``p + suffix``, in file order."""
        return [n[: -len(suffix)] for n in self.tensors if n.endswith(suffix)]


def _read_file(path) -> tuple:
    header, meta, _ = read_header(path)
    with open(path, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        blob = fh.read()
    base = n
    out = {}
    for name, t in header.items():
        b, e = t["offsets"]
        out[name] = np.frombuffer(blob, t["dtype"], count=math.prod(t["shape"]),
                                  offset=base + b).reshape(t["shape"])
    return out, meta


def _json(path, where):
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as fh:
            d = json.load(fh)
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        return d
    except ValueError as e:
        raise CheckpointError(f"{where}: corrupt {os.path.basename(path)}: {e}") from None


def read_checkpoint(path) -> Checkpoint:
    """Read a safetensors file, or an HF model directory (``model.safetensors``, sharded
    ``model.safetensors.index.json``, or every ``*.safetensors`` in it, plus
    ``config.json`` and ``hf_quant_config.json``).

    Raises:
      FileNotFoundError: no such file or directory, or a directory without safetensors.
      CheckpointError: a truncated/corrupt shard or JSON file; a shard listed in the index
        that is missing; a tensor name in two shards.
    """
    where = os.fspath(path)
    if not os.path.isdir(where):
        tensors, meta = _read_file(where)
        cfg = {}
        if CONFIG_META_KEY in meta:
            try:
                cfg = {"quantization_config": json.loads(meta[CONFIG_META_KEY])}
            except ValueError as e:
                raise CheckpointError(f"{where}: corrupt {CONFIG_META_KEY!r} metadata: {e}") \
                    from None
        return Checkpoint(where, tensors, cfg, {}, meta)
    config = _json(os.path.join(where, "config.json"), where)
    hf_quant = _json(os.path.join(where, "hf_quant_config.json"), where)
    index = os.path.join(where, "model.safetensors.index.json")
    if os.path.exists(index):
        wm = _json(index, where).get("weight_map")
        if not isinstance(wm, dict):
            raise CheckpointError(f"{where}: model.safetensors.index.json has no weight_map")
        files = list(dict.fromkeys(wm.values()))
        for f in files:
            if not os.path.exists(os.path.join(where, f)):
                raise CheckpointError(f"{where}: shard {f!r} listed in "
                                      "model.safetensors.index.json is missing")
    else:
        files = sorted(f for f in os.listdir(where) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"{where}: no *.safetensors file in this directory")
    tensors: Dict[str, np.ndarray] = {}
    meta0 = None
    for f in files:
        t, meta = _read_file(os.path.join(where, f))
        meta0 = meta if meta0 is None else meta0
        for k, v in t.items():
            if k in tensors:
                raise CheckpointError(f"{where}: tensor {k!r} is stored in two shards")
            tensors[k] = v
    if os.path.exists(index):
        missing = [k for k in wm if k not in tensors]
        if missing:
            raise CheckpointError(f"{where}: tensor {missing[0]!r} is listed in the index but "
                                  f"not in shard {wm[missing[0]]!r}")
    return Checkpoint(where, tensors, config, hf_quant, meta0 or {})


def model_dtype(ckpt: Checkpoint, default="bfloat16"):
    """The model's floating dtype from config.json (``torch_dtype`` / ``dtype``)."""
    name = ckpt.config.get("torch_dtype") or ckpt.config.get("dtype") or default
    try:
        return np.dtype(getattr(ml_dtypes, name, None) or name)
    except TypeError:
        raise CheckpointError(f"{ckpt.where}: config.json: unknown dtype {name!r}") from None


def packed_fp4_weight(ckpt: Checkpoint, name):
    """The uint8 tensor ``name`` of two E2M1 codes per byte, (out, in / 2), and its logical
    (out, in); CheckpointError naming it if it is not 2-D."""
    w = ckpt.take(name, np.uint8)
    if w.ndim != 2:
        ckpt.fail(name, f"expected a 2-D (out, in/2) uint8 tensor, got {w.shape}")
    return w, w.shape[0], 2 * w.shape[1]


# ----------------------------------------------------------------------------- bits
def swap_nibbles(b):
    """uint8 bytes with the two 4-bit halves exchanged (high-nibble-first <-> ours)."""
    b = np.asarray(b, np.uint8)
    return ((b & 0xF) << 4) | (b >> 4)


def unpack_nibbles(b):
    """uint8 (..., n) -> codes (..., 2n), element 2j = low nibble of byte j."""
    b = np.asarray(b, np.uint8)
    return np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])


def pack_nibbles(c):
    """codes (..., 2n) in [0, 16) -> uint8 (..., n), element 2j in the low nibble."""
    c = np.asarray(c, np.uint8).reshape(*np.shape(c)[:-1], -1, 2)
    return (c[..., 0] & 0xF) | (c[..., 1] << 4)


def unpack_int32(w, order=None):
    """int32 words (..., n) -> 4-bit codes (..., 8n) uint8. Nibble i (bits 4i..4i+3) of
    word j goes to element 8j + order[i] (default: 8j + i)."""
    u = np.asarray(w).view(np.uint32)
    nib = ((u[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF).astype(np.uint8)
    if order is not None:
        nib = nib[..., np.argsort(order)]
    return nib.reshape(*u.shape[:-1], 8 * u.shape[-1])


def pack_int32(c, order=None):
    """Inverse of :func:`unpack_int32`: codes (..., 8n) -> int32 (..., n)."""
    c = np.asarray(c, np.uint32).reshape(*np.shape(c)[:-1], -1, 8)
    if order is not None:
        c = c[..., list(order)]
    w = np.bitwise_or.reduce(c << (4 * np.arange(8, dtype=np.uint32)), axis=-1)
    return w.astype(np.uint32).view(np.int32)


# ----------------------------------------------------------------------------- QArrays
def qarray(fmt, data, scales, *, shape, dtype, block_size, tensor_scale=None, zeros=None):
    """A 2-D (out, in) QArray blocked along axis 1 from host arrays."""
    return QArray(jnp.asarray(data), jnp.asarray(scales),
                  None if tensor_scale is None else jnp.asarray(np.float32(tensor_scale)),
                  None if zeros is None else jnp.asarray(zeros), format=fmt, axis=1,
                  shape=shape, dtype=dtype, block_size=block_size)


def host_parts(q: QArray):
    """(codes (out, in) uint8, scales (out, in/bs), zeros or None, tensor_scale or None)
    of a 2-D QArray in the linear layout, as NumPy."""
    from ...ops import unprepare
    from ... import layout

    q = unprepare(q)
    out, k = q.shape
    scales = np.asarray(q.scales)
    if q.scale_layout == "swizzled":
        scales = np.asarray(layout.from_blocked(q.scales, (out, k // q.block_size)))
    codes = unpack_nibbles(np.asarray(q.data))
    zeros = None if q.zeros is None else np.asarray(q.zeros)
    ts = None if q.tensor_scale is None else np.float32(np.asarray(q.tensor_scale))
    return codes, scales, zeros, ts


def require(name, q, formats, *, tensor_scale=None, block_size=None, scale_dtype=None,
            convention=""):
    """Check a tree leaf is a 2-D QArray (out, in) blocked along axis 1 in one of
    ``formats``; raise ValueError naming it otherwise."""
    if not isinstance(q, QArray):
        raise TypeError(f"tree: {name!r} must be a QArray to be saved as {convention}, got "
                        f"{type(q).__name__}")
    want = f"a 2-D (out, in) {'/'.join(formats)} QArray blocked along axis 1"
    if q.format not in formats or q.ndim != 2 or q.axis != 1:
        raise ValueError(f"tree: {convention} stores {want} as {name!r}; got {q!r}")
    if tensor_scale is not None and (q.tensor_scale is not None) != tensor_scale:
        raise ValueError(f"tree: {convention} needs {name!r} "
                         f"{'with' if tensor_scale else 'without'} a tensor_scale; got {q!r}")
    if block_size is not None and q.block_size not in block_size:
        raise ValueError(f"tree: {convention}: {name!r} has block_size {q.block_size}; "
                         f"expected one of {sorted(block_size)}")
    if scale_dtype is not None and np.dtype(q.scales.dtype) != np.dtype(scale_dtype):
        raise ValueError(f"tree: {convention}: {name!r} has {np.dtype(q.scales.dtype).name} "
                         f"scales; expected {np.dtype(scale_dtype).name} (quantize with "
                         f"scale_dtype={np.dtype(scale_dtype).name})")


def module_of(name, convention):
    if not name.endswith(".weight"):
        raise ValueError(f"tree: {convention} names a quantized Linear '<module>.weight'; "
                         f"got the QArray {name!r}")
    return name[: -len(".weight")]


def blocks_from_g_idx(ckpt, name, g_idx, k, n_groups):
    """Turn a GPTQ-style ``g_idx`` (column -> group) into contiguous blocks.

    Our int4 QArray gives each run of ``block_size`` consecutive columns one scale and zero
    point. With act-order (desc_act) the groups are not contiguous runs, so the largest
    block size b that divides k and keeps g_idx constant within every aligned run of b
    columns is used (often 1), and each block takes its group's scale and zero point:
    the same values, exactly, at the cost of larger scale/zero tensors.

    Returns:
      (block_size, groups): groups (k / block_size,) int, the group of each block.
    Raises:
      CheckpointError: g_idx of the wrong length or with a group outside [0, n_groups).
    """
    g = np.asarray(g_idx).astype(np.int64).reshape(-1)
    if g.shape != (k,):
        ckpt.fail(name, f"expected shape ({k},) (one group per input column), got "
                        f"{tuple(np.shape(g_idx))}")
    if g.size and (g.min() < 0 or g.max() >= n_groups):
        ckpt.fail(name, f"expected groups in [0, {n_groups}), found [{g.min()}, {g.max()}]")
    for b in sorted((d for d in range(1, k + 1) if k % d == 0), reverse=True):
        runs = g.reshape(-1, b)
        if (runs == runs[:, :1]).all():
            return b, runs[:, 0]
    raise AssertionError("unreachable: b = 1 always qualifies")


def int4_from_kn(ckpt, p, codes_kn, zeros_gn, scales_gn, g_idx=None):
    """int4 QArray (out, in) from (in, out)-oriented codes, (groups, out) zero points and
    scales (AutoAWQ / GPTQ keep weights transposed, K = in first). Groups are contiguous
    runs of in/groups columns unless ``g_idx`` maps columns to groups."""
    k, n = codes_kn.shape
    g = scales_gn.shape[0]
    if g == 0 or k % g:
        ckpt.fail(p + ".scales", f"expected (groups, {n}) with groups dividing in = {k}, got "
                                 f"{scales_gn.shape}")
    block, grp = k // g, None
    if g_idx is not None:
        block, grp = blocks_from_g_idx(ckpt, p + ".g_idx", g_idx, k, g)
        if block == k // g and (grp == np.arange(g)).all():
            grp = None
    s, z = scales_gn.T, zeros_gn.T
    if grp is not None:
        s, z = s[:, grp], z[:, grp]
    return qarray("int4", pack_nibbles(codes_kn.T), np.ascontiguousarray(s), shape=(n, k),
                  dtype=scales_gn.dtype, block_size=block, zeros=np.ascontiguousarray(z))
