"""Save and load pytrees of arrays and QArrays as safetensors files (no pickle).

File layout (a plain safetensors file that any safetensors reader opens):

* every array leaf is one tensor named by its dotted key path
  (:func:`jax_fp4.tree_paths.path_str`, e.g. ``"layers.0.attn.query.bias"``);
* a :class:`~jax_fp4.QArray` leaf named ``W`` is stored as the tensors ``W.qdata`` (codes,
  uint8 or float8, blocked axis last), ``W.scales`` (F8_E4M3 / F8_E8M0 / F32 / BF16 ...),
  ``W.tensor_scale`` (NVFP4 two-level, F32 scalar) and ``W.zeros`` (INT4, U8);
* the header's ``__metadata__`` holds ``"jax_fp4.version": "1"`` and
  ``"jax_fp4.qarrays"``: a JSON object {W: {format, shape, axis, dtype, block_size,
  scale_layout, tensor_scale (bool), zeros (bool), scale_dtype}} from which the expected
  dtype and shape of every part is derived when loading.

* integrity (version "2"): ``"jax_fp4.checksums"`` holds a BLAKE2b-128 digest of every
  tensor's bytes (JSON {"algorithm": "blake2b-128", "tensors": {name: hex}}) and
  ``"jax_fp4.header_checksum"`` a BLAKE2b-128 digest of the 8-byte length prefix and the
  raw header bytes with that value's 32 hex digits read as zeros. Both are verified by
  :func:`load` and :func:`verify`; files of version "1" (before checksums) still load.

Float8 tensors use safetensors' own dtypes (F8_E4M3, F8_E5M2, F8_E8M0); bfloat16 is BF16.
Writing serialises the safetensors layout directly (8-byte little-endian header length,
JSON header padded with spaces to 8 bytes, tensors in order) through
:func:`jax_fp4.io.atomic.atomic_write`; reading parses and checks the header first (so a
truncated or corrupt file names the file and the tensor), then decodes with
``safetensors.deserialize``. docs/checkpoints.md describes the format and its guarantees.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import struct
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ..formats import get_format
from ..ops import prepare, unprepare
from ..qarray import QArray
from .atomic import atomic_write

__all__ = ["save", "load", "read_header", "describe", "verify", "CheckpointError",
           "QARRAY_PARTS", "METADATA_KEY", "VERSION"]

METADATA_KEY = "jax_fp4.qarrays"
CHECKSUMS_KEY = "jax_fp4.checksums"
HEADER_CHECKSUM_KEY = "jax_fp4.header_checksum"
VERSION = "2"
#: versions :func:`load` reads; "1" predates checksums
KNOWN_VERSIONS = ("1", "2")
CHECKSUM_ALGORITHM = "blake2b-128"
_HEADER_SUM_RE = re.compile(rb'"jax_fp4\.header_checksum":"([0-9a-f]{32})"')
#: tensor-name suffixes of a stored QArray, in order
QARRAY_PARTS = ("qdata", "scales", "tensor_scale", "zeros")
_MAX_HEADER = 100 * 1024 * 1024

_ST_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu), "C64": np.dtype(np.complex64),
}
_NP_TO_ST = {v: k for k, v in _ST_DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file is truncated, corrupt, or does not match what was expected.

    The message names the file, the tensor, what was expected and what was found."""


def _st_name(dt) -> str:
    return _NP_TO_ST.get(np.dtype(dt), str(np.dtype(dt)))


def _dt_str(dt) -> str:
    dt = np.dtype(dt)
    return f"{dt.name} ({_NP_TO_ST[dt]})" if dt in _NP_TO_ST else dt.name


