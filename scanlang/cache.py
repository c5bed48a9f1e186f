"""The on-disk cache directories, and what is trusted in them.

`settings.cache_dir()` names the root (SCANLANG_CACHE_DIR, default ~/.cache/scanlang). Everything
read back from it is treated as untrusted input:

- `directory(name)` is <root>/<name> (created 0700), used only when it is a real directory (not a
  symbolic link) owned by this user and not writable by everyone, inside a root that is the same;
- when the configured root is unusable (read-only, its parent missing, a file, a link to nowhere,
  another user's directory) the cache moves to a private temporary directory (mkdtemp, 0700) for the
  rest of the process, with ONE warning naming SCANLANG_CACHE_DIR and the reason;
- `read_bytes(path)` reads a regular file without following a link (None when there is none, or it
  is not a regular file: the caller rewrites it);
- `write_atomic(path, data)` writes through a temporary file and `os.replace`, so a reader never sees
  a half-written entry.

Callers check what they read (kernel modules against their source, proof records against their
expression hash) and rewrite what does not match, so a corrupt or forged entry heals on first use.
"""
from __future__ import annotations

import os
import stat
import tempfile
import warnings
from pathlib import Path

from . import settings

_FALLBACK: dict[str, Path] = {}   # unusable configured root -> the private directory used instead


class CacheUnusable(Exception):
    """Why a cache directory cannot be used (internal: turned into the fallback and its warning)."""


def _check_dir(path: Path, what: str):
    """Raise CacheUnusable unless `path` is a real directory of ours that others cannot write."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise CacheUnusable(f"{what} {path}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(st.st_mode):
        raise CacheUnusable(f"{what} {path} is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise CacheUnusable(f"{what} {path} is not a directory")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise CacheUnusable(f"{what} {path} belongs to another user (uid {st.st_uid})")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise CacheUnusable(f"{what} {path} is writable by every user")
    if not os.access(path, os.W_OK | os.X_OK):
        raise CacheUnusable(f"{what} {path} is not writable")


def _usable_root(root: Path, configured: bool) -> Path:
    """The root, created if needed (with parents only for the default location); CacheUnusable if not usable."""
    try:
        if os.path.islink(root):
            target = Path(os.path.realpath(root))
            _check_dir(target, "the cache directory (a link to)")
            return target
        if not root.exists():
            if configured and not root.parent.is_dir():
                raise CacheUnusable(f"the parent directory {root.parent} does not exist")
            root.mkdir(mode=0o700, parents=not configured, exist_ok=True)
    except OSError as exc:
        raise CacheUnusable(f"{root}: {exc.strerror or exc}") from None
    _check_dir(root, "the cache directory")
    return root


def directory(name: str) -> Path:
    """<cache root>/<name>, checked and created; the private fallback when the root is unusable."""
    configured = "SCANLANG_CACHE_DIR" in os.environ
    root = Path(settings.cache_dir())
    key = str(root)
    if key in _FALLBACK:
        return _subdir(_FALLBACK[key], name)
    try:
        return _subdir(_usable_root(root, configured), name)
    except CacheUnusable as exc:
        private = Path(tempfile.mkdtemp(prefix="scanlang-cache-"))
        _FALLBACK[key] = private
        source = "SCANLANG_CACHE_DIR" if configured else "the default cache directory"
        warnings.warn(f"scanlang: {source} ({root}) is unusable: {exc}; caching generated kernels and "
                      f"proofs in the private temporary directory {private} for this process instead",
                      RuntimeWarning, stacklevel=3)
        return _subdir(private, name)


def _subdir(root: Path, name: str) -> Path:
    path = root / name
    try:
        path.mkdir(mode=0o700, exist_ok=True)
    except FileExistsError:
        pass   # a file or a dangling link in its place: refused just below
    except OSError as exc:
        raise CacheUnusable(f"{path}: {exc.strerror or exc}") from None
    _check_dir(path, f"the cache subdirectory '{name}' at")
    return path


def read_bytes(path: Path) -> bytes | None:
    """The contents of a regular file at `path` (a link is not followed); None if there is none."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes):
    """Write `data` to `path` through a temporary file in the same directory and os.replace (which
    also replaces a link or a corrupt file standing there)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


__all__ = ["directory", "read_bytes", "write_atomic", "CacheUnusable"]
