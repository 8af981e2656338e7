"""What a machine offers scripts/gpu-check.sh (standard library only: it runs before anything of
cxlkv is built).

    python scripts/gpu_check_probe.py OUT.json          # the probe: prints it, writes OUT.json
    python scripts/gpu_check_probe.py --pool-dir FALLBACK GIB
        # prints a directory for pool files with GIB GiB free: /dev/shm when it has the room
        # (a container's is often 64 MiB), else FALLBACK (created; a disk-backed file)
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import shutil
import subprocess
import sys


def _version(name: str) -> str | None:
    try:
        mod = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - absent or broken alike: not usable here
        return None
    return str(getattr(mod, "__version__", "present"))


def _free_bytes(path: str) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _torch() -> dict:
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - no torch: no CUDA steps, said in one line
        return {"torch": None, "cuda_available": False, "why": f"import torch: {type(e).__name__}: {e}"}
    out: dict = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    try:
        out["cuda_available"] = bool(torch.cuda.is_available())
        if out["cuda_available"]:
            out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    except Exception as e:  # noqa: BLE001 - a broken driver is a finding, not a crash
        out["cuda_available"] = False
        out["why"] = f"{type(e).__name__}: {e}"
    return out


def probe() -> dict:
    out: dict = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "modules": {
            m: _version(m)
            for m in (
                "triton",
                "numpy",
                "rich",
                "pytest",
                "nanobind",
                "scikit_build_core",
                "pip",
                "cmake",
                "ninja",
            )
        },
        "tools": {t: shutil.which(t) for t in ("cmake", "ninja", "c++", "nvidia-smi")},
        "dev_shm_free_bytes": _free_bytes("/dev/shm"),
    }
    out.update(_torch())
    if out["tools"]["nvidia-smi"]:
        try:
            r = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            out["nvidia_smi"] = r.stdout.strip() or r.stderr.strip()
        except (OSError, subprocess.SubprocessError) as e:
            out["nvidia_smi"] = f"{type(e).__name__}: {e}"
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--pool-dir"]:
        fallback, gib = argv[1], float(argv[2])
        if _free_bytes("/dev/shm") >= (gib + 1) * 2**30:  # a GiB to spare for the tests' pools
            print("/dev/shm")
        else:
            os.makedirs(fallback, exist_ok=True)
            print(fallback)
        return 0
    p = probe()
    text = json.dumps(p, indent=1)
    print(text)
    if argv:
        with open(argv[0], "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
