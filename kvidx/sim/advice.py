"""The kv_hints policy's side of the simulator (issue #16): the index's hints, made as the service makes
them from what the router and the events tell it, followed by the simulated engines.

- prefetch (kvidx.core.hints): the chosen replica's plan, loaded while the request is queued
  (kvidx/sim/serving.py times it);
- placement and eviction advice (kvidx.core.sessions, fed with every routing decision's block hashes):
  a recurring session's prompt copied ahead of time to the replica with the shortest queue (the target
  engine caches it as a prefill would, publishing its events; the copy takes the target's load channel
  for tokens / `placement_tps`, and a request of the session there waits for it), and a silent session's
  own blocks demoted (moved to the head of its GPU free queue: evicted next, to the CPU tier where there
  is one) or dropped (from every tier first).
Each is followed with probability `hint_compliance`, `hint_delay_ms` after the decision, by vLLM replicas
(placement and eviction advice; prefetch by any). The engines know their prompts' tokens; the index side
(the trackers) sees hashes only: the sim keeps each session's latest prompt apart, as the engine would.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvidx.config import HintsConfig
from kvidx.core.hints import PrefetchGate, prefetch_hint
from kvidx.core.sessions import Session, SessionTracker
from kvidx.engines.vllm.sim import SimVllmEngine, chain_digests
from kvidx.sim.serving import HintCounts, ServingModel
from schemas.answers import ReplicaAnswer

SessionKey = tuple[str, int]  # (model, session id)


@dataclass
class EvictionLedger:
    """Eviction advice, counted per session (demote and drop of one session are one advice): issued,
    followed, regretted when the session came back through its advised blocks, paid off when it never did
    (its blocks were dead weight); lost_s, what each return's turn spent on the advised prefix beyond GPU
    hits (kvidx/sim/serving.py's prefix_turn_s). Over, in that the LRU could have evicted some of those
    blocks without the advice; under, in that it is the returning turn's own seconds, not the wait of
    the requests queued behind it. What it won (the reloads its room spared other sessions) needs the
    run without it: not measured."""
    serving: ServingModel
    index_block: int
    issued: set[SessionKey] = field(default_factory=set)
    followed: set[SessionKey] = field(default_factory=set)
    regretted: set[SessionKey] = field(default_factory=set)
    advised: dict[int, SessionKey] = field(default_factory=dict)  # the last block of an advised session
    lost_s: float = 0.0
    declined: int = 0  # advice not issued: not worth it for its class's return probability

    def follow(self, key: SessionKey, last_block: int) -> None:
        self.followed.add(key)
        self.advised[last_block] = key

    def came_back(self, hashes: list[int], reused: int, split: dict[str, int]) -> None:
        """A request (its index block hashes; `reused` tokens, `split` by tier) that continues sessions
        advised away: regretted, and its turn's seconds on the longest advised prefix it runs through."""
        if not self.advised:
            return
        longest = 0
        for i, h in enumerate(hashes):
            key = self.advised.pop(h, None)
            if key is not None:
                self.regretted.add(key)
                longest = i + 1
        if longest:
            self.lost_s += self.serving.prefix_turn_s(longest * self.index_block, reused, split)

    def counts(self) -> HintCounts:
        regretted = len(self.followed & self.regretted)
        return HintCounts(issued=len(self.issued), followed=len(self.followed),
                          paid_off=len(self.followed) - regretted, regretted=regretted, lost_s=self.lost_s)


class HintFollower:
    def __init__(self, cfg: Any, policy: str, serving: ServingModel, fleet: Any) -> None:
        kinds = set(cfg.hints) if policy == "kv_hints" else set()
        self.prefetch_on = "prefetch" in kinds
        self.sessions_on = bool(kinds & {"placement", "eviction"})
        self.placement_on = "placement" in kinds
        self.eviction_on = "eviction" in kinds
        self.rng = random.Random(cfg.seed + 2)  # its own draws: the routing draws stay the kv run's
        self.compliance = cfg.hint_compliance
        self.delay_s = cfg.hint_delay_ms / 1000.0
        # the service's decision (kvidx.core.hints.PrefetchGate), at the service's default margin
        self.gate = PrefetchGate(self.delay_s, HintsConfig().prefetch_margin_ms / 1000.0)
        self.serving = serving
        self.fleet = fleet
        self.index_block = cfg.index_block
        self.engine_block = cfg.engine_block
        self.placement_tps = cfg.placement_tps * cfg.token_scale
        self.bytes_per_token = cfg.kv_bytes_per_token / cfg.token_scale
        self.trackers = {m: SessionTracker(cfg.index_block) for m in cfg.models}
        # the engines' side: each session's latest prompt and its index block hashes
        self.prompts: dict[tuple[str, int], tuple[np.ndarray, np.ndarray, list[int]]] = {}
        self.eviction = EvictionLedger(serving, cfg.index_block)
        # session -> (target, copy done at, its tokens, its seconds on the target's load channel)
        self.placed: dict[SessionKey, tuple[str, float, int, float]] = {}
        self.placement = serving.placement  # the serving model counts what the copies delayed
        self.reps = {r.name: r for r in fleet.replicas()}

    def _follows(self) -> bool:
        return self.rng.random() < self.compliance

    # ---- prefetch ----------------------------------------------------------------------------------
    def prefetch(self, ans: ReplicaAnswer | None, name: str, t: float) -> tuple[Any, float | None]:
        """(the hint for `name`'s answer or None, the time the replica starts on it or None): the plan,
        issued where the gate says it can pay, as the service issues it."""
        if not self.prefetch_on or ans is None or not ans.resumable_tokens:
            return None, None
        sv = self.serving
        hint = prefetch_hint(ans, sv.pricer, sv.queue_s(name, t))
        if hint is None or not self.gate.admit(hint, t):
            return None, None
        sv.prefetch.issued += 1
        return hint, (t + self.delay_s if self._follows() else None)

    def prefetched(self, saved_s: float | None) -> None:
        """A followed plan's outcome (ServingModel.admit's seconds saved; None: none followed), learned
        by the gate's throttle."""
        if saved_s is not None:
            self.gate.outcome(saved_s > 0)

    # ---- placement and eviction advice ---------------------------------------------------------------
    def ready_at(self, model: str, hashes: list[int] | None, replica: str) -> float:
        """When a placed copy this prompt would reuse on `replica` is there (0: none pending)."""
        if not self.placement_on or not hashes:
            return 0.0
        s = self.trackers[model].find(hashes)
        placed = self.placed.get((model, s.sid)) if s is not None else None
        return placed[1] if placed is not None and placed[0] == replica else 0.0

    def routed(self, model: str, prompt: np.ndarray, output: np.ndarray, hashes: list[int] | None,
               replica: str, t: float, reused: int, split: dict[str, int]) -> None:
        """After the request was served (`reused` tokens, `split` by tier): the tracker sees the decision;
        eviction advice is regretted when the session came back; placement pays off when it came back to
        its copy; new advice is issued and followed."""
        if not self.sessions_on or not hashes:
            return
        tracker = self.trackers[model]
        self.eviction.came_back(hashes, reused, split)
        s = tracker.observe(hashes, replica, t)
        key = (model, s.sid)
        placed = self.placed.pop(key, None)
        if placed is not None and placed[0] == replica and reused > 0:
            self.placement.paid_off += 1
            self.placement.regretted -= 1
            self.placement.wasted_tokens -= placed[2]
            self.placement.wasted_s -= placed[3]
        self.prompts[key] = (prompt, output, list(hashes))
        if self.eviction_on:
            for adv in tracker.eviction_advice(t):
                self._evict(model, adv, tracker)
        if self.placement_on:
            self._place(model, s, tracker, t)
        if len(self.prompts) > 2 * len(tracker.sessions) + 64:  # the sessions the tracker forgot
            for k in [k for k in self.prompts if k[0] == model and k[1] not in tracker.sessions]:
                del self.prompts[k]

    def _engine_digests(self, key: tuple[str, int], hashes: list[int], engine: SimVllmEngine) -> list[bytes]:
        """The engine's block digests of the session's blocks named by `hashes` (index blocks), and of
        every block its latest request cached after its prompt (the output's): advice on a prefix holds for
        all below it, which its loss makes unreachable anyway (the engine acts on the subtree)."""
        known = self.prompts.get(key)
        if known is None:
            return []
        prompt, output, session_hashes = known
        pos = {h: i for i, h in enumerate(session_hashes)}
        per = self.engine_block // self.index_block
        wanted = sorted({pos[h] // per for h in hashes if h in pos})
        if not wanted:
            return []
        tokens = np.concatenate([prompt, output[:-1]]) if len(output) > 1 else prompt
        digests = chain_digests(tokens.tolist(), self.engine_block, engine._root)
        below = range(len(prompt) // self.engine_block, len(digests))
        return [digests[i] for i in [*wanted, *below] if i < len(digests)]

    def _evict(self, model: str, adv: Any, tracker: SessionTracker) -> None:
        key = (model, adv.session)
        cpu_s = self.serving.load_cost.get("CPU", 0.0)  # priced as the service prices it
        if tracker.worth_advising(adv, cpu_s, self.serving.pricer.per_token, cpu_s) is None:
            self.eviction.declined += 1
            return
        self.eviction.issued.add(key)
        rep = self.reps.get(adv.replica)
        if rep is None or not isinstance(rep.engine, SimVllmEngine) or not self._follows():
            return
        digests = self._engine_digests(key, adv.hashes, rep.engine)
        if rep.engine.advise(digests, drop=adv.action == "drop"):
            self.eviction.follow(key, self.prompts[key][2][-1])

    def _place(self, model: str, s: Session, tracker: SessionTracker, t: float) -> None:
        sv = self.serving
        names = [r.name for r in self.fleet.engines[model] if isinstance(r.engine, SimVllmEngine)]
        hint = tracker.placement(s, {n: sv.queue_s(n, t) for n in names}, self.placement_tps,
                                 room_s=sv.load_cost.get("CPU", 0.0))  # priced as the service prices it
        if hint is None:
            return
        self.placement.issued += 1
        known = self.prompts.get((model, s.sid))
        if known is None or not self._follows():
            return
        p = self.placement
        p.followed += 1
        p.regretted += 1  # regretted and wasted until the session reuses the copy
        p.wasted_tokens += hint.tokens
        p.wasted_s += hint.copy_s
        done = sv.reserve_channel(hint.target, t + self.delay_s, hint.copy_s, hint.tokens)
        self.fleet.place(self.reps[hint.target], known[0], t)
        self.placed[(model, s.sid)] = (hint.target, done, hint.tokens, hint.copy_s)

    def report(self) -> dict:
        """Per kind on: HintCounts.report(); saved_s None where the seconds won are not measured (they
        need the run without the hint)."""
        out = {}
        if self.prefetch_on:
            out["prefetch"] = {**self.serving.prefetch.report(), **self.gate.report()}
        if self.placement_on:
            out["placement"] = {**self.placement.report(), "saved_s": None}
        if self.eviction_on:
            out["eviction"] = {**self.eviction.counts().report(), "saved_s": None,
                               "declined": self.eviction.declined}
        return out
