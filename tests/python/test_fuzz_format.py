"""Format fuzzing in CI: a few hundred mutated pools, every CLI command and the Python workload on
each, each in its own process (tests/fuzz/fuzz_format.py). Passes only with 0 crashes, 0 hangs and
0 wrong reads. The seed is printed; CXLKV_FUZZ_SEED=<seed> replays a run, CXLKV_FUZZ_CASES sets
the number of cases (default 300), CXLKV_FUZZ_OUT keeps the failing cases, and scripts/fuzz.sh runs long campaigns.
"""

from __future__ import annotations

import glob
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
FUZZ = os.path.join(HERE, "..", "fuzz")
sys.path.insert(0, FUZZ)

import fuzz_format as F  # noqa: E402
import fuzz_layout as L  # noqa: E402


def test_layout_mirror_matches_core(make_pool, pool_path):
    """The fuzzers' offsets come from the core's own report of the geometry, not from a guess."""
    pool = make_pool(size=16 << 20, chunk_size=4 << 20)
    with open(pool_path, "rb") as f:
        L.assert_matches(pool.info(), f.read(4096))


def test_harness_counts_a_signal_as_crash(tmp_path):
    """A tool that dies by a signal must be a failure, or the fuzzer has no teeth."""

    r = {"rc": -8, "timed_out": False, "stdout": "", "stderr": "@ns_a\n"}
    assert F.classify("py", r) == ("crash", "SIGFPE@ns_a")
    assert F.classify("info", {"rc": None, "timed_out": True, "stdout": "", "stderr": ""})[0] == "hang"


CORPUS = sorted(glob.glob(os.path.join(FUZZ, "corpus", "*.json")))


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return F.Seeds(str(tmp_path_factory.mktemp("seeds")))


@pytest.mark.parametrize("case_file", CORPUS, ids=[os.path.basename(p)[:-5] for p in CORPUS])
def test_corpus_case(case_file, seeds, tmp_path):
    """Every mutation that once crashed, hung or read wrong bytes stays fixed."""
    with open(case_file) as f:
        case = json.load(f)["case"]
    res = F.run_case(case, seeds, str(tmp_path / "pool"), timeout=30)
    bad = {t: (v["outcome"], v["detail"]) for t, v in res["tools"].items() if v["outcome"] in F.FAILURES}
    assert not bad, f"{os.path.basename(case_file)}: {bad}"


@pytest.mark.timeout(1800)  # ~70 s on 2 idle cores; the suite's 300 s default is too tight under load
def test_format_fuzz(tmp_path):
    seed = int(os.environ.get("CXLKV_FUZZ_SEED") or random.randrange(1 << 31))
    cases = int(os.environ.get("CXLKV_FUZZ_CASES", "300"))
    out = Path(os.environ.get("CXLKV_FUZZ_OUT") or tmp_path / "failures")
    print(f"format fuzz seed {seed}: replay with CXLKV_FUZZ_SEED={seed}")
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(FUZZ, "fuzz_format.py"),
            "--seed",
            str(seed),
            "--cases",
            str(cases),
            "--workers",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    print(r.stdout[-6000:], r.stderr[-2000:])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cases"] == cases
    assert summary["failures"] == 0, (
        f"seed {seed}: {summary['signatures']}; cases: {summary['saved']} "
        f"(replay one with: python tests/fuzz/fuzz_format.py --replay FILE)"
    )