# ----------------------------------------------------------------------------- save
def _flatten(tree):
    """pytree -> ({tensor name: np array}, {qarray name: metadata})."""
    from ..tree_paths import path_str

    leaves = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, QArray))[0]
    tensors: Dict[str, np.ndarray] = {}
    qmeta: Dict[str, dict] = {}

    def put(name, arr, path):
        if name in tensors:
            raise ValueError(f"tree: two leaves map to the tensor name {name!r} (the second "
                             f"at {path!r}); rename one")
        tensors[name] = arr

    for path, leaf in leaves:
        name = path_str(path)
        if not name:
            raise ValueError("tree: expected a container (dict, list, module, state) of "
                             "arrays, got a bare leaf; wrap it, e.g. {'w': x}")
        if isinstance(leaf, QArray):
            leaf = unprepare(leaf)  # checkpoints hold the linear layout (PyTorch peers read it)
            f = leaf.fmt
            qmeta[name] = {
                "format": leaf.format, "shape": list(leaf.shape), "axis": leaf.axis,
                "dtype": leaf.dtype.name, "block_size": leaf.block_size,
                "scale_layout": leaf.scale_layout,
                "tensor_scale": leaf.tensor_scale is not None, "zeros": leaf.zeros is not None,
                "scale_dtype": np.dtype(leaf.scales.dtype).name if f.scale_dtype_per_call else None,
            }
            for part, child in zip(QARRAY_PARTS, (leaf.data, leaf.scales, leaf.tensor_scale,
                                                  leaf.zeros)):
                if child is not None:
                    put(f"{name}.{part}", _contiguous(child), name)
            continue
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            if isinstance(leaf, (bool, int, float, np.number)):
                leaf = np.asarray(leaf)
            else:
                raise TypeError(f"tree: leaf {name!r} is a {type(leaf).__name__}, not an array "
                                "or QArray; safetensors stores arrays only")
        arr = _contiguous(leaf)
        if arr.dtype not in _NP_TO_ST:
            raise TypeError(f"tree: leaf {name!r} has dtype {arr.dtype}, which safetensors "
                            "cannot store")
        put(name, arr, name)
    return tensors, qmeta


def _contiguous(x) -> np.ndarray:
    a = np.asarray(x)
    return np.ascontiguousarray(a).reshape(a.shape)  # ascontiguousarray makes 0-d 1-d


