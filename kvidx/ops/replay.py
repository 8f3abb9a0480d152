"""History replay: rebuild a model's index as it was at a past moment from the Kafka history, then
answer lookups with it or explain a past routing decision.

How it works
------------
The events topic (`kvidx.events.v1`, key = model, retention `EVENTS_RETENTION_MS`, 7 days) is the
history: every batch the index ever folded, in the order the service folded it. The index at time T is
the fold of the model's batches whose Kafka timestamp is <= T (`offsets_for_times` finds where to stop
in the partition), starting from an empty shard at the beginning of the topic, or from a **history
checkpoint**: a shard snapshot together with the events offset it covers. `kvidx checkpoint` (run it
periodically, e.g. `--every 600` as a sidecar of the worker) copies the worker's latest compacted
snapshots into `kvidx.history.v1` (chunks) and `kvidx.history-index.v1` (one small manifest per
checkpoint: model, events partition and offset, chunk offsets), both kept as long as the events. A
replay starts from the newest checkpoint at or before its stop offset, so it folds at most one
checkpoint interval of events. Routing decisions (`kvidx.routes.v1`) of the last `--routes-lookback`
seconds before T are applied as pending credit, interleaved with the events by timestamp, as a service
instance applies them (pending credit expires by each decision's ttl at T).

How far back
------------
Exactly back to the oldest point the retained history starts from: the topic's creation while the
events topic was never truncated (low watermark 0), else the oldest checkpoint whose events offset is
still retained (about `retention - checkpoint interval` back: 7 days minus 10 minutes by default). An
earlier T, or no checkpoint in a truncated topic, replays from the oldest retained event, which misses
the blocks stored before it: the answer is marked `exact: false`. The compacted snapshot topic holds
only the latest state, so it cannot serve a replay in the past by itself.

Accuracy: message timestamps are the relays' CreateTime; the service folds in offset order, so the
replayed state is the one a service instance had once it had read every batch stamped <= T (a few ms
of delivery delay are not modelled). Answers' `freshness` ages are relative to T.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from confluent_kafka import Producer

from kvidx import index
from kvidx.config import ShardSettings
from kvidx.core.fold import Undecodable, fold_message
from kvidx.core.groups import shard_key
from kvidx.core.hashing import prompt_hashes
from kvidx.core.shard import ModelShard
from kvidx.core.snapshot import decode_snapshot, encode_snapshot
from kvidx.kafka.config import client_config
from kvidx.kafka.delivery import require_delivered
from kvidx.kafka.log import (
    Progress,
    add_kafka_args,
    bootstrap_of,
    consumer,
    iso,
    offsets_after,
    parse_time,
    partitions,
    read,
    read_range,
    topic_prefix,
    watermarks,
)
from kvidx.kafka.snapshots import CHUNK, read_snapshots
from kvidx.kafka.topics import EVENTS_RETENTION_MS, create_topics, partition_for
from schemas.answers import ReplicaAnswer
from schemas.events import topic_names
from schemas.routes import decode_route
from schemas.usage import decode_usage

log = logging.getLogger("kvidx.ops.replay")
HISTORY_TOPIC = "kvidx.history.v1"
HISTORY_INDEX_TOPIC = "kvidx.history-index.v1"


# ---- history checkpoints ---------------------------------------------------------------------------
class Checkpoint(msgspec.Struct):
    """A shard snapshot in the history: the fold of the model's events before `events_offset` of
    `events_partition`."""
    model: str
    events_partition: int
    events_offset: int
    chunk_offsets: list[int]  # offsets of its chunks in partition 0 of the history topic
    blocks: int
    created: float
    snapshot_id: int = 0


def history_topics(names: dict[str, str]) -> tuple[str, str]:
    prefix = topic_prefix(names)
    return prefix + HISTORY_TOPIC, prefix + HISTORY_INDEX_TOPIC


def ensure_history_topics(bootstrap: str, names: dict[str, str]) -> tuple[str, str]:
    data, index = history_topics(names)
    create_topics(bootstrap, [data, index], partitions=1, retention_ms=EVENTS_RETENTION_MS)
    return data, index


def read_checkpoints(bootstrap: str, names: dict[str, str], model: str | None = None) -> list[Checkpoint]:
    _, index = history_topics(names)
    out = []
    for m in read_range(bootstrap, index, None, None, "history-index"):
        try:
            cp = msgspec.msgpack.decode(m.value, type=Checkpoint)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if model is None or cp.model == model:
            out.append(cp)
    return out


def load_checkpoint(bootstrap: str, names: dict[str, str], cp: Checkpoint) -> ModelShard:
    data_topic, _ = history_topics(names)
    c = consumer(bootstrap, "history")
    try:
        want = set(cp.chunk_offsets)
        got: dict[int, bytes] = {}
        # chunks of one checkpoint are consecutive in the one partition (one producer, flushed)
        lo, hi = min(want), max(want) + 1
        for m in read(c, data_topic, {0: lo}, {0: hi}):
            if m.offset in want:
                got[m.offset] = m.value
    finally:
        c.close()
    if len(got) != len(want):
        raise RuntimeError(f"checkpoint of {cp.model} at offset {cp.events_offset}: chunks missing "
                           "(expired from the history topic?)")
    shard = decode_snapshot(b"".join(got[o] for o in cp.chunk_offsets))
    shard.events_partition = cp.events_partition
    shard.events_offset = cp.events_offset
    return shard


def checkpoint(bootstrap: str, names: dict[str, str], models: list[str] | None = None) -> list[Checkpoint]:
    """Copy the workers' latest compacted snapshots into the history (those that moved on since the
    model's last checkpoint). Returns the checkpoints written."""
    data_topic, index_topic = ensure_history_topics(bootstrap, names)
    shards = read_snapshots(bootstrap, names["snapshots"])
    last: dict[str, int] = {}
    for cp in read_checkpoints(bootstrap, names):
        last[cp.model] = max(last.get(cp.model, -1), cp.events_offset)
    producer = Producer({**client_config(), "bootstrap.servers": bootstrap, "enable.idempotence": True,
                         "message.max.bytes": 4 << 20, "linger.ms": 5})
    written = []
    for model, shard in sorted(shards.items()):
        if models and model not in models:
            continue
        if shard.events_partition < 0 or shard.events_offset <= last.get(model, -1):
            continue
        data = encode_snapshot(shard)
        chunks = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
        offsets: list[int | None] = [None] * len(chunks)
        errors: list[str] = []

        def delivered(err, msg, i, offsets=offsets, errors=errors):
            if err is not None:
                errors.append(str(err))
            else:
                offsets[i] = msg.offset()

        for i, chunk in enumerate(chunks):
            producer.produce(data_topic, key=model.encode(), value=chunk, partition=0,
                             on_delivery=lambda err, msg, i=i, cb=delivered: cb(err, msg, i))
        require_delivered(producer, f"chunk(s) of {model}'s history checkpoint", refused=len(errors),
                          bootstrap=bootstrap)
        cp = Checkpoint(model, shard.events_partition, shard.events_offset, list(offsets),
                        index.keys_total(shard), time.time(), shard.snapshot_id)
        producer.produce(index_topic, key=model.encode(), value=msgspec.msgpack.encode(cp), partition=0)
        require_delivered(producer, f"manifest of {model}'s history checkpoint", bootstrap=bootstrap)
        written.append(cp)
        log.info("event=history_checkpoint model=%s partition=%d offset=%d chunks=%d", model,
                 cp.events_partition, cp.events_offset, len(chunks))
    return written


