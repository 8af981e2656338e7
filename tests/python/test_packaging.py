"""cxlkv installs like a Python package (issue 17): xxHash is vendored unmodified (no system
package), the extras exist, and the built module links no libxxhash. Cheap checks for CI; the
full check (a manylinux wheel installed in a fresh venv with no compiler, then the API tests) is
``bash scripts/build-wheel.sh --test``, which also runs this file against the installed wheel."""

from __future__ import annotations

import hashlib
import os
import re
import sys

import cxlkv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENDORED = os.path.join(ROOT, "third_party", "xxhash")

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = None


def test_vendored_xxhash_is_the_recorded_upstream_file() -> None:
    readme = open(os.path.join(VENDORED, "README.md")).read()
    for name in ("xxhash.h", "LICENSE"):
        want = re.search(rf"`{re.escape(name)}`\s*\|\s*`([0-9a-f]{{64}})`", readme)
        assert want, f"README.md records no sha256 for {name}"
        with open(os.path.join(VENDORED, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == want.group(1), f"{name} differs from upstream"


def test_sources_use_only_the_vendored_xxhash() -> None:
    cmake = open(os.path.join(ROOT, "CMakeLists.txt")).read()
    assert not re.search(r"find_(library|path)\([^)]*xx", cmake, re.I)
    bad = []
    for top in ("src", "tests/cpp"):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                text = open(os.path.join(d, f), errors="replace").read()
                if re.search(r'#\s*include\s*[<"](xxhash|xxh3|xxh_x86dispatch)\.h[>"]', text):
                    bad.append(os.path.join(d, f))
    assert not bad, f"include xxHash through src/core/platform/xxhash_inline.h: {bad}"


def test_module_links_no_libxxhash() -> None:
    with open(cxlkv._core.__file__, "rb") as f:
        assert b"libxxhash" not in f.read()


def test_extras_are_defined() -> None:
    if tomllib is None:
        return
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for name in ("vllm", "metrics", "lmcache", "sglang", "test"):
        assert name in extras, name


def test_installed_wheel_is_what_runs() -> None:
    venv = os.environ.get("CXLKV_WHEEL_VENV")  # set by scripts/build-wheel.sh --test
    if venv:
        assert cxlkv.__file__.startswith(venv), cxlkv.__file__


def test_tiny_tokenizer_word_list_ships_in_the_package() -> None:
    """The tiny test model's tokenizer is trained on text made from a data file of the package
    (cxlkv/testing/tiny_words.txt): a wheel without it could not build the model."""
    from importlib import resources

    from cxlkv.testing import models

    words = (resources.files("cxlkv.testing") / "tiny_words.txt").read_text(encoding="utf-8").split()
    assert len(words) == 529 and words[:3] == ["the", "of", "and"]
    assert words == models._WORDS