def _bytes(a: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array (any dtype, 0-d and empty included)."""
    return memoryview(a.reshape(-1).view(np.uint8))


def save(path, tree, *, metadata: Optional[Dict[str, str]] = None) -> None:
    """Write a pytree of arrays and QArrays to a safetensors file.

    Args:
      path: file to write, replaced atomically (:func:`jax_fp4.io.atomic.atomic_write`:
        a unique temporary file in the same directory, fsync'ed, renamed over ``path``;
        permissions from the umask or kept from the file replaced; a symlink's target is
        replaced; on failure nothing is left behind and the old file stays).
      tree: any pytree (dict, list, Flax Linen params, NNX ``State``, Equinox model, ...)
        whose leaves are arrays (jax or numpy, any dtype safetensors has: float64/32/16,
        bfloat16, float8_e4m3fn/e5m2/e8m0fnu, ints, bool), Python scalars or QArrays.
        Leaves are named by dotted key path; QArrays as described in the module docstring.
      metadata: extra ``{str: str}`` entries for the header's ``__metadata__``.
    Raises:
      TypeError: a leaf that is not an array/QArray, an unstorable dtype, non-string
        metadata.
      ValueError: two leaves with the same name, a bare (non-container) tree, or metadata
        using the reserved ``jax_fp4.`` prefix.
      OSError: the file cannot be written (with its path); the old file is unchanged.
    """
    tensors, qmeta = _flatten(tree)
    meta = {"jax_fp4.version": VERSION, METADATA_KEY: json.dumps(qmeta, sort_keys=True)}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata: expected str -> str, got {k!r}: {type(v).__name__}")
        if k.startswith("jax_fp4."):
            raise ValueError(f"metadata: key {k!r} uses the reserved prefix 'jax_fp4.'")
        meta[k] = v
    meta[CHECKSUMS_KEY] = json.dumps(
        {"algorithm": CHECKSUM_ALGORITHM,
         "tensors": {n: _digest(_bytes(a)) for n, a in tensors.items()}},
        sort_keys=True)
    meta[HEADER_CHECKSUM_KEY] = "0" * 32
    hdr, off = {"__metadata__": meta}, 0
    for name, arr in tensors.items():
        hdr[name] = {"dtype": _NP_TO_ST[arr.dtype], "shape": list(arr.shape),
                     "data_offsets": [off, off + arr.nbytes]}
        off += arr.nbytes
    raw = json.dumps(hdr, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    head = head.replace(b'"' + HEADER_CHECKSUM_KEY.encode() + b'":"' + b"0" * 32 + b'"',
                        b'"' + HEADER_CHECKSUM_KEY.encode() + b'":"'
                        + _digest(head).encode() + b'"', 1)

    def write(fh):
        fh.write(head)
        for arr in tensors.values():
            fh.write(_bytes(arr))

    atomic_write(path, write)


def _digest(buf) -> str:
    """BLAKE2b with a 16-byte digest, as hex: in the standard library, faster than SHA-256
    on 64-bit CPUs, and a cryptographic hash, so no corruption pattern is systematically
    missed."""
    return hashlib.blake2b(buf, digest_size=16).hexdigest()


# ----------------------------------------------------------------------------- read
def read_header(path):
    """Parse and check a safetensors header without reading the tensor data.

    For a jax-fp4 file the header checksum and the ``jax_fp4.*`` metadata (version,
    checksum table) are checked too; the tensors' checksums need the data
    (:func:`verify`, :func:`load`).

    Returns:
      (tensors, metadata, data_size): tensors = {name: {"dtype": np.dtype, "st_dtype":
      str, "shape": tuple, "offsets": (begin, end)}} in file order; metadata = the
      ``__metadata__`` dict (str -> str); data_size = bytes of the data section.
    Raises:
      FileNotFoundError: no such file.
      CheckpointError: truncated file (shorter than its header, or a tensor's bytes past
        the end), a header that is not a JSON object of well-formed entries, an unknown
        dtype, a tensor whose byte length does not match its dtype and shape, overlapping
        or gapped tensors, an unknown ``jax_fp4.version``, a header checksum mismatch.
    """
    path = os.fspath(path)
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: file is truncated: {size} bytes, but a safetensors "
                                  "file starts with an 8-byte header length")
        n = struct.unpack("<Q", head)[0]
        if n > _MAX_HEADER:
            raise CheckpointError(f"{path}: not a safetensors file (header length {n} bytes "
                                  f"is implausible)")
        if 8 + n > size:
            raise CheckpointError(f"{path}: file is truncated: the header says it is {n} "
                                  f"bytes long, but only {size - 8} bytes follow")
        raw = fh.read(n)
    tensors, meta, data_size = _parse_header(path, raw, size - 8 - n)
    _check_jax_fp4_meta(path, meta, head + raw)
    return tensors, meta, data_size


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_header(path, raw: bytes, data_size: int):
    try:
        hdr = json.loads(raw.decode("utf-8"))
        if not isinstance(hdr, dict):
            raise ValueError("the header is not a JSON object")
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from None
    meta = hdr.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{path}: corrupt safetensors header: __metadata__ must be an "
                              f"object of strings, got {json.dumps(meta)[:200]}")
    tensors = {}
    for name, info in hdr.items():
        ok = (isinstance(info, dict) and isinstance(info.get("dtype"), str)
              and isinstance(info.get("shape"), list)
              and all(_is_int(d) and d >= 0 for d in info["shape"])
              and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
              and all(_is_int(o) for o in info["data_offsets"])
              and 0 <= info["data_offsets"][0] <= info["data_offsets"][1])
        if not ok:
            raise CheckpointError(f"{path}: tensor {name!r}: corrupt header entry "
                                  f"{json.dumps(info)[:200]} (expected dtype: str, shape: "
                                  "[non-negative ints], data_offsets: [begin <= end])")
        st, shape, (b, e) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        if st not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r}: unsupported dtype {st!r}")
        dt = _ST_DTYPES[st]
        if e > data_size:
            raise CheckpointError(
                f"{path}: file is truncated: tensor {name!r} needs bytes [{b}, {e}) of the "
                f"data section, which has only {data_size} bytes")
        want = math.prod(shape) * dt.itemsize
        if e - b != want:
            raise CheckpointError(f"{path}: tensor {name!r}: {e - b} bytes stored, but dtype "
                                  f"{st} and shape {shape} need {want}")
        tensors[name] = {"dtype": dt, "st_dtype": st, "shape": shape, "offsets": (b, e)}
    tensors = dict(sorted(tensors.items(), key=lambda kv: kv[1]["offsets"]))
    end = 0
    for name, t in tensors.items():
        if t["offsets"][0] != end:
            raise CheckpointError(f"{path}: tensor {name!r}: starts at byte {t['offsets'][0]} "
                                  f"of the data section, expected {end} (tensors must be "
                                  "contiguous, without overlap)")
        end = t["offsets"][1]
    if end != data_size:
        raise CheckpointError(f"{path}: the data section has {data_size} bytes, but the "
                              f"tensors cover {end}")
    return tensors, meta, data_size


def _check_jax_fp4_meta(path, meta, head: bytes):
    """Version and header checksum of a jax-fp4 file (any file with jax_fp4.* metadata)."""
    ours = [k for k in meta if k.startswith("jax_fp4.")]
    if not ours:
        return
    version = meta.get("jax_fp4.version")
    if version not in KNOWN_VERSIONS:
        raise CheckpointError(
            f"{path}: jax_fp4.version {version!r} is not one this jax-fp4 reads (expected one "
            f"of {KNOWN_VERSIONS}; metadata keys {sorted(ours)})")
    if version == "1":
        if CHECKSUMS_KEY in meta or HEADER_CHECKSUM_KEY in meta:
            raise CheckpointError(f"{path}: jax_fp4.version '1' files have no checksums, but "
                                  "this one has checksum metadata (corrupt version)")
        return
    stored = meta.get(HEADER_CHECKSUM_KEY)
    found = _HEADER_SUM_RE.findall(head)
    if stored is None or len(found) != 1 or found[0].decode() != stored:
        raise CheckpointError(f"{path}: the header checksum ({HEADER_CHECKSUM_KEY}) is missing "
                              f"or malformed: {stored!r}")
    zeroed = _HEADER_SUM_RE.sub(b'"' + HEADER_CHECKSUM_KEY.encode() + b'":"' + b"0" * 32
                                + b'"', head)
    got = _digest(zeroed)
    if got != stored:
        raise CheckpointError(f"{path}: header checksum mismatch (stored {stored}, computed "
                              f"{got}): the header is corrupt")
    _checksums(path, meta)


def _checksums(path, meta) -> Optional[dict]:
    """{tensor name: hex digest} of a version-2 file, None for files without checksums."""
    if meta.get("jax_fp4.version") != "2":
        return None
    try:
        c = json.loads(meta[CHECKSUMS_KEY])
        if c["algorithm"] != CHECKSUM_ALGORITHM:
            raise ValueError(f"unknown algorithm {c['algorithm']!r}")
        sums = c["tensors"]
        if not isinstance(sums, dict) or not all(
                isinstance(v, str) and len(v) == 32 for v in sums.values()):
            raise ValueError("tensors must map names to 32 hex digits")
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupt {CHECKSUMS_KEY!r} metadata: {e}") from None
    return sums


def _verify_data(path, tensors, meta, blob, data_start):
    """Check every tensor's bytes against its recorded checksum (version-2 files)."""
    sums = _checksums(path, meta)
    if sums is None:
        return 0
    if set(sums) != set(tensors):
        missing = sorted(set(tensors) ^ set(sums))[:4]
        raise CheckpointError(f"{path}: the checksum table and the tensors disagree on the "
                              f"tensors {missing}")
    mv = memoryview(blob)
    for name, t in tensors.items():
        b, e = t["offsets"]
        got = _digest(mv[data_start + b:data_start + e])
        if got != sums[name]:
            raise CheckpointError(f"{path}: tensor {name!r}: checksum mismatch (stored "
                                  f"{sums[name]}, computed {got}): its data is corrupt")
    return len(tensors)


_QMETA_FIELDS = {"format": str, "shape": list, "axis": int, "dtype": str,
                 "block_size": int, "scale_layout": str}


def _qmeta(path, meta):
    """The ``jax_fp4.qarrays`` metadata, every entry's fields checked (CheckpointError
    naming the QArray and the field)."""
    raw = meta.get(METADATA_KEY)
    if raw is None:
        return {}
    try:
        qmeta = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"{path}: corrupt {METADATA_KEY!r} metadata: {e}") from None
    if not isinstance(qmeta, dict):
        raise CheckpointError(f"{path}: corrupt {METADATA_KEY!r} metadata: expected a JSON "
                              f"object, got {type(qmeta).__name__}")
    for name, m in qmeta.items():
        def bad(what):
            return CheckpointError(f"{path}: QArray {name!r}: corrupt {METADATA_KEY!r} "
                                   f"metadata: {what}")
        if not isinstance(m, dict):
            raise bad(f"expected an object, got {json.dumps(m)[:100]}")
        for field, typ in _QMETA_FIELDS.items():
            v = m.get(field)
            if not isinstance(v, typ) or isinstance(v, bool):
                raise bad(f"field {field!r}: expected {typ.__name__}, got {v!r}")
        if not all(_is_int(d) and d >= 0 for d in m["shape"]) or not m["shape"]:
            raise bad(f"field 'shape': expected a non-empty list of non-negative ints, got "
                      f"{m['shape']!r}")
        m["shape"] = tuple(m["shape"])
        if not 0 <= m["axis"] < len(m["shape"]):
            raise bad(f"field 'axis': expected 0 <= axis < {len(m['shape'])}, got {m['axis']}")
        for field in ("tensor_scale", "zeros"):
            if not isinstance(m.get(field, False), bool):
                raise bad(f"field {field!r}: expected a bool, got {m[field]!r}")
        try:
            get_format(m["format"])
            if m["dtype"] not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"field 'dtype': expected float32, bfloat16 or float16, got "
                                 f"{m['dtype']!r}")
            sd = m.get("scale_dtype")
            if sd is not None and sd not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"field 'scale_dtype': expected float32, bfloat16, float16 "
                                 f"or null, got {sd!r}")
        except ValueError as e:
            raise bad(str(e)) from None
    return qmeta


