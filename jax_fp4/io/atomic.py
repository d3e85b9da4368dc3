"""Atomic file replacement for checkpoints: readers see the old file or the new one,
never a partial one, and a failed write leaves the old file and no stray file behind.

Used by :func:`jax_fp4.io.save`; usable by any other checkpoint convention.
"""
from __future__ import annotations

import os
import tempfile
import threading

__all__ = ["atomic_write"]

_umask_lock = threading.Lock()


def _umask() -> int:
    """The process umask, read without changing it where Linux exposes it."""
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    with _umask_lock:  # os.umask can only be read by setting it
        old = os.umask(0o022)
        os.umask(old)
    return old


def _fsync_dir(d: str) -> None:
    try:
        fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # e.g. platforms that cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory: nothing more to do
        pass
    finally:
        os.close(fd)


def atomic_write(path, write_fn) -> None:
    """Write a file by ``write_fn(fileobj)`` and put it at ``path`` atomically.

    The data goes to a new uniquely named temporary file (``.<name>.<random>.tmp``,
    created exclusively, in the destination's directory so the rename stays on one
    filesystem), is flushed and fsync'ed, then renamed over the destination, and the
    directory is fsync'ed so the rename survives a crash. No other file is touched.

    * Permissions: an existing destination keeps its mode bits; a new file gets
      ``0o666 & ~umask``, as ``open()`` would give it. (Ownership is the writer's.)
    * Symlinks: if ``path`` is a symlink, the file it points to (resolved fully) is
      replaced and the link is left as it is.
    * Failure: on any exception, KeyboardInterrupt included, the temporary file is
      removed, the destination is unchanged and the exception propagates (OSErrors
      carry the destination path). Only a hard kill (SIGKILL, power loss) between
      creation and rename can leave a ``.<name>.*.tmp`` file behind.

    Args:
      path: destination file (str or os.PathLike).
      write_fn: called once with a binary file object open for writing.
    Raises:
      OSError: the directory is missing or not writable, the disk is full, ...; with
        ``filename`` set to ``path``. Whatever ``write_fn`` raises, unchanged.
    """
    path = os.fspath(path)
    target = os.path.realpath(path) if os.path.islink(path) else os.path.abspath(path)
    d, base = os.path.split(target)
    try:
        mode = os.stat(target).st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    except OSError as e:
        raise type(e)(e.errno, e.strerror, path) from None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=d)
    except OSError as e:
        raise type(e)(e.errno, f"cannot create a temporary file next to it: {e.strerror}",
                      path) from None
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)
            write_fn(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and e.filename is None and e.errno is not None:
            raise type(e)(e.errno, e.strerror, path) from e
        raise
    _fsync_dir(d)
