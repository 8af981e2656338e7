"""Coalescing of new prefixes, measured: two vLLM engines (separate processes, one pool) get the
same NEW long prompt at the same moment, as behind a round-robin router; TTFT of both, with
coalescing (one computes, the other waits for its blocks) and without (``"coalesce": false``: both
compute), the two configurations in the same run, each on fresh engines and a fresh pool.

    python -m cxlkv.tools.bench_coalesce [--model smollm2|tiny|DIR] [--prompt-words 3000]
                                         [--rounds 3] [--json]

Each round sends a prompt never seen before (other words) to both engines; TTFT is the wall time
of a one-token ``generate`` from the moment both are released (a file both poll every 10 ms).
Prints per configuration the median over rounds of the faster and the slower engine's TTFT and
the ratio against ``off`` measured in the same run. Needs vLLM (scripts/setup-vllm.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

from cxlkv.errors import CommandError
from cxlkv.testing.prompts import SERVING_VOCAB, seeded_words
from cxlkv.tools.serve_fleet import own_group_dies_with_us, signal_group

# The first twelve words of the tests' vocabulary: the prompts this benchmark has always sent.
VOCAB = SERVING_VOCAB[:12]


def words(seed: int, n: int) -> str:
    return seeded_words(seed, n, VOCAB)


def engine(spec: dict) -> None:
    """One engine process: a round per go file, one line `TTFT <round> <seconds>` each."""
    from vllm import LLM, SamplingParams

    from cxlkv.testing import models

    name = spec["model"]
    model = models.tiny_llama() if name == "tiny" else models.smollm2() if name == "smollm2" else name
    llm = LLM(
        model=model,
        enforce_eager=True,
        max_model_len=8192,
        seed=0,
        kv_transfer_config={
            "kv_connector": "CxlKVConnector",
            "kv_connector_module_path": "cxlkv.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"pool_path": spec["pool"], "pool_size": "2GiB", **spec["extra"]},
        },
    )
    print("READY", flush=True)
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    for i, prompt in enumerate(spec["prompts"]):
        go = f"{spec['go']}.{i}"
        while not os.path.exists(go):
            time.sleep(0.01)
        t0 = time.perf_counter()
        llm.generate([prompt], sp, use_tqdm=False)
        print(f"TTFT {i} {time.perf_counter() - t0:.3f}", flush=True)


def next_line(p: subprocess.Popen, prefix: str) -> list[str] | None:
    """The engine's next line starting with `prefix` (vLLM logs to stdout too); None at its end."""
    assert p.stdout is not None
    for line in p.stdout:
        if line.startswith(prefix):
            return line.split()
    return None


def run_config(model: str, coalesce: bool, prompts: list[str], bound_s: float = 900) -> list[list[float]]:
    """TTFT of both engines per round: [[a, b], ...]."""
    tmp = tempfile.mkdtemp(prefix="cxlkv-bench-coalesce-")
    pool = f"/dev/shm/cxlkv-bench-coalesce-{uuid.uuid4().hex}"
    spec = {
        "model": model,
        "pool": pool,
        "extra": {"coalesce": coalesce},
        "prompts": prompts,
        "go": f"{tmp}/go",
    }
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.pop("PYTHONHASHSEED", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "cxlkv.tools.bench_coalesce", "--engine", json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=open(f"{tmp}/engine-{n}.log", "w"),
            text=True,
            env=env,
            preexec_fn=own_group_dies_with_us,  # one group: the LLM frontend and vLLM's engine core
        )
        for n in range(2)
    ]
    try:
        for p in procs:
            if next_line(p, "READY") is None:
                raise CommandError(f"bench_coalesce: an engine failed to start (its log: {tmp}/engine-*.log)")
        out = []
        for i in range(len(prompts)):
            open(f"{spec['go']}.{i}", "w").close()
            row = []
            for p in procs:
                line = next_line(p, "TTFT ")
                if line is None or len(line) != 3:
                    raise CommandError(
                        f"bench_coalesce: an engine stopped in round {i} (its log: {tmp}/engine-*.log)"
                    )
                row.append(float(line[2]))
            out.append(sorted(row))
            print(f"  coalesce={coalesce} round {i}: TTFT {row[0]:.2f} s / {row[1]:.2f} s", file=sys.stderr)
        return out
    finally:
        for p in procs:
            # The whole group: killing the frontend alone left vLLM's engine-core process (and its
            # worker, GBs of KV cache) running, orphaned, after the bench had returned.
            signal_group(p, signal.SIGKILL)
            p.wait(60)
        if os.path.exists(pool):
            os.unlink(pool)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt-words", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.engine:
        engine(json.loads(args.engine))
        return
    prompts = [words(1000 + r, args.prompt_words) for r in range(args.rounds)]
    t0 = time.time()
    rows = {name: run_config(args.model, on, prompts) for name, on in (("off", False), ("coalesce", True))}
    summary = {
        name: {
            "first_ttft_s": statistics.median(r[0] for r in res),
            "second_ttft_s": statistics.median(r[1] for r in res),
            "rounds": res,
        }
        for name, res in rows.items()
    }
    for name in summary:
        summary[name]["sum_ratio_vs_off"] = round(
            (summary[name]["first_ttft_s"] + summary[name]["second_ttft_s"])
            / (summary["off"]["first_ttft_s"] + summary["off"]["second_ttft_s"]),
            3,
        )
    summary["seconds"] = round(time.time() - t0, 1)
    summary["load_average"] = os.getloadavg()
    if args.json:
        print(json.dumps(summary))
        return
    print(
        f"two engines, one new {args.prompt_words}-word prompt to both at once, median of {args.rounds} rounds"
    )
    print(f"{'config':10} {'faster TTFT s':>14} {'slower TTFT s':>14} {'sum vs off':>11}")
    for name in ("off", "coalesce"):
        s = summary[name]
        print(
            f"{name:10} {s['first_ttft_s']:14.2f} {s['second_ttft_s']:14.2f} {s['sum_ratio_vs_off']:10.2f}x"
        )
    print("load average:", " ".join(f"{x:.2f}" for x in summary["load_average"]))


if __name__ == "__main__":
    main()
