"""Seeded word prompts of the real-engine tests and benchmarks: the same seed gives the same
prompt in every process (the tests compare what several engines computed for one prompt), and a
new seed gives a prompt no engine has seen (a cache miss by construction)."""

from __future__ import annotations

import random

# About one token per word in SmolLM2's and the tiny models' tokenizers, so n words is about n
# tokens. Order matters: a seed picks by index, so a reordered list makes other prompts.
SERVING_VOCAB = (
    "memory",
    "cache",
    "block",
    "prefix",
    "token",
    "model",
    "layer",
    "attention",
    "shared",
    "pool",
    "process",
    "server",
    "request",
    "prompt",
    "decode",
    "prefill",
    "batch",
    "tensor",
    "buffer",
    "page",
    "store",
    "load",
    "hash",
    "index",
)


def seeded_words(seed: int, n: int, vocab: tuple[str, ...] = SERVING_VOCAB) -> str:
    """n words drawn from `vocab` by a generator seeded with `seed`, joined by spaces."""
    rng = random.Random(seed)
    return " ".join(rng.choice(vocab) for _ in range(n))
