"""`cxlkv roi`: the ByteDance cost model (seed 003, Table 1) reproduces the paper's example and
derives its inputs from a model config and from `bench serve` results."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

import cxlkv
from cxlkv.errors import CommandError
from cxlkv.tools import roi

PAPER = roi.RoiInputs(
    gpu_flops=100e12,
    prefill_flop=25e12,
    new_prompt_ratio=0.1,
    slo_s=0.4,
    load_s=0.1,
    multi_round_ratio=1.0,
    rps=120,
)


def test_the_papers_example():
    out = roi.compute(PAPER)
    assert out["p0_tflops"] == pytest.approx(62.5)
    assert out["p1_tflops"] == pytest.approx(8.333, rel=1e-3)
    assert out["requests_per_s_per_gpu_baseline"] == pytest.approx(1.6)
    assert out["requests_per_s_per_gpu_pool"] == pytest.approx(12.0)
    assert out["throughput_ratio"] == pytest.approx(7.5)
    assert (out["gpus_baseline"], out["gpus_pool"]) == (75, 10)  # 120 / 1.6, 120 / 12 exactly
    assert round(out["gpu_reduction"] * 100) == 87
    assert round(out["gpu_reduction_asymptotic"] * 100) == 87


def test_no_follow_ups_saves_nothing_and_gpus_round_up():
    out = roi.compute(roi.RoiInputs(100e12, 25e12, 0.1, 0.4, 0.1, 0.0, 10))
    assert out["throughput_ratio"] == pytest.approx(1.0)
    assert out["gpus_baseline"] == out["gpus_pool"] == math.ceil(10 / 1.6)


def test_a_load_that_eats_the_slo_is_refused():
    with pytest.raises(CommandError, match="nothing of the"):
        roi.compute(roi.RoiInputs(100e12, 25e12, 0.1, 0.4, 0.4, 0.5, 10))
    with pytest.raises(CommandError, match="in \\[0, 1\\]"):
        roi.compute(roi.RoiInputs(100e12, 25e12, 1.5, 0.4, 0.1, 0.5, 10))


LLAMA_8B = {  # Llama-3-8B's published config: 8.03 B parameters, 128 KiB of bf16 KV per token
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def test_parameters_and_kv_bytes_from_a_config():
    assert roi.model_params(LLAMA_8B) == pytest.approx(8.03e9, rel=0.01)
    assert roi.kv_bytes_per_token(LLAMA_8B) == 2 * 32 * 8 * 128 * 2
    # dtype sizes are the core's table's, every alias of it (config names, torch names, vLLM's)
    for name in ("float32", "torch.float16", "fp8", "fp8_e5m2", "int8"):
        assert roi.kv_bytes_per_token(LLAMA_8B, name) == 2 * 32 * 8 * 128 * cxlkv.dtype_bytes(name)
    with pytest.raises(CommandError):
        roi.kv_bytes_per_token(LLAMA_8B, "float7")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cxlkv", "roi", *args], capture_output=True, text=True)


def test_cli_prints_the_papers_table_and_json():
    args = ["--gpu-tflops", "100", "--prefill-tflop", "25", "--new-prompt-ratio", "0.1", "--slo-s", "0.4"]
    args += ["--load-s", "0.1", "--multi-round-ratio", "1", "--rps", "120"]
    text = _cli(*args)
    assert text.returncode == 0, text.stderr
    assert "1.6" in text.stdout and "12" in text.stdout and "7.50x" in text.stdout and "87%" in text.stdout
    js = _cli(*args, "--json")
    assert js.returncode == 0, js.stderr
    out = json.loads(js.stdout)
    assert out["gpus_baseline"] == 75 and out["gpus_pool"] == 10


def test_cli_from_a_config_and_bench_results(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_8B))
    bench = tmp_path / "serve.json"
    rows = [
        {"config": "plain", "concurrency": 4, "hit_rate": 0.5},
        {"config": "cxlkv", "concurrency": 1, "hit_rate": 0.5},
        {"config": "cxlkv", "concurrency": 4, "hit_rate": 0.9, "load_gbps": 20.0},
    ]
    bench.write_text(json.dumps(rows))
    res = _cli(
        "--gpu-tflops", "400", "--model-config", str(cfg), "--context-tokens", "4096",
        "--slo-s", "0.5", "--rps", "50", "--from-bench", str(bench), "--json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    inp = out["inputs"]
    assert inp["multi_round_ratio"] == 1.0 and inp["new_prompt_ratio"] == pytest.approx(0.1)
    assert inp["prefill_flop"] == pytest.approx(2 * roi.model_params(LLAMA_8B) * 4096)
    kv = roi.kv_bytes_per_token(LLAMA_8B) * 0.9 * 4096
    assert inp["load_s"] == pytest.approx(kv / 20e9)
    assert any("concurrency 4" in n for n in out["notes"])
    rows.append({"config": "cxlkv", "concurrency": 4, "hit_rate": 0.5, "dataset": "multiturn"})
    rows[2]["dataset"] = "prefix_repetition"
    bench.write_text(json.dumps(rows))
    base = [
        "--gpu-tflops",
        "400",
        "--prefill-tflop",
        "20",
        "--slo-s",
        "0.5",
        "--load-s",
        "0.1",
        "--rps",
        "50",
    ]
    both = _cli(*base, "--from-bench", str(bench))
    assert both.returncode != 0 and "--bench-dataset" in both.stderr
    one = _cli(*base, "--from-bench", str(bench), "--bench-dataset", "multiturn", "--json")
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["inputs"]["new_prompt_ratio"] == pytest.approx(0.5)
    missing = _cli("--gpu-tflops", "100", "--slo-s", "0.4", "--rps", "1")
    assert missing.returncode != 0 and "--prefill-tflop" in missing.stderr
