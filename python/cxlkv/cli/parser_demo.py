"""``cxlkv demo``, ``cxlkv sim`` and ``cxlkv roi``: the demo, the multi-host proof, the cost model."""

from __future__ import annotations

from typing import Any

import cxlkv
from cxlkv.sizes import parse_size
from cxlkv.tools.sim import BREAKS, FAULTS

from .commands import (
    cmd_demo,
    cmd_roi,
    cmd_sim,
)
from .parser_types import (
    _pos_float,
    _pos_int,
    _size_arg,
)


def add_demo(sub: Any, default_pool: str) -> None:
    """Adds demo, sim and roi to the subcommands ``sub``; ``default_pool``: the pool a command opens when
    none is named."""
    # demo -------------------------------------------------------------------------------------
    dm = sub.add_parser("demo", help="several processes sharing one pool: hit rates and bandwidth")
    dm.add_argument("--procs", type=_pos_int, default=4, help="worker processes (default 4)")
    dm.add_argument("--seconds", type=_pos_float, default=8.0, help="run time in seconds (default 8)")
    dm.add_argument(
        "--pool", default=default_pool, help=f"pool path, created if missing (default {default_pool})"
    )
    dm.add_argument(
        "--size",
        type=_size_arg,
        default=parse_size(cxlkv.DEFAULT_POOL_SIZE),
        help=f"size if the pool must be created (default {cxlkv.DEFAULT_POOL_SIZE})",
    )
    dm.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    dm.add_argument(
        "--vllm",
        action="store_true",
        help="the real thing: two vLLM servers (SmolLM2) sharing a pool, a multi-turn "
        "conversation moved from one to the other, TTFT against plain vLLM (needs vLLM)",
    )
    dm.add_argument(
        "--repeats",
        type=_pos_int,
        default=3,
        help="with --vllm: conversations run; each TTFT cell is their median (default 3)",
    )
    dm.set_defaults(func=cmd_demo)
    # sim ----------------------------------------------------------------------------------------
    sm = sub.add_parser("sim", help="multi-host proof: simulated hosts without coherence, checked")
    sm.add_argument("--hosts", type=_pos_int, default=3, help="simulated hosts (default 3, at most 59)")
    sm.add_argument(
        "--seconds",
        type=_pos_float,
        default=4.0,
        help="bound of the whole run (default 4): the workload gets what is left after stopping the "
        "hosts and the final check (two leases and under a second); a --lease-ms that leaves too "
        "little is refused, naming the shortest --seconds that fits",
    )
    sm.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    sm.add_argument(
        "--break",
        dest="brk",
        choices=BREAKS,
        default=None,
        help="negative control: flushes as no-ops, invalidations skipped, the lock's ticket "
        "write-backs dropped, or row healing that resets a held stripe's ticket; the run must then "
        "find violations (exit 1 if it does not)",
    )
    sm.add_argument(
        "--backend",
        choices=("multihost", "flush"),
        default="multihost",
        help="pool backend under test (flush: the one-host discipline, not multi-host safe)",
    )
    sm.add_argument("--lease-ms", type=_pos_int, default=500, help="heartbeat lease (default 500)")
    sm.add_argument("--no-crashes", action="store_true", help="no random host crashes")
    sm.add_argument("--no-pauses", action="store_true", help="no pauses past the lease")
    sm.add_argument(
        "--fault", choices=FAULTS, default=None, help="crash hosts at this named fault point instead"
    )
    sm.add_argument("--json", action="store_true", help="print the result as one JSON object")
    sm.set_defaults(func=cmd_sim)
    # roi ----------------------------------------------------------------------------------------
    ro = sub.add_parser(
        "roi",
        help="GPUs needed with and without the pool (the ByteDance ROI model, docs/REFERENCES.md)",
    )
    ro.add_argument("--gpu-tflops", type=_pos_float, required=True, help="P: one GPU's TFLOP/s")
    ro.add_argument("--prefill-tflop", type=_pos_float, help="C0: TFLOP of an initial request's prefill")
    ro.add_argument(
        "--model-config", help="a Hugging Face config.json: C0 = 2 x parameters x --context-tokens"
    )
    ro.add_argument(
        "--context-tokens", type=_pos_int, help="average prompt length in tokens (with --model-config)"
    )
    ro.add_argument(
        "--kv-dtype", default=None, help="KV dtype for the bytes a hit loads (default: the config's)"
    )
    ro.add_argument(
        "--new-prompt-ratio", type=float, help="r: share of a follow-up's prompt that is new (0..1)"
    )
    ro.add_argument("--slo-s", type=_pos_float, required=True, help="T_slo: the TTFT SLO in seconds")
    ro.add_argument("--load-s", type=float, help="T_load: seconds to load a prefix's KV from the pool")
    ro.add_argument(
        "--load-gbps", type=_pos_float, help="pool load bandwidth, GB/s (T_load from the KV bytes)"
    )
    ro.add_argument("--multi-round-ratio", type=float, help="h: share of requests that are follow-ups (0..1)")
    ro.add_argument("--rps", type=_pos_float, required=True, help="R: prefill requests/s to serve")
    ro.add_argument(
        "--from-bench", help="a `cxlkv bench serve --json` file: measured hit rate (and bandwidth)"
    )
    ro.add_argument(
        "--bench-config", default="cxlkv", help="which configuration of --from-bench (default cxlkv)"
    )
    ro.add_argument(
        "--bench-dataset", default=None, help="which dataset of --from-bench, when it has several"
    )
    ro.add_argument("--json", action="store_true", help="print one JSON object")
    ro.set_defaults(func=cmd_roi)