# ---- replay ----------------------------------------------------------------------------------------
@dataclass
class Replay:
    shard: ModelShard
    model: str
    at: float  # the moment replayed (s since the epoch)
    stop_offsets: dict[int, int]
    start: str  # "checkpoint" or "beginning"
    start_offsets: dict[int, int]
    exact: bool  # False if retained history starts after events this moment depends on
    batches: int = 0
    other_models: int = 0
    undecodable: int = 0
    routes_applied: int = 0
    seconds: float = 0.0
    last_event_ts: float | None = None
    earliest_exact_ts: float | None = None
    models_seen: set[str] = field(default_factory=set)  # other models' keys met (a few, for errors)
    checkpoint: Checkpoint | None = None
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {"model": self.model, "at": self.at, "at_iso": iso(self.at), "exact": self.exact,
                "start": self.start, "start_offsets": self.start_offsets, "stop_offsets": self.stop_offsets,
                "checkpoint_offset": self.checkpoint.events_offset if self.checkpoint else None,
                "batches_folded": self.batches, "other_models_skipped": self.other_models,
                "undecodable": self.undecodable, "routes_applied": self.routes_applied,
                "seconds": round(self.seconds, 3),
                "last_event_iso": iso(self.last_event_ts) if self.last_event_ts else None,
                "earliest_exact_iso": iso(self.earliest_exact_ts) if self.earliest_exact_ts else None,
                "warnings": self.warnings}


