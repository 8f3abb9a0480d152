"""Workloads for the fleet simulator: the Mooncake trace and generated multi-turn chat.

Mooncake (``mooncake_conversation_trace.jsonl``): one request per line, ``timestamp`` (ms),
``input_length``, ``output_length`` and ``hash_ids``: one id per 512-token block of the prompt, the
same id at the same place meaning the same prefix. Each id becomes a deterministic block of
``block_tokens`` token ids (a pure function of the id, so equal ids give equal tokens, on every
run); ``block_tokens < 512`` scales every length by ``block_tokens / 512`` (prompt, the partial last
block, output), which keeps the trace's prefix structure and divides the hashing work. The last id
of a prompt covers a partial block: it takes the first tokens of the id's block.

The trace carries no model: with several models a request goes to the model picked by a hash of its
first two ids (conversations that share a prefix beyond the system prompt stay on one model).

Generated chat (``chat_requests``): kvidx.sim.prompts.workload_requests per model (shared system
prompts, interleaved multi-turn conversations whose next turn extends the previous prompt and
output), with Poisson arrivals.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvidx.sim.prompts import workload_requests

TRACE_BLOCK = 512  # tokens per Mooncake hash id
VOCAB = 32000
DATA_DIR = Path(__file__).resolve().parent / "data"
MOONCAKE_TRACE = DATA_DIR / "mooncake_conversation_trace.jsonl"

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, vectorized (uint64 arithmetic wraps)."""
    x = x + _GOLD
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


@dataclass
class SimRequest:
    t: float  # arrival, seconds from the start of the workload (before time compression)
    model: str
    prompt: np.ndarray  # uint32 token ids
    output: np.ndarray  # uint32 token ids the engine generates
    trace_prompt_tokens: int  # the prompt's length in the workload's own units (before scaling)


def block_tokens_of(hash_ids: np.ndarray, block_tokens: int, salt: int = 0) -> np.ndarray:
    """The deterministic token ids of whole blocks `hash_ids` (block_tokens each), concatenated."""
    ids = np.asarray(hash_ids, dtype=np.uint64)
    pos = np.arange(block_tokens, dtype=np.uint64)
    x = (ids[:, None] * np.uint64(block_tokens) + pos[None, :]).ravel()
    with np.errstate(over="ignore"):
        x = _mix(x ^ np.uint64(salt))
    return (x % np.uint64(VOCAB)).astype(np.uint32)


def load_trace(path: str | Path | None = None, limit: int | None = None) -> list[dict]:
    rows = []
    with open(path or MOONCAKE_TRACE) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = json.loads(line)
            for key in ("timestamp", "input_length", "output_length", "hash_ids"):
                if key not in r:
                    raise ValueError(f"{path}:{n}: trace line without {key!r}")
            rows.append(r)
            if limit is not None and len(rows) >= limit:
                break
    return rows


def model_names(models: int) -> list[str]:
    return [f"model-{k}" for k in range(models)]


def trace_requests(rows: list[dict], block_tokens: int = 64, models: int = 1,
                   max_output: int | None = None) -> list[SimRequest]:
    """Mooncake rows -> requests with deterministic token blocks (see the module docstring)."""
    if not 1 <= block_tokens <= TRACE_BLOCK:
        raise ValueError(f"--trace-block-tokens must be in 1..{TRACE_BLOCK}")
    names = model_names(models)
    scale = block_tokens / TRACE_BLOCK
    t0 = rows[0]["timestamp"] if rows else 0
    out = []
    for i, r in enumerate(rows):
        ids = r["hash_ids"]
        n_in = int(r["input_length"])
        if not ids or n_in <= 0:
            continue
        # the last id covers the partial tail block: scale its length, at least one token
        last = n_in - TRACE_BLOCK * (len(ids) - 1)
        last_scaled = min(block_tokens, max(1, math.ceil(max(last, 1) * scale)))
        toks = block_tokens_of(np.asarray(ids), block_tokens)
        prompt = toks[: (len(ids) - 1) * block_tokens + last_scaled]
        n_out = max(1, math.ceil(int(r["output_length"]) * scale))
        if max_output is not None:
            n_out = min(n_out, max_output)
        output = block_tokens_of(np.asarray([i]), n_out, salt=0x0A7B17)[:n_out]
        key = ids[1] if len(ids) > 1 else ids[0]
        model = names[int(_mix(np.asarray([key], dtype=np.uint64))[0] % np.uint64(models))] \
            if models > 1 else names[0]
        out.append(SimRequest((r["timestamp"] - t0) / 1000.0, model, prompt, output, n_in))
    return out


def chat_requests(n_requests: int, models: int = 1, rate: float = 20.0, seed: int = 7,
                  systems: int = 8, turns: int = 6, active_convs: int = 64) -> list[SimRequest]:
    """Generated multi-turn chat with shared system prompts; Poisson arrivals at `rate` req/s."""
    names = model_names(models)
    rng = random.Random(seed)
    per = [n_requests // models + (1 if k < n_requests % models else 0) for k in range(models)]
    streams = [workload_requests(seed + 1000 * k, per[k], systems=systems, sys_len=(200, 800),
                                 user_len=(20, 200), output_len=40, turns=turns, one_shot_frac=0.2,
                                 active_convs=active_convs, max_prompt=4096, vocab=VOCAB)
               for k in range(models)]
    # interleave the model streams at random, each keeping its own order
    order = [k for k in range(models) for _ in range(per[k])]
    rng.shuffle(order)
    pos = [0] * models
    out = []
    t = 0.0
    for k in order:
        prompt, output = streams[k][pos[k]]
        pos[k] += 1
        t += rng.expovariate(rate)
        out.append(SimRequest(t, names[k], np.asarray(prompt, dtype=np.uint32),
                              np.asarray(output, dtype=np.uint32), len(prompt)))
    return out


def agent_requests(n_requests: int, models: int = 1, rate: float = 20.0, seed: int = 7,
                   agent_types: int = 4, concurrent: int = 24, steps: tuple[int, int] = (4, 16)
                   ) -> list[SimRequest]:
    """Generated agent loops: each agent starts from its type's long system prompt (tool
    descriptions, shared by every agent of the type) and a task, then loops: the model's output (a
    tool call) and the tool's result are appended and the grown context is sent again. Up to
    `concurrent` agents interleave; Poisson arrivals at `rate` req/s."""
    names = model_names(models)
    rng = random.Random(seed)

    def toks(lo: int, hi: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))]

    systems = [[toks(1000, 3000) for _ in range(agent_types)] for _ in range(models)]
    active: list[dict] = []
    out: list[SimRequest] = []
    t = 0.0
    while len(out) < n_requests:
        while len(active) < concurrent:
            m = rng.randrange(models)
            active.append({"model": m, "context": systems[m][rng.randrange(agent_types)] + toks(100, 300),
                           "left": rng.randint(*steps)})
        agent = active[rng.randrange(len(active))]
        call = toks(40, 120)  # the model's tool call
        t += rng.expovariate(rate)
        out.append(SimRequest(t, names[agent["model"]], np.asarray(agent["context"], dtype=np.uint32),
                              np.asarray(call, dtype=np.uint32), len(agent["context"])))
        agent["context"] = agent["context"] + call + toks(100, 800)  # + the tool's result
        agent["left"] -= 1
        if agent["left"] == 0 or len(agent["context"]) > 16000:
            active.remove(agent)
    return out
