"""The format fuzzer: mutates a seed pool and runs every tool on each mutated copy.

For each case (fuzz_mutate.py) a fresh copy of the mutated file is given, in its own process with a
timeout, to `cxlkv pool info`, `pool check`, `pool stats` and the Python workload (fuzz_workload.py).
Outcome per tool:
  clean | clean_error (rc 1/2 with a one-line error; a cxlkv/OS error in the workload)   -> fine
  crash (death by signal, a traceback, a non-cxlkv exception, guard bytes hit)          -> failure
  hang (timeout) | wrong (a read succeeded with bytes that differ from the stored ones)  -> failure
Processes are forked from warm workers that already imported cxlkv (about 20x faster than exec);
`--exec` runs the real `cxlkv` executable and `python fuzz_workload.py` instead, and `--replay FILE`
re-runs one saved case that way. Every failing case is written to --out as a JSON file with its
replay command. The seed is printed first; CXLKV_FUZZ_SEED or --seed replays a run.

  python tests/fuzz/fuzz_format.py [--cases N] [--minutes M] [--seed S] [--workers W] [--out DIR]
  python tests/fuzz/fuzz_format.py --replay DIR/case-....json [--write-pool /dev/shm/x]
Known crashers live in tests/fuzz/corpus/ and are replayed by every CI run.
Exit status: 0 when no case failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import multiprocessing as mp
import os
import random
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fuzz_mutate as M  # noqa: E402
import fuzz_seedpool as S  # noqa: E402

TOOLS = ("info", "check", "stats", "py")
FAILURES = ("crash", "hang", "wrong")
RANK = {"clean": 0, "clean_error": 1, "hang": 2, "crash": 3, "wrong": 4}
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
CXLKV_CLI = os.path.join(os.path.dirname(sys.executable), "cxlkv")


def _limits() -> None:
    """No core dumps from the crashes we provoke; a cap so a runaway allocation cannot hurt the host."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))


def _child_body(tool: str, path: str) -> int:
    if tool == "py":
        import fuzz_workload

        sys.stdout.write(json.dumps(fuzz_workload.exercise(path)) + "\n")
        return 0
    from cxlkv import cli

    return int(cli.main(["pool", tool, path]) or 0)


def run_forked(tool: str, path: str, timeout: float) -> dict:
    """Runs one tool in a forked child; returns rc (negative: signal), timed_out, stdout, stderr."""
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            os.close(r_out)
            os.close(r_err)
            os.dup2(w_out, 1)
            os.dup2(w_err, 2)
            sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0, closefd=False), write_through=True)
            sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0, closefd=False), write_through=True)
            _limits()
            code = _child_body(tool, path)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    os.close(w_out)
    os.close(w_err)
    out = {r_out: bytearray(), r_err: bytearray()}
    open_fds = [r_out, r_err]
    deadline = time.monotonic() + timeout
    timed_out = False
    while open_fds:  # until the child closes both pipes (it exits) or runs out of time
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            os.kill(pid, signal.SIGKILL)
            break
        ready, _, _ = select.select(open_fds, [], [], min(left, 0.5))
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.remove(fd)
            elif len(out[fd]) < 1 << 20:
                out[fd] += chunk
    _, status = os.waitpid(pid, 0)
    os.close(r_out)
    os.close(r_err)
    text = {fd: bytes(b).decode(errors="replace") for fd, b in out.items()}
    rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return {
        "rc": None if timed_out else rc,
        "timed_out": timed_out,
        "stdout": text[r_out],
        "stderr": text[r_err],
    }


def run_exec(tool: str, path: str, timeout: float) -> dict:
    cmd = (
        [sys.executable, os.path.join(HERE, "fuzz_workload.py"), path]
        if tool == "py"
        else [CXLKV_CLI, "pool", tool, path]
    )
    try:
        r = subprocess.run(cmd, capture_output=True, timeout=timeout, preexec_fn=_limits)
    except subprocess.TimeoutExpired as e:
        return {
            "rc": None,
            "timed_out": True,
            "stdout": (e.stdout or b"").decode(errors="replace"),
            "stderr": (e.stderr or b"").decode(errors="replace"),
        }
    return {
        "rc": r.returncode,
        "timed_out": False,
        "stdout": r.stdout.decode(errors="replace"),
        "stderr": r.stderr.decode(errors="replace"),
    }


def signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"SIG{-rc}"


