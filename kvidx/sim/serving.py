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
    """One hint kind's fate over a run: issued by the index, followed by the engine, paid off (the
    followed hint's tokens were reused and at least part of their load was done before the request's
    turn), and the seconds of load it hid."""
    issued: int = 0
    followed: int = 0
    paid_off: int = 0
    saved_s: float = 0.0
    wasted_tokens: int = 0  # prefetched, not reused by the request
    regretted: int = 0  # eviction advice followed for a session that came back

    def report(self) -> dict:
        return {"issued": self.issued, "followed": self.followed, "paid_off": self.paid_off,
                "saved_s": round(self.saved_s, 4), "wasted_tokens": self.wasted_tokens,
                "regretted": self.regretted}


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
    channel_free: dict[str, float] = field(init=False)  # end of the replica's queued prefetches
    served: dict[str, int] = field(init=False)
    ttft: np.ndarray = field(init=False)
    prefetch: HintCounts = field(default_factory=HintCounts)
    reused_tokens: int = 0
    gpu_reused_tokens: int = 0  # reused from GPU memory at the request's turn (prefetched in time included)
    loaded_tokens: int = 0  # moved toward GPU memory: loads at the request's turn and prefetches

    def __post_init__(self) -> None:
        self.busy_until = dict.fromkeys(self.names, 0.0)
        self.inflight = {name: [] for name in self.names}
        self.channel_free = dict.fromkeys(self.names, 0.0)
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
              ) -> None:
        """Queue request `i` (n prompt tokens at `t`, `reused` of them cached, `split` by the tier they
        came from) on `name`; `hint`, when the replica follows it, starts loading at `followed_at`; a
        copy placed there for it is done at `ready_at`."""
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
        if followed_at is not None and hint is not None:
            self.prefetch.followed += 1
            self.prefetch.wasted_tokens += wasted
            self.loaded_tokens += prefetched_reused + wasted
            ch_start = max(followed_at, self.channel_free[name])
            ch_end = ch_start + channel_s
            self.channel_free[name] = ch_end
            # the reused tokens are the plan's first (a prompt's prefix, loaded in prompt order): the turn
            # waits for them only; the rest of the plan just holds the channel
            useful_end = ch_start + useful_s
            wait_s = max(0.0, useful_end - start) if prefetched_reused else 0.0
            saved = useful_s - wait_s if useful_s > 0 else 0.0
            if saved > 0:
                self.prefetch.paid_off += 1
                self.prefetch.saved_s += saved
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

    def report(self) -> dict:
        """The run's reuse by tier and bytes moved (the JSON's policies.<name> fields)."""
        return {"gpu_share_of_reused": round(self.gpu_reused_tokens / self.reused_tokens, 6)
                if self.reused_tokens else 0.0,
                "loaded_tokens": self.loaded_tokens, "bytes_moved": self.bytes_moved}
