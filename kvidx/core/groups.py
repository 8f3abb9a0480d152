"""Replica groups: how one model's index is split so that no process has to hold or fold all of it.

A model with G replica groups is G shards: a replica (all its DP ranks) belongs to exactly one group,
so each group's events stay ordered under one Kafka key (`shard_key`) and the groups spread over the
events topic's partitions and the workers that own them. A lookup over several groups merges their
per-replica answers: replicas never span groups, so nothing is counted twice.

A replica's group: the deployment's explicit map where it names the replica (topology-aware
placement), else the group of the shared pool it reads (a pool and its readers must be in one shard:
pool credit is a mask over that shard's slots), else a stable hash of its name (xxh3-64, the same in
every process and release). G = 1 (the default) is today's layout: one shard per model, key = model.
Pure: no I/O.
"""

from __future__ import annotations

import re

import xxhash

KEY_SEP = "#"  # shard key of group g > 0: f"{model}#{g}"; group 0's key is the model's name


def shard_key(model: str, group: int) -> str:
    """The Kafka key (and snapshot name) of one group of a model's index. Group 0 keeps the model's
    own name: a model that never had groups, or that grows them, keeps its first shard."""
    return model if group == 0 else f"{model}{KEY_SEP}{group}"


_GROUP_IN_KEY = re.compile(r"#(\d+)(?:/|$)")


def key_group(key: str) -> int:
    """The replica group of a shard key, or of a snapshot key under it (`model#2/manifest` -> 2,
    `model/manifest` -> 0)."""
    m = _GROUP_IN_KEY.search(key)
    return int(m.group(1)) if m else 0


def hashed_group(replica: str, groups: int) -> int:
    """A replica's group by a stable hash of its name (the same in every process)."""
    return xxhash.xxh3_64_intdigest(replica.encode()) % groups if groups > 1 else 0


def replica_group(replica: str, groups: int, placement: dict[str, int] | None = None,
                  pool_of: dict[str, str] | None = None) -> int:
    """The group of `replica` in a model of `groups` groups: its explicit `placement`, else the group
    of the pool it reads (`pool_of`: reader -> pool name), else `hashed_group`."""
    if groups <= 1:
        return 0
    if placement:
        g = placement.get(replica)
        if g is not None:
            return g
    if pool_of:
        pool = pool_of.get(replica)
        if pool is not None:
            return replica_group(pool, groups, placement)
    return hashed_group(replica, groups)


def parse_groups(spec: str, what: str = "--groups") -> frozenset[int]:
    """`--groups 0,2` -> {0, 2}; ValueError naming `what` (the option or parameter) and what is wrong."""
    out = set()
    for part in spec.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ValueError(f"{what} takes group numbers separated by commas (e.g. 0,2), not {spec!r}")
        out.add(int(part))
    return frozenset(out)
