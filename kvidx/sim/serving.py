"""How long each request takes to reach its first token on the replica it was routed to: the queueing
that routing causes and the time to load what it reuses, apart from the engines' cache steps.

Per replica, a FIFO prefill server: a request's turn comes when the requests before it are done; its
turn then takes the load of the reused tokens held below GPU memory (tokens / the tier's load rate, the
way LMCache's retrieve and the offloading connector's load hold the request's forward step) plus the
prefill of the tokens it does not reuse (tokens / `prefill_tps`). Decodes in flight
(`decode_ms_per_token`) give the routers their load signal.

Prefetch (issue #16): a replica that follows a prefetch hint starts loading the hinted tokens when the
hint reaches it (arrival + the hint's delay) on its own load channel (one per replica: the host-to-GPU
copies run in order), while the request waits in the queue; at its turn the server waits only for what
is still loading. The hidden part is what the hint is worth; a hint whose tokens the request did not
reuse (the index was wrong) still takes the channel and its bytes.

Rates are in workload tokens per second, scaled by `token_scale` like the prefill's; bytes moved are
the tokens loaded toward GPU memory (by the request or by a prefetch) x the model's KV bytes per token.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from kvidx.core.hints import PrefetchHint
from kvidx.core.price import PriceConfig, Pricer
from schemas.answers import ReplicaAnswer


@dataclass
class HintCounts:
    """One hint kind's fate over a run: issued by the index, followed by the engine, paid off, regretted,
    the seconds won and lost on the requests' turns, and the tokens and load-channel seconds wasted.

    - prefetch: paid off, the hint's tokens were reused and part of their load was done before the
      request's turn (won: the load the turn did not wait for); regretted, the turn waited for its
      prefetch longer than the load it replaced would have taken at the turn (the hint came late, or the
      channel was busy with earlier prefetches; lost: that difference); wasted, hinted tokens the request
      did not reuse and their channel seconds (they delay later prefetches: in those requests' lost_s);
    - placement (kvidx/sim/advice.py): paid off, the session came back to its copy and reused it;
      regretted and wasted, the copies not (yet) reused; lost, what the copies on the targets' load
      channels (which carry prefetches and copies only) added to their requests' waits for prefetches,
      vs the same channels without them (first order: the turns are held as they were). Not counted: the
      blocks a copy evicts at its target and a session's own wait for its copy (their price is a run
      without the copy);
    - eviction (kvidx/sim/advice.py's EvictionLedger): lost, what the advised prefix cost the returning
      sessions' turns.
    All first order: a turn's own seconds, not what they add to the requests queued behind it. Won is
    measured for prefetch only (the others report None). Issued counts what the gates let through:
    kvidx/sim/advice.py adds the plans and advice they declined (and the prefetch throttle's count and
    pay-off ratio) to the report."""
    issued: int = 0
    followed: int = 0
    paid_off: int = 0
    saved_s: float = 0.0
    lost_s: float = 0.0
    wasted_tokens: int = 0  # prefetched, not reused by the request
    wasted_s: float = 0.0  # the load channel's seconds on those tokens
    regretted: int = 0  # eviction advice followed for a session that came back

    def report(self) -> dict:
        return {"issued": self.issued, "followed": self.followed, "paid_off": self.paid_off,
                "regretted": self.regretted,
                "saved_s": round(self.saved_s, 4),
                "lost_s": round(self.lost_s, 4), "wasted_tokens": self.wasted_tokens,
                "wasted_s": round(self.wasted_s, 4)}


@dataclass
class ServingModel:
    """The replicas' queues and load channels over a run; `ttft[i]` is request i's estimate."""
    names: list[str]
    n_requests: int
    prefill_tps: float  # simulated tokens per second per replica
    load_tps: dict[str, float]  # simulated tokens per second per tier (0 or absent: free, GPU)
    decode_s: float  # per simulated output token
    bytes_per_token: float  # per simulated token
    busy_until: dict[str, float] = field(init=False)  # end of the replica's queued prefill
    inflight: dict[str, list[float]] = field(init=False)  # heaps of decode end times
    channel_free: dict[str, float] = field(init=False)  # end of the replica's queued prefetches and copies
    copyless_free: dict[str, float] = field(init=False)  # the same without the placements' copies
    served: dict[str, int] = field(init=False)
    ttft: np.ndarray = field(init=False)
    prefetch: HintCounts = field(default_factory=HintCounts)
    placement: HintCounts = field(default_factory=HintCounts)  # its copies' cost (kvidx/sim/advice.py)
    reused_tokens: int = 0
    gpu_reused_tokens: int = 0  # reused from GPU memory at the request's turn (prefetched in time included)
    loaded_tokens: int = 0  # moved toward GPU memory: loads at the request's turn and prefetches

    def __post_init__(self) -> None:
        self.busy_until = dict.fromkeys(self.names, 0.0)
        self.inflight = {name: [] for name in self.names}
        self.channel_free = dict.fromkeys(self.names, 0.0)
        self.copyless_free = dict.fromkeys(self.names, 0.0)
        self.served = dict.fromkeys(self.names, 0)
        self.ttft = np.zeros(self.n_requests)
        rates = {"GPU": 0.0, **self.load_tps}
        self.pricer = Pricer(PriceConfig(recompute_tokens_per_s=self.prefill_tps, load_tokens_per_s=rates))
        self.load_cost = self.pricer.load_cost

    @property
    def bytes_moved(self) -> int:
        return int(self.loaded_tokens * self.bytes_per_token)

    def queue_s(self, name: str, t: float) -> float:
        return max(0.0, self.busy_until[name] - t)

    def prefix_turn_s(self, tokens: int, reused: int, split: dict[str, int]) -> float:
        """Seconds a request's turn spent on its first `tokens` prompt tokens beyond GPU hits, for a request
        that reused `reused` tokens (`split` by tier): those it recomputed and those it loaded from below
        GPU memory (its GPU hits come first in the prompt; the lower tiers' at their mean rate)."""
        gpu = split.get("GPU", 0)
        below = reused - gpu
        below_s = sum(k * self.load_cost.get(tier, 0.0) for tier, k in split.items() if tier != "GPU")
        loaded = max(0, min(tokens, reused) - gpu)
        return max(0, tokens - reused) / self.prefill_tps + (loaded * below_s / below if below > 0 else 0.0)

    def load_s(self, answer: ReplicaAnswer | None, n: int) -> float:
        """Seconds to load `answer`'s resumable tokens from their tiers (the index's view, priced as the
        service prices them)."""
        return self.pricer(answer, n).load_s if answer is not None and answer.resumable_tokens else 0.0

    def expire(self, names: list[str], t: float) -> None:
        """Forget the decodes of `names` that ended by `t`."""
        for name in names:
            q = self.inflight[name]
            while q and q[0] <= t:
                heapq.heappop(q)

    def reserve_channel(self, name: str, at: float, seconds: float, tokens: int) -> float:
        """A copy of `tokens` to `name` (a placement) on its load channel from `at`: when it is done."""
        end = max(at, self.channel_free[name]) + seconds
        self.channel_free[name] = end
        self.loaded_tokens += tokens
        return end

    def admit(self, i: int, name: str, t: float, n: int, reused: int, split: dict[str, int], n_output: int,
              hint: PrefetchHint | None = None, followed_at: float | None = None, ready_at: float = 0.0
              ) -> float | None:
        """Queue request `i` (n prompt tokens at `t`, `reused` of them cached, `split` by the tier they
        came from) on `name`; `hint`, when the replica follows it, starts loading at `followed_at`; a
        copy placed there for it is done at `ready_at`. The followed hint's seconds saved (> 0: it paid
        off), else None."""
        cost = self.load_cost
        start = max(t, self.busy_until[name], ready_at if reused else 0.0)
        hinted: dict[str, int] = {}
        if hint is not None and followed_at is not None:
            for run in hint.runs:
                hinted[run.tier] = hinted.get(run.tier, 0) + run.end - run.start
        at_turn_s = 0.0  # loads on the server at the request's turn
        useful_s = channel_s = 0.0  # prefetched and reused; everything the prefetch loads
        prefetched_reused = wasted = 0
        gpu = split.get("GPU", 0)
        for tier, k in split.items():
            if tier != "GPU" and k > 0:
                pre = min(k, hinted.get(tier, 0))
                at_turn_s += (k - pre) * cost.get(tier, 0.0)
                self.loaded_tokens += k - pre
        for tier, h in hinted.items():
            c = cost.get(tier, 0.0)
            pre = min(split.get(tier, 0), h)
            useful_s += pre * c
            channel_s += h * c
            prefetched_reused += pre
            wasted += h - pre  # hinted tokens the request did not reuse from that tier
        wait_s = 0.0
        saved: float | None = None
        if followed_at is not None and hint is not None:
            p = self.prefetch
            p.followed += 1
            p.wasted_tokens += wasted
            p.wasted_s += channel_s - useful_s
            self.loaded_tokens += prefetched_reused + wasted
            ch_start = max(followed_at, self.channel_free[name])
            self.channel_free[name] = ch_start + channel_s
            # the reused tokens are the plan's first (a prompt's prefix, loaded in prompt order): the turn
            # waits for them only; the rest of the plan just holds the channel
            useful_end = ch_start + useful_s
            wait_s = max(0.0, useful_end - start) if prefetched_reused else 0.0
            # the same on a channel without the placements' copies: what they delayed is theirs
            copyless_start = max(followed_at, self.copyless_free[name])
            self.copyless_free[name] = copyless_start + channel_s
            copyless_wait = max(0.0, copyless_start + useful_s - start) if prefetched_reused else 0.0
            self.placement.lost_s += wait_s - copyless_wait
            if copyless_wait > useful_s:  # regretted: the turn would have been sooner loading at it
                p.regretted += 1
                p.lost_s += copyless_wait - useful_s
            saved = useful_s - wait_s if useful_s > 0 else 0.0
            if saved > 0:
                p.paid_off += 1
                p.saved_s += saved
            # reused tokens whose prefetch was done at the request's turn count as GPU hits
            done = 1.0 if useful_end <= start or useful_s <= 0 else max(0.0, (start - ch_start) / useful_s)
            gpu += int(prefetched_reused * done)
        self.reused_tokens += reused
        self.gpu_reused_tokens += gpu
        end = start + wait_s + at_turn_s + (n - reused) / self.prefill_tps
        self.busy_until[name] = end
        self.ttft[i] = end - t
        heapq.heappush(self.inflight[name], end + n_output * self.decode_s)
        self.served[name] += 1
        return saved

    def report(self) -> dict:
        """The run's reuse by tier and bytes moved (the JSON's policies.<name> fields)."""
        return {"gpu_share_of_reused": round(self.gpu_reused_tokens / self.reused_tokens, 6)
                if self.reused_tokens else 0.0,
                "loaded_tokens": self.loaded_tokens, "bytes_moved": self.bytes_moved}
