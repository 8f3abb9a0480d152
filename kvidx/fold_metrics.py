"""The compiled fold's counters (kvidx.core.shard.NATIVE_FOLD) as Prometheus families, read at scrape
time: the worker's registry and the lookup service's show the same two, under their own prefixes."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily

from kvidx.core.shard import NATIVE_FOLD


def compiled_fold_families(prefix: str) -> Iterator[CounterMetricFamily]:
    """`{prefix}_fold_compiled_batches_total` and `{prefix}_fold_reference_batches_total{reason}`;
    nothing where the compiled core is not built."""
    if NATIVE_FOLD is None:
        return
    yield CounterMetricFamily(f"{prefix}_fold_compiled_batches", "Event batches (redeliveries included) "
                              "the compiled fold took; the rest: the Python fold", value=NATIVE_FOLD.folded)
    declined = CounterMetricFamily(
        f"{prefix}_fold_reference_batches", "Event batches of compiled shards the compiled fold handed to "
        "the Python fold, by reason: new_replica (its first batch), new_group_or_tier (a store into one "
        "the shard does not have yet), future_epoch, other (a field of another type than the schema's)",
        labels=["reason"])
    for reason, n in NATIVE_FOLD.declines.items():
        declined.add_metric([reason], n)
    yield declined
