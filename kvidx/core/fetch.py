"""Fetch hints (issue #41 item 5): when a router sends a prompt to a replica that holds less of its prefix
than another replica does, the chosen replica can fetch the longer prefix from that one instead of
computing it. Dynamo (1.6+) carries such a hint to the worker with the request, as its `KvHint` (crate
dynamo-kv-router, kv_hints.rs): one `kv.fetch@1.0` action naming the source's control endpoint and the
source-side engine block hashes of the prefix, root-aligned (block_hashes[i] is request block i); the
worker's KV connector (KVCR) asks the source for them and keeps what it can confirm.

The index keys blocks by its canonical hashes; the engines' own hashes ride along in the stored events
(`BlocksStored.engine_hashes`). `EngineHashes` keeps, per model, the engine hash of each canonical GPU
block seen stored: enough for the hint, because the engines of one model hash alike (vLLM with one
PYTHONHASHSEED, SGLang always); where two replicas disagree on a block's engine hash, the table says
so and the model's fetch hints stop (a hint with another replica's hashes would name nothing).

Pure, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvidx.core.price import Pricer
from schemas.answers import ReplicaAnswer
from schemas.events import BlocksStored, EventBatch
from schemas.service import KvHint, KvHintAction

__all__ = ["EngineHashes", "FetchPlan", "dynamo_kv_hint", "fetch_plan", "source_endpoint"]

KV_HINT_PROTOCOL_VERSION = "0.1"  # dynamo_kv_router::kv_hints (1.6.1)
KV_FETCH_ACTION = ("kv.fetch", "1.0")
KV_FETCH_ACTION_ID = "a1"  # the one action id Dynamo's own selection uses (services/selection/core/run.rs)
DEFAULT_CAPACITY = 2_000_000  # canonical -> engine hash pairs kept per model (~200 MB at most)


class EngineHashes:
    """One model's canonical GPU block hash -> the engine's block hash, from stored events, bounded: two
    generations of at most `capacity / 2` pairs each (a full young generation becomes the old one, and
    the old is dropped), so a block stored again recently is always found and memory never grows."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.half = max(1, capacity // 2)
        self.young: dict[int, int] = {}
        self.old: dict[int, int] = {}
        self.per_engine_block = 0  # index blocks per engine block, from the last event that said
        self.conflicts = 0  # canonical blocks seen with two engine hashes (engines hashing apart)

    def __len__(self) -> int:
        return len(self.young) + len(self.old)

    @property
    def consistent(self) -> bool:
        return not self.conflicts

    def observe(self, batch: EventBatch) -> None:
        """The GPU stores of `batch` (full-attention group 0, whole blocks) remembered. An engine block
        may span k index blocks (SGLang's pages of 64 at the default 16): its hash goes to the last."""
        for ev in batch.events:
            if (type(ev) is not BlocksStored or ev.tier != "GPU" or ev.group or ev.tail or ev.router_keys
                    or ev.copy or not ev.engine_hashes or batch.part):
                continue
            k, rest = divmod(len(ev.hashes), len(ev.engine_hashes))
            if not k or rest:
                continue  # engine blocks finer than the index's: no hash names an index block
            self.per_engine_block = k
            pairs = dict(zip(ev.hashes[k - 1::k], ev.engine_hashes, strict=True))
            for seen in (self.young, self.old):
                common = pairs.keys() & seen.keys()
                if common:
                    self.conflicts += len(common) - len(pairs.items() & seen.items())
            self.young.update(pairs)
            if len(self.young) >= self.half:
                self.old, self.young = self.young, {}

    def chain(self, hashes: list[int]) -> list[int]:
        """The engine hashes of the prompt's leading engine blocks, root-aligned, up to the first the
        table does not hold (`hashes`: the prompt's canonical hashes, in index blocks)."""
        k = self.per_engine_block
        if not k:
            return []
        young, old = self.young, self.old
        last = hashes[k - 1::k]
        out = list(map(young.get, last))
        if None in out:
            from_old = list(map(old.get, last))
            out = [a if a is not None else b for a, b in zip(out, from_old, strict=True)]
            if None in out:
                out = out[:out.index(None)]
        return out


@dataclass
class FetchPlan:
    """Fetch the prompt's first `tokens` tokens, held on `source`, to the chosen replica (which holds
    `held_tokens` of them): `engine_hashes` name the source's blocks; it saves `gain_s` of prefill and
    costs `copy_s` of transfer."""
    source: str
    source_dp_rank: int
    endpoint: str
    engine_hashes: list[int]
    tokens: int
    held_tokens: int
    gain_s: float
    copy_s: float

    @property
    def net_s(self) -> float:
        return self.gain_s - self.copy_s


def fetch_plan(answers: list[ReplicaAnswer], replica: str, dp_rank: int, endpoints: dict[str, str],
               table: EngineHashes, hashes: list[int], block_size: int, pricer: Pricer,
               copy_tokens_per_s: float) -> FetchPlan | None:
    """The plan for `replica` (DP rank `dp_rank`), chosen for a prompt (`hashes`, `answers`: its lookup,
    best first): the replica with a control endpoint holding the longest prefix beyond the chosen one's
    GPU-resident tokens, cut to the blocks whose engine hashes the table holds; None when no replica holds
    more, the model's engines hash apart, or the copy would take longer than the prefill it saves."""
    if not table.consistent:
        return None
    held = 0
    for a in answers:
        if a.replica == replica and a.dp_rank == dp_rank:
            held = a.resumable_tokens
            break
    for a in answers:  # best first: the first eligible source holds the most
        endpoint = source_endpoint(endpoints, a.replica, a.dp_rank)
        if a.replica == replica or not endpoint or a.resumable_tokens <= held:
            continue
        gpu = a.tiers[0].tokens if a.tiers and a.tiers[0].tier == "GPU" else 0
        blocks = min(a.resumable_tokens, gpu) // block_size
        if blocks * block_size <= held:
            return None
        engine = table.chain(hashes[:blocks])
        tokens = min(len(engine) * table.per_engine_block * block_size, blocks * block_size)
        if tokens <= held:
            return None
        extra = tokens - held
        return FetchPlan(a.replica, a.dp_rank, endpoint, engine, tokens, held, extra * pricer.per_token,
                         extra / copy_tokens_per_s)
    return None


def source_endpoint(endpoints: dict[str, str], replica: str, dp_rank: int) -> str | None:
    """A replica's control endpoint for fetches: "REPLICA#RANK" names one DP rank's (each rank keeps its
    own KV cache), "REPLICA" rank 0's."""
    return endpoints.get(f"{replica}#{dp_rank}") or (endpoints.get(replica) if dp_rank == 0 else None)


def dynamo_kv_hint(message_id: str, plan: FetchPlan) -> KvHint:
    """`plan` as Dynamo's `KvHint` (dynamo_kv_router::kv_hints, built by `KvHint::new(message_id,
    vec![KvHintAction::fetch("a1", payload)])`; its serde JSON is msgspec's of this struct, the payload's
    keys in BTreeMap order): what a Dynamo router puts in `PreprocessedRequest.kv_hint` for the worker."""
    action_type, action_version = KV_FETCH_ACTION
    payload = {"block_hashes": plan.engine_hashes, "source_control_endpoint": plan.endpoint}
    return KvHint(KV_HINT_PROTOCOL_VERSION, message_id,
                  [KvHintAction(KV_FETCH_ACTION_ID, action_type, action_version, payload)])
