"""A user has only the project: no document, script, requirement list or source file points to a
path outside the repository (a build machine's directory, a sibling checkout's notes)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTSIDE = re.compile(r"\.\./shared\b|(?<![\w.])/work/|/home/\w+/")
TEXT = (".md", ".sh", ".txt", ".py", ".toml", ".cpp", ".h", ".cfg", ".yml", ".yaml")
# Tests quote where their findings came from; recorded figures (JSON) keep the machine they ran on.
SKIP = ("tests/",)


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (an installed wheel)")
    return [f for f in out.stdout.splitlines() if f.endswith(TEXT) and not f.startswith(SKIP)]


def test_no_tracked_file_points_outside_the_repository():
    bad = []
    for rel in _tracked():
        with open(os.path.join(ROOT, rel), errors="replace") as f:
            for n, line in enumerate(f, 1):
                if OUTSIDE.search(line):
                    bad.append(f"{rel}:{n}: {line.strip()[:100]}")
    assert not bad, "paths outside the repository:\n" + "\n".join(bad)
