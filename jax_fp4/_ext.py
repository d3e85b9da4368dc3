"""Loads the compiled extension ``jax_fp4._native`` and registers its XLA FFI targets.

Nothing happens at import: the first call to any function below imports the
extension (an ImportError or any other failure means "no kernels", and the reason is
kept for :func:`load_error`) and registers every handler once with
``jax.ffi.register_ffi_target`` (platform ``"cpu"`` or ``"CUDA"``). Target names,
buffers and attributes are the contract in ``csrc/README.md``.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["has_kernels", "registered_targets", "build_info", "load_error"]

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
        except Exception as e:  # ImportError, missing symbols, ABI mismatch, ...
            _error = f"cannot import {_NATIVE_MODULE}: {type(e).__name__}: {e}"
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


def has_kernels(platform: str, target: str | None = None) -> bool:
    """True if compiled handlers are registered for ``platform`` ("cpu" or "cuda").

    With ``target`` (e.g. ``"jax_fp4_quantize_v1"``), whether that target is."""
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
