"""CI runs every test module: those that need an optional package (vLLM, torch, Triton, LMCache,
SGLang, a Prometheus server) skip in scripts/test.sh's first pass, where none is installed, so
test.sh runs them again once they are. A module that skips on one of them and is missing from that
second pass would never run in CI; this test names it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL = ("vllm", "torch", "triton", "lmcache", "sglang", "prometheus")
SKIPS = re.compile(r"importorskip\(\s*[\"']({})".format("|".join(OPTIONAL)))


def test_every_module_needing_an_optional_package_runs_after_it_is_installed():
    script = (ROOT / "scripts" / "test.sh").read_text()
    second_pass = script[script.index('setup-vllm.sh" "$VENV"') :]
    missing = []
    for path in sorted((ROOT / "tests" / "python").glob("test_*.py")):
        text = path.read_text()
        needs = SKIPS.search(text) or 'which("prometheus")' in text or "HAVE_VLLM" in text
        if needs and f"tests/python/{path.name}" not in second_pass:
            missing.append(path.name)
    assert not missing, f"skipped in CI's first pass and never run after the installs: {missing}"
