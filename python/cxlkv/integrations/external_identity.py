"""The weights part of the identity where the engine's storage plug-in is handed a model path.

Used in the engine's own process: SGLang's HiCache backend (``model_path``, the directory that
SGLang loads) and cxlkv's vLLM-side LMCache connector (lmcache_vllm.py: the directory vLLM
resolved). The path is resolved (a hub id to its downloaded snapshot, offline) and the weights are
digested by content (every byte of the weight files + the sampled per-tensor digest + the config
files, the ``files:`` kind of docs/IDENTITY.md): the same bytes at two paths share a namespace;
two different checkpoints under one alias never do. Never on the LMCache server's side: a server
cannot know which bytes an engine's model name stood for (lmcache_identity.py).
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path

from cxlkv.integrations import identity as ident
from cxlkv.integrations.loaded_weights import files_digest


class UnresolvableModelError(LookupError):
    """A model name that names no weights on this host: nothing can be stored under it."""


def resolve_model_dir(ref: str) -> Path:
    """The directory (or lone weight file) that ``ref`` names on this host."""
    p = Path(ref).expanduser()
    if p.exists():
        return p.resolve()
    try:  # a hub id: the snapshot the engine downloaded (never a network call from here)
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(ref, local_files_only=True)).resolve()
    except Exception as e:
        raise UnresolvableModelError(
            f"model {ref!r} is neither a local path nor a downloaded Hugging Face snapshot; "
            "cxlkv derives its namespace from the weights' bytes and cannot store its KV "
            f"({type(e).__name__})"
        ) from e


_lock = threading.Lock()


@functools.lru_cache(maxsize=64)
def _weights_of_dir(root: str, stamp: tuple) -> tuple[str, str]:
    files = ident.weights_digest(root)
    every_byte = files_digest(ident.weight_files(root))
    return ident.weights_identity(files, ident.config_digest(), every_byte)


def weights_of(ref: str) -> tuple[str, str]:
    """(KVIdentity.weights, its source text) of the model ``ref`` names. Cached per resolved path
    and the (inode, size, mtime_ns, ctime_ns) of its weight and config files, so a re-pointed symlink or a
    rewritten file is digested again."""
    root = resolve_model_dir(ref)
    # Every file weights_digest reads, config files included: an edited config.json beside
    # unchanged weights is another computation, hence another identity.
    stamp = tuple(
        (str(path), str(real), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        for path, real in ident._weight_files(root)
        for st in (os.stat(real),)
    )
    with _lock:  # one digest at a time: two threads asking for one model hash it once
        return _weights_of_dir(str(root), stamp)
