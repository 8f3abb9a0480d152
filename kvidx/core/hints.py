"""Prefetch hints (issue #16): what a replica chosen for a prompt could load back to GPU
memory while the request waits in its queue, so the load overlaps the wait instead of adding to it.

Pure, no I/O: built from one replica's lookup answer (its tier runs) and the model's price rates. A
prefetch is worth issuing only for the resumable tokens held below GPU memory; its benefit is the part
of their load time the queue can hide (min(load, queue wait)); its cost the bytes it moves, and the
turn's wait when it comes late. PrefetchGate decides which plans are issued (issue #41): only those
whose net gain beats a margin, fewer while the kind's bets lose.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvidx.core.price import Pricer
from schemas.answers import PrefetchHint, PrefetchRun, ReplicaAnswer

__all__ = ["PrefetchGate", "PrefetchHint", "PrefetchRun", "prefetch_hint"]


def prefetch_hint(answer: ReplicaAnswer, pricer: Pricer, queue_s: float,
                  bytes_per_token: int = 0) -> PrefetchHint | None:
    """The prefetch plan for `answer`'s replica, expected to start the request in `queue_s` seconds:
    its resumable tokens held outside GPU memory, in prompt order, or None when there are none (or
    none whose tier costs anything to load). Load costs are the model's `Pricer`'s (the service keeps one
    per model), so a plan and the price it came with agree; the walk mirrors Pricer.__call__'s, kept
    inline there because the price runs for every replica of every lookup."""
    left = answer.resumable_tokens
    pos = 0
    runs: list[PrefetchRun] = []
    for run in answer.tiers:
        if left <= 0:
            break
        take = min(run.tokens, left)
        per_token = pricer.load_cost.get(run.tier, 0.0)
        if run.tier != "GPU" and per_token > 0:
            runs.append(PrefetchRun(run.tier, pos, pos + take, take * per_token))
        pos += take
        left -= take
    if not runs:
        return None
    tokens = sum(r.end - r.start for r in runs)
    load_s = sum(r.load_s for r in runs)
    wait = max(0.0, queue_s)
    return PrefetchHint(answer.replica, answer.dp_rank, runs, tokens, load_s, wait, min(load_s, wait),
                        tokens * bytes_per_token)


# The gate's constants (issue #41: a hint is issued only when its expected gain beats its cost):
MARGIN_S = 0.001  # a hint must hide at least 1 ms more than it can cost: below that, the copy's bytes
# (host-to-GPU bandwidth the engine's own loads share, which the gate does not model) and the queue
# estimate's error (pending prefill at the price's rate) are of the same size as the gain
WINDOW = 64  # outcomes the throttle remembers: a ratio within ~6 % (binomial s.d. at 0.5), and recent
# enough to follow a change of traffic within a few hundred routing decisions
MIN_OUTCOMES = 16  # no throttling before this many outcomes (a ratio of fewer is noise)
FLOOR = 0.5  # a kind whose recent bets lost more often than they paid off is throttled ...
PROBE_EVERY = 8  # ... to every 8th hint that passes the gain test: enough outcomes to see it recover


@dataclass
class PrefetchGate:
    """One model's prefetch decisions, the service's (index_service/query.py, per model) and the
    simulator's (kvidx/sim/advice.py, per run): the same code, so `kvidx simulate` decides as `kvidx serve`.

    A plan (`prefetch_hint`) is a bet: it is issued when what its load hides before the request's turn,
    net of what it can delay that turn, beats `margin_s` (`net_gain_s`): the replica starts loading
    `delay_s` after the decision (the hints topic and the engine's actuator; the simulator's
    --hint-delay-ms), or when its load channel is done with the prefetches issued before (the gate keeps
    that channel's end per replica from its own issued plans: the cost of a hint to those queued behind it
    is in their wait); a plan whose load would start after the request's turn makes the turn wait
    (lag - queue) for nothing. On an idle replica (no queue) no plan can pay.

    An online throttle: `outcome` is told whether each issued plan paid off (the simulator: its load was
    partly hidden; the service: the engine's usage report reused the plan's tokens); when fewer than
    `floor` of the last `window` paid off, only every `probe_every`-th plan that passes the gain test is
    issued, until the ratio recovers."""
    delay_s: float
    margin_s: float = MARGIN_S
    window: int = WINDOW
    floor: float = FLOOR
    probe_every: int = PROBE_EVERY
    channel_free: dict[tuple[str, int], float] = field(default_factory=dict)  # its issued plans' end
    outcomes: deque[bool] = field(init=False)
    issued: int = 0
    declined: int = 0  # plans that could not pay (net gain <= margin)
    throttled: int = 0  # plans that could, withheld by the throttle
    _candidates: int = 0  # plans that passed the gain test while throttled (every probe_every-th goes)

    def __post_init__(self) -> None:
        self.outcomes = deque(maxlen=self.window)

    def net_gain_s(self, load_s: float, queue_s: float, key: tuple[str, int], now: float) -> float:
        """Seconds a plan loading `load_s` on replica `key`, whose request starts in `queue_s`, takes off
        the request's first token: the load hidden before the turn, or minus the turn's wait for the
        load to start (a late hint)."""
        lag = max(self.delay_s, self.channel_free.get(key, 0.0) - now)  # until the load starts
        return min(load_s, queue_s - lag) if queue_s >= lag else queue_s - lag

    @property
    def payoff_ratio(self) -> float | None:
        """Paid-off share of the last `window` outcomes (None before any)."""
        return sum(self.outcomes) / len(self.outcomes) if self.outcomes else None

    @property
    def is_throttled(self) -> bool:
        r = self.payoff_ratio
        return r is not None and len(self.outcomes) >= MIN_OUTCOMES and r < self.floor

    def expected_s(self, load_s: float, queue_s: float, key: tuple[str, int], now: float) -> float:
        """What a router may count on a plan hiding on `key` (0 where the gate would not issue it): the
        kv_hints router's price (kvidx/sim/fleet.py) uses it, so it bets on what is issued only."""
        if not load_s or self.is_throttled:
            return 0.0
        gain = self.net_gain_s(load_s, queue_s, key, now)
        return gain if gain > self.margin_s else 0.0

    def admit(self, hint: PrefetchHint, now: float) -> bool:
        """Issue `hint` (made at `now`, its request expected to start in `hint.deadline_s`) or not; an
        issued plan holds its replica's load channel for `hint.load_s`."""
        key = (hint.replica, hint.dp_rank)
        if not self.admit_net(self.net_gain_s(hint.load_s, hint.deadline_s, key, now)):
            return False
        start = now + max(self.delay_s, self.channel_free.get(key, 0.0) - now)
        self.channel_free[key] = start + hint.load_s
        return True

    def admit_net(self, net_s: float) -> bool:
        """Issue a bet expected to take `net_s` seconds off its request (gain net of cost) or not: the
        margin, then the throttle (a fetch hint's whole decision, kvidx.core.fetch; a plan's last step)."""
        if net_s <= self.margin_s:
            self.declined += 1
            return False
        if self.is_throttled:
            self._candidates += 1
            if self._candidates % self.probe_every:
                self.throttled += 1
                return False
        self.issued += 1
        return True

    def outcome(self, paid_off: bool) -> None:
        """An issued plan's fate, as it becomes known."""
        self.outcomes.append(paid_off)

    def report(self) -> dict:
        r = self.payoff_ratio
        return {"declined": self.declined, "throttled": self.throttled,
                "payoff_ratio": None if r is None else round(r, 4)}