def _expected_parts(m) -> dict:
    """{part: ShapeDtypeStruct} a QArray with metadata ``m`` must have."""
    key = tuple(sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v)
                       for k, v in m.items()))
    return dict(_expected_parts_cached(key))


@functools.lru_cache(maxsize=1024)
def _expected_parts_cached(key):
    from ..ops import quantize

    m = dict(key)
    f = get_format(m["format"])
    kw = dict(axis=m["axis"], block_size=m["block_size"], scale_layout=m["scale_layout"])
    if f.has_tensor_scale:
        kw["tensor_scale"] = "auto" if m.get("tensor_scale") else None
    if f.scale_dtype_per_call and m.get("scale_dtype"):
        kw["scale_dtype"] = jnp.dtype(m["scale_dtype"])
    x = jax.ShapeDtypeStruct(m["shape"], jnp.dtype(m["dtype"]))
    q = jax.eval_shape(lambda x: quantize(x, f.name, **kw), x)
    return tuple((p, c) for p, c in zip(QARRAY_PARTS, (q.data, q.scales, q.tensor_scale,
                                                        q.zeros)) if c is not None)


def _check(path, name, got_dtype, got_shape, want_dtype, want_shape):
    if np.dtype(got_dtype) != np.dtype(want_dtype):
        raise CheckpointError(f"{path}: tensor {name!r}: expected dtype {_dt_str(want_dtype)}, "
                              f"got {_dt_str(got_dtype)}")
    if tuple(got_shape) != tuple(want_shape):
        raise CheckpointError(f"{path}: tensor {name!r}: expected shape {tuple(want_shape)}, "
                              f"got {tuple(got_shape)}")


