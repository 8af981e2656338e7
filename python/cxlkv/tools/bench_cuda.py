"""Pool <-> GPU bandwidth of the fused paged-KV kernel (kernels/paged.py) against the limits, in
one run: one cudaMemcpy of the same bytes (contiguous, registered pool <-> device) and one
cudaMemcpyAsync per fragment (what a connector without the kernel does: layers x 2 per block).

    python -m cxlkv.tools.bench_cuda [--pool PATH | --pool-dir DIR] [--blocks 256] [--json] [--out FILE]
    python -m cxlkv.tools.bench_cuda --register-gib 8 [--pool-dir DIR] [--json] [--out FILE]

``--register-gib N``: instead, how long ``cudaHostRegister`` of an N GiB pool file takes
(cuda_registration.py: ranges cut between chunks, every range's device pointer checked), cold
(the registration faults the file's pages in) and warm, with the default 64 GiB ranges and with
1 GiB and 256 MiB ones, and how long unregistering takes.

Needs a GPU (scripts/gpu-check.sh runs it there). ``--device cpu`` runs the same logic on CPU
tensors (under TRITON_INTERPRET=1: a correctness smoke test of the bench, its timings mean
nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def _geometry(small: bool) -> dict:
    # Llama-3-8B-like per-layer blocks (32 layers, 8 KV heads x 128, 16 tokens, bf16: 2 MiB per
    # block); --small: a toy geometry for the CPU smoke run.
    return (
        dict(layers=2, heads=2, head_dim=8, block_size=4)
        if small
        else dict(layers=32, heads=8, head_dim=128, block_size=16)
    )


def run(
    device: str = "cuda",
    blocks: int = 256,
    small: bool = False,
    pool_path: str | None = None,
    iters: int = 5,
    pool_dir: str = "/dev/shm",
) -> dict:
    import torch

    import cxlkv
    from cxlkv.integrations.cuda_registration import register_pool
    from cxlkv.kernels import paged

    g = _geometry(small)
    dev = torch.device(device)
    nb = blocks + 8
    kv = [
        torch.randn(2, nb, g["block_size"], g["heads"], g["head_dim"], device=dev).to(torch.bfloat16)
        for _ in range(g["layers"])
    ]
    bb = sum(a[:, 0].numel() * a.element_size() for a in kv)
    path = pool_path or os.path.join(pool_dir, f"cxlkv-bench-cuda-{os.getpid()}")
    size = max(64 << 20, (blocks * bb * 3) // 2 + (64 << 20))
    pool = cxlkv.Pool.create(path, size, exist_ok=True)
    registration = None
    try:
        ns = pool.namespace(
            cxlkv.KVLayout(
                model_id="bench/cuda",
                dtype="bf16",
                num_layers=g["layers"],
                num_kv_heads=g["heads"],
                head_size=g["head_dim"],
                tokens_per_block=g["block_size"],
            )
        )
        keys = [os.urandom(32) for _ in range(blocks)]
        res = ns.reserve(keys)
        offs = [o for o in res.offsets if o >= 0]
        if len(offs) != blocks:
            raise RuntimeError(f"the pool has room for {len(offs)} of {blocks} blocks")
        view = pool.transfer_view()
        host = torch.from_numpy(view)
        plan = paged.plan_fragments(kv, 1, bb)
        if dev.type == "cuda":
            registration = register_pool(pool, background=False)
            if not registration.registered:
                raise RuntimeError(f"pool not registered with CUDA: {registration.reason}")
            words: Any = _UvaWords(int(view.ctypes.data), paged.pool_words(host, plan.word_bytes).dtype, dev)
        else:
            words = paged.pool_words(host, plan.word_bytes)
        ids = list(range(blocks))
        total = blocks * bb
        contiguous_dev = torch.empty(total, dtype=torch.uint8, device=dev)
        lo = min(offs)
        span = host[lo : lo + total]  # the same number of bytes, contiguous in the pool

        def timed(fn) -> float:
            fn()
            _sync(dev)
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            _sync(dev)
            return (time.perf_counter() - t0) / iters

        frags = [(a, k) for a in kv for k in range(2)]

        def per_fragment(to_pool: bool) -> None:
            for i, o in enumerate(offs):
                at = o
                for a, k in frags:
                    n = a[k, i].numel() * a.element_size()
                    pool_part = host[at : at + n]
                    kv_part = a[k, i].view(-1).view(torch.uint8)
                    if to_pool:
                        pool_part.copy_(kv_part, non_blocking=True)
                    else:
                        kv_part.copy_(pool_part, non_blocking=True)
                    at += n

        out: dict = {
            "device": _device_name(dev),
            "blocks": blocks,
            "block_bytes": bb,
            "bytes": total,
            "fragments_per_block": plan.fragments,
            "iters": iters,
            "pool_path": path,
        }
        for name, to_pool in (("gpu_to_pool", True), ("pool_to_gpu", False)):
            copy = paged.gather if to_pool else paged.scatter

            def fused(copy=copy) -> None:
                copy(plan, words, int(view.shape[0]), ids, offs)

            def memcpy_once(to_pool=to_pool) -> None:
                if to_pool:
                    span.copy_(contiguous_dev, non_blocking=True)
                else:
                    contiguous_dev.copy_(span, non_blocking=True)

            kernel = timed(fused)
            memcpy = timed(memcpy_once)
            per_frag = timed(lambda to_pool=to_pool: per_fragment(to_pool))
            out[name] = {
                "kernel_gbps": round(total / kernel / 1e9, 3),
                "memcpy_gbps": round(total / memcpy / 1e9, 3),
                "per_fragment_gbps": round(total / per_frag / 1e9, 3),
                "kernel_vs_memcpy": round(memcpy / kernel, 3),
                "kernel_vs_per_fragment": round(per_frag / kernel, 3),
            }
        # the bytes the kernel wrote are the CPU path's bytes (docs/ARCHITECTURE.md)
        paged.gather(plan, words, int(view.shape[0]), ids[:1], offs[:1])
        _sync(dev)
        out["layout_matches_cpu_path"] = bytes(view[offs[0] : offs[0] + bb]) == paged.reference_pack(kv, 1, 0)
        res.abort()
        return out
    finally:
        if registration is not None:
            registration.close()
        pool.close()
        if pool_path is None:
            cxlkv.Pool.destroy(path, ignore_attached=True)


def run_registration(gib: float, pool_dir: str = "/dev/shm") -> dict:
    """cudaHostRegister of a pool file of ``gib`` GiB in ranges (see the module's docstring)."""
    import torch

    import cxlkv
    from cxlkv.integrations.cuda_registration import MAX_RANGE_BYTES, register_pool

    torch.zeros(1, device="cuda")  # the CUDA context exists before anything is timed
    path = os.path.join(pool_dir, f"cxlkv-bench-register-{os.getpid()}")
    pool = cxlkv.Pool.create(path, int(gib * 2**30))
    try:
        size = int(pool.transfer_view().shape[0])
        runs = []
        for label, max_range in (
            ("cold", MAX_RANGE_BYTES),
            ("warm", MAX_RANGE_BYTES),
            ("warm", 1 << 30),
            ("warm", 256 << 20),
        ):
            try:
                ranges = len(pool.transfer_ranges(max_range))
            except ValueError as e:  # the pool's head (index, tables) is larger than max_range
                runs.append({"pages": label, "max_range_bytes": max_range, "skipped": str(e)})
                continue
            t0 = time.perf_counter()
            reg = register_pool(pool, background=False, max_range_bytes=max_range)
            reg_s = time.perf_counter() - t0
            ok, reason = reg.registered, reg.reason
            t0 = time.perf_counter()
            reg.close()
            unreg_s = time.perf_counter() - t0
            runs.append(
                {
                    "pages": label,
                    "max_range_bytes": max_range,
                    "ranges": ranges,
                    "registered": ok,
                    "reason": reason,
                    "register_s": round(reg_s, 4),
                    "register_gbps": round(size / reg_s / 1e9, 2),
                    "unregister_s": round(unreg_s, 4),
                }
            )
        return {
            "device": torch.cuda.get_device_name(0),
            "pool_bytes": size,
            "pool_path": path,
            "runs": runs,
            "all_registered": all(r.get("registered", True) for r in runs),
        }
    finally:
        pool.close()
        cxlkv.Pool.destroy(path, ignore_attached=True)


class _UvaWords:
    def __init__(self, addr: int, dtype: Any, device: Any) -> None:
        self._addr, self.dtype, self.device = addr, dtype, device

    def data_ptr(self) -> int:
        return self._addr


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _device_name(dev) -> str:
    import torch

    return (
        torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else "cpu (TRITON_INTERPRET: timings meaningless)"
    )


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="a toy geometry (the CPU smoke run)")
    ap.add_argument("--pool", default=None, help="an existing or new pool file (kept)")
    ap.add_argument("--pool-dir", default="/dev/shm", help="where a temporary pool file goes")
    ap.add_argument(
        "--register-gib", type=float, default=0, help="time cudaHostRegister of a pool this large"
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON result to this file")
    a = ap.parse_args(argv)
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("bench_cuda: skipped: no CUDA device in this process (torch.cuda.is_available() is False)")
            return 0
    if a.register_gib:
        if a.device != "cuda":
            ap.error("--register-gib needs --device cuda")
        r = run_registration(a.register_gib, a.pool_dir)
        ok = r["all_registered"]
    else:
        r = run(a.device, a.blocks, a.small, a.pool, a.iters, a.pool_dir)
        ok = r["layout_matches_cpu_path"]
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1)
    if a.json:
        print(json.dumps(r))
    elif a.register_gib:
        print(f"{r['device']}: cudaHostRegister of a {r['pool_bytes'] / 2**30:.1f} GiB pool file")
        for x in r["runs"]:
            if "skipped" in x:
                print(
                    f"  {x['pages']:>4} pages, ranges of <= {x['max_range_bytes'] >> 20} MiB: skipped: {x['skipped']}"
                )
                continue
            print(
                f"  {x['pages']:>4} pages, {x['ranges']:>3} range(s) of <= {x['max_range_bytes'] >> 20} MiB: "
                f"{x['register_s']} s ({x['register_gbps']} GB/s), unregister {x['unregister_s']} s"
                + ("" if x["registered"] else f"  NOT REGISTERED: {x['reason']}")
            )
    else:
        print(
            f"{r['device']}: {r['blocks']} blocks of {r['block_bytes']} B ({r['fragments_per_block']} fragments each)"
        )
        for k in ("gpu_to_pool", "pool_to_gpu"):
            v = r[k]
            print(
                f"  {k}: kernel {v['kernel_gbps']} GB/s, one memcpy {v['memcpy_gbps']} GB/s "
                f"(kernel/memcpy {v['kernel_vs_memcpy']}x), memcpy per fragment {v['per_fragment_gbps']} GB/s "
                f"(kernel/per-fragment {v['kernel_vs_per_fragment']}x)"
            )
        print(f"  pool bytes equal the CPU path's layout: {r['layout_matches_cpu_path']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
