"""What agentpool needs of the Redis server that a connection alone does not prove, read from INFO
(allowed where a managed Redis disables CONFIG).

An evicting ``maxmemory-policy`` is the one setting that silently breaks the guarantee: under memory
pressure Redis deletes keys, and a deleted ledger intent lets an unsafe tool run twice, a deleted
lease lets a second worker in, a deleted job loses a turn. Managed Redis often ships with one
(``volatile-lru``). Workers say so when they start; ``agentpool check --strict`` fails on it.
"""

from __future__ import annotations

from redis import Redis
from redis.exceptions import ResponseError


def hazards(r: Redis) -> list[str]:
    """One sentence per server setting that puts runs at risk, or that could not be checked; empty
    when there is none. Connection errors are the caller's (it just reached the server)."""
    found = []
    try:
        memory = r.info("memory")
        cluster = r.info("cluster")
    except ResponseError as exc:  # an ACL user without INFO (it is in @dangerous)
        refused = (
            f"cannot check the server's maxmemory-policy: INFO was refused ({exc}); make sure it is noeviction, "
            "or grant this user +info so that workers and `agentpool check` can"
        )
        return [refused]
    policy = str(memory.get("maxmemory_policy", "noeviction"))
    maxmemory = int(memory.get("maxmemory", 0) or 0)
    if policy != "noeviction" and maxmemory > 0:
        found.append(
            f"Redis evicts keys under memory pressure (maxmemory-policy {policy}, maxmemory {maxmemory} bytes): "
            "an evicted ledger intent lets an unsafe tool run twice and an evicted run is lost; "
            "set maxmemory-policy noeviction (deploy/README.md, 'Redis durability')"
        )
    if cluster.get("cluster_enabled"):
        found.append(
            "Redis runs in cluster mode, which agentpool does not support (a save touches a run's keys and "
            "the global indexes in one script); use one primary with replicas (docs/high-availability.md), "
            "or several primaries as shards (AGENTPOOL_SHARDS, docs/sharding.md)"
        )
    return found
