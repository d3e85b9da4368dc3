"""Loads the compiled extension ``jax_fp4._native`` and registers its XLA FFI targets.

Nothing happens at import: the first call to any function below imports the
extension (an ImportError or any other failure means "no kernels", and the reason is
kept for :func:`load_error`) and registers every handler once with
``jax.ffi.register_ffi_target`` (platform ``"cpu"`` or ``"CUDA"``). Target names,
buffers and attributes are the contract in ``csrc/README.md``.

Before registering anything it checks that the extension's formats (``format_table()``:
the ids, element bits, families and element code values of ``csrc/codecs.h``) agree with
:mod:`jax_fp4.formats`; an extension that disagrees (or predates the check) registers
nothing, and :func:`load_error` says why.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["has_kernels", "registered_targets", "build_info", "load_error",
           "format_table_problems", "all_reduce_setup"]

_NATIVE_MODULE = "jax_fp4._native"
_PLATFORM_NAMES = {"cpu": "cpu", "host": "cpu", "cuda": "CUDA", "gpu": "CUDA"}

_lock = threading.Lock()
_loaded = False
_error: str | None = None
_info: dict[str, Any] = {}
_targets: dict[str, tuple[str, ...]] = {}


def _load() -> None:
    global _loaded, _error, _info
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        try:
            import importlib

            native = importlib.import_module(_NATIVE_MODULE)
            regs = native.registrations()
            _info = dict(native.build_info())
            problems = format_table_problems(native.format_table())
        except Exception as e:  # ImportError, missing symbols, ABI mismatch, ...
            _error = f"cannot import {_NATIVE_MODULE}: {type(e).__name__}: {e}"
            _loaded = True
            return
        if problems:
            _error = (f"{_NATIVE_MODULE}'s formats (csrc/codecs.h) disagree with "
                      f"jax_fp4/formats.py: " + "; ".join(problems))
            _loaded = True
            return
        import jax.ffi

        problems = []
        for name, per_platform in regs.items():
            done = []
            for platform, capsule in per_platform.items():
                try:
                    jax.ffi.register_ffi_target(name, capsule, platform=platform)
                    done.append(platform)
                except Exception as e:
                    problems.append(f"{name}@{platform}: {type(e).__name__}: {e}")
            if done:
                _targets[name] = tuple(done)
        if problems:
            _error = "some FFI targets could not be registered: " + "; ".join(problems)
        _loaded = True


def format_table_problems(table) -> list[str]:
    """How the extension's format table (``_native.format_table()``: a list of dicts with
    fid, name, bits, mx, codebook, values) differs from :mod:`jax_fp4.formats`: format
    ids and names, element bits, the MX and codebook families, and the value of every
    element code (minifloat decodes, codebook tables, INT4 codes 0..15), compared bit for
    bit (NaNs by NaN-ness). An empty list when they agree."""
    import numpy as np

    from . import formats

    problems = []
    native = {int(row["fid"]): row for row in table}
    python = {f.fid: f for f in (formats.get_format(n) for n in formats.FORMAT_NAMES)}
    for fid in sorted(set(native) | set(python)):
        row, f = native.get(fid), python.get(fid)
        if row is None or f is None:
            problems.append(f"format id {fid}: {row['name'] if row else f.name!r} exists only "
                            f"in {'the extension' if row else 'formats.py'}")
            continue
        if row["name"] != f.name:
            problems.append(f"format id {fid}: {row['name']!r} in the extension, {f.name!r} in "
                            f"formats.py")
            continue
        if int(row["bits"]) != f.bits:
            problems.append(f"{f.name}: {row['bits']}-bit elements in the extension, {f.bits} "
                            f"in formats.py")
        if bool(row["mx"]) != (f.family == "mx") or bool(row["codebook"]) != (f.family == "codebook"):
            problems.append(f"{f.name}: family {f.family!r} in formats.py, the extension says "
                            f"mx={row['mx']}, codebook={row['codebook']}")
        if f.table is not None:
            want = f.table
        elif f.elem is not None:
            want = formats.decode_table(f.elem)
        else:
            want = np.arange(1 << f.bits, dtype=np.float32)
        got = np.asarray(row["values"], np.float32)
        same = got.shape == want.shape and np.array_equal(np.isnan(got), np.isnan(want))
        # non-NaN codes bit for bit (signed zeros, infinities); NaNs by NaN-ness alone
        if not same or not np.array_equal(got.view(np.uint32)[~np.isnan(got)],
                                          want.view(np.uint32)[~np.isnan(want)]):
            problems.append(f"{f.name}: element code values differ")
    return problems


def has_kernels(platform: str, target: str | None = None) -> bool:
    """True if compiled handlers are registered for ``platform`` ("cpu" or "cuda").

    With ``target`` (e.g. ``"jax_fp4_quantize_v2"``), whether that target is."""
    _load()
    plat = _PLATFORM_NAMES.get(platform.lower(), platform)
    if target is not None:
        return plat in _targets.get(target, ())
    return any(plat in p for p in _targets.values())


def registered_targets() -> dict[str, tuple[str, ...]]:
    """{target_name: (platform, ...)} of every registered FFI target."""
    _load()
    return dict(_targets)


def build_info() -> dict[str, Any]:
    """Build configuration of the extension ({} if it could not be imported)."""
    _load()
    return dict(_info)


def load_error() -> str | None:
    """Why the extension (or some target) is unavailable; None when all is well."""
    _load()
    return _error


def all_reduce_setup(groups, max_elements: int) -> int:
    """The buffers of one in-graph all-reduce call site (target ``jax_fp4_all_reduce_v1``,
    csrc/cuda/collective/all_reduce.cu) on every GPU of ``groups`` (lists of CUDA device
    ordinals, each in rank order), for messages of up to ``max_elements`` float32 values.

    Returns the call site's channel id (> 0), or 0 where the extension has no CUDA
    all-reduce or some pair of the GPUs has no peer access. Raises RuntimeError naming the
    CUDA error where an allocation fails."""
    if not has_kernels("cuda", "jax_fp4_all_reduce_v1"):
        return 0
    import importlib

    native = importlib.import_module(_NATIVE_MODULE)
    return int(native.all_reduce_setup([list(map(int, g)) for g in groups], int(max_elements)))
