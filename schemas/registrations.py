"""What `kvidx serve` keeps of the workers registered through Dynamo's API (index_service/dynamo_api.py),
on the compacted topic `kvidx.registrations.v1`: one record per (instance, DP rank), key
`"<instance_id>/<dp_rank>"`, a tombstone (no value) once unregistered. Every service instance reads
it at start and follows it; the instance named `owner` runs the worker's relay. The same topic keeps
the addresses of the workers that feed SGLang's external-indexer API (index_service/sglang_indexer.py):
key `"sglang/<model>/<worker_id>"`, value a SglangWorker; and Mooncake conductor's registrations
(index_service/conductor_api.py): key `"conductor/<instance>|<tenant>|<dp_rank>"`, value a
ConductorService, a tombstone once unregistered. Evolution as in schemas/events.py."""

from __future__ import annotations

import msgspec

REGISTRATIONS_VERSION = 1


class Registration(msgspec.Struct, array_like=True):
    v: int
    instance_id: int
    dp_rank: int
    model_name: str
    routing_group: str
    block_size: int
    endpoint: str
    replay_endpoint: str | None
    owner: str  # the `kvidx serve --instance-name` that runs the relay


class SglangWorker(msgspec.Struct, array_like=True):
    v: int
    model: str
    worker_id: str
    address: str  # the worker's URL as SGLang's router knows it


SGLANG_KEY_PREFIX = b"sglang/"
CONDUCTOR_KEY_PREFIX = b"conductor/"


class ConductorService(msgspec.Struct, array_like=True):
    v: int
    endpoint: str
    replay_endpoint: str
    type: str
    model: str
    lora_name: str
    tenant_id: str
    instance_id: str
    block_size: int
    dp_rank: int
    cache_group: int | None
    profile: dict[str, str]
    owner: str  # the `kvidx serve --instance-name` that runs the relay


def conductor_key(service_key: str) -> bytes:
    return CONDUCTOR_KEY_PREFIX + service_key.encode()


def sglang_worker_key(model: str, worker_id: str) -> bytes:
    return SGLANG_KEY_PREFIX + f"{model}/{worker_id}".encode()


def registration_key(instance_id: int, dp_rank: int) -> bytes:
    return f"{instance_id}/{dp_rank}".encode()


_encoder = msgspec.msgpack.Encoder()
_decoders = {t: msgspec.msgpack.Decoder(t) for t in (Registration, SglangWorker, ConductorService)}


def encode_record(r: Registration | SglangWorker | ConductorService) -> bytes:
    return _encoder.encode(r)


def _decode(t: type, data: bytes):
    r = _decoders[t].decode(data)
    if r.v != REGISTRATIONS_VERSION:
        raise ValueError(f"unsupported registration version {r.v} "
                         f"(this reader knows {REGISTRATIONS_VERSION})")
    return r


def decode_registration(data: bytes) -> Registration:
    return _decode(Registration, data)


def decode_sglang_worker(data: bytes) -> SglangWorker:
    return _decode(SglangWorker, data)


def decode_conductor_service(data: bytes) -> ConductorService:
    return _decode(ConductorService, data)
