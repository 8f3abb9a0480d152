"""Sessions, from the routing decisions (issue #16): which prompts continue which, how soon they come
back, how many sessions pass through each block, and the advice made of it.

Pure, no I/O, hashes and counts only. A routing decision's prompt continues a session when one of its
block hashes is the last block of that session's latest prompt (a chat's next turn, an agent's next
step: the previous prompt, plus output and new input); else it starts one. Per session: where its latest
prompt went, how often and how soon it came back (the mean gap), and its blocks; per block, how many
sessions pass through it (a system prompt: many; a conversation's own turns: one).

- Eviction advice, per replica, ranked by tokens freed: a session silent for longer than `idle_factor`
  x its gap (or than `idle_s` for one that never came back) is `demote` (its own blocks can leave GPU
  memory for a lower tier), and after `drop_factor` x that, `drop` (they can go); blocks other sessions
  pass through are never named. Each carries its class's return probability, learned online from the
  demoted sessions whose blocks a later prompt came back through (the session's own next prompt or
  another's; per traffic class: how often the session had come back), and is issued only where
  worth_advising says its benefit beats its expected cost. A
  recurring session that is due back soon is `keep` (keep_advice: an API for engines that pin; neither
  the service nor the simulator issues it yet).
- Placement: a recurring session whose replica will still be busy when it is due back is worth copying
  ahead of its next prompt to the replica with the shortest queue, when the wait it avoids, weighed by
  its class's return probability, exceeds the copy's time and the room it takes at the target.

Known ambiguity: a first prompt that ends exactly where many conversations branch (a system prompt and
nothing else) is continued by the next conversation through it; its blocks stop being anyone's own as
soon as a second session passes through them. Sessions are per replica name (DP rank 0).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from kvidx.core.hints import PrefetchGate


class EvictionAdvice(msgspec.Struct):
    replica: str
    session: int  # the tracker's session id
    action: str  # keep, demote or drop
    hashes: list[int]  # the session's own blocks (no other session passes through them)
    tokens: int  # their tokens (blocks x block size)
    idle_s: float  # how long the session has been silent
    gap_s: float  # its mean gap between prompts (0: it never came back)
    # the share of demoted sessions of its traffic class (SessionTracker.traffic_class) that came back so
    # far (Laplace: (returned + 1) / (demoted + 2)): what the advice risks; see advice_seconds for its
    # benefit and cost in seconds, and worth_advising for the decision
    p_return: float = 0.5


# eviction advice is issued only when its benefit is at least twice its expected cost: the benefit (the
# room it frees, priced as a reload it spares an active session) is an upper bound, as only a replica
# short of room gains from it and its LRU would free part of that room anyway
ADVICE_MARGIN = 2.0
# blocks of demoted sessions remembered until a prompt comes back through them (about 20 MB): the oldest
# are forgotten first, and a return after that many later advised blocks counts as none
MAX_ADVISED_BLOCKS = 200_000


def advice_seconds(adv: EvictionAdvice, demote_reload_s: float, drop_reload_s: float,
                   room_s: float) -> tuple[float, float]:
    """(benefit_s, cost_s) of eviction advice, per token costs in seconds: its room lets as many tokens of
    sessions still active stay where they are instead of being reloaded from the tier below
    (`room_s` per token); it costs, if the session comes back (p_return), reloading its tokens from where
    the advice sends them (demote: the tier below, `demote_reload_s`; drop: recompute, `drop_reload_s`)."""
    reload = demote_reload_s if adv.action == "demote" else drop_reload_s
    return adv.tokens * room_s, adv.p_return * adv.tokens * reload


def worth_advising(adv: EvictionAdvice, demote_reload_s: float, drop_reload_s: float,
                   room_s: float) -> tuple[float, float] | None:
    """advice_seconds where the advice is worth issuing (benefit > ADVICE_MARGIN x cost), else None: the
    one decision of the service (index_service/query.py) and the simulator (kvidx/sim/advice.py). A
    demotion (reloaded from the tier its room is priced at) goes for a class of sessions that come back
    less than half the time; a drop (recomputed) only for classes that almost never do."""
    benefit, cost = advice_seconds(adv, demote_reload_s, drop_reload_s, room_s)
    return (benefit, cost) if benefit > ADVICE_MARGIN * cost else None


class PlacementHint(msgspec.Struct):
    source: str
    target: str
    hashes: list[int]  # the session's prompt, all of it (the target holds none of it)
    tokens: int
    copy_s: float  # the copy's time at the transfer rate
    benefit_s: float  # the wait at the source its next prompt avoids, less the target's
    bytes: int


@dataclass
class Session:
    sid: int
    hashes: list[int]  # its latest prompt's block hashes
    replica: str  # where its latest prompt went
    last_ts: float
    returns: int = 0
    gap_s: float = 0.0  # mean time between its prompts (0 until it comes back)
    advised: str = ""  # the last eviction advice given for it
    advised_class: int = 0  # its traffic class when it was advised demote
    version: int = 0  # bumps at each prompt: stale entries of the due heap are skipped


@dataclass
class SessionTracker:
    block_size: int
    idle_factor: float = 4.0
    idle_s: float = 30.0  # for sessions that never came back
    min_idle_s: float = 5.0  # for those that did: a gap from a few returns is noisy
    drop_factor: float = 4.0  # drop after demote's threshold x this
    sessions: dict[int, Session] = field(default_factory=dict)
    by_last: dict[int, int] = field(default_factory=dict)  # last block hash -> session id
    passes: dict[int, int] = field(default_factory=dict)  # block hash -> sessions through it
    _due: list[tuple[float, int, int]] = field(default_factory=list)  # (when to look again, sid, version)
    demoted: int = 0  # sessions advised demote
    returned: int = 0  # of those, sessions that came back
    demoted_by: dict[int, int] = field(default_factory=dict)  # the same per traffic class
    returned_by: dict[int, int] = field(default_factory=dict)
    # a demoted session's own blocks -> its id, and its id -> its class until a prompt (its own next one,
    # or any other session's) comes back through one of them: what the advice risked, learned per class
    advised_blocks: dict[int, int] = field(default_factory=dict)
    open_advice: dict[int, int] = field(default_factory=dict)
    # the kinds' throttles (kvidx.core.hints.PrefetchGate, margin 0: the rules below decide what can pay):
    # a placement paid off when the session's next prompt went to its target; a demotion when the
    # session stayed silent until its drop, and lost when a prompt came back through its blocks
    placement_gate: PrefetchGate = field(default_factory=lambda: PrefetchGate(0.0, 0.0))
    eviction_gate: PrefetchGate = field(default_factory=lambda: PrefetchGate(0.0, 0.0))
    placed: dict[int, str] = field(default_factory=dict)  # session id -> its placement's target
    _next: int = 0

    def find(self, hashes: Sequence[int]) -> Session | None:
        """The session a prompt continues: the one whose latest prompt ends at its deepest such block."""
        for i in range(len(hashes) - 1, -1, -1):
            sid = self.by_last.get(hashes[i])
            if sid is not None:
                return self.sessions[sid]
        return None

    def observe(self, hashes: Sequence[int], replica: str, ts: float) -> Session:
        """A routing decision: its prompt's block hashes, where it went, when. The session it continues
        (updated) or the one it starts."""
        if self.advised_blocks:
            self._came_back(hashes)
        s = self.find(hashes)
        if s is None:
            s = Session(self._next, [], replica, ts)
            self._next += 1
            self.sessions[s.sid] = s
        else:
            target = self.placed.pop(s.sid, None)
            if target is not None:
                self.placement_gate.outcome(replica == target)
            gap = ts - s.last_ts
            s.gap_s = (s.gap_s * s.returns + gap) / (s.returns + 1)
            s.returns += 1
            if self.by_last.get(s.hashes[-1]) == s.sid:
                del self.by_last[s.hashes[-1]]
        old = set(s.hashes)
        for h in hashes:
            if h not in old:
                self.passes[h] = self.passes.get(h, 0) + 1
        s.hashes, s.replica, s.last_ts, s.advised = list(hashes), replica, ts, ""
        s.version += 1
        if hashes:
            self.by_last[hashes[-1]] = s.sid
        heapq.heappush(self._due, (ts + self._idle_after(s), s.sid, s.version))
        return s

    def _came_back(self, hashes: Sequence[int]) -> None:
        """A prompt through blocks of demoted sessions: each such advice counted returned, once."""
        advised = self.advised_blocks
        for sid in {advised.pop(h) for h in hashes if h in advised}:
            cls = self.open_advice.pop(sid, None)
            if cls is not None:
                self.returned += 1
                self.returned_by[cls] = self.returned_by.get(cls, 0) + 1
                self.eviction_gate.outcome(False)

    def _advised(self, sid: int, cls: int, own: list[int]) -> None:
        """A demotion of session `sid` (class `cls`) of its blocks `own`, watched for a return."""
        self.demoted += 1
        self.demoted_by[cls] = self.demoted_by.get(cls, 0) + 1
        self.open_advice.pop(sid, None)
        self.open_advice[sid] = cls
        advised = self.advised_blocks
        for h in own:
            advised[h] = sid
        while len(advised) > MAX_ADVISED_BLOCKS:  # the oldest first (dicts keep insertion order)
            del advised[next(iter(advised))]
        while len(self.open_advice) > MAX_ADVISED_BLOCKS:
            del self.open_advice[next(iter(self.open_advice))]

    @staticmethod
    def traffic_class(s: Session) -> int:
        """The class whose return probability a session's advice is priced with: how often it came
        back (0, 1, 2-3, 4 or more times): one-shot prompts seldom return, long chats and agent loops
        mostly do, and the classes learn it from the traffic (SessionTracker.p_return)."""
        return min(s.returns.bit_length(), 3)

    def p_return(self, cls: int) -> float:
        """The share of class `cls`'s sessions advised demote that a prompt came back through (Laplace:
        1/2 unmeasured)."""
        return (self.returned_by.get(cls, 0) + 1) / (self.demoted_by.get(cls, 0) + 2)

    def _idle_after(self, s: Session) -> float:
        return max(self.idle_factor * s.gap_s, self.min_idle_s) if s.returns else self.idle_s

    def own_blocks(self, s: Session) -> list[int]:
        """The session's blocks no other session passes through."""
        return [h for h in s.hashes if self.passes.get(h, 0) <= 1]

    def eviction_advice(self, now: float) -> list[EvictionAdvice]:
        """Sessions that fell silent since the last call: demote, then (silent `drop_factor` times
        longer) drop, their own blocks; ranked per replica by tokens freed. A dropped session is
        forgotten (a later prompt of it starts a new one)."""
        out: list[EvictionAdvice] = []
        p_return = {c: self.p_return(c) for c in range(4)}  # as measured before this call's advice
        while self._due and self._due[0][0] <= now:
            _, sid, version = heapq.heappop(self._due)
            s = self.sessions.get(sid)
            if s is None or s.version != version:
                continue
            own = self.own_blocks(s)
            dropped_by = s.last_ts + self._idle_after(s) * self.drop_factor
            action = "drop" if s.advised == "demote" or now >= dropped_by else "demote"
            if s.advised == "demote" and s.sid in self.open_advice:
                self.eviction_gate.outcome(True)  # silent until its drop: the demotion paid off
            cls = s.advised_class if action == "drop" and s.advised else self.traffic_class(s)
            if own:
                out.append(EvictionAdvice(s.replica, s.sid, action, own, len(own) * self.block_size,
                                          now - s.last_ts, s.gap_s, p_return[cls]))
            if action == "demote":
                s.advised, s.advised_class = "demote", cls
                if own:
                    self._advised(sid, cls, own)
                heapq.heappush(self._due, (dropped_by, sid, version))
            else:
                self._forget(s)
        out.sort(key=lambda a: (a.replica, -a.tokens))
        return out

    def keep_advice(self, now: float, within_s: float) -> list[EvictionAdvice]:
        """Recurring sessions due back within `within_s`: keep their own blocks where they are."""
        out = [EvictionAdvice(s.replica, s.sid, "keep", own, len(own) * self.block_size, now - s.last_ts,
                              s.gap_s)
               for s in self.sessions.values()
               if s.returns and s.last_ts + s.gap_s <= now + within_s and (own := self.own_blocks(s))]
        out.sort(key=lambda a: (a.replica, -a.tokens))
        return out

    def worth_advising(self, adv: EvictionAdvice, demote_reload_s: float, drop_reload_s: float,
                       room_s: float) -> tuple[float, float] | None:
        """`worth_advising`'s rule (benefit over ADVICE_MARGIN x cost) as the kind's gate applies it, then
        its throttle: the decision of the service and the simulator."""
        benefit, cost = advice_seconds(adv, demote_reload_s, drop_reload_s, room_s)
        return (benefit, cost) if self.eviction_gate.admit_net(benefit - ADVICE_MARGIN * cost) else None

    def _forget(self, s: Session) -> None:
        if self.placed.pop(s.sid, None) is not None:
            self.placement_gate.outcome(False)  # the session never came back to its copy
        del self.sessions[s.sid]
        if s.hashes and self.by_last.get(s.hashes[-1]) == s.sid:
            del self.by_last[s.hashes[-1]]
        for h in s.hashes:
            c = self.passes.get(h, 0) - 1
            if c > 0:
                self.passes[h] = c
            else:
                self.passes.pop(h, None)

    def placement(self, s: Session, queue_s: dict[str, float], transfer_tokens_per_s: float,
                  bytes_per_token: int = 0, room_s: float = 0.0) -> PlacementHint | None:
        """Where to copy recurring session `s`'s prompt ahead of its next one: the replica with the
        shortest queue, when the wait it is expected to avoid beats what it costs; None otherwise (or for a
        session that never came back). The wait avoided is the queue still left at its own replica when
        the session is due back (queues drain while it is away: now less its mean gap), less the
        target's, expected as far as sessions of its class come back (p_return, learned online); the cost
        is the copy's time and the room it takes at the target: as many tokens of others pushed out of
        GPU memory, priced `room_s` a token (a reload from the tier below)."""
        if not s.returns or not s.hashes or s.replica not in queue_s:
            return None
        target = min((r for r in queue_s if r != s.replica), key=queue_s.__getitem__, default=None)
        if target is None:
            return None
        tokens = len(s.hashes) * self.block_size
        copy_s = tokens / transfer_tokens_per_s
        gap = s.gap_s
        benefit = max(0.0, queue_s[s.replica] - gap) - max(0.0, queue_s[target] - gap)
        if not self.placement_gate.admit_net(self.p_return(self.traffic_class(s)) * benefit
                                             - copy_s - tokens * room_s):
            return None  # it cannot pay, or the kind's recent copies went unused (throttled)
        self.placed[s.sid] = target
        return PlacementHint(s.replica, target, list(s.hashes), tokens, copy_s, benefit,
                             tokens * bytes_per_token)