def _read_all(path):
    """-> (flat {name: np array | QArray-parts dict}, qmeta, metadata), fully checked."""
    import safetensors

    path = os.fspath(path)
    with open(path, "rb") as fh:
        blob = fh.read()
    head = blob[:8]
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
    if n is None or n > _MAX_HEADER or 8 + n > len(blob):
        read_header(path)  # raises the precise truncation error
        raise CheckpointError(f"{path}: the file changed while it was read")
    header, meta, _ = _parse_header(path, blob[8:8 + n], len(blob) - 8 - n)
    _check_jax_fp4_meta(path, meta, blob[:8 + n])
    qmeta = _qmeta(path, meta)
    # check every QArray's parts against its metadata before touching the data
    for name, m in qmeta.items():
        try:
            parts = _expected_parts(m)
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{path}: QArray {name!r}: inconsistent metadata {m}: {e}") \
                from None
        want = {p for p in parts if p != "tensor_scale"} | (
            {"tensor_scale"} if m.get("tensor_scale") else set())
        if set(parts) != want or bool(m.get("zeros")) != ("zeros" in parts):
            raise CheckpointError(f"{path}: QArray {name!r}: metadata flags tensor_scale / "
                                  f"zeros do not fit format {m['format']!r}")
        for part, sds in parts.items():
            t = header.get(f"{name}.{part}")
            if t is None:
                raise CheckpointError(f"{path}: tensor {name}.{part!s} is missing (part of the "
                                      f"{m['format']} QArray {name!r})")
            _check(path, f"{name}.{part}", t["dtype"], t["shape"], sds.dtype, sds.shape)
        stray = [p for p in QARRAY_PARTS if p not in parts and f"{name}.{p}" in header]
        if stray:
            raise CheckpointError(f"{path}: tensor {name}.{stray[0]}: a {m['format']} QArray "
                                  "has no such part (metadata and tensors disagree)")
    _verify_data(path, header, meta, blob, 8 + n)
    try:
        items = safetensors.deserialize(blob)
    except Exception as e:  # safetensors.SafetensorError and friends
        raise CheckpointError(f"{path}: not a valid safetensors file: {e}") from None
    arrays = {}
    for name, info in items:
        dt = _ST_DTYPES[info["dtype"]]
        arrays[name] = np.frombuffer(info["data"], dtype=dt).reshape(info["shape"])
    return arrays, qmeta, meta


