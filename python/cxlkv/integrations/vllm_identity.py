"""The identity of the KV bytes a vLLM engine holds (the vLLM side of identity.py and
docs/IDENTITY.md): what determines them (weights by content, KV layout, dtype and scales,
quantization, block size, total KV heads, device layout) read from vLLM's configs, and the
handshake by which the workers, who hold the loaded weights, name the namespace for the
scheduler side.

Used by the connector's both sides (vllm.py is the façade) and by lmcache_vllm.py."""

from __future__ import annotations

import dataclasses
import os
import sys
import uuid
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
from vllm.logger import init_logger

import cxlkv
from cxlkv.integrations import identity as ident
from cxlkv.integrations import loaded_weights as lw
from cxlkv.integrations import vllm_groups as vg
from cxlkv.integrations import vllm_state_groups as vsg
from cxlkv.integrations.heads import HeadPlan

# Under the "vllm" logger, so that vLLM's logging configuration (level, format) applies.
logger = init_logger("vllm.cxlkv")


def model_path(mc: Any) -> str | None:
    for cand in (getattr(mc, "model_weights", None), mc.model):
        if cand and os.path.exists(str(cand)):
            return str(cand)
    try:  # a hub id: the local snapshot vLLM loaded
        from huggingface_hub import snapshot_download

        return snapshot_download(mc.model, revision=getattr(mc, "revision", None), local_files_only=True)
    except Exception:  # noqa: BLE001 - not resolvable: the caller says what to do
        return None


def kv_dtype(vllm_config: Any, spec: Any) -> str:
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
    if cache_dtype != "auto":  # fp8 caches may be stored as uint8: the configured type is the truth
        return ident.canonical_dtype(cache_dtype)
    return ident.canonical_dtype(getattr(spec, "dtype", vllm_config.model_config.dtype))


def kv_scales(vllm_config: Any, dtype: str) -> str:
    if not dtype.startswith("fp8") and dtype not in ("int8", "uint8"):  # canonical names
        return "none"
    if getattr(vllm_config.cache_config, "calculatekv_scales", False):
        # Scales computed from this process's first batch: the bytes depend on it, so no other
        # process can share them.
        return f"dynamic-{uuid.uuid4().hex}"
    return "checkpoint-or-unit"  # scales from the checkpoint (in the weights digest) or 1.0


def config_paths(mc: Any) -> list[str]:
    """Config sources other than the model directory (whose config files weights_digest hashes)."""
    p = getattr(mc, "hf_config_path", None)
    return [str(p)] if p and os.path.exists(str(p)) else []


def loaded_config(mc: Any) -> dict | None:
    """The config as vLLM parsed it (hf_config_path, hf_overrides, GGUF metadata all end up here)."""
    to_dict = getattr(getattr(mc, "hf_config", None), "to_dict", None)
    return to_dict() if callable(to_dict) else None


def hashes_loaded_weights(extra: dict) -> bool:
    """Whether the workers name the namespace by the weights as loaded (the default) rather
    than by the sampled file digest ("weights_identity": "sampled"). An operator's model_id or
    namespace replaces both."""
    mode = extra.get("weights_identity", "loaded")
    if mode not in ("loaded", "sampled"):
        raise ValueError(f"cxlkv: weights_identity must be 'loaded' or 'sampled', not {mode!r}")
    return mode == "loaded" and not extra.get("model_id") and not extra.get("namespace")


def loaded_digest(mc: Any, tp_size: int = 1) -> lw.LoadedDigest | None:
    """Every byte of this worker's weights: as loaded; where the engine moved some out of reach
    (vLLM CPU's oneDNN linears), or where a rank holds a shard of them (tp_size > 1: a shard's
    digest would differ per rank and per TP size, and every TP size shares the namespace), of the
    weight files they were loaded from; None when the model is not reachable (the namespace then
    uses the sampled file digest, and its source says so)."""
    if tp_size > 1:
        path = model_path(mc)
        if path is None:
            return None
        d = lw.files_digest(ident.weight_files(path))
        logger.info(
            "cxlkv: weights (%s, TP %d): %s, hashed in %.2f s", d.kind, tp_size, d.describe(), d.seconds
        )
        return d
    model = lw.caller_model()
    if model is None:
        logger.warning(
            "cxlkv: the loaded model is not reachable from the connector; the namespace is "
            "named by the sampled file digest (docs/IDENTITY.md)"
        )
        return None
    try:
        d = lw.module_digest(model)
        path = model_path(mc) if d.emptied else None
        if path is not None:
            logger.info(
                "cxlkv: %d weights were repacked out of reach at load; hashing every byte of the weight files",
                d.emptied,
            )
            d = lw.files_digest(ident.weight_files(path))
    except (RuntimeError, TypeError, ValueError, OSError) as e:  # a tensor numpy cannot view, ...
        logger.warning(
            "cxlkv: the weights cannot be hashed (%s); the namespace is named by the sampled file digest", e
        )
        return None
    logger.info("cxlkv: weights (%s): %s, hashed in %.2f s", d.kind, d.describe(), d.seconds)
    return d


