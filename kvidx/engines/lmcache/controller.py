"""LMCache controller messages (lmcache/v1/cache_controller/message.py): the admit/evict reports an
LMCache worker pushes to its controller, decoded into index events for the replica it serves.

Formats read in LMCache's source (msgspec msgpack, `MsgBase(msgspec.Struct, tag=True)`: a map whose
"type" is the class name):
- KVAdmitMsg / KVEvictMsg {instance_id: str, worker_id: int, key: str, location: str} (older
  releases; `key` is CacheEngineKey.to_string() "fmt@model@world_size@worker_id@chunk_hash");
- the same with `key: int` (the chunk hash) and `seq_num: int = 0` (KVOperationMsg, newer releases);
- a variant with explicit `type: Literal["kv_admit" | "kv_evict"]`;
- BatchedKVOperationMsg {instance_id, worker_id, location, operations: [{op_type: "admit"|"evict",
  key: int, seq_num: int}]} (newest).
`location` names the storage backend (e.g. "LocalCPUBackend", "LocalDiskBackend"): its tier comes from
kvidx.engines.lmcache.chunks.location_tier. Keys are LMCache's chunk hashes: they are matched to
the chunks the relay placed from LMCache's stores re-published through vLLM (which carry tokens); an
unknown key is counted, never guessed. Other controller messages (register, heartbeat ...) are ignored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec

from kvidx.engines.contract import DeadLetter, Frame, RelayOutput
from kvidx.engines.vllm.relay import VllmPublisherRelay
from schemas.events import SCHEMA_VERSION, EventBatch

MAX_CONTROLLER_MSG = 1 << 20
ADMIT_TYPES = frozenset({"KVAdmitMsg", "kv_admit"})
EVICT_TYPES = frozenset({"KVEvictMsg", "kv_evict"})
IGNORED_TYPES = frozenset({"RegisterMsg", "DeRegisterMsg", "HeartbeatMsg", "register", "de_register",
                           "FullSyncStartMsg", "FullSyncStatusMsg", "FullSyncEndMsg"})


class _Op(msgspec.Struct):
    op_type: str
    key: int
    seq_num: int = 0


class _Msg(msgspec.Struct):
    type: str
    instance_id: str = ""
    worker_id: int = 0
    key: int | str | None = None
    location: str = ""
    seq_num: int = 0
    operations: list[msgspec.Raw] | None = None  # _Op each, read one by one


_dec = msgspec.msgpack.Decoder(_Msg)
_dec_op = msgspec.msgpack.Decoder(_Op)


@dataclass
class KvOp:
    admit: bool
    instance_id: str
    worker_id: int
    key: int
    location: str
    seq_num: int


@dataclass
class BadOp:
    """An operation of a BatchedKVOperationMsg that cannot be placed (the message's other operations
    are): its position, kind ("stored" for an admit, "removed" for an evict, "other"), its key if it
    could be read, why, and its own bytes."""
    position: int
    kind: str
    key: int | None
    location: str
    reason: str
    detail: str
    raw: bytes


def _bad_op(i: int, raw: bytes, location: str, reason: str, detail: str) -> BadOp:
    try:
        obj = msgspec.msgpack.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        obj = None
    obj = obj if isinstance(obj, dict) else {}
    kind = {"admit": "stored", "evict": "removed"}.get(obj.get("op_type"), "other") \
        if isinstance(obj.get("op_type"), str) else "other"
    try:
        key = parse_key(obj["key"]) if isinstance(obj.get("key"), int | str) else None
    except ControllerMessageError:
        key = None
    return BadOp(i, kind, key, location, reason, detail[:300], raw)


class ControllerMessageError(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def parse_key(key: int | str) -> int:
    """A chunk hash from either key form, folded to unsigned 64 bits like every engine hash."""
    if isinstance(key, int):
        return key & 0xFFFF_FFFF_FFFF_FFFF
    h = key.rsplit("@", 1)[-1]
    try:
        v = int(h)
    except ValueError:
        try:
            v = int(h, 16)
        except ValueError:
            raise ControllerMessageError("bad_key", f"key {key[:80]!r} has no chunk hash") from None
    return v & 0xFFFF_FFFF_FFFF_FFFF


def decode_controller(payload: bytes) -> list[KvOp | BadOp]:
    """Admit/evict operations of one controller message ([] for messages that are not about chunks);
    an operation of a batched message that cannot be read is a BadOp in its place. Raises msgspec
    errors or ControllerMessageError for the message itself."""
    try:
        m = _dec.decode(payload)
    except RecursionError:  # msgspec's depth limit on deeply nested values: malformed, not a crash
        raise msgspec.DecodeError("nested too deeply") from None
    if m.type in IGNORED_TYPES:
        return []
    if m.type == "BatchedKVOperationMsg":
        if m.operations is None:
            raise ControllerMessageError("missing_field", "BatchedKVOperationMsg without operations")
        ops: list[KvOp | BadOp] = []
        for i, raw in enumerate(m.operations):
            try:
                op = _dec_op.decode(raw)
            except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as e:
                ops.append(_bad_op(i, bytes(raw), m.location, "undecodable_event", str(e) or "nested"))
                continue
            if op.op_type not in ("admit", "evict"):
                ops.append(_bad_op(i, bytes(raw), m.location, "unknown_op", f"op_type {op.op_type!r}"))
                continue
            ops.append(KvOp(op.op_type == "admit", m.instance_id, m.worker_id, parse_key(op.key), m.location,
                            op.seq_num))
        return ops
    if m.type in ADMIT_TYPES or m.type in EVICT_TYPES:
        if m.key is None or not m.location:
            raise ControllerMessageError("missing_field", f"{m.type} without key or location")
        return [KvOp(m.type in ADMIT_TYPES, m.instance_id, m.worker_id, parse_key(m.key), m.location,
                     m.seq_num)]
    raise ControllerMessageError("unknown_type", f"message type {m.type!r}")


class LmcacheControllerRelay:
    """Feeds one LMCache instance's admit/evict messages into the relay of the vLLM engine it serves,
    so both streams share one mirror (the chunk-hash memo) and one (epoch, seq) order: each message
    becomes a batch ordered after the last engine batch (EventBatch.part, like a mirror replay).
    Sequence numbers (seq_num > 0) per worker: a repeated or older one is dead-lettered
    (`out_of_order`)."""

    def __init__(self, core: VllmPublisherRelay):
        self.core = core
        self.last_seq: dict[tuple[str, int], int] = {}
        self.counters = {"messages": 0, "ops": 0, "ignored": 0}

    def on_message(self, payload: bytes, recv_ns: int | None = None) -> RelayOutput:
        recv_ns = recv_ns or time.time_ns()
        frame = Frame(b"lmcache-controller", -1, payload, recv_ns, self.core.replica, "lmcache")
        out = RelayOutput()
        self.counters["messages"] += 1
        if len(payload) > MAX_CONTROLLER_MSG:
            out.dead.append(DeadLetter("oversized", f"{len(payload)} bytes", frame))
            return out
        try:
            ops = decode_controller(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            out.dead.append(DeadLetter("malformed_payload", str(e)[:300], frame))
            return out
        except ControllerMessageError as e:
            out.dead.append(DeadLetter(e.reason, str(e)[:300], frame))
            return out
        if not ops:
            self.counters["ignored"] += 1
            return out
        events: list = []
        lm = self.core.mirror.lmcache
        now = recv_ns / 1e9
        for op in ops:
            if isinstance(op, BadOp):  # set aside alone, never crediting more (docs/engines.md)
                out.set_aside.append(self._set_aside(op, lm, events, frame))
                continue
            if op.seq_num > 0:
                k = (op.instance_id, op.worker_id)
                if op.seq_num <= self.last_seq.get(k, 0):
                    out.dead.append(DeadLetter("out_of_order", f"seq_num {op.seq_num} after "
                                               f"{self.last_seq[k]}", frame))
                    continue
                self.last_seq[k] = op.seq_num
            self.counters["ops"] += 1
            if op.admit:
                lm.admit(op.key, op.location, events, now)
            else:
                lm.evict(op.key, op.location, events)
        if events:
            self.core.resync_part += 1
            c = self.core
            out.batches.append(EventBatch(
                v=SCHEMA_VERSION, model=c.model, replica=c.replica, dp_rank=c.dp_rank or 0, epoch=c.epoch,
                seq=c.next_seq - 1 if c.next_seq is not None else -1, engine_ts=now, relay_ts=now,
                block_size=c.mirror.block_size, events=events, part=c.resync_part))
        return out

    def _set_aside(self, op: BadOp, lm, events: list, frame: Frame) -> DeadLetter:
        """An admit is not applied; an evict (or an operation of another kind) of a readable key evicts
        that key; one whose key cannot be read evicts every chunk of its location."""
        if op.kind == "stored":
            action = "skipped"
        elif op.key is not None:
            lm.evict(op.key, op.location, events)
            action = "dropped"
        else:
            lm.evict_location(op.location, events)
            action = "dropped_location"
        key = (op.reason, op.kind)
        self.core.set_aside[key] = self.core.set_aside.get(key, 0) + 1
        f = Frame(frame.topic, frame.seq, op.raw, frame.recv_ns, frame.endpoint, frame.src)
        return DeadLetter(op.reason, f"{action}: {op.detail}"[:300], f, op.position, op.kind)
