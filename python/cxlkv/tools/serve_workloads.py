"""The request sets of `cxlkv bench serve`, as vLLM's benchmark client takes them
(``vllm.benchmarks.datasets.SampleRequest``), each request tagged with what the analysis needs:
its prefix group (which requests may share KV with it) and how many of its tokens a later request
of the group starts with.

* ``prefix_repetition``: vLLM's own ``PrefixRepetitionRandomDataset`` (P prefixes x L tokens, a
  random suffix each), sampled unshuffled so the group of each request is known, then shuffled
  here with the same seed. One round; the router sends request i to server i mod N.
* ``multiturn``: U conversations x T turns. Turn 0 is an opening context of ``prefix_len``
  tokens and a question of ``turn_len``; every later turn appends the previous answer
  (``output_len`` tokens) and a new question, so its prompt extends the previous turn's prompt
  token for token (prompts are token ids: no re-tokenization can break the prefix). vLLM's client
  cannot feed a reply back into the next request, so the answers in the history are fixed
  random tokens: what is measured is the cost of the history, which is the same. T rounds, one
  per turn (turn t of every conversation, in parallel up to the concurrency), each request
  tagged ``cxlkv_route`` so the router sends turn t of conversation u to server (u + t) mod N.
* ``multiturn_overlap``: the same conversations in ONE round, conversation by conversation (turn
  0, 1, ... of conversation 0, then of 1, ...): with a concurrency above 1 turn t + 1 reaches its
  server while turn t is still in flight on another, and shares all of turn t's prompt (what a
  coalescing engine may wait for) but not the answer and question after it (what no in-flight
  prompt covers). The coalescing convoy of issue 24 item 2 in a few requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

__all__ = ["Tagged", "multiturn", "multiturn_overlap", "prefix_repetition"]

FIRST_SAFE_TOKEN = 100  # random token ids start above the special tokens of both models


@dataclass
class Tagged:
    request: Any  # vllm.benchmarks.datasets.SampleRequest
    group: int  # requests of one group may share KV (one prefix; one conversation)
    turn: int  # multiturn: the turn; prefix_repetition: 0
    reusable: int  # tokens of this prompt that later requests of its group start with


def prefix_repetition(
    tokenizer,
    num_prompts: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    seed: int,
    tag: str,
) -> list[list[Tagged]]:
    from vllm.benchmarks.datasets import PrefixRepetitionRandomDataset

    ds = PrefixRepetitionRandomDataset(random_seed=seed, disable_shuffle=True)
    reqs = ds.sample(
        tokenizer,
        num_requests=num_prompts,
        prefix_len=prefix_len,
        suffix_len=suffix_len,
        num_prefixes=num_prefixes,
        output_len=output_len,
    )
    per = len(reqs) // num_prefixes  # sample() emits prefix-major: `per` requests of prefix 0, ...
    tagged = [Tagged(r, i // per, 0, prefix_len) for i, r in enumerate(reqs)]
    random.Random(seed).shuffle(tagged)
    for i, t in enumerate(tagged):
        t.request.request_id = f"{tag}-{i}"
    return [tagged]


def multiturn(
    tokenizer, users: int, turns: int, prefix_len: int, turn_len: int, output_len: int, seed: int, tag: str
) -> list[list[Tagged]]:
    import numpy as np
    from vllm.benchmarks.datasets import SampleRequest

    rng = np.random.RandomState(seed)
    hi = int(tokenizer.vocab_size)

    def tokens(n: int) -> list[int]:
        return rng.randint(FIRST_SAFE_TOKEN, hi, size=n).tolist()

    rounds: list[list[Tagged]] = [[] for _ in range(turns)]
    for u in range(users):
        history = tokens(prefix_len)
        for t in range(turns):
            prompt = history + tokens(turn_len)
            req = SampleRequest(
                prompt=prompt,
                prompt_len=len(prompt),
                expected_output_len=output_len,
                request_id=f"{tag}-u{u}-t{t}",
                request_overrides={"cxlkv_route": {"user": u, "turn": t}},
            )
            rounds[t].append(Tagged(req, u, t, len(prompt)))
            history = prompt + tokens(output_len)  # the answer, as the next turn's history has it
    return rounds


def multiturn_overlap(
    tokenizer, users: int, turns: int, prefix_len: int, turn_len: int, output_len: int, seed: int, tag: str
) -> list[list[Tagged]]:
    rounds = multiturn(tokenizer, users, turns, prefix_len, turn_len, output_len, seed, tag)
    return [sorted((t for rnd in rounds for t in rnd), key=lambda t: (t.group, t.turn))]