def derive_identity(
    vllm_config: Any,
    spec: Any,
    layers: int,
    block_bytes: int,
    kind: str,
    tp_rank: int,
    tp_size: int,
    extra: dict,
    loaded: lw.LoadedDigest | None = None,
    shards: Any = None,
) -> ident.KVIdentity:
    mc = vllm_config.model_config
    if extra.get("model_id"):
        override = str(extra["model_id"])
        weights, source = "model_id:" + override, f"operator model_id {override!r}"
    else:
        path = model_path(mc)
        if path is None:
            raise ValueError(
                f"cxlkv: cannot read the weights of model {mc.model!r} to derive the KV "
                "namespace from them; set kv_connector_extra_config.model_id"
            )
        w = ident.weights_digest(path)
        config = ident.config_digest(config_paths(mc), loaded_config(mc))
        weights, source = ident.weights_identity(w, config, loaded)
    dtype = kv_dtype(vllm_config, spec)
    # Dense: one pool entry per block and KV head of the model, whatever the TP size (heads.py);
    # MLA: the replicated latent, one entry per block; a state group cut into units
    # (state_shards.py): one entry per block and unit, num_kv_heads counting the units.
    heads = head_plan(vllm_config, spec, kind, tp_rank, shards)
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    device = vllm_config.device_config.device_type
    overrides = getattr(mc, "hf_overrides", None)
    return ident.KVIdentity(
        weights=weights,
        weights_source=source,
        dtype=dtype,
        kind=kind,
        num_layers=layers,
        num_kv_heads=heads.total,
        heads_per_entry=1 if heads.split and kind == "dense" else 0,
        head_size=int(getattr(spec, "head_size", 1)),
        block_size=vllm_config.cache_config.block_size,
        kv_scales=kv_scales(vllm_config, dtype),
        quantization=str(mc.quantization or "none"),
        compute_dtype=str(mc.dtype).replace("torch.", ""),
        overrides=repr(overrides) if overrides and not callable(overrides) else "",
        device_layout=f"{device}|{backend or 'auto'}|{type(spec).__name__}|{sys.byteorder}",
        block_bytes=block_bytes // len(heads.local),  # a rank's block holds its local heads
    )


def head_plan(vllm_config: Any, spec: Any, kind: str, tp_rank: int, shards: Any = None) -> HeadPlan:
    """Which of the model's KV heads this rank holds (vLLM's split, heads.py); for a state group
    with ``shards``, which of its state units (state_shards.py)."""
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    if shards is not None:
        return shards.plan(tp_size, tp_rank)
    if kind != "dense":
        return HeadPlan.replicated(tp_size, tp_rank)
    total = getattr(vllm_config.model_config, "get_total_num_kv_heads", None)
    local = int(getattr(spec, "num_kv_heads", 1))
    return HeadPlan(int(total()) if callable(total) else local * tp_size, tp_size, tp_rank)


def text_config_of(vllm_config: Any) -> Any:
    """The model's text config (a state group's mixer dims: vllm_state_groups.shards_of)."""
    return getattr(getattr(vllm_config, "model_config", None), "hf_text_config", None)


def tp_rank_of(vllm_config: Any, is_worker: bool) -> int:
    """This worker's tensor-parallel rank (the scheduler side: 0)."""
    if not is_worker or vllm_config.parallel_config.tensor_parallel_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def kind_of(spec: Any) -> str:
    """A KV cache spec's entry kind: "mla" (one latent, replicated over ranks), "opaque" (an SSM
    state group's states: one entry per block, vllm_state_groups.py) or "dense"."""
    if vsg.is_state_spec(spec):
        return "opaque"
    return "mla" if "MLA" in type(spec).__name__ else "dense"


