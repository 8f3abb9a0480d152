"""Helpers shared by the tests, imported by absolute name (`from tests.helpers import ...`): the repo's
paths and recordings, polling, uvicorn on a loopback port, and a seeded lookup-service store.

Test modules never import each other; what several of them need lives here (or, for the broker tests
alone, in tests/integration/helpers.py; for running `kvidx` commands, in tests/commands.py)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc

from index_service.sglang_indexer import SERVICE
from index_service.sglang_pb import kv_indexer_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
LLAMA = FIXTURES / "vllm-0.32" / "llama_c4"
GEMMA = FIXTURES / "vllm-0.32" / "gemma2_swa"


def wait_for(cond, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll `cond` until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class ServerThread:
    """uvicorn on a free loopback port, in a thread (index_service.http_protocol.InProcessServer)."""

    def __init__(self, app, **config):
        from index_service.http_protocol import InProcessServer

        self.inner = InProcessServer(app, **config)
        self.port, self.server, self.thread = self.inner.port, self.inner.server, self.inner.thread

    def __enter__(self) -> str:
        return self.inner.start(15)

    def __exit__(self, *exc) -> None:
        self.inner.stop()


SEEDED_MODEL = "fuzz-model"
SEEDED_BS = 16


def seeded_store(model: str = SEEDED_MODEL, replicas: int = 4, prompt: list[int] | None = None,
                 engine_ts: float | None = None):
    """A ShardStore with one model whose replicas hold growing prefixes of `prompt` (two tiers), in
    batches stamped `engine_ts` by the engine (default: now), applied now."""
    from index_service.store import ShardStore
    from kvidx.core.hashing import prompt_hashes
    from schemas.events import BlocksStored, EventBatch

    bs = SEEDED_BS
    prompt = prompt if prompt is not None else list(range(1000, 1000 + 40 * bs))
    hashes = prompt_hashes(prompt, bs)
    store = ShardStore(bs)
    now = time.time() if engine_ts is None else engine_ts
    for r in range(replicas):
        n = len(hashes) * (r + 1) // replicas
        gpu, cpu = hashes[:n // 2], hashes[n // 2:n]
        events = [BlocksStored("GPU", 0, gpu, None, 0)]
        if cpu:
            events.append(BlocksStored("CPU", 0, cpu, gpu[-1] if gpu else None, len(gpu)))
        store.apply(EventBatch(1, model, f"tcp://10.0.0.{r}:5557", 0, 1, 0, now, now, bs, events))
    store.ready = True
    return store


TRACE_BT = 32  # tokens per hash id of the Mooncake trace in the fleet simulator's tests: small and fast


def fleet_config(**kw):
    """The fleet simulator's test configuration (4 replicas of one model, no delay, no drops), with
    `kw` overriding."""
    from kvidx.sim.fleet import FleetConfig
    from kvidx.sim.workloads import model_names

    base = dict(models=model_names(1), replicas=4, engine_block=16, index_block=16, num_blocks=1500,
                delay_ms=(0.0, 0.0), drop_rate=0.0, token_scale=TRACE_BT / 512, window_s=30.0)
    base.update(kw)
    return FleetConfig(**base)


class ListSink:
    """A relay sink that keeps what it is given (relays.sinks.Sink): batches and dead letters."""

    def __init__(self):
        self.batches, self.dead = [], []

    def publish(self, batch) -> None:
        self.batches.append(batch)

    def dead_letter(self, dl, model: str, replica: str) -> None:
        self.dead.append(dl)

    def flush(self, timeout: float = 10.0) -> int:
        return 0


def random_fleet(replicas: int, seed: int = 1, groups: int = 1, block_size: int = 16):
    """Batches of a random fleet of model "m" (two KV-cache groups, GPU and CPU tiers, evictions, a
    clear; each replica's batches in order, replicas interleaved; EventBatch.replica_group among
    `groups`) and the prompts (hash chains) to look up."""
    import random

    from kvidx.core.groups import hashed_group
    from schemas.events import SCHEMA_VERSION, BlocksRemoved, BlocksStored, EventBatch, ReplicaCleared

    rng = random.Random(seed)
    docs = [[rng.getrandbits(63) for _ in range(rng.randint(2, 12))] for _ in range(30)]
    batches = []
    for r in range(replicas):
        name = f"replica-{r}"
        held: list[list[int]] = []
        for seq in range(rng.randint(2, 8)):
            events = []
            doc = rng.choice(docs)
            n = rng.randint(1, len(doc))
            tier = "GPU" if rng.random() < 0.8 else "CPU"
            events.append(BlocksStored(tier, 0, doc[:n], None, 0))
            if rng.random() < 0.3:
                events.append(BlocksStored(tier, 1, doc[:n], None, 0, group_kind="sliding_window",
                                           sliding_window=32))
            held.append(doc[:n])
            if held and rng.random() < 0.3:
                gone = rng.choice(held)
                events.append(BlocksRemoved(tier, 0, gone[len(gone) // 2:]))
            if rng.random() < 0.05:
                events.append(ReplicaCleared("engine_cache_reset"))
            t = 1.0 + seq
            batches.append(EventBatch(SCHEMA_VERSION, "m", name, r % 2, 1, seq, t, t, block_size, events,
                                      replica_group=hashed_group(name, groups)))
    order = sorted(range(len(batches)), key=lambda i: rng.random())
    by_replica: dict[str, list[EventBatch]] = {}
    for b in batches:
        by_replica.setdefault(b.replica, []).append(b)
    mixed = []
    cursors = {k: 0 for k in by_replica}
    for i in order:  # a random interleaving that keeps each replica's order
        k = batches[i].replica
        if cursors[k] < len(by_replica[k]):
            mixed.append(by_replica[k][cursors[k]])
            cursors[k] += 1
    for k, lst in by_replica.items():
        mixed += lst[cursors[k]:]
    return mixed, docs


# ---- SGLang's external-indexer gRPC API (index_service/sglang_indexer.py) ----------------------------
class SglangClient:
    """What sgl-router and SGLang's bridge send, over a real gRPC channel."""

    def __init__(self, port: int):
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")

    def call(self, method: str, request, reply_type):
        rpc = self.channel.unary_unary(f"/{SERVICE}/{method}",
                                       request_serializer=lambda m: m.SerializeToString(),
                                       response_deserializer=reply_type.FromString)
        return rpc(request, timeout=10)

    def apply(self, worker: str, actions, address: str | None = None, seq: int = 1):
        address = f"http://{worker}:30000" if address is None else address
        req = pb.ApplyExternalKvBatchRequest(worker_id=worker, seq=seq, actions=actions,
                                             worker_address=address)
        return self.call("ApplyExternalKvBatch", req, pb.ApplyExternalKvBatchResponse)

    def prefix(self, hashes, max_blocks: int = 0) -> pb.MatchExternalKvPrefixResponse:
        req = pb.MatchExternalKvPrefixRequest(hashes=hashes, max_blocks=max_blocks)
        return self.call("MatchExternalKvPrefix", req, pb.MatchExternalKvPrefixResponse)


def sglang_action(kind, tier, hashes=()):
    return pb.ExternalKvAction(type=kind, tier=tier, hashes=list(hashes))


def sglang_matches(resp) -> list[tuple[str, int, str]]:
    return [(m.worker_id, m.matched_prefix_blocks, m.worker_address) for m in resp.matches]


def make_pki(d: Path) -> Path:
    """Test certificates made by openssl in `d`: ca (the deployment's CA), server (127.0.0.1 and
    localhost, for serving and as a client), client (a router's), and stranger (a client certificate
    signed by another CA, other-ca). Each as NAME.crt and NAME.key."""
    import subprocess

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    def signed(name: str, ca: str, extensions: str) -> None:
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}")
        (d / f"{name}.ext").write_text(extensions)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
                "-CAcreateserial", "-days", "2", "-out", f"{name}.crt", "-extfile", f"{name}.ext")

    for ca in ("ca", "other-ca"):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.crt",
                "-days", "2", "-subj", f"/CN=test {ca}")
    signed("server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                           "extendedKeyUsage=serverAuth,clientAuth\n")
    signed("client", "ca", "extendedKeyUsage=clientAuth\n")
    signed("stranger", "other-ca", "extendedKeyUsage=clientAuth\n")
    return d
