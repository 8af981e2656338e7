"""What naming a namespace by the weights as loaded costs (docs/IDENTITY.md, "The weights as
loaded"): loaded_weights.module_digest over a real model, against baselines of the same run.

    python -m cxlkv.tools.bench_loaded_weights [MODEL_DIR] [--rounds N] [--json]

MODEL_DIR defaults to SmolLM2-135M (cxlkv.testing.models.smollm2), loaded in bf16 with
transformers. Also every byte of its weight files (loaded_weights.files_digest, page cache warm:
what vLLM CPU workers hash). Baselines, same tensors: one read of every byte (numpy sum of uint64 views: the
memory's read speed from Python), the core's XXH3 (cxlkv._core.xxh3_64, which copies each tensor
into a bytes object first) and the sampled file digest without its cache. Median of N rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def _median_s(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list | None = None) -> int:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from cxlkv import _core
    from cxlkv.integrations import identity as ident
    from cxlkv.integrations import loaded_weights as lw

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.model is None:
        from cxlkv.testing import models

        args.model = models.smollm2()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    load_s = time.perf_counter() - t0
    params = [p.detach() for _, p in model.named_parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    cores = len(os.sched_getaffinity(0))

    def read_all() -> None:
        for p in params:
            a = p.reshape(-1).view(torch.uint8).numpy()
            n = a.nbytes // 8 * 8
            np.sum(a[:n].view(np.uint64), dtype=np.uint64)

    def xxh3_all() -> None:
        for p in params:
            _core.xxh3_64(p.reshape(-1).view(torch.uint8).numpy().tobytes())

    def sampled_uncached() -> None:
        with tempfile.TemporaryDirectory() as d:  # a fresh copy: no cache, page cache warm
            copy = Path(d) / "m"
            shutil.copytree(args.model, copy, ignore=shutil.ignore_patterns(ident.CACHE_FILE))
            t = time.perf_counter()
            ident.weights_digest(copy)
            sampled_times.append(time.perf_counter() - t)

    sampled_times: list[float] = []
    out = {
        "model": str(args.model),
        "tensors": len(params),
        "bytes": nbytes,
        "cores": cores,
        "model_load_s": round(load_s, 3),
        "digest": lw.module_digest(model).digest,
    }
    for name, fn in (
        ("sha256_1t", lambda: lw.module_digest(model, threads=1)),
        (f"sha256_{cores}t", lambda: lw.module_digest(model, threads=cores)),
        ("files_sha256_1t", lambda: lw.files_digest(ident.weight_files(args.model), threads=1)),
        (f"files_sha256_{cores}t", lambda: lw.files_digest(ident.weight_files(args.model), threads=cores)),
        ("read_numpy_1t", read_all),
        ("xxh3_core_copy_1t", xxh3_all),
    ):
        s = _median_s(fn, args.rounds)
        out[name] = {"s": round(s, 4), "gbps": round(nbytes / s / 1e9, 3)}
    for _ in range(args.rounds):
        sampled_uncached()
    out["sampled_file_digest_uncached_s"] = round(statistics.median(sampled_times), 4)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
