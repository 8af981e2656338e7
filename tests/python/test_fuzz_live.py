"""The live co-tenant corruption probe (tests/fuzz/live_corrupt.py) as a test: for each scenario, a
co-tenant process scribbles on one area of the pool (header fields, payloads, index entries,
descriptors, chunk map, node table...) while a reader loops over get/put/delete verifying every
byte. Passes with 0 crashes, 0 hangs and 0 wrong reads. Each scenario runs
CXLKV_FUZZ_LIVE_SECONDS (default 1 s; scripts/fuzz.sh runs them longer). The reader's seed is
printed; CXLKV_TEST_SEED=<seed> replays its operations.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fuzz"))
import cxlkv_testutil as tu
import live_corrupt

SECONDS = float(os.environ.get("CXLKV_FUZZ_LIVE_SECONDS", "1"))


@pytest.mark.parametrize("scenario", live_corrupt.SCENARIOS)
def test_live_corruption(scenario):
    r = live_corrupt.run_scenario(scenario, SECONDS, tu.random_test_seed(f"live corruption {scenario}"))
    print(json.dumps({k: v for k, v in r.items() if k != "stderr"}))
    assert not r["failures"], f"{scenario}: {r['failures']}\n{r.get('stderr', '')}"
    assert r["ops"], f"the reader did no work: {r}"
