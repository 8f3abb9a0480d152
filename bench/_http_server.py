"""The lookup service for bench_http.py: a ShardStore restored from a snapshot file, served by uvicorn
(one worker) on 127.0.0.1. Not meant to be run by hand."""

from __future__ import annotations

import argparse
import signal
import sys
import time

import _common  # noqa: F401  (puts the project on sys.path)

from index_service.app import create_app
from index_service.http_protocol import serve
from index_service.store import ShardStore
from kvidx.core.snapshot import decode_snapshot


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--snapshot", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--profile", help="profile the serving loop; write the report here on shutdown")
    p.add_argument("--profiler", choices=("pyinstrument", "cprofile"), default="pyinstrument")
    args = p.parse_args()
    t = time.perf_counter()
    with open(args.snapshot, "rb") as f:
        shard = decode_snapshot(f.read())
    store = ShardStore(shard.block_size)
    store.put(shard)
    store.ready = True
    print(f"[server] restored {shard.model} in {time.perf_counter() - t:.2f}s", flush=True)
    prof = _start_profiler(args.profiler) if args.profile else None
    # uvicorn re-raises the SIGTERM it caught once it has shut down: turn that into SystemExit so
    # the profile is written below
    signal.signal(signal.SIGTERM, _exit)
    try:
        serve(create_app(store), "127.0.0.1", args.port, log_level="warning")
    finally:
        if prof is not None:
            _write_profile(prof, args.profile)
    return 0


def _exit(*_) -> None:
    raise SystemExit(0)


def _start_profiler(kind: str):
    try:
        if kind != "pyinstrument":
            raise ImportError(kind)
        from pyinstrument import Profiler

        prof = Profiler(interval=0.0005, async_mode="disabled")
    except ImportError:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
        return prof
    prof.start()
    return prof


def _write_profile(prof, path: str) -> None:
    if hasattr(prof, "output_text"):
        prof.stop()
        text = prof.output_text(unicode=False, color=False, show_all=False)
    else:
        import io
        import pstats

        prof.disable()
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        st.dump_stats(path + ".pstats")
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(30)
        text = buf.getvalue()
    with open(path, "w") as f:
        f.write(text)
    print(f"[server] profile written to {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