def replay(bootstrap: str, names: dict[str, str], model: str, until: float | None = None,
           at_offset: tuple[int | None, int] | None = None, *, settings: ShardSettings | None = None,
           use_checkpoints: bool = True,
           pending: bool = True, routes_lookback_s: float = 600.0,
           exclude_routes: frozenset[str] = frozenset(),
           progress: bool | None = None) -> Replay:
    """The model's shard as it was at `until` (s since the epoch), or just before offset `at_offset`
    ((partition or None, offset)) of the events topic."""
    if (until is None) == (at_offset is None):
        raise ValueError("give exactly one of until and at_offset")
    t0 = time.monotonic()
    topic = names["events"]
    key = model.encode()
    # a model split in replica groups (kvidx.core.groups) is every group's key; a history checkpoint
    # holds one key's shard, so such a model is replayed from the beginning of the topic
    groups = (settings or ShardSettings()).config.model(model).replica_groups
    keys = {shard_key(model, g).encode() for g in range(groups)}
    cps = read_checkpoints(bootstrap, names, model) if use_checkpoints and groups == 1 else []
    c = consumer(bootstrap, "replay")
    try:
        parts = partitions(c, topic)
        lows = {p: watermarks(c, topic, p)[0] for p in parts}
        if at_offset is not None:
            p, off = at_offset
            if p is None:  # the partition the relays' producer puts the model's key in
                p = partition_for(key, len(parts))
            if p not in lows:
                raise ValueError(f"{topic} has no partition {p} (its partitions: 0-{max(parts)})")
            hi = watermarks(c, topic, p)[1]
            if not lows[p] <= off <= hi:
                raise ValueError(f"offset {off} is outside partition {p} of {topic} (its offsets: "
                                 f"{lows[p]}..{hi}; model {model} is in partition "
                                 f"{partition_for(key, len(parts))})")
            stops = {p: off}
        else:
            stops = offsets_after(c, topic, parts, until)
        usable = [cp for cp in cps if cp.events_partition in stops
                  and lows[cp.events_partition] <= cp.events_offset <= stops[cp.events_partition]]
        earliest = _earliest_exact(c, topic, cps, lows)
        cp = max(usable, key=lambda x: x.events_offset) if usable else None
        if cp is not None:
            shard = load_checkpoint(bootstrap, names, cp)
            starts = {cp.events_partition: cp.events_offset}
            stops = {cp.events_partition: stops[cp.events_partition]}
            exact, start = True, "checkpoint"
        else:
            shard = (settings or ShardSettings()).new_shard(model)
            starts = {p: lows[p] for p in stops}
            exact, start = all(lows[p] == 0 for p in stops), "beginning"
        at = until
        if at is None:  # the time of the last message before the offset
            at = _ts_before(c, topic, next(iter(stops)), next(iter(stops.values())), starts)
        result = Replay(shard, model, at, dict(stops), start, dict(starts), exact, checkpoint=cp,
                        earliest_exact_ts=earliest)
        if not exact:
            result.warnings.append("the events topic was truncated by retention and no history checkpoint "
                                   "covers this moment: blocks stored before the oldest retained event are "
                                   "missing (run `kvidx checkpoint` periodically)")
        routes = []
        if pending and at is not None:
            seen = set(exclude_routes)
            for m in read_range(bootstrap, names["routes"], at - routes_lookback_s, at, "replay-routes", key):
                try:
                    d = decode_route(m.value)
                except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                    continue
                if d.request_id not in seen and d.ts <= at:
                    seen.add(d.request_id)
                    routes.append((m.ts, d))
        ri = 0
        total = sum(max(0, stops[p] - starts[p]) for p in stops)
        bar = Progress(f"replay {model}", total, progress)
        base = dict(starts)

        def on_progress(pos):
            bar.update(sum(pos[p] - base[p] for p in pos), result.batches)

        for m in read(c, topic, starts, stops, on_progress=on_progress, timeout_s=3600):
            if m.key not in keys:
                result.other_models += 1
                if len(result.models_seen) < 20 and m.key is not None:
                    result.models_seen.add(m.key.decode(errors="replace"))
                continue
            while ri < len(routes) and routes[ri][0] <= m.ts:
                _add_route(shard, routes[ri][1])
                ri += 1
            try:
                fold_message(lambda _batch: shard, m.value, m.ts, m.partition, m.offset)
            except Undecodable:
                result.undecodable += 1
                continue
            result.batches += 1
            result.last_event_ts = m.ts
        bar.close()
        for _, d in routes[ri:]:
            _add_route(shard, d)
        result.routes_applied = len(routes)
        if result.batches == 0 and cp is None:
            _explain_empty(c, topic, key, parts, stops, result)
    finally:
        c.close()
    result.seconds = time.monotonic() - t0
    return result


