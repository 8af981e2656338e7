"""The identity an LMCache client sends cxlkv's L2 adapter in place of a model name.

LMCache's object key carries ``model_config.model`` as the engine typed it. The LMCache server
cannot know which bytes that name stood for in the engine (another host or container, another
``--revision`` of a hub id, ``hf_overrides``, another KV dtype), so it must not derive identity
from it. The engine can: :mod:`cxlkv.integrations.lmcache_vllm` (the vLLM-side connector)
digests the weights it loads and the configuration that shapes the KV, and puts
``cxlkv-kv1.<sha256 hex>`` where the name was. The adapter accepts only keys of that form.
No vLLM or LMCache import here: the server side uses it too.
"""

from __future__ import annotations

import hashlib
import json
import re

from cxlkv.errors import UntrustedModelNameError

TOKEN_PREFIX = "cxlkv-kv1."
_TOKEN = re.compile(r"cxlkv-kv1\.([0-9a-f]{64})")


def model_token(fields: dict) -> str:
    """The model field for LMCache keys: a digest of every field (str/int values) that
    determines the KV bytes besides what LMCache's key already carries (rank, group, tokens)."""
    blob = json.dumps({"v": TOKEN_PREFIX, **fields}, sort_keys=True)
    return TOKEN_PREFIX + hashlib.sha256(blob.encode()).hexdigest()


def weights_of_model_field(model: str) -> str:
    """KVIdentity.weights for a key's model field; UntrustedModelNameError unless it is a token."""
    m = _TOKEN.fullmatch(model)
    if m is None:
        raise UntrustedModelNameError(
            f"LMCache key model {model[:100]!r} is a name, not an identity derived from the "
            "weights: cxlkv does not store its KV. Run vLLM with kv_connector "
            '"CxlKVLMCacheMPConnector" and kv_connector_module_path "cxlkv.integrations.lmcache_vllm" '
            "(docs/INTEGRATIONS.md)"
        )
    return "engine:" + m.group(1)