def classify(tool: str, r: dict) -> tuple[str, str]:
    """(outcome, detail) of one tool run."""
    ops = [ln[1:] for ln in r["stderr"].splitlines() if ln.startswith("@")] if tool == "py" else []
    at = f"@{ops[-1]}" if ops else ""
    if r["timed_out"]:
        return "hang", "timeout" + at
    rc = r["rc"]
    if rc < 0 or rc >= 128:
        return "crash", (signal_name(rc) if rc < 0 else f"rc{rc}") + at
    if tool != "py":
        if "Traceback" in r["stderr"] or "Traceback" in r["stdout"]:
            last = [ln for ln in r["stderr"].strip().splitlines() if ln and not ln.startswith(" ")]
            return "crash", "traceback:" + (last[-1][:120] if last else "?")
        if rc == 0:
            return "clean", ""
        lines = [ln for ln in r["stderr"].splitlines() if ln.strip()]
        if rc in (1, 2) and (rc == 1 or len(lines) == 1):
            return "clean_error", f"rc{rc}"
        return "crash", f"rc{rc}-stderr-{len(lines)}-lines"
    results = [ln for ln in r["stdout"].splitlines() if ln.startswith("{")]
    if rc != 0 or not results:
        return "crash", f"rc{rc}-no-result" + at
    res = json.loads(results[-1])
    if res["wrong"]:
        return "wrong", "wrong:" + ",".join(sorted({w[0] for w in res["wrong"]}))
    if res["guard"]:
        return "crash", "guard-bytes:" + ",".join(sorted({g[0] for g in res["guard"]}))
    if res["unexpected"]:
        return "crash", f"exception:{res['unexpected'][0][1]}@{res['unexpected'][0][0]}"
    return ("clean_error" if any(o[1] != "ok" for o in res["ops"]) else "clean"), ""


class Seeds:
    """The seed pools (built once per run) and their maps."""

    def __init__(self, workdir: str):
        self.bytes, self.maps = {}, {}
        for v in S.VARIANTS:
            p = os.path.join(workdir, f"seed-{v}")
            S.build(p, v)
            with open(p, "rb") as f:
                self.bytes[v] = f.read()
            os.unlink(p)
            self.maps[v] = S.describe(self.bytes[v])


def run_case(case: dict, seeds: Seeds, scratch: str, timeout: float, exec_mode: bool = False) -> dict:
    data = M.apply_case(seeds.bytes[case["variant"]], case)
    out = {"id": case["id"], "kind": case["kind"], "variant": case["variant"], "tools": {}}
    for tool in TOOLS:  # each tool on a fresh copy: one tool's repairs must not hide another's crash
        with open(scratch, "wb") as f:
            f.write(data)
        t0 = time.monotonic()
        r = (run_exec if exec_mode else run_forked)(tool, scratch, timeout)
        outcome, detail = classify(tool, r)
        t = {"outcome": outcome, "detail": detail, "rc": r["rc"], "secs": round(time.monotonic() - t0, 2)}
        if outcome in FAILURES:
            t["stderr"] = r["stderr"][-1500:]
            t["stdout"] = r["stdout"][-1500:]
        out["tools"][tool] = t
    for p in (scratch,):
        if os.path.exists(p):
            os.unlink(p)
    out["outcome"] = max((t["outcome"] for t in out["tools"].values()), key=RANK.get)
    return out


def signature(res: dict) -> str:
    parts = [
        f"{t}:{v['outcome']}:{v['detail'].split('@')[0]}"
        for t, v in res["tools"].items()
        if v["outcome"] in FAILURES
    ]
    return res["kind"].split(":")[0] + "|" + ";".join(parts)


# -- workers ----------------------------------------------------------------------------------
_W: dict = {}


