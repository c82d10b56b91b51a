"""The compile cache's disk tier: compiled programs as shared libraries in a directory, found by a stable hash.

Layout of the directory (one entry per graph):

    <name>.json               metadata (JSON, never pickle): the entry name, the
                              library file it points at, its size and sha256
    <name>.<sha16>.so         the library `executable.export_library` wrote;
                              named by its content, so two processes writing the
                              same entry at once never tear each other's file

`name` is sha256 of a process-independent text of the graph key plus a salt
(see cache.py: TVM version, target, the caller's version, a fingerprint of the
code). A library is loaded only after its size and sha256 match the metadata: dlopen
of a truncated library can kill the process (SIGBUS), so no check is left to
the loader. Every write goes to a temporary name first and is renamed into
place (`os.replace`), so readers see whole files or none. Entries are evicted,
least recently used first (metadata mtime, touched on every hit), when the
directory grows past its size limit.
"""
import hashlib
import json
import os
import stat
import tempfile
import time
import warnings

import tvm

FORMAT = 1
_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 3600  # a temporary file this old belongs to a writer that died
_ORPHAN_S = 600  # a library no metadata points at, this old, lost a race or an eviction


class CacheDirError(RuntimeError):
    """The cache directory is unsafe or unusable (the message names it)."""


class UnstableKey(Exception):
    """The graph key holds something whose text differs between processes."""


def stable_text(obj) -> str:
    """Return a text of a graph key that is the same in every process (or raise UnstableKey).

    OpOverloads become their schema name ('aten::add.Tensor'), torch dtypes and
    devices their str; anything whose repr shows a memory address is refused.
    """
    parts = []
    _stable(obj, parts)
    return "".join(parts)


def _stable(obj, out):
    t = type(obj)
    if obj is None or t in (bool, int, str, bytes):
        out.append(repr(obj))
    elif t is float:
        out.append(f"f{obj!r}")  # 1.0 and 1 stay apart
    elif isinstance(obj, (tuple, list)):
        out.append(f"{t.__name__}(" if t not in (tuple, list) else ("(" if t is tuple else "["))
        for x in obj:
            _stable(x, out)
            out.append(",")
        out.append(")")
    elif isinstance(obj, dict):
        out.append("{")
        for k, v in obj.items():
            _stable(k, out)
            out.append(":")
            _stable(v, out)
            out.append(",")
        out.append("}")
    elif t.__name__ in ("OpOverload", "OpOverloadPacket") and hasattr(obj, "name"):
        out.append(f"op<{obj.name() if callable(obj.name) else obj.name}>")
    elif t.__module__ == "torch" and t.__name__ in ("dtype", "device", "layout", "memory_format"):
        out.append(f"torch<{obj}>")
    else:
        text = repr(obj)
        if " at 0x" in text or t.__repr__ is object.__repr__:
            raise UnstableKey(f"{t.__name__} has no process-independent text: {text[:80]}")
        out.append(f"{t.__name__}<{text}>")


