"""The per-file digest cache of :func:`cxlkv.integrations.identity.weights_digest`: a hint that
saves re-reading a checkpoint at every start, never an authority (docs/IDENTITY.md).

* An entry is used only when every stat field of the file matches: device, inode, size,
  mtime_ns and ctime_ns. mtime alone is not enough: Nix stores, zip archives and reproducible
  images normalise it, so two versions of a model carry the same one; the inode and the ctime
  (which nobody can set: any write, rename or chmod moves it to "now") tell them apart.
* The cache lives beside the model (``.cxlkv-identity.json``) when that directory is writable,
  else under ``~/.cache/cxlkv/identity/``, named by the *resolved* path of the model.
* A cache file is read only when it is a regular file with one link, owned by the current user
  or by the owner of every model file, and writable by nobody else: whoever can write the model
  directory must not be able to hand model B the digest of model A.
* Anything malformed (not JSON, another version, another root, a bad entry) is ignored and
  recomputed; the cache never makes ``weights_digest`` raise.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path

CACHE_FILE = ".cxlkv-identity.json"
MAX_CACHE_BYTES = 16 << 20  # a cache is ~150 bytes per file; anything larger is not ours
_DIGEST = re.compile(r"[0-9a-f]{64}")


def stamp(st: os.stat_result) -> list[int]:
    """What must be unchanged for a cached digest to still describe the file."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def cache_path(root: Path) -> Path:
    """Where the cache of the (resolved) model path ``root`` lives."""
    d = root if root.is_dir() else root.parent
    if os.access(d, os.W_OK):
        return d / (CACHE_FILE if root.is_dir() else f".{root.name}{CACHE_FILE}")
    tag = hashlib.sha256(str(root).encode()).hexdigest()[:24]
    return Path.home() / ".cache" / "cxlkv" / "identity" / f"{tag}.json"


def trusted(st: os.stat_result, owners: set[int]) -> bool:
    """A cache file that only a trusted user could have written: the current user, or the one
    user who owns every model file (who could rewrite the weights anyway)."""
    allowed = {os.geteuid()} | (owners if len(owners) == 1 else set())
    return (
        stat.S_ISREG(st.st_mode)
        and st.st_nlink == 1  # a hard link to someone else's trusted cache is not this cache
        and st.st_uid in allowed
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


class IdentityCache:
    """The cached digests of one model path; :meth:`get` and :meth:`put` per file, then
    :meth:`save` (best effort)."""

    def __init__(self, root: Path, owners: set[int], version: str) -> None:
        self.root = root
        self.version = version
        self.path = cache_path(root)
        self.owners = owners
        self.entries = self._load()
        self.fresh: dict[str, dict] = {}

    def _load(self) -> dict:
        try:
            # O_NOFOLLOW + fstat: the file checked is the file read (no symlink, no swap between).
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return {}
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not trusted(st, self.owners) or st.st_size > MAX_CACHE_BYTES:
                return {}
            raw = f.read(MAX_CACHE_BYTES)
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return {}
        if not isinstance(data, dict) or data.get("version") != self.version:
            return {}
        files = data.get("files")
        if data.get("root") != str(self.root) or not isinstance(files, dict):
            return {}
        return files

    def get(self, rel: str, st: os.stat_result) -> str | None:
        """The cached digest of file ``rel`` if its stamp still matches and it is well formed."""
        hit = self.entries.get(rel)
        if not isinstance(hit, dict) or hit.get("stamp") != stamp(st):
            return None
        digest = hit.get("digest")
        return digest if isinstance(digest, str) and _DIGEST.fullmatch(digest) else None

    def put(self, rel: str, st: os.stat_result, digest: str) -> None:
        self.fresh[rel] = {"stamp": stamp(st), "digest": digest}

    def save(self) -> None:
        """Writes the fresh entries when they differ. Best effort (a read-only tree, a full disk
        just mean recomputing next time); atomic; mode 0644 whatever the umask, so that the next
        start trusts it."""
        if self.fresh == self.entries:
            return
        data = {"version": self.version, "root": str(self.root), "files": self.fresh}
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o644)
                f.write(json.dumps(data, sort_keys=True, indent=0))
            os.replace(tmp, self.path)
        except OSError:
            try:
                tmp.unlink()
            except OSError:
                pass
