"""What `kvidx serve` keeps of the workers registered through Dynamo's API (index_service/dynamo_api.py),
on the compacted topic `kvidx.registrations.v1`: one record per (instance, DP rank), key
`"<instance_id>/<dp_rank>"`, a tombstone (no value) once unregistered. Every service instance reads
it at start and follows it; the instance named `owner` runs the worker's relay. Evolution as in
schemas/events.py."""

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


def registration_key(instance_id: int, dp_rank: int) -> bytes:
    return f"{instance_id}/{dp_rank}".encode()


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Registration)


def encode_registration(r: Registration) -> bytes:
    return _encoder.encode(r)


def decode_registration(data: bytes) -> Registration:
    r = _decoder.decode(data)
    if r.v != REGISTRATIONS_VERSION:
        raise ValueError(f"unsupported registration version {r.v} "
                         f"(this reader knows {REGISTRATIONS_VERSION})")
    return r
