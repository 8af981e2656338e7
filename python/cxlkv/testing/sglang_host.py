"""SGLang's own MHA and MLA host KV pools and HiCache storage backend, built on CPU for the tests that check
cxlkv's SGLang backend against SGLang's real objects (tests/python/test_sglang_backend.py with a
fake model, tests/vllm/test_engines_share.py against a vLLM engine).

Its functions need ``sglang`` and ``torch`` (imported by each function: the module itself imports
without them, as the testing layer must).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: the testing layer itself imports without torch or SGLang
    import torch

# Every host layout SGLang's MHA host pool has; cxlkv's backend serves them all.
HOST_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


def host_pool(
    layout: str, *, layers: int, heads: int, head_dim: int, page: int, tokens: int, ratio: float = 1.0
) -> Any:
    """SGLang's MHA host pool over ``tokens`` bf16 device tokens on CPU (pin_memory off: no CUDA);
    the host holds ``ratio`` times as many tokens as the device buffers."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    k = tuple(torch.zeros(tokens, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers))
    v = tuple(torch.zeros(tokens, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers))

    def ptrs(ts):
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
        page_size=page, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )  # fmt: skip
    # SGLang refuses a host pool when the machine's free memory minus its reserve is short: these
    # pools are a few MiB at most, so book them against a budget of their own (a loaded CI host
    # is not short of memory for them).
    with host_memory_budget_scope(1 << 30):
        return MHATokenToKVPoolHost(
            info, ratio, 0, page, layout, pin_memory=False, device="cpu",
            device_capacity_tokens=tokens, start_layer=0, end_layer=layers,
        )  # fmt: skip


# The host layouts of SGLang's MLA host pool that cxlkv shares with vLLM.
MLA_HOST_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def mla_host_pool(layout: str, *, layers: int, latent: tuple[int, int], page: int, tokens: int) -> Any:
    """SGLang's MLA host pool over ``tokens`` bf16 device tokens on CPU; ``latent``: (kv_lora_rank,
    rope dim), one row of their sum per token and layer."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    rank, rope = latent
    bufs = tuple(torch.zeros(tokens, 1, rank + rope, dtype=torch.bfloat16) for _ in range(layers))
    info = MLABufferInfo(
        buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
        layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=page, kv_lora_rank=rank,
        qk_rope_head_dim=rope, kv_cache_dim=rank + rope, dtype=torch.bfloat16, device=torch.device("cpu"),
    )  # fmt: skip
    with host_memory_budget_scope(1 << 30):  # as host_pool: a few MiB, booked on their own
        return MLATokenToKVPoolHost(
            info, 1.0, 0, page, layout, pin_memory=False, device="cpu", device_capacity_tokens=tokens,
            start_layer=0, end_layer=layers, target_layer_num=layers,
        )  # fmt: skip


def mla_logical_view(host) -> torch.Tensor:
    """The MLA host buffer as [layer, token, latent], from the dims SGLang documents for each
    layout (MLATokenToKVPoolHost.init_kv_buffer): independent of cxlkv's own views."""
    buf, layers, dim = host.kv_buffer, host.layer_num, host.kv_cache_dim
    if host.layout == "layer_first":  # [layer, token, 1, latent]
        return buf.view(layers, -1, dim)
    if host.layout == "page_first":  # [token, layer, 1, latent]
        return buf.view(-1, layers, dim).permute(1, 0, 2)
    assert host.layout == "page_first_direct", host.layout  # [page, layer, token, 1, latent]
    return buf.view(host.page_num, layers, -1, dim).permute(1, 0, 2, 3).reshape(layers, -1, dim)


def hicache_backend(
    pool_path: str, host, *, model: str | None = None, tp_rank: int = 0, tp_size: int = 1
) -> Any:
    """What SGLang's cache controller does with ``--hicache-storage-backend dynamic`` and cxlkv's
    backend in its extra config: create it by SGLang's factory and register the host pool."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    extra = {
        "backend_name": "cxlkv",
        "module_path": "cxlkv.integrations.sglang",
        "class_name": "CxlKVHiCacheStorage",
        "interface_v1": 1,
        "pool_path": pool_path,
    }
    if model is not None:
        extra["model_path"] = model
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=type(host).__name__.startswith("MLA"), enable_storage_metrics=False, is_page_first_layout=host.layout == "page_first",
        model_name="served-alias", extra_config=extra,
    )  # fmt: skip
    storage = StorageBackendFactory.create_backend("dynamic", config, host)
    assert isinstance(storage, HiCacheStorage)
    storage.register_mem_pool_host(host)
    return storage


def logical_view(host) -> torch.Tensor:
    """The host buffer as [k/v, layer, token, head, dim], from the dims SGLang documents for each
    layout (MHATokenToKVPoolHost.init_kv_buffer): independent of cxlkv's own views."""
    buf, layers, heads, dim = host.kv_buffer, host.layer_num, host.head_num, host.head_dim
    if host.layout == "layer_first":  # [2, layer, token, head, dim]
        return buf
    if host.layout == "page_first":  # [2, token, layer, head, dim]
        return buf.permute(0, 2, 1, 3, 4)
    if host.layout == "page_first_direct":  # [2, page, layer, token, head, dim]
        return buf.permute(0, 2, 1, 3, 4, 5).reshape(2, layers, -1, heads, dim)
    assert host.layout == "page_head", host.layout  # [2, page, head, token, layer, dim]
    return buf.permute(0, 4, 1, 3, 2, 5).reshape(2, layers, -1, heads, dim)


def page_bytes(host, page: int) -> bytes:
    """Page ``page``'s bytes as SGLang's own zero-copy metadata lists them."""
    import torch

    size = host.page_size
    ptrs, sizes = host.get_page_buffer_meta(torch.arange(page * size, (page + 1) * size))
    return b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes, strict=True))


def page_indices(pages: list[int], page_size: int) -> torch.Tensor:
    """The token indices of ``pages`` in a host pool of ``page_size``-token pages."""
    import torch

    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages])
