"""docs/API.md against the code, both ways (in process, milliseconds):

* every name of ``cxlkv.__all__`` is documented, and every ``cxlkv.X`` the document names exists;
* every public attribute of Pool, Namespace, Lease and KVLayout is documented as ``pool.X``,
  ``ns.X``, ``lease.X`` / ``Lease.X`` or ``layout.X`` / a KVLayout field, and every one the
  document names exists;
* the keyword defaults written in the document's signatures (``cxlkv.Pool.create(...)``,
  ``cxlkv.Pool.open(...)``, ``cxlkv.Pool.destroy(...)``) are the code's; the ``cxlkv.KVLayout(...)``
  example names every field and only fields.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

import cxlkv

API_MD = Path(__file__).resolve().parents[2] / "docs" / "API.md"
TEXT = API_MD.read_text()

# Public attributes deliberately left out of API.md, each with its reason.
UNDOCUMENTED = {
    ("Namespace", "bench_index"): "benchmark helper behind `cxlkv bench index`, not a contract",
    ("KVLayout", "default_name"): "used by Pool.namespace when no name is given",
}


def _resolve(dotted: str):
    """The object ``cxlkv.a.b`` names: attributes first, then submodules."""
    obj = cxlkv
    parts = dotted.split(".")[1:]
    for i, p in enumerate(parts):
        if hasattr(obj, p):
            obj = getattr(obj, p)
        else:
            obj = importlib.import_module(".".join(["cxlkv", *parts[: i + 1]]))
    return obj


def test_every_public_name_is_documented():
    missing = [n for n in cxlkv.__all__ if not re.search(rf"\b{re.escape(n)}\b", TEXT)]
    assert not missing, f"in cxlkv.__all__ but not in docs/API.md: {missing}"


def test_every_documented_cxlkv_name_exists():
    names = set(re.findall(r"\bcxlkv(?:\.[A-Za-z_]\w*)+", TEXT))
    assert names, "no cxlkv.X found in docs/API.md"
    bad = []
    for n in sorted(names):
        try:
            _resolve(n)
        except (AttributeError, ImportError):
            bad.append(n)
    assert not bad, f"docs/API.md names what does not exist: {bad}"


@pytest.mark.parametrize(
    "cls, prefixes",
    [
        (cxlkv.Pool, ("pool", "Pool", "cxlkv.Pool")),
        (cxlkv.Namespace, ("ns",)),
        (cxlkv.Lease, ("lease", "Lease")),
        (cxlkv.KVLayout, ("layout", "cxlkv.KVLayout")),
    ],
)
def test_methods_and_attributes_both_ways(cls, prefixes):
    alt = "|".join(re.escape(p) for p in prefixes)
    documented = set(re.findall(rf"(?<![\w.])(?:{alt})\.([A-Za-z_]\w*)", TEXT))
    public = {n for n in dir(cls) if not n.startswith("_")}
    if dataclasses.is_dataclass(cls):  # fields are documented in the KVLayout(...) example
        fields = {f.name for f in dataclasses.fields(cls)}
        public |= fields
        documented |= set(_signature_defaults("cxlkv.KVLayout"))
    ghosts = sorted(documented - public)
    assert not ghosts, f"docs/API.md documents {cls.__name__}.{ghosts}, which do not exist"
    missing = sorted(n for n in public - documented if (cls.__name__, n) not in UNDOCUMENTED)
    assert not missing, f"{cls.__name__} has {missing}, not in docs/API.md (document them or list why not)"


def _signature_defaults(call: str) -> dict[str, str]:
    """``name -> default`` (as source text) of the first ``call(...)`` written in API.md."""
    i = TEXT.index(call + "(")
    depth, j = 0, i + len(call)
    while True:
        c = TEXT[j]
        depth += c == "("
        depth -= c == ")"
        j += 1
        if depth == 0:
            break
    src = re.sub(r"#.*", "", TEXT[i:j])  # comments interleaved with the arguments
    node = ast.parse(src.replace("*,", "").strip(), mode="eval").body
    assert isinstance(node, ast.Call)
    out = {k.arg: ast.unparse(k.value) for k in node.keywords}
    out.update({a.id: "<required>" for a in node.args if isinstance(a, ast.Name)})
    return out


@pytest.mark.parametrize("call", ["cxlkv.Pool.create", "cxlkv.Pool.open", "cxlkv.Pool.destroy"])
def test_documented_defaults_are_the_codes(call):
    documented = _signature_defaults(call)
    params = inspect.signature(_resolve(call)).parameters
    unknown = sorted(set(documented) - set(params))
    assert not unknown, f"{call} has no parameter {unknown}"
    for name, text in documented.items():
        p = params[name]
        if text == "<required>":
            continue
        assert p.default is not inspect.Parameter.empty, f"{call}: {name} has no default"
        assert ast.literal_eval(text) == p.default, (
            f"docs/API.md: {call}(... {name}={text}) but the code's default is {p.default!r}"
        )