def code_fingerprint(packages) -> str:
    """Return sha256 over the .py files under the given package directories.

    Files are named relative to their package's parent, so the same code hashes
    the same wherever it is checked out.
    """
    h = hashlib.sha256()
    for package in packages:
        base = os.path.dirname(os.path.abspath(package))
        for root, dirs, names in os.walk(package):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for n in sorted(names):
                if n.endswith(".py"):
                    path = os.path.join(root, n)
                    h.update(os.path.relpath(path, base).replace(os.sep, "/").encode())
                    with open(path, "rb") as fh:
                        h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class DiskCache:
    """Compiled programs in directory `root`, at most `size_limit` bytes; `salt` is part of every name."""

    def __init__(self, root: str, size_limit: int, salt: str):
        self.root = root
        self.size_limit = size_limit
        self.salt = salt
        self._checked = False

    # ---- names -----------------------------------------------------------------
    def name(self, key):
        """Return the entry name of graph key `key`, or None if the key has no stable text."""
        try:
            text = stable_text(key)
        except UnstableKey:
            return None
        return hashlib.sha256(f"{FORMAT}\n{self.salt}\n{text}".encode()).hexdigest()

    def _meta_path(self, name):
        return os.path.join(self.root, f"{name}.json")

    # ---- the directory ------------------------------------------------------------
    def check_dir(self):
        """Create the directory (mode 0700) if needed; refuse one others could write into."""
        if self._checked:
            return
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        st = os.stat(self.root)
        if not stat.S_ISDIR(st.st_mode):
            raise CacheDirError(f"ratex compile cache: {self.root} is not a directory (RATEX_CACHE_DIR)")
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise CacheDirError(
                f"ratex compile cache: refusing to use {self.root}: it belongs to another user "
                f"(uid {st.st_uid}); compiled code loaded from it would run in this process. "
                'Set RATEX_CACHE_DIR to a directory of your own, or RATEX_CACHE_DIR="" to disable the cache.'
            )
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise CacheDirError(
                f"ratex compile cache: refusing to use {self.root}: it is writable by group/other users "
                f"(mode {stat.S_IMODE(st.st_mode):#o}), so others could plant code this process would load. "
                f'Run `chmod go-w {self.root}`, or set RATEX_CACHE_DIR to another directory ("" disables the cache).'
            )
        self._checked = True

    # ---- read ----------------------------------------------------------------------
    def load(self, name: str, accept=None):
        """Return the loaded runtime module of entry `name`, or None (miss, or a corrupt entry, removed).

        `accept(metadata)` returning false makes an entry a miss (it is out of date;
        the next store replaces it).
        """
        self.check_dir()
        meta_path = self._meta_path(name)
        try:
            with open(meta_path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        try:
            meta = json.loads(raw)
            lib_name = meta["lib"]
            if meta.get("format") != FORMAT or meta.get("name") != name:
                raise ValueError("metadata names another entry")
            if os.path.basename(lib_name) != lib_name or not lib_name.startswith(name + "."):
                raise ValueError(f"bad library name {lib_name!r}")
        except (ValueError, KeyError, TypeError) as err:
            self._drop_corrupt(name, None, f"unreadable metadata ({err})")
            return None
        if accept is not None and not accept(meta):
            return None
        lib_path = os.path.join(self.root, lib_name)
        try:
            size = os.path.getsize(lib_path)
            digest = _sha256_file(lib_path) if size == meta.get("size") else None
        except FileNotFoundError:
            self._remove(meta_path)  # evicted under us: a plain miss
            return None
        if digest != meta.get("sha256"):
            what = "size" if digest is None else "sha256"
            self._drop_corrupt(name, lib_path, f"library {what} does not match its metadata (truncated or modified)")
            return None
        try:
            lib = tvm.runtime.load_module(lib_path)
        except Exception as err:  # noqa: BLE001 - any load failure means a bad entry
            self._drop_corrupt(name, lib_path, f"loading failed ({type(err).__name__}: {str(err)[:200]})")
            return None
        try:
            os.utime(meta_path)  # least recently used goes first
        except OSError:
            pass
        return lib

    def _drop_corrupt(self, name, lib_path, why):
        warnings.warn(
            f"ratex compile cache: entry {name[:16]} in {self.root} is corrupt: {why}; "
            "removed it, recompiling",
            stacklevel=4,
        )
        self._remove(self._meta_path(name))
        if lib_path:
            self._remove(lib_path)

    # ---- write ---------------------------------------------------------------------
    def store(self, name: str, executable, info: dict = None) -> str:
        """Export `executable` as entry `name` (atomically), evict others down to the size limit.

        Returns the path of the library written (load it with tvm.runtime.load_module).
        """
        self.check_dir()
        fd, tmp_lib = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".so", dir=self.root)
        os.close(fd)
        try:
            executable.export_library(tmp_lib)
            digest = _sha256_file(tmp_lib)
            lib_name = f"{name}.{digest[:16]}.so"
            meta = {
                "format": FORMAT,
                "name": name,
                "lib": lib_name,
                "size": os.path.getsize(tmp_lib),
                "sha256": digest,
                "created": time.time(),
                **(info or {}),
            }
            os.chmod(tmp_lib, 0o600)
            os.replace(tmp_lib, os.path.join(self.root, lib_name))
            self._write_atomic(self._meta_path(name), json.dumps(meta, indent=1, sort_keys=True).encode())
        finally:
            self._remove(tmp_lib)
        self.evict(keep=name)
        return os.path.join(self.root, lib_name)

    def _write_atomic(self, path, data: bytes):
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".json", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finally:
            self._remove(tmp)

    # ---- size limit -----------------------------------------------------------------
    def evict(self, keep: str = None):
        """Delete least recently used entries (but not entry `keep`) until the directory fits the size limit."""
        now = time.time()
        try:
            listing = list(os.scandir(self.root))
        except FileNotFoundError:
            return
        files = {}
        for e in listing:
            try:
                if e.is_file(follow_symlinks=False):
                    st = e.stat(follow_symlinks=False)
                    files[e.name] = (st.st_size, st.st_mtime)
            except FileNotFoundError:
                continue
        entries, used_libs = [], set()
        for fname, (size, mtime) in files.items():
            if fname.endswith(".json") and not fname.startswith(_TMP_PREFIX):
                name = fname[: -len(".json")]
                libs = [f for f in files if f.startswith(name + ".") and f.endswith(".so")]
                used_libs.update(libs)
                total = size + sum(files[f][0] for f in libs)
                entries.append((mtime, fname, libs, total))
        total = 0
        for fname, (size, mtime) in files.items():
            stale_tmp = fname.startswith(_TMP_PREFIX) and now - mtime > _STALE_TMP_S
            orphan = fname.endswith(".so") and not fname.startswith(_TMP_PREFIX) and fname not in used_libs
            if stale_tmp or (orphan and now - mtime > _ORPHAN_S):
                self._remove(os.path.join(self.root, fname))
            else:
                total += size
        entries.sort()
        for mtime, fname, libs, size in entries:
            if total <= self.size_limit:
                break
            if fname == f"{keep}.json":
                continue
            self._remove(os.path.join(self.root, fname))  # metadata first: readers then see a miss
            for lib in libs:
                self._remove(os.path.join(self.root, lib))
            total -= size

    @staticmethod
    def _remove(path):
        try:
            os.remove(path)
        except (FileNotFoundError, IsADirectoryError):
            pass
        except OSError:
            pass