class NoSuchModel(LookupError):
    pass


def _explain_empty(c, topic: str, key: bytes, parts: list[int], stops: dict[int, int], r: Replay) -> None:
    """A replay that folded nothing says why, never just "0 batches": the model is not in the topic
    at all (an error), or its first event comes after the moment asked for (a warning naming it)."""
    p = partition_for(key, len(parts))
    ends = {p: watermarks(c, topic, p)[1]}
    first = None
    for m in read(c, topic, {p: min(stops.get(p, 0), ends[p])}, ends, timeout_s=60):
        if m.key == key:
            first = m
            break
    if first is None:
        seen = sorted(r.models_seen) or ["none"]
        raise NoSuchModel(f"no events of model {r.model!r} in {topic} (models seen before the moment: "
                          f"{', '.join(seen)}{', ...' if len(seen) >= 20 else ''})")
    if p not in stops:
        r.warnings.append(f"model {r.model!r} is in partition {p} of {topic}, not in the one asked for "
                          f"({', '.join(map(str, stops))}): 0 batches folded")
        return
    r.warnings.append(f"the moment asked for ({iso(r.at) if r.at else 'offset ' + str(stops[p])}) is before "
                      f"the model's first event in {topic}: {iso(first.ts)} (Kafka time, when the relay "
                      "published it; a played recording keeps its engine clock in the events, not here)")


def _add_route(shard: ModelShard, d) -> None:
    shard.add_pending(d.replica, d.dp_rank, d.block_hashes, d.prompt_tokens, d.credited_tokens,
                      d.ts + d.ttl_s)


def _ts_before(c, topic: str, p: int, off: int, starts: dict[int, int]) -> float | None:
    if off <= 0:
        return None
    gen = read(c, topic, {p: off - 1}, {p: off})
    try:
        for m in gen:
            return m.ts
    finally:
        gen.close()  # unassign now, before the caller assigns again
    return None


def _exact_since(ts: float | None) -> str:
    """How far back a replay of this topic is exact, for a person (_earliest_exact's value)."""
    if ts == 0.0:
        return "a replay is exact back to the topic's first event"
    if ts is None:
        return "a replay is exact for no earlier time: retention dropped events no retained checkpoint holds"
    return f"a replay is exact back to {iso(ts)}"


def _earliest_exact(c, topic: str, cps: list[Checkpoint], lows: dict[int, int]) -> float | None:
    """The oldest moment a replay is exact for: the topic's first event if it was never truncated,
    else the oldest retained checkpoint's (its events offset's time)."""
    if all(lo == 0 for lo in lows.values()):
        return 0.0
    ok = [cp for cp in cps if cp.events_offset >= lows.get(cp.events_partition, 0)]
    if not ok:
        return None
    cp = min(ok, key=lambda x: x.events_offset)
    return _ts_before(c, topic, cp.events_partition, cp.events_offset, {}) or cp.created


# ---- answers ---------------------------------------------------------------------------------------
def load_prompts(path: str | Path) -> list[dict]:
    """Prompts as token ids: a JSON list of token ids, a list of such lists, or objects
    {"token_ids": [...], "lora_name": ..., "cache_salt": ..., "name": ...} (one or a list), or a
    requests log (JSON lines with `prompt_token_ids`, as tests/fixtures/*/requests.jsonl)."""
    text = Path(path).read_text()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError:  # JSON lines: a requests log
        raw = [json.loads(line) for line in text.splitlines() if line.strip()]
        raw = [{"token_ids": r.get("prompt_token_ids", r.get("token_ids")), "name": str(r.get("i", i))}
               if isinstance(r, dict) else r for i, r in enumerate(raw)]
    if isinstance(raw, dict):
        raw = [raw]
    if raw and all(isinstance(t, int) for t in raw):
        raw = [raw]
    out = []
    for i, p in enumerate(raw):
        if isinstance(p, list):
            p = {"token_ids": p}
        if not isinstance(p, dict) or not isinstance(p.get("token_ids"), list) or not p["token_ids"]:
            raise ValueError(f"prompt {i} has no token_ids")
        out.append({"name": p.get("name", str(i)), "token_ids": p["token_ids"],
                    "lora_name": p.get("lora_name"), "cache_salt": p.get("cache_salt")})
    return out


