"""Fold throughput (block events/s) and relay throughput.

1. Worker fold: pre-encoded EventBatch messages (<= --per-batch block events each, removes and
   stores, --replicas replicas, Mooncake-trace block patterns over per-replica LRU caches at 16-token
   index blocks) -> decode_batch -> ModelShard.apply, after a warm-up that fills the caches (so the
   timed part runs on a full shard with steady-state evictions). Also decode alone and apply alone.
2. Relay: vLLM 0.32 wire payloads (token ids, engine block size --engine-block-size) produced by the
   simulated engine's block pool from the same trace -> kvidx.engines.vllm.wire.decode_payload alone, and
   VllmPublisherRelay.on_frame (decode + mirror + canonical re-hash), and on_frame + encode_batch.

Target (DESIGN.md): ingest >= 250k block events/s (relay decode -> Kafka -> fold -> shard).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import _common as c
import msgspec
import numpy as np

from kvidx.core.shard import NATIVE_FOLD, ModelShard
from kvidx.core.snapshot import decode_snapshot, encode_snapshot
from kvidx.engines.contract import Frame
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.engines.vllm.sim import SimVllmEngine
from kvidx.engines.vllm.wire import BlockRemoved, BlockStored, decode_payload
from schemas.events import BlocksRemoved as BlocksRemovedEv
from schemas.events import BlocksStored as BlocksStoredEv
from schemas.events import EventBatch, decode_batch, encode_batch

TARGET = 250_000


def bench_worker_fold(args, figs: c.Figures) -> None:
    c.log(f"worker fold: generating ~{args.events:,} timed block events, {args.replicas} replicas, "
          f"capacity {args.capacity:,} blocks/replica, <= {args.per_batch} block events/batch ...")
    t = time.perf_counter()
    warm, timed = c.batches_from_stream(args.replicas, args.capacity, 16, args.per_batch, args.events)
    n_timed = sum(map(c.block_events, timed))
    n_removed = sum(len(e.hashes) for b in timed for e in b.events if type(e).__name__ == "BlocksRemoved")
    msgs = [encode_batch(b) for b in timed]
    c.log(f"  {len(warm):,} warm-up + {len(timed):,} timed batches ({n_timed:,} block events, "
          f"{n_removed / n_timed:.0%} removes, {sum(map(len, msgs)) / len(msgs):.0f} B/msg) "
          f"in {time.perf_counter() - t:.1f}s")

    base = ModelShard(c.MODEL, 16)
    for b in warm:
        base.apply(b, 0.0)
    blocks, entries = c.shard_entries(base)
    c.log(f"  warm shard: {blocks:,} blocks, {entries:,} entries")
    snap = encode_snapshot(base)
    del warm

    dec = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        for m in msgs:
            decode_batch(m)
        dec.append(n_timed / (time.perf_counter() - t))
    c.log(f"  decode_batch alone: {max(dec):,.0f} blocks/s (best of {args.repeat})")

    decoded = [decode_batch(m) for m in msgs]
    app = []
    for _ in range(args.repeat):
        shard = decode_snapshot(snap)
        t = time.perf_counter()
        for b in decoded:
            shard.apply(b, 1.0)
        app.append(n_timed / (time.perf_counter() - t))
    c.log(f"  apply alone: {max(app):,.0f} blocks/s (best of {args.repeat})")
    fore = []
    for _ in range(args.repeat):
        shard = decode_snapshot(snap)
        shard.foresight.active = True  # as after the model's first route: the eviction order is kept
        t = time.perf_counter()
        for b in decoded:
            shard.apply(b, 1.0)
        fore.append(n_timed / (time.perf_counter() - t))
    c.log(f"  apply with eviction foresight: {max(fore):,.0f} blocks/s (best of {args.repeat})")
    del decoded

    both = []
    for i in range(args.repeat):
        shard = decode_snapshot(snap)
        c.collect()
        t = time.perf_counter()
        for m in msgs:
            shard.apply(decode_batch(m), 1.0)
        dt = time.perf_counter() - t
        both.append(n_timed / dt)
        c.log(f"  run {i + 1}/{args.repeat}: decode+apply {n_timed:,} block events in {dt:.2f}s = "
              f"{both[-1]:,.0f} blocks/s ({len(msgs) / dt:,.0f} batches/s)")
    figs.add("fold decode_batch+apply, block events/s (best)", max(both), "blocks/s", f">= {TARGET}",
             f"median {statistics.median(both):,.0f}; {args.per_batch} blocks/batch, "
             f"{args.replicas} replicas")
    figs.add("fold decode_batch alone, block events/s", max(dec), "blocks/s")
    figs.add("fold ModelShard.apply alone, block events/s", max(app), "blocks/s")
    figs.add("fold ModelShard.apply with eviction foresight (routes recorded), block events/s", max(fore),
             "blocks/s")


def production_stream(timed: list[EventBatch], seed: int = 7,
                      host_tier: bool = True) -> list[tuple[EventBatch, list[int] | None]]:
    """The timed batches as a service instance that follows routes folds them (issue #40 item 1): each
    batch that stores blocks comes after its prompt's route (pending credit and eviction foresight on:
    every request through a router); a tenth of the batches also offload the blocks they evict to the
    host tier (CPU stores: the group has two tiers, removals check the union); one in fifty carries a
    partial-block key (vLLM's partial blocks under --prefix-match-unit: the Python fold's). (batch, the
    route's hashes or None). Without `host_tier`, the same stream but the CPU stores (the same draws:
    the same batches carry partial-block keys)."""
    r = random.Random(seed)
    out = []
    for b in timed:
        stored = [h for e in b.events if isinstance(e, BlocksStoredEv) for h in e.hashes]
        removed = [h for e in b.events if isinstance(e, BlocksRemovedEv) for h in e.hashes]
        events = list(b.events)
        if removed and r.random() < 0.1 and host_tier:
            events.append(BlocksStoredEv("CPU", 0, removed, None, 0))
        if stored and r.random() < 0.02:
            events.append(BlocksStoredEv("GPU", 0, [stored[-1] ^ 0x5A5A], None, 0, tail=True))
        out.append((msgspec.structs.replace(b, events=events), stored or None))
    return out


def _fold_timed(shard: ModelShard, stream: list[tuple[EventBatch, list[int] | None]]) -> float:
    """Seconds in `apply` alone (the routes recorded between the batches are not timed)."""
    clock = time.perf_counter
    spent = 0.0
    for b, route in stream:
        if route is not None:
            shard.add_pending(b.replica, b.dp_rank, route, 16 * len(route), 0, 1e12)
        t = clock()
        shard.apply(b, 1.0)
        spent += clock() - t
    return spent


def bench_production_fold(args, figs: c.Figures) -> dict:
    """ModelShard.apply on the plain stream and on the production stream (production_stream), compiled
    and Python, in one run: block events/s, best of --repeat, apply alone in both, on decoded batches.
    Each shard is the steady state a running instance holds: made by folding the warm-up stream of its
    kind (the production ones with their routes, host tier and partial-block keys, so the tier's union
    and each replica's eviction order exist and are full before the timed part, not made during it)."""
    warm, timed = c.batches_from_stream(args.replicas, args.capacity, 16, args.per_batch, args.events)
    n_timed = sum(map(c.block_events, timed))
    plain_warm = _decoded([(b, None) for b in warm])
    prod_warm = _decoded(production_stream(warm, seed=8))
    # and with its routes but no host tier: what the host tier's union costs, apart from the routes
    no_host_warm = _decoded(production_stream(warm, seed=8, host_tier=False))
    del warm
    plain = _decoded([(b, None) for b in timed])
    prod = _decoded(production_stream(timed))
    unrouted = [(b, None) for b, _ in prod]  # the production stream's events without its routes
    no_host = _decoded(production_stream(timed, host_tier=False))
    n_prod = sum(c.block_events(b) for b, _ in prod)
    n_no_host = sum(c.block_events(b) for b, _ in no_host)
    rates: dict[str, list[float]] = {"plain_compiled": [], "production_compiled": [], "production_python": [],
                                     "production_unrouted_compiled": [], "production_no_host_compiled": []}
    for _ in range(args.repeat):
        # (name, timed stream, its warm-up, routes recorded, Python fold, block events)
        for name, stream, warmed, routes, python_fold, n in (
                ("plain_compiled", plain, plain_warm, False, False, n_timed),
                ("production_compiled", prod, prod_warm, True, False, n_prod),
                ("production_python", prod, prod_warm, True, True, n_prod),
                ("production_unrouted_compiled", unrouted, prod_warm, False, False, n_prod),
                ("production_no_host_compiled", no_host, no_host_warm, True, False, n_no_host)):
            shard = _warm_shard(warmed, routes=routes, python_fold=python_fold)
            c.collect()
            rates[name].append(n / _fold_timed(shard, stream))
    best = {k: max(v) for k, v in rates.items()}
    for k, v in best.items():
        c.log(f"  {k}: {v:,.0f} block events/s (best of {args.repeat})")
    ratio = best["production_compiled"] / best["plain_compiled"]
    figs.add("fold ModelShard.apply, production stream compiled / plain compiled", ratio, "x", ">= 0.8",
             f"routes before every store, 10 % offloads to CPU, 2 % partial-block keys; python "
             f"{best['production_python']:,.0f}")
    # what the events cost without the routes' side: the host tier's union and the keys alone
    figs.add("fold ModelShard.apply, production events without routes / plain compiled",
             best["production_unrouted_compiled"] / best["plain_compiled"], "x", "",
             f"production folds at 1/"
             f"{best['production_unrouted_compiled'] / best['production_compiled']:.2f} of its rate")
    # and the routes with no host tier: the tier's union (a second map a block) is what it leaves out.
    # (Rates per block event: the production stream also has the host tier's stores.)
    figs.add("fold ModelShard.apply, production routes and keys without a host tier / plain compiled",
             best["production_no_host_compiled"] / best["plain_compiled"], "x", "",
             f"production folds at 1/"
             f"{best['production_no_host_compiled'] / best['production_compiled']:.2f} of its rate")
    if NATIVE_FOLD is not None:
        c.log(f"  compiled fold declined {NATIVE_FOLD.declined:,} of "
              f"{NATIVE_FOLD.declined + NATIVE_FOLD.folded:,} batches in this process")
    return best


def _decoded(stream: list[tuple[EventBatch, list[int] | None]]) -> list[tuple[EventBatch, list[int] | None]]:
    """The batches as a service instance folds them: through the wire and its decoder (each event's
    hashes packed), as in the worker fold above; the routes' hashes stay the router's lists."""
    return [(decode_batch(encode_batch(b)), route) for b, route in stream]


def _warm_shard(warm: list[tuple[EventBatch, list[int] | None]], routes: bool,
                python_fold: bool) -> ModelShard:
    """A shard that folded `warm` (and its routes, with `routes`) compiled, then folds with the compiled
    fold or (`python_fold`) with ModelShard.fold_reference, the Python fold."""
    shard = ModelShard(c.MODEL, 16)
    for b, route in warm:
        if routes and route is not None:
            shard.add_pending(b.replica, b.dp_rank, route, 16 * len(route), 0, 1e12)
        shard.apply(b, 0.0)
    if python_fold:
        vars(shard).pop("apply", None)  # the compiled fold bound in __init__: the class's apply is Python
    return shard


def bench_fold_scaling(args, figs: c.Figures) -> None:
    """decode_batch+apply at f x the base load: f x --replicas replicas (each caching --capacity
    blocks, so the warm shard grows f x) and f x --per-batch block events per batch."""
    for f in args.scale:
        replicas, per_batch = round(args.replicas * f), round(args.per_batch * f)
        warm, timed = c.batches_from_stream(replicas, args.capacity, 16, per_batch, args.scale_events)
        n_timed = sum(map(c.block_events, timed))
        msgs = [encode_batch(b) for b in timed]
        del timed
        shard = ModelShard(c.MODEL, 16)
        for b in warm:
            shard.apply(b, 0.0)
        del warm
        blocks, entries = c.shard_entries(shard)
        snap = encode_snapshot(shard)
        best = 0.0
        for _ in range(2):
            shard = decode_snapshot(snap)
            c.collect()
            t = time.perf_counter()
            for m in msgs:
                shard.apply(decode_batch(m), 1.0)
            best = max(best, n_timed / (time.perf_counter() - t))
        load = f"{replicas} replicas x {per_batch} blocks/batch, warm shard {entries / 1e6:.2f}M entries"
        c.log(f"  scale {f:g}x: {load}: {best:,.0f} blocks/s ({n_timed:,} block events, "
              f"{blocks:,} blocks)")
        figs.scale("fold decode_batch+apply", f, load, best, "blocks/s", f">= {TARGET}")


class _CapturingEngine(SimVllmEngine):
    """The simulated vLLM engine's block pool and wire format; payloads are kept, not sent."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.payloads: list[tuple[int, bytes]] = []

    def _publish(self, payload: bytes) -> int:
        seq = self._seq
        self._seq += 1
        self.payloads.append((seq, payload))
        return seq


def _prompt(n_in: int, ids: list[int]) -> list[int]:
    keys = (np.asarray(ids, dtype=np.uint64)[:, None] * np.uint64(c.TRACE_BLOCK)
            + np.arange(c.TRACE_BLOCK, dtype=np.uint64)).ravel()[:n_in]
    return (c.mix64(keys) % np.uint64(150_000)).tolist()


def bench_relay(args, figs: c.Figures) -> None:
    bs = args.engine_block_size
    c.log(f"relay: simulating {args.relay_replicas} vLLM engines (block size {bs}, "
          f"{args.engine_blocks:,} blocks each) over {args.relay_requests:,} trace requests ...")
    t = time.perf_counter()
    trace = c.load_trace(args.relay_requests)
    rng = np.random.default_rng(3)
    engines = [_CapturingEngine(args.engine_blocks, bs, endpoint="tcp://127.0.0.1:*", dp_rank=0)
               for _ in range(args.relay_replicas)]
    max_tokens = args.engine_blocks * bs // 2
    try:
        for (n_in, ids), r in zip(trace, rng.integers(0, len(engines), len(trace)).tolist(), strict=True):
            n_in = min(n_in, max_tokens)
            engines[r].serve(_prompt(n_in, ids), rng.integers(0, 150_000, 32).tolist())
    finally:
        streams = [e.payloads for e in engines]
        for e in engines:
            e.close()
    payloads = [p for s in streams for _, p in s]
    n_engine = 0
    for p in payloads:
        for ev in decode_payload(p).events:
            if isinstance(ev, BlockStored | BlockRemoved):
                n_engine += len(ev.block_hashes)
    n_bytes = sum(map(len, payloads))
    c.log(f"  {len(payloads):,} payloads, {n_engine:,} engine block events, {n_bytes / 1e6:.1f} MB "
          f"({n_bytes / n_engine:.0f} B/block event) in {time.perf_counter() - t:.1f}s")

    dec = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        for p in payloads:
            decode_payload(p)
        dec.append(n_engine / (time.perf_counter() - t))
    c.log(f"  decode_payload alone: {max(dec):,.0f} engine blocks/s")

    runs, runs_enc, n_index = [], [], 0
    for i in range(min(args.repeat, 2)):
        for with_encode in (False, True):
            relays = [VllmPublisherRelay(c.MODEL, f"replica-{r}", args.index_block_size, epoch=1)
                      for r in range(len(streams))]
            frames = [[Frame(b"kv", seq, p, 0) for seq, p in s] for s in streams]
            c.collect()
            n_out = 0
            t = time.perf_counter()
            for relay, fs in zip(relays, frames, strict=True):
                on_frame = relay.on_frame
                for f in fs:
                    out = on_frame(f)
                    if with_encode:
                        for b in out.batches:
                            encode_batch(b)
                    elif i == 0:
                        n_out += sum(map(c.block_events, out.batches))
            dt = time.perf_counter() - t
            (runs_enc if with_encode else runs).append(n_engine / dt)
            if not with_encode and i == 0:
                n_index = n_out
                dead = sum(r.mirror.stats["orphan_blocks"] for r in relays)
                c.log(f"  relay out: {n_index:,} index block events ({dead} orphan blocks)")
        c.log(f"  run {i + 1}: on_frame {runs[-1]:,.0f} engine blocks/s, "
              f"+encode_batch {runs_enc[-1]:,.0f}")
    if args.profile:
        _profile_relay(streams, args)
    ratio = n_index / n_engine if n_engine else 0
    note = f"engine block size {bs}, index block size {args.index_block_size}"
    figs.add("relay decode_payload alone, engine block events/s", max(dec), "blocks/s", "", note)
    figs.add("relay on_frame (decode+mirror+hash), engine block events/s", max(runs), "blocks/s",
             f">= {TARGET}", note)
    figs.add("relay on_frame + encode_batch, engine block events/s", max(runs_enc), "blocks/s", "",
             f"{ratio:.2f} index block events per engine block event")


def _profile_relay(streams: list[list[tuple[int, bytes]]], args) -> None:
    """One more on_frame pass under cProfile; the per-function table goes to --profile."""
    import cProfile
    import io
    import pstats

    relays = [VllmPublisherRelay(c.MODEL, f"replica-{r}", args.index_block_size, epoch=1)
              for r in range(len(streams))]
    frames = [[Frame(b"kv", seq, p, 0) for seq, p in s] for s in streams]
    prof = cProfile.Profile()
    prof.enable()
    for relay, fs in zip(relays, frames, strict=True):
        for f in fs:
            relay.on_frame(f)
    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(25)
    with open(args.profile, "w") as f:
        f.write(buf.getvalue())
    c.log(f"  relay profile (cProfile) written to {args.profile}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CI-size run (a few seconds)")
    p.add_argument("--events", type=int, default=3_000_000, help="timed block events (fold)")
    p.add_argument("--replicas", type=int, default=64)
    p.add_argument("--capacity", type=int, default=16384, help="blocks cached per replica (fold)")
    p.add_argument("--per-batch", type=int, default=64, help="block events per EventBatch")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--relay-requests", type=int, default=700, help="trace requests for the relay part")
    p.add_argument("--relay-replicas", type=int, default=8)
    p.add_argument("--engine-block-size", type=int, default=16)
    p.add_argument("--index-block-size", type=int, default=16)
    p.add_argument("--engine-blocks", type=int, default=16384, help="KV blocks per simulated engine")
    p.add_argument("--skip-relay", action="store_true")
    p.add_argument("--profile", help="write a cProfile table of one relay on_frame pass to this file")
    p.add_argument("--scale", default="", help="comma-separated load factors for the scaling series "
                   "(e.g. 1,2,4: x replicas and x block events per batch); empty: none")
    p.add_argument("--scale-events", type=int, default=1_000_000, help="timed block events per factor")
    p.add_argument("--json", nargs="?", const="-", help="end with one JSON line of the production fold's "
                   "figures ({plain_compiled, production_compiled, production_python}, block events/s); with "
                   "a path, also write every figure to that file")
    p.add_argument("--skip-production", action="store_true", help="no production-fold comparison")
    args = p.parse_args(argv)
    if args.quick:
        args.events, args.capacity, args.repeat, args.relay_requests = 300_000, 2048, 1, 200
        args.engine_blocks, args.scale_events = 4096, 200_000
    args.scale = c.parse_scale(args.scale)
    figs = c.Figures("fold")
    bench_worker_fold(args, figs)
    production = None
    if not args.skip_production:
        c.log("production fold: the same stream with routes, a host tier and partial-block keys ...")
        production = bench_production_fold(args, figs)
    if args.scale:
        c.log(f"fold scaling: x{', x'.join(f'{f:g}' for f in args.scale)} "
              f"({args.scale_events:,} events each)")
        bench_fold_scaling(args, figs)
    if not args.skip_relay:
        bench_relay(args, figs)
    figs.write(None if args.json == "-" else args.json)
    if args.json and production is not None:
        print(json.dumps({k: round(v) for k, v in production.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