@dataclasses.dataclass
class CxlKVHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler side: the namespace it derived and the weights field
    (with its source text) that the scheduler cannot compute, not holding the weights."""

    namespace: str
    weights: str
    weights_source: str


class AwaitingWorkers:
    """The scheduler's namespace until the workers report theirs. vLLM's engine core reports
    before the first request; an engine that never does gets the namespace of the sampled
    file digest at first use: the one workers that could not hash their weights use."""

    def __init__(self, open_namespace: Any) -> None:
        self._open = open_namespace
        self._ns: Any = None

    def __getattr__(self, name: str) -> Any:
        if self._ns is None:
            self._ns = self._open()
        return getattr(self._ns, name)

    def __getitem__(self, group: int) -> Any:  # a hybrid model's namespaces (one per group)
        if self._ns is None:
            self._ns = self._open()
        return self._ns[group]


def pool_layout(identity: ident.KVIdentity) -> cxlkv.KVLayout:
    return cxlkv.KVLayout(
        model_id=identity.model_id(),
        dtype=identity.dtype,
        num_layers=identity.num_layers,
        num_kv_heads=identity.num_kv_heads,
        head_size=identity.head_size,
        tokens_per_block=identity.block_size,
        kind=identity.kind,
        heads_per_entry=identity.heads_per_entry,
        block_bytes=identity.block_bytes,
        source=identity.source(),
    )


def describe(vllm_config: Any, kv_cache_config: Any, is_worker: bool, extra: dict) -> list[ident.KVIdentity]:
    """The identity of each KV cache group of this engine (vllm_groups.py), in vLLM's order. One
    group (uniform attention, or vLLM's hybrid manager off) keeps the identity it always had; in
    a hybrid model each group's attention reach, window and layers are in its device layout."""
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    groups = vg.group_layouts(
        kv_cache_config, vllm_config.cache_config.block_size, tp_size, text_config=text_config_of(vllm_config)
    )
    tp_rank = tp_rank_of(vllm_config, is_worker)
    # The worker holds the loaded weights (vLLM builds it after load_model); the scheduler
    # never sees them and adopts rank 0's identity in set_xfer_handshake_metadata.
    loaded = (
        loaded_digest(vllm_config.model_config, tp_size)
        if is_worker and hashes_loaded_weights(extra)
        else None
    )
    out = []
    for g in groups:
        identity = derive_identity(
            vllm_config,
            g.spec,
            len(g.layer_names),
            g.block_bytes,
            kind_of(g.spec),
            tp_rank,
            tp_size,
            extra,
            loaded,
            g.shards,
        )
        if len(groups) > 1:
            identity = dataclasses.replace(
                identity, device_layout=f"{identity.device_layout}|{g.describe(len(groups))}"
            )
        else:
            identity = engine_neutral(vllm_config, g.spec, identity, extra, loaded) or identity
        out.append(identity)
    return out


# The KV cache specs whose entries are the engine-neutral ones, and their entry kind. vLLM CPU
# keeps a full-attention layer as [blocks, heads, 2 x block_size, head_size] (read per head by
# heads.py) and an MLA layer as [blocks, block_size, latent] (CPU_MLA and AMX_MLA alike).
SHARED_SPECS = {"FullAttentionSpec": "dense", "MLAAttentionSpec": "mla"}


def engine_neutral(
    vllm_config: Any, spec: Any, identity: ident.KVIdentity, extra: dict, loaded: lw.LoadedDigest | None
) -> ident.KVIdentity | None:
    """The namespace other engines share (identity.shared_identity; SGLang's HiCache backend
    derives the same) when nothing but the weights, dtype, geometry and block size determines
    this engine's entries (per KV head; an MLA latent per block); None keeps the engine's own.
    The entry order (per layer K rows then V rows of one head; per layer the latent rows) is vLLM
    CPU's (SHARED_SPECS): other devices keep their own namespace until theirs is shown equal. Checked alike on both sides (the scheduler adopts the workers'
    weights field into the identity this returns)."""
    mc = vllm_config.model_config
    path = None if extra.get("model_id") else model_path(mc)
    if (
        extra.get("share_engines", True) is False
        or vllm_config.device_config.device_type != "cpu"
        or SHARED_SPECS.get(type(spec).__name__) != identity.kind
        or identity.quantization != "none"
        or identity.overrides
        or config_paths(mc)
        or identity.dtype not in ident.SHARED_DTYPES
        or ident.canonical_dtype(mc.dtype) != identity.dtype
        or (path is not None and str(path).endswith(".gguf"))  # its config is parsed, not a file
    ):
        return None
    weights, source = identity.weights, identity.weights_source
    if path is not None:  # the model directory alone: vLLM's parsed config is vLLM's own
        weights, source = ident.weights_identity(ident.weights_digest(path), ident.config_digest(), loaded)
    shared = ident.shared_identity(
        weights,
        source,
        identity.dtype,
        identity.num_layers,
        identity.num_kv_heads,
        identity.head_size,
        identity.block_size,
        identity.kind,
    )
    return shared if shared.block_bytes == identity.block_bytes else None
