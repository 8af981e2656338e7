"""The C++ core's rooms (docs/ARCHITECTURE.md, "The core's folders"), held the way test_layers.py
holds the Python package's layers: a static scan of every ``#include "..."`` line under src/core.

* Each folder of src/core states in its README.md, in a sentence that starts with "May include:",
  what its files may include: other folders (```format/```), single headers (```errors.h```,
  ```nodes/liveness.h```). A file may always include the files of its own folder. The root files
  (``pool.h``, ``pool.cpp``, ``region.*``, ``errors.h``) are the façade and are not limited.
* Includes are flat (every folder is an include directory), so a name is resolved to the one file
  of src/core that has it; a name found nowhere in src/core is a third-party or system header.
* KNOWN lists the edges that break the rules today, each with the reason, until a commit removes
  it; an entry that no longer exists fails too, so the list only shrinks.

Pure file reading: no extension, no compiler, well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "src" / "core"
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
TOKEN = re.compile(r"`([^`]+)`")

# (file, included file), both relative to src/core, with the reason: the edges that break the
# rules. Empty since issue 23 item 1 (every subsystem reached back up into the façade while `Pool`
# owned its state and protocols); an edge added here needs its reason, and the list only shrinks.
KNOWN: dict[tuple[str, str], str] = {}


def _files() -> list[Path]:
    return sorted(p for p in CORE.rglob("*") if p.suffix in (".h", ".cpp"))


def _index() -> dict[str, str]:
    """Header name -> its path relative to src/core (names are unique: includes are flat)."""
    by_name: dict[str, list[str]] = {}
    for p in _files():
        by_name.setdefault(p.name, []).append(p.relative_to(CORE).as_posix())
    dup = {n: ps for n, ps in by_name.items() if len(ps) > 1}
    assert not dup, f"file names must be unique under src/core (flat includes): {dup}"
    return {n: ps[0] for n, ps in by_name.items()}


def _allowed(folder: str) -> set[str]:
    """The backticked tokens of the README's "May include:" sentence (up to its first '. '; what follows
    is prose, e.g. known debt): folders end with '/'."""
    readme = CORE / folder / "README.md"
    assert readme.exists(), f"src/core/{folder} has no README.md stating what it may include"
    text = readme.read_text()
    m = re.search(r"^May include:(.*?)(?:\n\s*\n|\Z)", text, re.M | re.S)
    assert m, f"src/core/{folder}/README.md has no paragraph starting with 'May include:'"
    return set(TOKEN.findall(m.group(1).split(". ")[0]))


def _edges() -> list[tuple[str, str]]:
    names = _index()
    out = []
    for p in _files():
        rel = p.relative_to(CORE).as_posix()
        for name in INCLUDE.findall(p.read_text()):
            target = names.get(Path(name).name)
            if target is not None:
                out.append((rel, target))
    return out


def _permitted(src: str, dst: str, allowed: dict[str, set[str]]) -> bool:
    folder = src.split("/")[0]
    if "/" not in src:
        return True  # the façade (root files)
    if dst.startswith(folder + "/"):
        return True  # its own folder
    ok = allowed[folder]
    dst_folder = dst.split("/")[0] + "/" if "/" in dst else None
    return dst in ok or (dst_folder is not None and dst_folder in ok)


def test_every_include_is_allowed_by_its_folders_readme():
    folders = sorted(p.name for p in CORE.iterdir() if p.is_dir())
    allowed = {f: _allowed(f) for f in folders}
    for f, toks in allowed.items():
        for t in toks:
            where = CORE / t.rstrip("/")
            assert where.exists(), f"src/core/{f}/README.md allows `{t}`, which does not exist"
    wrong = [
        f"src/core/{s} includes {d}"
        for s, d in _edges()
        if not _permitted(s, d, allowed) and (s, d) not in KNOWN
    ]
    assert not wrong, (
        "includes that the folder's README.md does not allow (move the code to the room that owns it, "
        "or state the dependency in the README if it is by design):\n  " + "\n  ".join(wrong)
    )


def test_known_exceptions_still_exist():
    edges = set(_edges())
    gone = [f"{s} -> {d}" for s, d in KNOWN if (s, d) not in edges]
    assert not gone, "remove these fixed entries from KNOWN (the list only shrinks):\n  " + "\n  ".join(gone)


def test_no_folder_cycles():
    """Folder-level include graph, KNOWN edges left out: no two rooms include each other (directly or
    around a loop). The root (façade) is above every folder and not part of the graph."""
    graph: dict[str, set[str]] = {}
    for s, d in _edges():
        if "/" not in s or "/" not in d or (s, d) in KNOWN:
            continue
        a, b = s.split("/")[0], d.split("/")[0]
        if a != b:
            graph.setdefault(a, set()).add(b)
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif len(path) < len(graph) + 1:
                visit(nxt, path + [nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert not cycles, "folder include cycles:\n  " + "\n  ".join(sorted(set(cycles)))


def test_a_wrong_include_is_caught():
    """The check can fail: a platform file including a store header is not permitted."""
    allowed = {f: _allowed(f) for f in ("platform", "store")}
    assert not _permitted("platform/mapping.cpp", "store/evictor.h", allowed)
    assert _permitted("store/index.cpp", "store/evictor.h", allowed)
