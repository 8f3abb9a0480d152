"""The partial service instances of a `kvidx simulate --kafka --service-instances N` run, measured as
real processes once the run is over: one `kvidx serve --groups ...` per instance, on the run's broker
and topics, each rebuilding its groups from the topics as a deployed instance would. For each: its
resident memory (`rss_bytes`, from /proc) once its index equals the in-process instance's (distinct
blocks per model and group, read from its /metrics); then the run's last lookups sent to the
processes in turn over HTTP (the binary form, as kvidx.client sends it), each answered by one
instance and the instances it fans out to, timed, and compared with the full in-process index's
answer (per replica, without freshness or price: the processes saw no usage reports or routes, and
the comparison is made after every route's pending credit expired).
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np

from kvidx.client import KvidxClient, UnknownModel
from kvidx.config import Config
from schemas.answers import ReplicaAnswer

ROOT = Path(__file__).resolve().parents[2]
Answers = Callable[[str, np.ndarray], list[ReplicaAnswer]]  # (model, prompt) -> per-replica answers
_BLOCKS = re.compile(r'^kvidx_index_blocks\{group="(\d+)",model="([^"]*)"\} (\S+)$', re.M)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _index_blocks(url: str) -> dict[tuple[str, int], int] | None:
    """(model, group) -> distinct blocks, from the instance's /metrics; None until it is ready."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
    if "kvidx_ready 1.0" not in text:
        return None
    return {(m, int(g)): int(float(v)) for g, m, v in _BLOCKS.findall(text)}


def answer_key(answers: Sequence[ReplicaAnswer]) -> list:
    """An answer's per-replica credit, in a stable order: what the processes and the in-process index
    must agree on (freshness and price depend on when and what else each one saw)."""
    out = []
    for a in answers:
        d = msgspec.to_builtins(a)
        for k in ("freshness", "price"):
            d.pop(k, None)
        out.append(d)
    return sorted(out, key=lambda d: (-d["resumable_tokens"], d["replica"], d["dp_rank"]))


def census(bootstrap: str, topic_prefix: str, config: Config, index_block: int,
           held: Sequence[frozenset[int]], expected: Sequence[dict[tuple[str, int], int]],
           prompts: Sequence[tuple[str, np.ndarray]], full: Answers, timeout_s: float = 120.0
           ) -> dict[str, Any]:
    """`held[i]`: the groups of instance i; `expected[i]`: its in-process index, (model, group) ->
    distinct blocks; `full(model, prompt)`: the full index's answer. Raises RuntimeError (with the
    process's log) when an instance does not reach its expected index within `timeout_s`."""
    tmp = Path(tempfile.mkdtemp(prefix="kvidx-sim-census-"))
    conf = tmp / "config.json"
    conf.write_bytes(msgspec.json.encode(config))
    procs: list[tuple[subprocess.Popen, str, Path]] = []
    try:
        for i, groups in enumerate(held):
            port = _free_port()
            log = tmp / f"serve{i}.log"
            cmd = [sys.executable, "-m", "kvidx.cli", "serve", "--bootstrap", bootstrap, "--topic-prefix",
                   topic_prefix, "--config", str(conf), "--index-block-size", str(index_block), "--groups",
                   ",".join(map(str, sorted(groups))), "--port", str(port), "--log-level", "warning"]
            with open(log, "w") as out:  # `-m` from the repository's root: this checkout's kvidx
                p = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
            procs.append((p, f"http://127.0.0.1:{port}", log))
        deadline = time.monotonic() + timeout_s
        for (p, url, log), want in zip(procs, expected, strict=True):
            while (got := _index_blocks(url)) is None or {k: v for k, v in got.items() if v} != want:
                if p.poll() is not None or time.monotonic() > deadline:
                    tail = log.read_text()[-2000:]
                    raise RuntimeError(f"service instance {url} did not reach the run's index (last seen "
                                       f"{got}, expected {want}):\n{tail}")
                time.sleep(0.2)
        instances = [{"groups": sorted(g), "rss_bytes": _rss(p.pid)}
                     for (p, _, _), g in zip(procs, held, strict=True)]
        urls = [u for _, u, _ in procs]
        return {"instances": instances, **_fanout_over_http(urls, prompts, full, deadline)}
    finally:
        for p, _, _ in procs:
            p.terminate()
        for p, _, _ in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)  # an instance's log is in the error that needed it


def _fanout_over_http(urls: list[str], prompts: Sequence[tuple[str, np.ndarray]], full: Answers,
                      deadline: float) -> dict[str, Any]:
    clients = [KvidxClient(u, timeout=10) for u in urls]
    try:
        # the instances find each other on the instances topic: wait until a lookup is whole everywhere
        probe = next(iter(prompts), None)
        while probe is not None and any(_partial(c, *probe) for c in clients):
            if time.monotonic() > deadline:
                raise RuntimeError("the service instances did not find each other on the instances topic")
            time.sleep(0.2)
        us, mismatches, partial = [], 0, 0
        for i, (model, prompt) in enumerate(prompts):
            c = clients[i % len(clients)]
            t0 = time.perf_counter()
            try:
                ans = c.lookup(model, token_ids=prompt.astype("<u4").tobytes())
                replicas, partial = ans.replicas, partial + ans.partial
            except UnknownModel:
                replicas = []
            us.append((time.perf_counter() - t0) * 1e6)
            mismatches += answer_key(replicas) != answer_key(full(model, prompt))
        a = np.asarray(us or [0.0])
        return {"fanout_http_lookup_us": {"p50": round(float(np.percentile(a, 50)), 1),
                                          "p99": round(float(np.percentile(a, 99)), 1)},
                "fanout_http_lookups": len(us), "fanout_http_mismatches": mismatches,
                "fanout_http_partial": partial}
    finally:
        for c in clients:
            c.close()


def _partial(client: KvidxClient, model: str, prompt: np.ndarray) -> bool:
    try:
        return client.lookup(model, token_ids=prompt.astype("<u4").tobytes()).partial
    except UnknownModel:
        return False
