"""vLLM's LMCache multiprocess connector, sending the KV identity instead of the model name.

    --kv-transfer-config '{"kv_connector": "CxlKVLMCacheMPConnector",
        "kv_connector_module_path": "cxlkv.integrations.lmcache_vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 5555}}'

LMCache's own connector puts ``model_config.model`` (what the operator typed) into every object
key. cxlkv's L2 adapter in the LMCache server does not trust a name (lmcache_identity.py), so this
subclass derives the identity here, in the engine, from what determines the KV bytes, and puts it
where the name was (``cxlkv-kv1.<sha256>``): the weights vLLM loads (the directory it resolved,
a hub id at its ``--revision``; every byte of the weight files + the sampled per-tensor digest +
the config files, as for the LMCache server before), the config as vLLM parsed it (``hf_overrides``,
``hf_config_path``), the KV cache dtype and scales, the weight quantization, the compute dtype,
the device, attention backend and byte order, and LMCache's own layout decoration (DCP). The
scheduler and the workers derive it from the same vLLM config, so their keys agree. Everything
else is LMCache's connector, unchanged.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from lmcache.integration.vllm.lmcache_mp_connector import get_dcp_decorated_model_name
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector import LMCacheMPConnector

from cxlkv.integrations import identity as ident
from cxlkv.integrations import vllm_identity as cxlkv_vllm
from cxlkv.integrations.external_identity import UnresolvableModelError, weights_of
from cxlkv.integrations.lmcache_identity import model_token

log = logging.getLogger("cxlkv.lmcache_vllm")


def engine_identity(vllm_config: Any, cache_model_name: str) -> tuple[str, str]:
    """(the model field for LMCache keys, a display text of what it was derived from)."""
    mc = vllm_config.model_config
    path = cxlkv_vllm.model_path(mc)
    if path is None:
        raise UnresolvableModelError(
            f"cxlkv: cannot read the weights of model {mc.model!r} (revision "
            f"{getattr(mc, 'revision', None)!r}) to derive the identity LMCache keys carry"
        )
    weights, source = weights_of(path)
    kv_dtype = cxlkv_vllm.kv_dtype(vllm_config, None)
    overrides = getattr(mc, "hf_overrides", None)
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    fields = {
        "weights": weights,
        "config": ident.config_digest(cxlkv_vllm.config_paths(mc), cxlkv_vllm.loaded_config(mc)),
        "kv_dtype": kv_dtype,
        "kv_scales": cxlkv_vllm.kv_scales(vllm_config, kv_dtype),
        "quantization": str(mc.quantization or "none"),
        "compute_dtype": str(mc.dtype).replace("torch.", ""),
        "overrides": repr(overrides) if overrides and not callable(overrides) else "",
        "device": f"{vllm_config.device_config.device_type}|{backend or 'auto'}|{sys.byteorder}",
        # LMCache's own decoration of the name (a DCP interleave layout), kept as a field
        "lmcache_layout": cache_model_name[len(str(mc.model)) :],
    }
    return model_token(fields), f"{source}; kv {kv_dtype} quant={fields['quantization']}"


class CxlKVLMCacheMPConnector(LMCacheMPConnector):
    """LMCacheMPConnector whose LMCache keys carry cxlkv's identity instead of the model name."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        # First: a model whose weights cannot be read fails here, before any server handshake.
        token, source = engine_identity(
            vllm_config, get_dcp_decorated_model_name(vllm_config, kv_cache_config)
        )
        super().__init__(vllm_config, role, kv_cache_config)
        adapters = [a for a in (getattr(self, n, None) for n in ("scheduler_adapter", "worker_adapter")) if a]
        if not adapters or not all(hasattr(a, "model_name") for a in adapters):
            raise RuntimeError(
                "cxlkv: this LMCache version's connector keeps no adapter.model_name; "
                "CxlKVLMCacheMPConnector supports LMCache 0.5.6"
            )
        for adapter in adapters:
            adapter.model_name = token  # what every ObjectKey it builds from now on carries
        log.info("cxlkv: LMCache keys carry identity %s (%s)", token, source)
