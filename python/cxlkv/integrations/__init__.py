"""cxlkv inside serving systems: the vLLM connector (``vllm.py``, module path
``cxlkv.integrations.vllm`` in vLLM's kv_transfer_config; a façade over ``vllm_scheduler.py``,
``vllm_worker.py``, ``vllm_identity.py``, ``vllm_common.py``, ``vllm_metrics.py`` and
``vllm_groups.py``: a hybrid model's KV cache groups), model identity (``identity.py``),
block keys (``keys.py``), pool-fault handling (``pool_guard.py``) and the prefill/decode proxy
(``pd_proxy.py``). Imports only the public API (and each other): never tools or the CLI."""
