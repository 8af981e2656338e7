"""The Python package's layers (docs/ARCHITECTURE.md, "Layers"), held by a static scan and a fresh
interpreter, in about a second:

* every module belongs to a layer, and imports only what its layer may import (function-local
  imports included: they are how the old tools/CLI cycle hid);
* the import graph between cxlkv modules has no cycle;
* every module imports in a fresh interpreter with nothing of cxlkv loaded before it but the
  extension (one that needs vLLM or aiohttp is skipped where they are missing), and ``import
  cxlkv`` loads no module above the API;
* only entry points (``__main__``, the CLI's dispatch and parser, ``if __name__ == "__main__"``
  blocks) raise SystemExit: a library or tool that exits would bypass the CLI's exit codes.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import cxlkv

PKG_DIR = Path(cxlkv.__file__).parent
PKG = "cxlkv"

# layer -> the layers it may import (its own included where listed). "api" is every top-level
# module of the package (Pool, KVLayout, errors, dtypes, sizes, paths) and the extension.
MAY_IMPORT: dict[str, set[str]] = {
    "api": {"api"},
    "testing": {"api"},
    "kernels": {"api", "kernels"},  # Triton kernels of the device data paths
    "integrations": {"api", "integrations", "kernels"},
    # operator services (exporter, events, query, top): production code, so no benchmark or test model
    "services": {"api", "services", "integrations"},
    "tools": {"api", "tools", "testing", "integrations", "kernels"},  # a benchmark measures an integration
    "cli": {"api", "tools", "services", "cli"},
    "main": {"cli"},
}
SUBPACKAGE_LAYERS = {"tools", "services", "cli", "integrations", "testing", "kernels"}
# Modules that need a third-party package beyond the core dependencies to import at all.
OPTIONAL_DEPS = {"vllm", "aiohttp", "torch", "triton", "sglang", "lmcache"}


def module_files() -> dict[str, Path]:
    """Every .py module of the package: dotted name -> file."""
    out = {}
    for f in sorted(PKG_DIR.rglob("*.py")):
        parts = list(f.relative_to(PKG_DIR).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join([PKG, *parts])] = f
    return out


MODULES = module_files()


def layer_of(module: str) -> str:
    parts = module.split(".")
    if module == "cxlkv.__main__":
        return "main"
    if len(parts) == 1 or (len(parts) == 2 and parts[1] not in SUBPACKAGE_LAYERS):
        return "api"
    if parts[1] in SUBPACKAGE_LAYERS:
        return parts[1]
    raise AssertionError(f"{module}: in no layer; add its folder to MAY_IMPORT and ARCHITECTURE.md")


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    is_pkg = MODULES[module].name == "__init__.py"
    base = module.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def cxlkv_imports(module: str) -> set[str]:
    """The cxlkv modules ``module`` imports anywhere in its body (a name imported from a package
    counts as its submodule when there is one: ``from cxlkv import _core``)."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES or a.name == "_core" else base
                for a in node.names
            ]
        else:
            continue
        for name in names:
            if name == PKG or name.startswith(PKG + "."):
                # `import cxlkv.tools.bench` names cxlkv.tools.bench; a dotted name that is not a
                # module of ours (an attribute) counts as its nearest module
                while name not in MODULES and name.rsplit(".", 1)[-1] != "_core" and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name != module:
                    found.add(name)
    return found


GRAPH = {m: cxlkv_imports(m) for m in MODULES}


def test_every_module_is_in_a_layer():
    layers = {m: layer_of(m) for m in MODULES}
    assert set(layers.values()) <= set(MAY_IMPORT), layers
    # the layers exist (a renamed folder must not leave this test checking nothing)
    assert {"api", "tools", "cli", "integrations", "testing", "main"} <= set(layers.values())


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_stay_within_the_layers_rules(module):
    layer = layer_of(module)
    bad = sorted(
        m
        for m in GRAPH[module]
        if (layer_of(m) if not m.endswith("._core") else "api") not in MAY_IMPORT[layer]
    )
    assert not bad, (
        f"{module} (layer {layer!r}) imports {bad}; a {layer!r} module may import only "
        f"{sorted(MAY_IMPORT[layer])}"
    )


def test_no_import_cycle():
    """Tarjan's strongly connected components over the import graph: any component of more
    than one module is a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in GRAPH:
                continue  # the extension
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def _dependency_order() -> list[str]:
    order: list[str] = []
    seen: set[str] = set()

    def visit(v: str) -> None:
        if v in seen or v not in GRAPH:
            return
        seen.add(v)
        for w in sorted(GRAPH[v]):
            visit(w)
        order.append(v)

    for v in sorted(GRAPH):
        visit(v)
    return order


_FRESH_IMPORTS = r"""
import importlib, json, sys
import cxlkv._core  # the extension cannot be loaded twice; every Python module is, below
report = {"api_loads": None, "ok": [], "skipped": {}, "failed": {}}
def forget():
    for name in [n for n in sys.modules if n.startswith("cxlkv") and n != "cxlkv._core"]:
        del sys.modules[name]
forget()
import cxlkv
report["api_loads"] = sorted(n for n in sys.modules if n.startswith("cxlkv."))
for m in json.loads(sys.argv[1]):
    forget()
    try:
        importlib.import_module(m)
        report["ok"].append(m)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in set(json.loads(sys.argv[2])):
            report["skipped"][m] = e.name
        else:
            report["failed"][m] = f"{type(e).__name__}: {e}"
    except Exception as e:
        report["failed"][m] = f"{type(e).__name__}: {e}"
print(json.dumps(report))
"""


def test_every_module_imports_first_in_a_fresh_interpreter():
    order = [m for m in _dependency_order() if m != "cxlkv.__main__"]
    print("dependency order:", " ".join(order))
    r = subprocess.run(
        [sys.executable, "-c", _FRESH_IMPORTS, json.dumps(order), json.dumps(sorted(OPTIONAL_DEPS))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert not report["failed"], report["failed"]
    print("skipped (optional dependency missing):", report["skipped"])
    above_api = [m for m in report["api_loads"] if not m.endswith("._core") and layer_of(m) != "api"]
    assert not above_api, f"`import cxlkv` loads modules above the API: {above_api}"
    assert set(report["ok"]) | set(report["skipped"]) == set(order)
    # only the integrations that need vLLM / aiohttp / torch / LMCache / SGLang, and the Triton kernels (torch),
    # may be skipped
    assert all(layer_of(m) in ("integrations", "kernels") for m in report["skipped"]), report["skipped"]


def _is_main_guard(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators)
    )


def _exits(tree: ast.AST) -> list[int]:
    """Lines that raise SystemExit or call sys.exit / exit / quit, outside __main__ guards."""
    lines = []

    def walk(node: ast.AST) -> None:
        if _is_main_guard(node):
            return
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id == "SystemExit":
                lines.append(node.lineno)
        if isinstance(node, ast.Call):
            f = node.func
            if (
                isinstance(f, ast.Attribute)
                and f.attr == "exit"
                and isinstance(f.value, ast.Name)
                and f.value.id == "sys"
            ) or (isinstance(f, ast.Name) and f.id in ("exit", "quit")):
                lines.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            walk(child)

    walk(tree)
    return lines


def test_only_entry_points_exit():
    offenders = {}
    for m, f in MODULES.items():
        if layer_of(m) in ("main", "cli"):
            continue  # the dispatch owns the exit codes; argparse exits through it
        lines = _exits(ast.parse(f.read_text()))
        if lines:
            offenders[m] = lines
    assert not offenders, f"SystemExit outside an entry point (raise CommandError instead): {offenders}"
