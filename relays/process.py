"""The live relay process of a ZMQ-publishing engine: one relay per DP rank (each rank publishes on
the base port + rank, vLLM's and SGLang's rule), the control listener that asks for mirror replays,
and the run until SIGTERM. `kvidx relay` builds the relay logic (the engine's adapter) and the sink
and hands them here."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from relays.control import ControlListener
from relays.run import Relay
from relays.sinks import Sink
from relays.zmq_source import ZmqSource
from schemas.control import ResyncRequest

log = logging.getLogger("kvidx.relay")


@dataclass
class LiveRelaySettings:
    model: str
    replica: str
    endpoint: str
    replay_endpoint: str | None = None
    dp_size: int = 1
    dp_rank: int | None = None
    bind: bool = False
    controller_endpoint: str | None = None  # LMCache's admit/evict PULL socket (one rank only)
    record_to: str | None = None
    resync_blocks_per_s: float = 50_000
    resync_jitter_s: float = 5.0
    status_every_s: float = 30.0


def rank_endpoints(s: LiveRelaySettings) -> list[tuple[int | None, str, str | None]]:
    """(dp rank, events endpoint, replay endpoint) of every publisher the relay follows."""
    from kvidx.engines.contract import dp_endpoints

    if s.dp_size > 1:
        return [(rank, ep, rep) for rank, (ep, rep) in
                enumerate(dp_endpoints(s.endpoint, s.replay_endpoint, s.dp_size))]
    return [(s.dp_rank, s.endpoint, s.replay_endpoint)]


def run_live(s: LiveRelaySettings, make_core: Callable, sink: Sink, bootstrap: str, control_topic: str,
             stop: threading.Event) -> int:
    """Relay every rank until `stop` (SIGTERM) or every rank's source ends; SIGUSR1 or a resync request
    on the control topic replays the mirrors. `make_core(model, replica, index_block_size?, rank)` is
    the engine's relay logic, bound to its index block size by the caller."""
    ranks = rank_endpoints(s)
    one = len(ranks) == 1  # a controller feed and a recording belong to a single publisher
    relays = [Relay(make_core(s.model, s.replica, rank), sink,
                    ZmqSource(ep, rep, bind=s.bind,
                              controller_endpoint=s.controller_endpoint if one else None),
                    record_to=s.record_to if one else None, resync_blocks_per_s=s.resync_blocks_per_s,
                    resync_jitter_s=s.resync_jitter_s, status_every_s=s.status_every_s)
              for rank, ep, rep in ranks]

    def resync_all(req: ResyncRequest | None = None) -> None:
        for r in relays:
            r.request_resync(req.replica_groups if req is not None else 0)

    control = ControlListener(bootstrap, control_topic, s.model, s.replica, resync_all).start()
    signal.signal(signal.SIGUSR1, lambda *_: resync_all())  # a mirror replay in the same group
    log.info("event=relay_start model=%s replica=%s endpoint=%s ranks=%d kafka=%s waiting_for=%r", s.model,
             s.replica, s.endpoint, len(relays), bootstrap,
             f"the engine's KV events (a status line follows every {s.status_every_s:g}s)")
    threads = []
    for r in relays:
        r.start_fresh()
        th = threading.Thread(target=r.run_live, daemon=True, name=f"relay-{r.core.dp_rank}")
        th.start()
        threads.append(th)
    try:
        while not stop.is_set() and any(th.is_alive() for th in threads):
            stop.wait(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        control.stop()
        for r in relays:
            r.close()
        for th in threads:
            th.join(5)
    drain = getattr(sink, "drain", None)
    if drain is not None and (lost := drain(30.0)):
        log.error("event=relay_stop_undelivered messages=%d hint=%r", lost,
                  "the relay's next start clears and replays this replica")
        return 1
    return 0
