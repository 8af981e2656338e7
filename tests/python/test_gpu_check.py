"""scripts/gpu-check.sh's bare-machine path on every landing (issue 24, item 1): from a fresh
checkout (the files `git ls-files` names, as the lent GPU machine receives them: nothing built), in
a fresh venv that sees the project venv's packages the way a GPU image has its own (torch, build
tools), with pip's index turned off, the script builds the extension, imports it from its own
build, skips the CUDA steps with one line where there is no GPU, and writes its log and JSON
under $OUT. The build is the cost (a Release build of the core and the module: 2-4 min on 2 cores).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _missing_build_tools() -> list[str]:
    missing = []
    for mod in ("nanobind", "scikit_build_core"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    missing += [tool for tool in ("cmake", "git") if shutil.which(tool) is None]
    if not (ROOT / ".git").exists():  # the checkout is copied as git names it
        missing.append("a git checkout")
    return missing


@pytest.mark.timeout(900)
def test_gpu_check_builds_offline_from_a_fresh_checkout_and_skips_cuda_in_one_line(tmp_path: Path) -> None:
    missing = _missing_build_tools()
    if missing:
        pytest.skip(f"the build tools a GPU image has are not in this venv: {missing} (pip install .[test])")
    # the checkout as the lent machine gets it: tracked files and untracked ones git does not ignore
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    checkout = tmp_path / "checkout"
    for f in files:
        if not f:
            continue
        src = ROOT / os.fsdecode(f)
        if not src.is_file():  # deleted in the work tree, or a submodule
            continue
        dst = checkout / os.fsdecode(f)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    assert not list(checkout.glob("python/cxlkv/_core*")), "a built module came with the checkout"

    # a fresh interpreter environment whose site sees this venv's packages (as an image's would)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "project-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OUT=str(out), PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env["CXLKV_GPU_CHECK_BUILD_TIMEOUT"] = "780"  # 2 shared cores build in ~4 min (242 s at load 9)
    env["PATH"] = (
        os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    )  # cmake/ninja of this venv
    r = subprocess.run(
        ["bash", "scripts/gpu-check.sh", "--python", str(py), "--budget", "840"],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=880,
    )
    print(r.stdout[-6000:], r.stderr[-3000:])
    assert r.returncode == 0, r.stdout[-3000:]
    log = (out / "gpu-check.log").read_text()
    report = json.loads((out / "gpu-check.json").read_text())
    status = {s["step"]: s["status"] for s in report["steps"]}
    assert report["ok"], report["steps"]
    assert status["build"] == "ok" and status["import"] == "ok", report["steps"]
    assert str(checkout / "build" / "gpu-check" / "site") in log  # imported from its own build
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        skip_lines = [line for line in log.splitlines() if "cuda: skipped:" in line]
        assert len(skip_lines) == 1, skip_lines
        assert "tests" not in status and "bench" not in status