def _assemble(arrays, qmeta):
    out: Dict[str, Any] = {}
    used = set()
    for name, m in qmeta.items():
        kids = []
        for part in QARRAY_PARTS:
            key = f"{name}.{part}"
            kids.append(jnp.asarray(arrays[key]) if key in arrays else None)
            used.add(key)
        out[name] = QArray(*kids, format=m["format"], axis=m["axis"], shape=m["shape"],
                           dtype=jnp.dtype(m["dtype"]), block_size=m["block_size"],
                           scale_layout=m["scale_layout"])
    for name, arr in arrays.items():
        if name not in used:
            out[name] = _to_jax(arr)
    return out


def _to_jax(arr):
    """jax array, except 64-bit dtypes while jax_enable_x64 is off (kept as numpy so
    nothing is silently narrowed)."""
    if arr.dtype.itemsize == 8 and arr.dtype.kind in "iuf" and not jax.config.jax_enable_x64:
        return arr
    return jnp.asarray(arr)


def load(path, target=None, *, strict: bool = True):
    """Read a safetensors file written by :func:`save` (or any safetensors file).

    Args:
      path: the file.
      target: optional pytree giving the expected structure (e.g. the model's
        ``nnx.state``, Linen params, an Equinox model, or ``jax.eval_shape`` of one): each
        leaf (array, ``ShapeDtypeStruct`` or QArray) names a tensor by its dotted path
        whose dtype and shape (for a QArray: format, shape, axis, block size, layout) must
        match.
      strict: with ``target``, also fail on tensors in the file that the target lacks.
    Returns:
      without ``target``: a flat dict {dotted name: jax array or QArray} in file order
      (QArray parts folded into their QArray); with ``target``: a pytree of the target's
      structure holding the loaded values. Every tensor's checksum is verified first
      (files saved before checksums, version "1", load without that check).
    Raises:
      FileNotFoundError: no such file.
      CheckpointError (a ValueError): truncated or corrupt file (malformed header or
        metadata, a checksum mismatch, an unknown ``jax_fp4.version``); a QArray part
        missing or with the wrong dtype/shape; with ``target``: a missing tensor, a dtype/shape/format
        mismatch, or (strict) unexpected tensors. Messages name the file and the tensor
        and give expected vs found.
    """
    path = os.fspath(path)
    arrays, qmeta, _ = _read_all(path)
    flat = _assemble(arrays, qmeta)
    if target is None:
        return flat
    from ..tree_paths import path_str

    leaves, treedef = jax.tree_util.tree_flatten_with_path(
        target, is_leaf=lambda x: isinstance(x, QArray))
    values, seen = [], set()
    for p, leaf in leaves:
        name = path_str(p)
        seen.add(name)
        if name not in flat:
            raise CheckpointError(f"{path}: tensor {name!r} is missing (the target expects "
                                  f"{_describe_leaf(leaf)})")
        got = flat[name]
        if isinstance(leaf, QArray):
            if isinstance(got, QArray) and leaf.scale_layout == "tiled":
                prepared = prepare(got)  # files hold the linear layout; a prepared target
                if prepared.scale_layout == "tiled":  # gets its own where it applies
                    got = prepared
            if not isinstance(got, QArray):
                raise CheckpointError(f"{path}: tensor {name!r}: expected a {leaf.format} QArray "
                                      f"of shape {leaf.shape}, got a plain {_dt_str(got.dtype)} "
                                      f"tensor of shape {tuple(got.shape)}")
            for attr in ("format", "shape", "axis", "dtype", "block_size", "scale_layout"):
                if getattr(leaf, attr) != getattr(got, attr):
                    raise CheckpointError(
                        f"{path}: QArray {name!r}: expected {attr} {getattr(leaf, attr)!r}, "
                        f"got {getattr(got, attr)!r}")
            for part, a, b in zip(QARRAY_PARTS, leaf.tree_flatten()[0], got.tree_flatten()[0]):
                if (a is None) != (b is None):
                    raise CheckpointError(
                        f"{path}: QArray {name!r}: the target {'has' if a is not None else 'lacks'}"
                        f" a {part}, the file {'has' if b is not None else 'lacks'} one")
                if a is not None:
                    _check(path, f"{name}.{part}", b.dtype, b.shape, a.dtype, a.shape)
        else:
            if isinstance(got, QArray):
                raise CheckpointError(f"{path}: tensor {name!r}: expected a plain tensor "
                                      f"({_describe_leaf(leaf)}), got {got!r}")
            if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
                _check(path, name, got.dtype, got.shape, leaf.dtype, leaf.shape)
        values.append(got)
    if strict:
        extra = [n for n in flat if n not in seen]
        if extra:
            raise CheckpointError(f"{path}: {len(extra)} tensor(s) not in the target: "
                                  f"{', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''}")
    return jax.tree_util.tree_unflatten(treedef, values)


