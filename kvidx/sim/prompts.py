"""Token-level workloads for the simulated engines, the tests and the benchmarks: shared system prompts
with multi-turn conversations (`workload_requests`), and chats whose turns end inside blocks
(`chat_requests`); (prompt, output) pairs, deterministic by seed."""

from __future__ import annotations

import random
from typing import Any


def workload_requests(
    seed: int,
    n_requests: int,
    systems: int = 5,
    sys_len: tuple[int, int] = (40, 130),
    user_len: tuple[int, int] = (8, 60),
    output_len: int = 6,
    turns: int = 4,
    one_shot_frac: float = 0.2,
    active_convs: int = 4,
    max_prompt: int = 1024,
    vocab: int = 1024,
) -> list[tuple[list[int], list[int]]]:
    """A shared-prefix multi-turn workload as (prompt, output) pairs, deterministic by seed.

    System prompts are shared; a conversation's turn 0 is system + user tokens, turn k is the
    previous prompt + its output + new user tokens. Up to `active_convs` conversations interleave;
    a fraction `one_shot_frac` are one-shot requests (system + fresh suffix).
    """
    rng = random.Random(seed)

    def toks(lo: int, hi: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]

    sys_prompts = [toks(*sys_len) for _ in range(systems)]
    convs: list[dict[str, Any]] = []
    out: list[tuple[list[int], list[int]]] = []
    while len(out) < n_requests:
        conv = None
        if rng.random() < one_shot_frac:
            prompt = rng.choice(sys_prompts) + toks(*user_len)
        else:
            while len(convs) < active_convs:
                convs.append({"prev": None, "turn": 0, "sys": rng.choice(sys_prompts)})
            conv = rng.choice(convs)
            base = conv["sys"] if conv["prev"] is None else conv["prev"]
            prompt = base + toks(*user_len)
        prompt = prompt[:max_prompt]
        output = [rng.randrange(vocab) for _ in range(output_len)]
        out.append((prompt, output))
        if conv is not None:
            conv["prev"] = prompt + output
            conv["turn"] += 1
            if conv["turn"] >= turns or len(conv["prev"]) + user_len[1] > max_prompt:
                convs.remove(conv)
    return out


def workload(seed: int, n_requests: int, systems: int = 5, **kw: Any) -> list[list[int]]:
    """Prompts only of `workload_requests` (the outputs are folded into later turns' prompts)."""
    return [p for p, _ in workload_requests(seed, n_requests, systems=systems, **kw)]


def chat_requests(seed: int, n_requests: int, conversations: int = 16, vocab: int = 1000,
                  max_history: int = 900) -> list[tuple[list[int], list[int]]]:
    """Multi-turn chat as (prompt, output) pairs, deterministic by seed: each turn is its conversation's
    history (every earlier prompt and output) + 3-39 new tokens, so an engine's cache ends inside a
    block at every turn (what partial-block credit is for). No shared system prompt; a conversation
    whose history passes `max_history` tokens starts over."""
    rng = random.Random(seed)

    def fresh() -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randrange(20, 90))]

    hist = [fresh() for _ in range(conversations)]
    out: list[tuple[list[int], list[int]]] = []
    while len(out) < n_requests:
        c = rng.randrange(conversations)
        prompt = hist[c] + [rng.randrange(vocab) for _ in range(rng.randrange(3, 40))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        out.append((prompt, output))
        hist[c] = prompt + output if len(prompt) + len(output) <= max_history else fresh()
    return out
