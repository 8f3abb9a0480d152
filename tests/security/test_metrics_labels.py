"""/metrics label values a caller could create: per-replica series are capped (the replicas that applied
a batch last), the rest counted; label values are escaped by the exposition format (no forged lines)."""

from __future__ import annotations

import time

import httpx

from index_service import metrics
from index_service.app import create_app
from schemas.events import SCHEMA_VERSION, BlocksStored, EventBatch
from tests.helpers import SEEDED_MODEL, ServerThread, seeded_store


def _series(text: str, name: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(name + "{")]


def test_per_replica_series_are_capped(monkeypatch):
    store = seeded_store(replicas=4)
    monkeypatch.setattr(metrics, "MAX_REPLICA_SERIES", 3)
    newest = "tcp://10.9.9.9:5557\nkvidx_ready 1"  # a name that tries to forge a line of its own
    now = time.time()
    time.sleep(0.01)  # applied after the seeded replicas: the freshest
    store.apply(EventBatch(SCHEMA_VERSION, SEEDED_MODEL, newest, 0, 1, 0, now, now, 16,
                           [BlocksStored("GPU", 0, [11, 12], None, 0)]))
    with ServerThread(create_app(store)) as url:
        text = httpx.get(f"{url}/metrics").text
    blocks = _series(text, "kvidx_replica_blocks")
    assert len(blocks) == 3 and "kvidx_replica_series_omitted 2.0" in text  # 5 replicas, the 3 freshest
    assert any("10.9.9.9" in ln for ln in blocks)
    assert "\nkvidx_ready 1\n" not in text and 'replica="tcp://10.9.9.9:5557\\nkvidx_ready 1"' in text
