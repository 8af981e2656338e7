"""Runs one real vLLM engine (CPU) with or without the cxlkv connector, as its own process, and
prints one `RESULT <json>` line per round. Driven by tests/vllm/test_connector.py.

    python llm_driver.py '<json spec>'

spec: model ("tiny" | "tiny-swa" (sliding window on every other layer) | "tiny-nemotron-h" (an
SSM hybrid) | "tiny-qwen3-next" | "tiny-qwen3-next-tp" | "tiny-nemotron-h-tp" | "tiny-jamba" | "tiny-granite4" | "tiny-granite4-tp" (more SSM hybrids) | "tiny-deepseek-v2" (MLA) | "smollm2" | a model directory), load_format (vLLM's), served_model_name (optional), pool (path),
connector (bool), role ("kv_both" ...), on_pool_error ("fail": an unusable pool stops the engine
instead of serving without the cache), max_num_batched_tokens (optional), prefix_caching (bool,
default true), attention_backend and block_size (vLLM's), ids (bool: report prompt token ids), stats (bool: report preemptions and the
connector's vllm:cxlkv_* counters as "cxlkv"), tp (tensor_parallel_size; set
VLLM_CPU_OMP_THREADS_BIND in the environment), extra_config (more kv_connector_extra_config keys),
max_tokens, top_logprobs (k > 1: report each position's top k as "top"), async_saves (bool;
default: $CXLKV_TEST_ASYNC_SAVES, else the connector's), rounds: [{"prompts": [{"prompt":
str, "cache_salt": str?}], "before": "corrupt_pool" | "corrupt_depth:D" | "unlink_pool" |
"truncate_pool" | "replace_pool" | null, "reset_prefix_cache": bool?, "wait_for": path?, "abort": {"after_steps": N,
"requests": [index, ...]}?}]. A round with "wait_for" prints
`WAITING <round>` and starts once that file exists (the test stops and resumes the engine there).
"""

import json
import mmap
import os
import struct
import sys
import time

