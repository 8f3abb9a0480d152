"""The lookup service for bench_http.py: a ShardStore restored from a snapshot file, served by uvicorn
(one worker) on 127.0.0.1. Not meant to be run by hand."""

from __future__ import annotations

import argparse
import sys
import time

import _common  # noqa: F401  (puts the project on sys.path)
import uvicorn

from index_service.app import create_app
from index_service.store import ShardStore
from kvidx.core.shard import ModelShard


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--snapshot", required=True)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    t = time.perf_counter()
    with open(args.snapshot, "rb") as f:
        shard = ModelShard.restore(f.read())
    store = ShardStore(shard.block_size)
    store.put(shard)
    store.ready = True
    print(f"[server] restored {shard.model} in {time.perf_counter() - t:.2f}s", flush=True)
    uvicorn.run(create_app(store), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
