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


# A work cited by section, table or appendix: "Beluga §5.3", "SAC's Appendix C", "Beluga Table 3".
CITATION = re.compile(r"\b([A-Z][A-Za-z]+)(?:'s)? (?:§ ?\d|Table \d|Appendix [A-Z]\b)")
# A red-team finding's number (F1..F23) or a seed document's ("seed 003"): what they number is not
# in the repository.
FINDING = re.compile(r"\bF\d{1,2}\b|\bseed \d{3}\b")


def test_every_work_cited_is_listed_in_references():
    """docs/REFERENCES.md names each work the documents and code cite by short name (title,
    authors), so a reader with only the project can find it; the repo's own documents
    (ARCHITECTURE §9) cite themselves."""
    with open(os.path.join(ROOT, "docs", "REFERENCES.md")) as f:
        listed = set(re.findall(r"^\* \*\*(\w+)", f.read(), re.M))
    assert {"Beluga", "TraCT", "SAC"} <= listed
    own = {os.path.splitext(os.path.basename(r))[0] for r in _tracked() if r.endswith(".md")}
    unlisted = []
    for rel in _tracked():
        with open(os.path.join(ROOT, rel), errors="replace") as f:
            for n, line in enumerate(f, 1):
                unlisted += [
                    f"{rel}:{n}: {m.group(0)}"
                    for m in CITATION.finditer(line)
                    if m.group(1) not in listed and m.group(1) not in own
                ]
    assert not unlisted, "works cited but not in docs/REFERENCES.md:\n" + "\n".join(unlisted)


def test_docs_and_python_cite_no_numbers_of_documents_outside():
    """A finding number (F11) means nothing without the report, "seed 003" nothing without the
    seed: say what the finding was, name the paper (docs/REFERENCES.md)."""
    bad = []
    for rel in _tracked():
        if rel.endswith(".md") or rel.startswith("python/"):
            with open(os.path.join(ROOT, rel), errors="replace") as f:
                bad += [
                    f"{rel}:{n}: {line.strip()[:100]}" for n, line in enumerate(f, 1) if FINDING.search(line)
                ]
    assert not bad, "numbers of documents outside the repository:\n" + "\n".join(bad)