def _describe_leaf(leaf):
    if isinstance(leaf, QArray):
        return repr(leaf)
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return f"{_dt_str(leaf.dtype)} of shape {tuple(leaf.shape)}"
    return type(leaf).__name__


def verify(path) -> dict:
    """Read a whole file and check it as :func:`load` does, without building arrays.

    Returns:
      {"file", "version" (None for a plain safetensors file), "tensors" (count),
      "checksummed" (tensors whose checksum was verified: 0 for files without checksums)}.
    Raises:
      FileNotFoundError: no such file.
      CheckpointError: anything :func:`load` would refuse (the first problem found).
    """
    path = os.fspath(path)
    arrays, _, meta = _read_all(path)
    return {"file": path, "version": meta.get("jax_fp4.version"), "tensors": len(arrays),
            "checksummed": len(arrays) if _checksums(path, meta) is not None else 0}


def describe(path) -> dict:
    """Summarize a safetensors file from its header (no tensor data is read).

    Returns:
      {"file", "bytes", "metadata" (other header metadata), "qarrays": [{name, format,
      shape, axis, block_size, scale_layout, dtype, tensor_scale, zeros, nbytes,
      bf16_bytes}], "tensors": [{name, dtype, shape, nbytes}] (plain tensors),
      "total_bytes", "qarray_bytes", "qarray_bf16_bytes"}.
    Raises:
      CheckpointError: as :func:`read_header`.
    """
    path = os.fspath(path)
    header, meta, _ = read_header(path)
    qmeta = _qmeta(path, meta)
    parts = {f"{n}.{p}": n for n in qmeta for p in QARRAY_PARTS}
    qbytes = {n: 0 for n in qmeta}
    tensors = []
    for name, t in header.items():
        nb = t["offsets"][1] - t["offsets"][0]
        if name in parts:
            qbytes[parts[name]] += nb
        else:
            tensors.append({"name": name, "dtype": t["st_dtype"], "shape": list(t["shape"]),
                            "nbytes": nb})
    qarrays = [dict(name=n, format=m["format"], shape=list(m["shape"]), axis=m["axis"],
                    block_size=m["block_size"], scale_layout=m["scale_layout"],
                    dtype=m["dtype"], tensor_scale=bool(m.get("tensor_scale")),
                    zeros=bool(m.get("zeros")), nbytes=qbytes[n],
                    bf16_bytes=2 * math.prod(m["shape"])) for n, m in qmeta.items()]
    other = {k: v for k, v in meta.items() if not k.startswith("jax_fp4.")}
    return {"file": path, "bytes": os.path.getsize(path), "metadata": other,
            "jax_fp4_version": meta.get("jax_fp4.version"), "qarrays": qarrays,
            "tensors": tensors,
            "total_bytes": sum(t["nbytes"] for t in tensors) + sum(qbytes.values()),
            "qarray_bytes": sum(qbytes.values()),
            "qarray_bf16_bytes": sum(q["bf16_bytes"] for q in qarrays)}
