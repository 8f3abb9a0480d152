"""Dynamo registrations beyond one process: the compacted topic `kvidx.registrations.v1`
(schemas/registrations.py). `kvidx serve` writes a record on POST /register and a tombstone on
/unregister before answering, and follows the topic from its start: at start-up it takes up the
registrations it owns (their relays start again: a restart does not forget them), and it learns the
others' so that any instance answers /workers and /query for every registered worker. The addresses of
the workers feeding SGLang's external-indexer API (index_service/sglang_indexer.py) and Mooncake
conductor's registrations (index_service/conductor_api.py) are kept there too."""

from __future__ import annotations

import logging
import threading
import time

from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, Producer, TopicPartition

from kvidx.kafka.config import client_config
from kvidx.kafka.log import consumer
from schemas.registrations import (
    CONDUCTOR_KEY_PREFIX,
    SGLANG_KEY_PREFIX,
    ConductorService,
    Registration,
    SglangWorker,
    conductor_key,
    decode_conductor_service,
    decode_registration,
    decode_sglang_worker,
    encode_record,
    registration_key,
    sglang_worker_key,
)

log = logging.getLogger("kvidx.registrations")
# a topic just made: its partition's leader not elected yet
_NOT_YET = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
            KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._TIMED_OUT}


class RegistrationLog:
    def __init__(self, bootstrap: str, topic: str):
        self.bootstrap = bootstrap
        self.topic = topic
        self.producer = Producer({**client_config(), "bootstrap.servers": bootstrap, "acks": "all",
                                  "enable.idempotence": True})
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.caught_up = threading.Event()  # set once every record written before the start is applied
        self._echoes: dict[bytes, int] = {}  # per key, this instance's writes not read back yet
        self._echo_lock = threading.Lock()

    def _write(self, key: bytes, value: bytes | None, timeout_s: float = 10.0) -> None:
        errors: list[str] = []

        def delivered(err, _msg) -> None:
            if err is not None:
                errors.append(str(err))
                self._stale_echo(key)  # never written: no echo will come

        with self._echo_lock:
            self._echoes[key] = self._echoes.get(key, 0) + 1
        self.producer.produce(self.topic, key=key, value=value, on_delivery=delivered)
        if self.producer.flush(timeout_s) or errors:
            raise RuntimeError(errors[0] if errors else f"not acknowledged within {timeout_s:.0f} s")

    def _stale_echo(self, key: bytes) -> bool:
        """Whether a record of `key` just read is this instance's own, superseded by a newer write of
        its own still to be read back: applying it would undo that write for a moment (a registration
        removed right after it was made started its relay again, clearing the replica, until the
        tombstone was read)."""
        with self._echo_lock:
            n = self._echoes.get(key, 0)
            if n <= 1:
                self._echoes.pop(key, None)
                return False
            self._echoes[key] = n - 1
            return True

    def publish(self, reg: Registration) -> None:
        self._write(registration_key(reg.instance_id, reg.dp_rank), encode_record(reg))

    def remove(self, instance_id: int, dp_rank: int) -> None:
        """The tombstone, acknowledged (RuntimeError if not: the registration stays, the caller says so)."""
        self._write(registration_key(instance_id, dp_rank), None)

    def publish_sglang_worker(self, w: SglangWorker) -> None:
        self._write(sglang_worker_key(w.model, w.worker_id), encode_record(w))

    def publish_conductor(self, c: ConductorService) -> None:
        self._write(conductor_key(f"{c.instance_id}|{c.tenant_id}|{c.dp_rank}"), encode_record(c))

    def remove_conductor(self, service_key: str) -> None:
        """The tombstone, acknowledged (RuntimeError if not), as `remove`."""
        self._write(conductor_key(service_key), None)

    def follow(self, apply, sglang_worker=None, conductor=None) -> RegistrationLog:
        """From the topic's start, in a thread: `apply(key, Registration | None)` for every Dynamo
        record, `sglang_worker(SglangWorker)` for every SGLang worker's address, `conductor(service key,
        ConductorService | None)` for every conductor registration.

        The records written before the start are read first and applied as the compacted topic's view
        (per key its last record; a key whose last record is a tombstone not at all), once caught up:
        a registration removed before a restart never starts its relay again, not even for a moment
        (the relay's start clears its replica)."""
        self._thread = threading.Thread(target=self._run, args=(apply, sglang_worker, conductor), daemon=True,
                                        name="registrations")
        self._thread.start()
        return self

    def _run(self, apply, sglang_worker, conductor) -> None:
        c = consumer(self.bootstrap, "registrations")

        def one(key: bytes, value: bytes | None, offset: int) -> None:
            try:
                if key.startswith(SGLANG_KEY_PREFIX):
                    if sglang_worker is not None and value is not None:
                        sglang_worker(decode_sglang_worker(value))
                elif key.startswith(CONDUCTOR_KEY_PREFIX):
                    if conductor is not None:
                        conductor(key[len(CONDUCTOR_KEY_PREFIX):].decode(),
                                  decode_conductor_service(value) if value is not None else None)
                else:
                    apply(key, decode_registration(value) if value is not None else None)
            except (ValueError, TypeError) as e:
                log.warning("event=registration_unreadable offset=%d error=%s", offset, e)

        backlog: dict[bytes, tuple[bytes | None, int]] = {}  # before caught up: key -> its last record

        def catch_up() -> None:
            for key, (value, offset) in backlog.items():
                if value is not None:  # a removed registration is not taken up again
                    one(key, value, offset)
            backlog.clear()
            self.caught_up.set()

        try:
            high = self._end(c)
            c.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])
            if high <= 0:
                self.caught_up.set()
            while not self._stop.is_set():
                msg = c.poll(0.2)
                if msg is None:
                    continue
                if msg.error() is not None:
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        log.warning("event=registrations_error error=%s", msg.error())
                    elif not self.caught_up.is_set():  # the end, short of `high` (compacted away)
                        catch_up()
                    continue
                stale = self._stale_echo(msg.key())
                if self.caught_up.is_set():
                    if not stale:
                        one(msg.key(), msg.value(), msg.offset())
                    continue
                if not stale:
                    backlog.pop(msg.key(), None)  # kept in the order of each key's last record
                    backlog[msg.key()] = (msg.value(), msg.offset())
                if msg.offset() + 1 >= high:
                    catch_up()
        except Exception as e:  # noqa: BLE001 - a follower that stops must say why
            log.error("event=registrations_follower_stopped error=%s", e)
        finally:
            c.close()

    def _end(self, c) -> int:
        """The topic's end offset; a broker still electing the partition's leader (a topic just made)
        is asked again, for up to a minute."""
        deadline = time.monotonic() + 60
        while True:
            try:
                return c.get_watermark_offsets(TopicPartition(self.topic, 0), timeout=30)[1]
            except KafkaException as e:
                if e.args[0].code() not in _NOT_YET or time.monotonic() > deadline or self._stop.wait(1.0):
                    raise

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.producer.flush(5)