def lookup_prompts(r: Replay, prompts: list[dict]) -> list[dict]:
    out = []
    for p in prompts:
        hashes = prompt_hashes(p["token_ids"], r.shard.block_size, p["lora_name"], p["cache_salt"],
                               lookahead=r.shard.lookahead)
        out.append({"name": p["name"], "prompt_tokens": len(p["token_ids"]),
                    "replicas": index.lookup(r.shard, hashes, len(p["token_ids"]), r.at)})
    return out


def state_summary(r: Replay) -> list[dict]:
    """Per replica at the replayed moment: live blocks per group, epoch/seq, last engine event."""
    out = []
    for st in sorted(index.replicas(r.shard), key=lambda s: (s.replica, s.dp_rank)):
        # "last event": when it was published (the clock --until reads); the engine's own clock
        # beside it (a played recording keeps the time it was recorded at)
        out.append({"replica": st.replica, "dp_rank": st.dp_rank, "blocks": st.blocks,
                    "group_blocks": dict(st.group_blocks), "epoch": st.epoch, "seq": st.seq,
                    "seq_gaps": st.seq_gaps, "last_event_iso": iso(st.applied_ts) if st.batches else None,
                    "last_event_engine_iso": (iso(st.engine_ts) if st.batches
                                              and abs(st.engine_ts - st.applied_ts) > 1.0 else None)})
    return out


