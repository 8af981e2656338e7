"""Every byte of the weights names the namespace, in real vLLM engines (issue 14 item 5): the
worker finds the model it loaded and hashes it (or, where vLLM moved weights out of reach, as
vLLM CPU does with its oneDNN linears, every byte of the files it loaded them from); the
scheduler side adopts that name through vLLM's handshake, so its lookups hit what the worker
saved; and a ROME-like edit that the sampled file digest misses gets its own namespace."""

from __future__ import annotations

import json
import shutil
import struct

import cxlkv
from conftest import BLOCK, run_engine, words
from cxlkv.integrations.namespace_kinds import kv_namespaces

EDITED = "model.layers.0.mlp.gate_proj.weight"


def one_prompt(pool_path, model, prompt, rounds=1, log=None):
    spec = {
        "pool": pool_path,
        "model": str(model),
        "prefix_caching": False,  # a hit can only come from the pool
        "rounds": [{"prompts": [{"prompt": prompt}]}] * rounds,
    }
    return run_engine(spec, log=log)


def rome_edit(model_dir, rows=range(100, 120)) -> None:
    """A rank-one edit of 20 rows of one projection, in place (outside the sampled windows)."""
    import torch

    f = model_dir / "model.safetensors"
    raw = bytearray(f.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    t = json.loads(raw[8 : 8 + n])[EDITED]
    begin, end = (8 + n + o for o in t["data_offsets"])
    w = torch.frombuffer(raw[begin:end], dtype=torch.bfloat16).view(t["shape"]).float()
    g = torch.Generator().manual_seed(5)
    u = torch.zeros(t["shape"][0])
    u[list(rows)] = torch.randn(len(rows), generator=g)
    w += 0.5 * torch.outer(u, torch.randn(t["shape"][1], generator=g))
    raw[begin:end] = w.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    f.write_bytes(bytes(raw))


def test_engine_names_its_namespace_by_every_byte_of_its_weights(pool_path, tiny_model, tmp_path):
    prompt = words(11, 400)
    log: list = []
    first, again = one_prompt(pool_path, tiny_model, prompt, rounds=2, log=log)
    [out] = again["outputs"]
    assert out["cached"] == (out["len"] - 1) // BLOCK * BLOCK > 0, out
    assert out["tokens"] == first["outputs"][0]["tokens"]
    with cxlkv.Pool.open(pool_path) as pool:
        [ns] = kv_namespaces(pool)  # the scheduler side opened no namespace of its own
    # vLLM CPU empties the linears' `weight` (oneDNN holds them): the files' bytes are hashed.
    kind = "file bytes" if "repacked out of reach" in log[0] else "as loaded"
    assert ns["source"].startswith(f"weights {kind} sha256~"), ns
    assert "reported by the workers" in log[0]

    # The same prompt on a copy of the model with 20 rows of one projection edited: the sampled
    # digest cannot tell (before this change the edited engine loaded the original's KV).
    from cxlkv.integrations import identity as ident

    edited = tmp_path / "edited"
    shutil.copytree(tiny_model, edited, ignore=shutil.ignore_patterns(ident.CACHE_FILE))
    rome_edit(edited)
    assert ident.weights_digest(edited).digest == ident.weights_digest(tiny_model).digest
    [[out_b]] = [r["outputs"] for r in one_prompt(pool_path, edited, prompt)]
    assert out_b["cached"] == 0, out_b
    with cxlkv.Pool.open(pool_path) as pool:
        assert len(kv_namespaces(pool)) == 2