os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def corrupt_pool(path: str, depth: int = -1) -> int:
    """Flips one payload byte of every READY block in the pool (the layout of src/core/format/format.h),
    or only of the blocks at chain depth `depth`."""
    import cxlkv

    with cxlkv.Pool.open(path) as pool:
        info = pool.info()
        blocks = {n["id"]: n["block_bytes"] for n in pool.namespaces()}
    chunk = info["chunk_bytes"]
    desc = (chunk // 1024 * 8 + 4095) // 4096 * 4096
    flipped = 0
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        for slot in range(info["index_slots"]):
            off = info["index_off"] + slot * 64
            state = struct.unpack_from("<Q", m, off)[0]
            if state >> 56 != 2:  # READY
                continue
            ns_id, c, b, d = struct.unpack_from("<IIHH", m, off + 40)
            if depth >= 0 and d != depth:
                continue
            stride = (blocks[ns_id] + 63) // 64 * 64
            p = info["arena_off"] + c * (desc + chunk) + desc + b * stride + 100
            m[p] ^= 0xFF
            flipped += 1
    return flipped


def cxlkv_counters(metrics) -> dict:
    """The connector's counters so far (vllm:cxlkv_*; a labelled one as name{label=value})."""
    out: dict = {}
    for m in metrics:
        if not m.name.startswith("vllm:cxlkv_") or not isinstance(getattr(m, "value", None), int | float):
            continue
        own = [f"{k}={v}" for k, v in sorted(m.labels.items()) if k not in ("engine", "model_name")]
        key = m.name + ("{" + ",".join(own) + "}" if own else "")
        out[key] = out.get(key, 0) + m.value
    return out


def generate_aborting(llm, inputs: list, sp, after_steps: int, requests: list) -> tuple[list, set]:
    """llm.generate, stepping the engine by hand: after `after_steps` steps the requests at the
    indices `requests` are aborted (vLLM's finish_requests path, as a client disconnecting). Returns
    the last output of every request (an aborted one: what it had so far) and the aborted indices."""
    engine = llm.llm_engine
    ids = [f"abortable-{i}" for i in range(len(inputs))]
    for rid, inp in zip(ids, inputs, strict=True):
        engine.add_request(rid, inp, sp)
    last: dict = {}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            last[o.request_id] = o
        steps += 1
        if steps == after_steps:
            engine.abort_request([ids[i] for i in requests])
    missing = [rid for rid in ids if rid not in last]
    if missing:
        sys.exit(f"llm_driver: no output for {missing} (aborted before their first step?)")
    return [last[rid] for rid in ids], set(requests)


def _saves_mode(spec: dict) -> dict:
    """The connector's async_saves: the spec's, else $CXLKV_TEST_ASYNC_SAVES (0 or 1: run the whole
    suite in one mode), else the connector's default (async)."""
    if "async_saves" in spec:
        return {"async_saves": bool(spec["async_saves"])}
    env = os.environ.get("CXLKV_TEST_ASYNC_SAVES")
    return {"async_saves": env == "1"} if env in ("0", "1") else {}


def _ranked(lp: dict) -> list:
    """[[token, logprob], ...] of one position, most likely first (the sampled token may be extra)."""
    return sorted(([t, v.logprob] for t, v in lp.items()), key=lambda x: -x[1])


def main() -> None:
    spec = json.loads(sys.argv[1])
    in_process = spec.get("tp", 1) == 1 and not spec.get("multiprocess")
    if in_process:
        # vLLM's engine core and its one worker in this process, as vLLM runs one GPU (the "uni"
        # executor): each engine of the suite then imports torch and vLLM once, not three times
        # (about two thirds of a tiny engine's start on 2 cores). Specs with "multiprocess" (and
        # every TP > 1 engine) keep the CPU platform's default: engine core and workers as
        # processes, the connector's scheduler and worker sides apart.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from cxlkv.testing import models

    name = spec.get("model", "tiny")
    model = models.tiny_llama() if name == "tiny" else models.smollm2() if name == "smollm2" else name
    if name == "tiny-swa":
        model = models.tiny_swa_llama()
    if name == "tiny-nemotron-h":  # an SSM hybrid (a Mamba-2 layer, an attention layer)
        model = models.tiny_nemotron_h()
    more_hybrids = {  # more SSM / linear-attention hybrids
        "tiny-qwen3-next": models.tiny_qwen3_next,
        "tiny-qwen3-next-tp": models.tiny_qwen3_next_tp,  # two key heads: TP=1 and TP=2
        "tiny-nemotron-h-tp": models.tiny_nemotron_h_tp,  # two Mamba-2 groups: TP=1 and TP=2
        "tiny-jamba": models.tiny_jamba,
        "tiny-granite4": models.tiny_granite4,
        "tiny-granite4-tp": models.tiny_granite4_tp,  # two Mamba-2 groups: TP=1 and TP=2
        "tiny-lfm2": models.tiny_lfm2,  # short conv, two KV heads: TP=1 and TP=2
        "tiny-deepseek-v2": models.tiny_deepseek_v2,  # MLA: one latent, replicated over ranks
    }
    if name in more_hybrids:
        model = more_hybrids[name]()
    kw = dict(
        model=model,
        enforce_eager=True,
        kv_cache_memory_bytes=spec.get("kv_bytes", 1 << 30),
        max_model_len=spec.get("max_model_len", 4096),
        seed=0,
    )
    if spec.get("load_format"):
        kw["load_format"] = spec["load_format"]
    if spec.get("tp", 1) > 1:  # vLLM CPU: one OpenMP thread bound per rank ("0|1")
        kw["tensor_parallel_size"] = spec["tp"]
        kw["distributed_executor_backend"] = "mp"
    elif in_process:
        kw["distributed_executor_backend"] = "uni"
    if spec.get("served_model_name"):
        kw["served_model_name"] = spec["served_model_name"]
    if spec.get("attention_backend"):  # e.g. "CPU_MLA": the same backend (and block size) on every CPU
        kw["attention_backend"] = spec["attention_backend"]
    if spec.get("block_size"):
        kw["block_size"] = spec["block_size"]
    if spec.get("prefix_caching") is False:
        kw["enable_prefix_caching"] = False
    if spec.get("stats"):
        kw["disable_log_stats"] = False  # enables llm.get_metrics(): preemption counts
    if spec.get("max_num_batched_tokens"):
        kw["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
        kw["max_num_seqs"] = spec.get("max_num_seqs", 4)
    if spec.get("connector", True):
        kw["kv_transfer_config"] = {
            "kv_connector": "CxlKVConnector",
            "kv_connector_module_path": "cxlkv.integrations.vllm",
            "kv_role": spec.get("role", "kv_both"),
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "pool_path": spec["pool"],
                "pool_size": spec.get("pool_size", "1GiB"),
                **({"chunk_size": spec["chunk_size"]} if spec.get("chunk_size") else {}),
                **({"on_pool_error": spec["on_pool_error"]} if spec.get("on_pool_error") else {}),
                **_saves_mode(spec),
                **spec.get("extra_config", {}),
            },
        }
    t0 = time.time()
    llm = LLM(**kw)
    print("STARTUP", round(time.time() - t0, 1), flush=True)
    # vLLM's final word on its hybrid KV cache manager (a connector without SupportsHMA turns it off)
    hybrid = not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    top = spec.get("top_logprobs", 1)
    sp = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), logprobs=top)
    for i, rnd in enumerate(spec["rounds"]):
        extra = {}
        if rnd.get("wait_for"):
            print("WAITING", i, flush=True)
            deadline = time.monotonic() + 600  # the test's own timeouts are shorter
            while not os.path.exists(rnd["wait_for"]):
                if time.monotonic() > deadline:
                    sys.exit(f"llm_driver: {rnd['wait_for']} never appeared")
                time.sleep(0.05)
        before = rnd.get("before") or ""
        if rnd.get("reset_prefix_cache"):  # vLLM's own cache emptied: a hit then comes from the pool
            assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
        if before == "corrupt_pool":
            extra["corrupted"] = corrupt_pool(spec["pool"])
        elif before.startswith("corrupt_depth:"):
            extra["corrupted"] = corrupt_pool(spec["pool"], int(before.split(":")[1]))
        elif before == "unlink_pool":
            os.unlink(spec["pool"])
        elif before == "truncate_pool":
            os.truncate(spec["pool"], 4096)
        elif before == "replace_pool":  # another pool file renamed over the path
            import cxlkv

            cxlkv.Pool.create(spec["pool"] + ".new", "64MiB").close()
            os.rename(spec["pool"] + ".new", spec["pool"])
        inputs = [
            {"prompt": p["prompt"], **({"cache_salt": p["cache_salt"]} if p.get("cache_salt") else {})}
            for p in rnd["prompts"]
        ]
        t0 = time.time()
        aborted: set = set()
        if rnd.get("abort"):
            outs, aborted = generate_aborting(llm, inputs, sp, **rnd["abort"])
        else:
            outs = llm.generate(inputs, sp)
        res = [
            {
                "len": len(o.prompt_token_ids),
                "cached": o.num_cached_tokens or 0,
                "tokens": list(o.outputs[0].token_ids),
                **({"ids": list(o.prompt_token_ids)} if spec.get("ids") else {}),
                "logprobs": [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs],
                **({"top": [_ranked(lp) for lp in o.outputs[0].logprobs]} if top > 1 else {}),
                **({"aborted": True} if i in aborted else {}),
            }
            for i, o in enumerate(outs)
        ]
        if spec.get("stats"):
            metrics = llm.get_metrics()
            extra["preemptions"] = sum(
                getattr(m, "value", 0) or 0 for m in metrics if m.name == "vllm:num_preemptions"
            )
            extra["cxlkv"] = cxlkv_counters(metrics)
        print(
            "RESULT "
            + json.dumps(
                {"round": i, "seconds": round(time.time() - t0, 3), "hybrid": hybrid, "outputs": res, **extra}
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