def _worker_init(seeds: Seeds, timeout: float, workdir: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import numpy  # noqa: F401  - warm imports, shared by every forked child

    import cxlkv.cli  # noqa: F401
    import fuzz_workload  # noqa: F401

    _W.update(seeds=seeds, timeout=timeout, scratch=os.path.join(workdir, f"case-{os.getpid()}"))


def _worker_run(case: dict) -> dict:
    try:
        return run_case(case, _W["seeds"], _W["scratch"], _W["timeout"])
    except Exception as e:  # noqa: BLE001 - a harness bug is reported, not hidden
        return {
            "id": case["id"],
            "kind": case["kind"],
            "outcome": "harness_error",
            "error": repr(e),
            "tools": {},
        }


def save_failure(out_dir: str, seed: int, case: dict, res: dict, seeds: Seeds) -> str:
    name = f"case-s{seed}-{case['id']:06d}-{res['outcome']}.json"
    path = os.path.join(out_dir, name)
    rec = {
        "seed": seed,
        "signature": signature(res) if res["tools"] else "harness_error",
        "case": case,
        "where": M.describe_case(case, seeds.maps[case["variant"]]),
        "result": res,
        "replay": f"python tests/fuzz/fuzz_format.py --replay {path}",
    }
    with open(path, "w") as f:
        json.dump(rec, f, indent=1)
    return path


def fuzz(seed: int, cases: int, minutes: float, workers: int, timeout: float, out_dir: str) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="cxlkv-fuzz-", dir=SHM)
    try:
        seeds = Seeds(workdir)
        counts, per_tool = collections.Counter(), {t: collections.Counter() for t in TOOLS}
        sigs: dict = collections.Counter()
        saved: list[str] = []
        t0 = time.monotonic()
        done = 0
        gen = (M.gen_case(seed, i, seeds.bytes, seeds.maps) for i in range(cases))
        with mp.get_context("fork").Pool(workers, _worker_init, (seeds, timeout, workdir)) as pool:
            for res in pool.imap_unordered(_worker_run, gen, chunksize=2):
                done += 1
                counts[res["outcome"]] += 1
                for t, v in res["tools"].items():
                    per_tool[t][v["outcome"]] += 1
                if res["outcome"] in FAILURES + ("harness_error",):
                    sg = signature(res) if res["tools"] else "harness_error"
                    sigs[sg] += 1
                    case = M.gen_case(seed, res["id"], seeds.bytes, seeds.maps)
                    if sigs[sg] <= 3:  # a few examples per signature are enough
                        saved.append(save_failure(out_dir, seed, case, res, seeds))
                    print(f"FAIL case {res['id']} {sg}", flush=True)
                if done % 100 == 0:
                    print(f"[{time.monotonic() - t0:5.0f}s] {done} cases {dict(counts)}", flush=True)
                if minutes and time.monotonic() - t0 > minutes * 60:
                    print("time budget reached", flush=True)
                    pool.terminate()
                    break
        summary = {
            "seed": seed,
            "cases": done,
            "elapsed_s": round(time.monotonic() - t0, 1),
            "outcomes": dict(counts),
            "per_tool": {t: dict(c) for t, c in per_tool.items()},
            "signatures": dict(sigs),
            "saved": saved,
            "failures": sum(counts[o] for o in FAILURES + ("harness_error",)),
        }
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        return summary
    finally:
        for name in os.listdir(workdir):
            os.unlink(os.path.join(workdir, name))
        os.rmdir(workdir)


def replay(path: str, timeout: float, write_pool: str | None = None) -> dict:
    with open(path) as f:
        case = json.load(f)["case"]
    workdir = tempfile.mkdtemp(prefix="cxlkv-fuzz-", dir=SHM)
    try:
        seeds = Seeds(workdir)
        if write_pool:  # the mutated pool itself, to run a tool under gdb
            with open(write_pool, "wb") as f:
                f.write(M.apply_case(seeds.bytes[case["variant"]], case))
        res = run_case(case, seeds, os.path.join(workdir, "replay"), timeout, exec_mode=True)
        return {
            "where": M.describe_case(case, seeds.maps[case["variant"]]),
            "outcome": res["outcome"],
            "tools": res["tools"],
        }
    finally:
        for name in os.listdir(workdir):
            os.unlink(os.path.join(workdir, name))
        os.rmdir(workdir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--minutes", type=float, default=0.0, help="stop after this long (0: run every case)")
    ap.add_argument("--seed", type=int, default=None, help="default: $CXLKV_FUZZ_SEED, else random")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per tool run before it is a hang")
    ap.add_argument("--out", default="fuzz-failures", help="folder for failing cases and summary.json")
    ap.add_argument("--replay", help="re-run one saved case with the real executables")
    ap.add_argument("--write-pool", help="with --replay: also write the mutated pool file here")
    args = ap.parse_args(argv)
    if args.replay:
        r = replay(args.replay, args.timeout, args.write_pool)
        print(json.dumps(r, indent=1))
        return 1 if r["outcome"] in FAILURES else 0
    seed = (
        args.seed
        if args.seed is not None
        else int(os.environ.get("CXLKV_FUZZ_SEED") or random.randrange(1 << 31))
    )
    print(
        f"format fuzz: seed {seed} (replay the run: CXLKV_FUZZ_SEED={seed}), up to {args.cases} cases, "
        f"{args.workers} workers, failures -> {args.out}",
        flush=True,
    )
    s = fuzz(seed, args.cases, args.minutes, args.workers, args.timeout, args.out)
    print(json.dumps({k: s[k] for k in ("seed", "cases", "elapsed_s", "outcomes", "signatures")}, indent=1))
    return 1 if s["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