def _blocks_by_tier(answer: ReplicaAnswer, block_size: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in answer.tiers:
        out[t.tier] = out.get(t.tier, 0) + t.tokens // block_size
    return out


def find_route(bootstrap: str, names: dict[str, str], request_id: str, model: str | None = None,
               since: float | None = None, until: float | None = None):
    key = model.encode() if model else None
    for m in read_range(bootstrap, names["routes"], since, until, "explain", key):
        try:
            d = decode_route(m.value)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            continue
        if d.request_id == request_id:
            return d
    return None


def find_usage(bootstrap: str, names: dict[str, str], request_id: str, model: str, around: float):
    for m in read_range(bootstrap, names["usage"], around - 60, around + 3600, "explain-usage",
                        model.encode()):
        try:
            u = decode_usage(m.value)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            continue
        if u.request_id == request_id:
            return u
    return None


def explain(bootstrap: str, names: dict[str, str], request_id: str, model: str | None = None,
            since: float | None = None, **replay_kw) -> dict:
    """Why the router sent `request_id` where it did: the index rebuilt at the decision's time, the
    prompt looked up on every replica, against what the router credited and the engine reused."""
    d = find_route(bootstrap, names, request_id, model, since)
    if d is None:
        raise LookupError(f"no routing decision {request_id!r} in {names['routes']}"
                          + (f" for model {model!r}" if model else ""))
    r = replay(bootstrap, names, d.model, until=d.ts, exclude_routes=frozenset({request_id}), **replay_kw)
    answers = index.lookup(r.shard, d.block_hashes, d.prompt_tokens, d.ts)
    bs = r.shard.block_size
    usage = find_usage(bootstrap, names, request_id, d.model, d.ts) if "usage" in names else None
    reps = []
    for a in answers:
        reps.append({"replica": a.replica, "dp_rank": a.dp_rank,
                     "blocks": a.cached_tokens // bs, "blocks_by_tier": _blocks_by_tier(a, bs),
                     "cached_tokens": a.cached_tokens, "resumable_tokens": a.resumable_tokens,
                     "pending_tokens": a.pending_tokens, "upper_bound": a.upper_bound,
                     "chosen": a.replica == d.replica and a.dp_rank == d.dp_rank})
    chosen = next((x for x in reps if x["chosen"]), None)
    index_credit = chosen["resumable_tokens"] if chosen else 0
    best = reps[0] if reps else None
    out = {"request_id": request_id, "model": d.model, "decided_at": d.ts, "decided_at_iso": iso(d.ts),
           "router": d.router, "routed_to": {"replica": d.replica, "dp_rank": d.dp_rank},
           "prompt_tokens": d.prompt_tokens, "prompt_blocks": len(d.block_hashes), "block_size": bs,
           "router_credited_tokens": d.credited_tokens, "index_credited_tokens": index_credit,
           "engine_reused_tokens": usage.cached_tokens if usage else None,
           "engine": usage.engine if usage else None,
           "replicas": [x for x in reps if x["blocks"] or x["pending_tokens"] or x["chosen"]],
           "replay": r.summary()}
    out["text"] = _explain_text(out, best)
    return out


def _explain_text(o: dict, best: dict | None) -> str:
    parts = []
    for x in o["replicas"][:6]:
        tiers = ", ".join(f"{n} on {t}" for t, n in x["blocks_by_tier"].items()) or "0"
        parts.append(f"{x['replica']} (rank {x['dp_rank']}) had {x['blocks']} blocks of this prompt "
                     f"({tiers}), resumable {x['resumable_tokens']} tokens"
                     + (f" incl. {x['pending_tokens']} pending" if x["pending_tokens"] else ""))
    s = f"At {o['decided_at_iso']} (request {o['request_id']}, {o['prompt_tokens']} prompt tokens = " \
        f"{o['prompt_blocks']} blocks of {o['block_size']}): "
    s += "; ".join(parts) if parts else "no replica held any block of this prompt"
    to = o["routed_to"]
    s += f". The router sent it to {to['replica']} (rank {to['dp_rank']}) and credited " \
         f"{o['router_credited_tokens']} tokens; the index credited {o['index_credited_tokens']} there"
    if best and not (best["replica"] == to["replica"] and best["dp_rank"] == to["dp_rank"]) \
            and best["resumable_tokens"] > o["index_credited_tokens"]:
        s += f" (best was {best['replica']} with {best['resumable_tokens']})"
    if o["engine_reused_tokens"] is not None:
        s += f"; the engine reported {o['engine_reused_tokens']} reused"
    return s + "."


# ---- CLI -------------------------------------------------------------------------------------------
def _at_offset(text: str) -> tuple[int | None, int]:
    if ":" in text:
        p, o = text.split(":", 1)
        return int(p), int(o)
    return None, int(text)


def cmd_replay(args) -> int:
    from kvidx.config import load_config

    prompts = None
    if args.prompts:  # read before anything else: a missing or bad file fails at once
        try:
            prompts = load_prompts(args.prompts)
        except OSError as e:
            sys.exit(f"error: --prompts {args.prompts}: {e.strerror or e}")
        except ValueError as e:  # not JSON, or not prompts
            sys.exit(f"error: --prompts {args.prompts}: {e}")
    b = bootstrap_of(args)
    names = topic_names(args.topic_prefix)
    # shards are made as the worker and the service make them (one configuration source)
    settings = ShardSettings(load_config(args.config), args.index_block_size)
    kw = dict(settings=settings, use_checkpoints=not args.no_checkpoints,
              pending=not args.no_pending, routes_lookback_s=args.routes_lookback,
              progress=False if args.json and not sys.stderr.isatty() else None)
    if args.request_id:
        try:
            out = explain(b, names, args.request_id, args.model,
                          parse_time(args.since) if args.since else None, **kw)
        except LookupError as e:
            sys.exit(f"error: {e}")
        print(json.dumps(out, indent=None if args.json else 2) if args.json else out["text"])
        if not args.json:
            for x in out["replicas"]:
                mark = "*" if x["chosen"] else " "
                print(f"  {mark} {x['replica']} rank {x['dp_rank']}: {x['blocks']} blocks "
                      f"{x['blocks_by_tier']}, resumable {x['resumable_tokens']}")
        return 0
    if not args.model:
        sys.exit("error: --model is required (or --request-id to explain a routing decision)")
    if (args.until is None) == (args.at_offset is None):
        sys.exit("error: give --until TIME or --at-offset [PARTITION:]OFFSET")
    try:
        r = replay(b, names, args.model, parse_time(args.until) if args.until else None,
                   _at_offset(args.at_offset) if args.at_offset else None, **kw)
    except (ValueError, NoSuchModel) as e:
        sys.exit(f"error: {e}")
    out = {"replay": r.summary(), "replicas": state_summary(r)}
    if prompts is not None:
        out["lookups"] = lookup_prompts(r, prompts)
    if args.json:
        print(msgspec.json.encode(out).decode())
        return 0
    s = out["replay"]
    print(f"{args.model} at {s['at_iso']}: {s['batches_folded']} batches folded from the {s['start']} "
          f"in {s['seconds']} s ({'exact' if s['exact'] else 'NOT exact'}; "
          f"{_exact_since(r.earliest_exact_ts)})")
    for w in s["warnings"]:
        print(f"warning: {w}")
    for x in out["replicas"]:
        engine = f" (engine clock {x['last_event_engine_iso']})" if x["last_event_engine_iso"] else ""
        print(f"  {x['replica']} rank {x['dp_rank']}: {x['blocks']} blocks, epoch {x['epoch']} "
              f"seq {x['seq']}, last event published {x['last_event_iso']}{engine}")
    for lk in out.get("lookups", []):
        print(f"prompt {lk['name']} ({lk['prompt_tokens']} tokens):")
        for a in lk["replicas"]:
            tiers = ", ".join(f"{t.tier} {t.tokens}" for t in a.tiers)
            print(f"  {a.replica} rank {a.dp_rank}: cached {a.cached_tokens} ({tiers}), "
                  f"resumable {a.resumable_tokens}")
    return 0


def cmd_checkpoint(args) -> int:
    b = bootstrap_of(args)
    names = topic_names(args.topic_prefix)
    while True:
        written = checkpoint(b, names, args.model or None)
        print(json.dumps({"checkpoints": [{"model": cp.model, "partition": cp.events_partition,
                                           "offset": cp.events_offset, "blocks": cp.blocks}
                                          for cp in written]}), flush=True)
        if not args.every:
            return 0
        time.sleep(args.every)


def add_cli(subparsers) -> None:
    """Register `replay` and `checkpoint`."""
    p = subparsers.add_parser(
        "replay", help="rebuild a model's index at a past moment from Kafka; look up or explain",
        description="Rebuilds the index of a model as it was at a past moment from the events topic "
                    "(from the newest history checkpoint before it, see `kvidx checkpoint`), then prints "
                    "the replicas' state, answers lookups for prompts given as token ids (--prompts), or "
                    "explains a routing decision (--request-id). Exact back to the events topic's "
                    "retention (7 days) minus the checkpoint interval.")
    add_kafka_args(p)
    p.add_argument("--model", help="the model (required unless --request-id)")
    p.add_argument("--until", help="the moment: ISO 8601 (UTC unless a zone is given), epoch seconds, "
                   "'now' or -15m / -2h / -1d")
    p.add_argument("--at-offset", metavar="[PARTITION:]OFFSET",
                   help="instead of --until: the state just before this offset of the events topic")
    p.add_argument("--prompts", help="JSON file of prompts as token ids to look up at that moment")
    p.add_argument("--request-id", help="explain this routing decision (found in the routes topic)")
    p.add_argument("--since", help="with --request-id: search the routes topic from this time on")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--index-block-size", type=int, default=None, metavar="N",
                   help="for a replay without a checkpoint (default: the model's in --config, else 16)")
    p.add_argument("--config", help="deployment configuration (per-model block size, eviction kinds; "
                   "docs/config.md)")
    p.add_argument("--no-checkpoints", action="store_true", help="fold from the oldest retained event")
    p.add_argument("--no-pending", action="store_true", help="leave routing decisions (pending credit) out")
    p.add_argument("--routes-lookback", type=float, default=600.0, metavar="S",
                   help="routing decisions applied as pending credit: those of the S seconds before")
    p.set_defaults(func=cmd_replay)

    c = subparsers.add_parser(
        "checkpoint", help="copy the latest shard snapshots into the history (for fast replays)",
        description="Copies the workers' latest compacted snapshots into kvidx.history.v1 with the events "
                    "offset they cover, so that `kvidx replay` starts from the newest one before its "
                    "moment. Run it periodically (--every 600).")
    add_kafka_args(c)
    c.add_argument("--model", action="append", help="only this model (repeatable)")
    c.add_argument("--every", type=float, default=0.0, metavar="S", help="repeat every S seconds")
    c.set_defaults(func=cmd_checkpoint)
