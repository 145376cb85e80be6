"""Run records that do not decode (damaged, or written by a newer agentpool during a rolling deploy):
each read of that run says why in an agentpool error, every other run stays listed and readable, and
nothing is written to the damaged record. Real Redis, the real CLI."""

from __future__ import annotations

import pytest
from redis import Redis
from test_usability import agentpool_cli

from agentpool import Shards, enqueue_run, get_run, list_runs
from agentpool.ops.cli import _describe
from agentpool.store.codec import pack
from agentpool.store.errors import SchemaTooNew, UnreadableRecord
from agentpool.store.keys import RunKeys
from agentpool.store.records import SCHEMA_VERSION

# Shapes that decode as msgpack but are not what agentpool writes, each by the field it lands in.
DAMAGE = {
    "pending-int": ("run", "pending", pack(7)),
    "pending-no-value": ("run", "pending", pack({"x": 1})),
    "pending-no-name": ("run", "pending", pack({"plain": [{"id": "toolu_1", "input": {}}]})),
    "content-int": ("messages", 0, pack({"v": SCHEMA_VERSION, "role": "user", "content": 5})),
    "tool-use-no-name": (
        "messages",
        0,
        pack({"v": SCHEMA_VERSION, "role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1"}]}),
    ),
}
HEADER_DAMAGE = {"pending-int", "pending-no-value", "pending-no-name"}  # what a listing (headers only) meets


def damage(r: Redis, run_id: str, where: str, field: str | int, blob: bytes) -> None:
    keys = RunKeys.of(run_id)
    if where == "run":
        r.hset(keys.run, field, blob)
    else:
        r.lset(keys.messages, field, blob)


def snapshot(r: Redis, run_id: str) -> dict[str, bytes | None]:
    keys = RunKeys.of(run_id)
    return {key: r.dump(key) for key in (keys.run, keys.messages)}


def test_a_record_of_the_wrong_shape_is_unreadable_and_every_other_run_stays_listed(r, redis_server):
    good = enqueue_run("pool_agents:support", "a good run", connection=r, run_id="good-1")
    for name, (where, field, blob) in DAMAGE.items():
        enqueue_run("pool_agents:support", f"to be damaged: {name}", connection=r, run_id=name)
        damage(r, name, where, field, blob)
    before = {name: snapshot(r, name) for name in DAMAGE}

    listed = {run.id: run for run in list_runs(connection=r)}
    assert set(listed) == {good, *DAMAGE}, "one bad record takes no other run off the list"
    assert listed[good].status == "queued"
    for name in DAMAGE:
        # A damaged message is not read by a listing (headers only); a damaged header is listed as such.
        assert listed[name].status == ("unreadable" if name in HEADER_DAMAGE else "queued"), name
        with pytest.raises(UnreadableRecord):
            get_run(name, connection=r)

    out = agentpool_cli("runs", url=redis_server.url)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:] if line.strip()}
    assert set(rows) == {good, *DAMAGE}
    assert "unreadable" in rows["pending-no-name"] and "cannot read it here: " in rows["pending-no-name"]
    for name in DAMAGE:
        shown = agentpool_cli("show", name, url=redis_server.url)
        assert shown.returncode == 1 and "Traceback" not in shown.stderr, shown.stderr
        assert shown.stderr.startswith("error: ") and len(shown.stderr.strip().splitlines()) == 1, shown.stderr
    assert {name: snapshot(r, name) for name in DAMAGE} == before, "the damaged records are left as found"


def test_a_run_from_a_newer_agentpool_is_listed_as_unreadable_saying_why(r, redis_server):
    """During a rolling deploy, newer workers write newer records: an older app or CLI lists them (their
    agent, queue and why they cannot be read here) instead of leaving them out."""
    good = enqueue_run("pool_agents:support", "a good run", connection=r, run_id="good-1")
    newer = enqueue_run("pool_agents:support", "from a newer agentpool", connection=r, run_id="newer-1", queue="urgent")
    r.hset(RunKeys.of(newer).run, "v", SCHEMA_VERSION + 1)

    listed = {run.id: run for run in list_runs(connection=r)}
    assert set(listed) == {good, newer}
    run = listed[newer]
    assert (run.status, run.agent, run.queue) == ("unreadable", "pool_agents:support", "urgent")
    assert f"schema version {SCHEMA_VERSION + 1}" in run.error
    assert run.created_at > 0 and run.to_dict()["status"] == "unreadable"
    assert [run.id for run in list_runs(connection=r, status="unreadable")] == [newer]
    assert [run.id for run in list_runs(connection=r, status="queued")] == [good], "a status filter means that status"
    assert [run.id for run in list_runs(connection=r, agent="support", status="unreadable")] == [newer]
    with pytest.raises(SchemaTooNew):
        get_run(newer, connection=r)

    out = agentpool_cli("runs", url=redis_server.url)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith(newer))
    assert "unreadable" in row and f"cannot read it here: was written with schema version {SCHEMA_VERSION + 1}" in row
    only = agentpool_cli("runs", "--status", "unreadable", url=redis_server.url)
    assert only.returncode == 0 and [line.split()[0] for line in only.stdout.splitlines()[1:]] == [newer]


def test_a_bad_record_on_one_shard_leaves_every_shard_listed(r, redis_server):
    base = redis_server.url.rsplit("/", 1)[0]
    pool = Shards([f"{base}/0", f"{base}/1"])
    made = [enqueue_run("pool_agents:support", f"run {n}", connection=pool) for n in range(6)]
    bad = made[0]
    home = pool.clients[int(bad.rsplit("-s", 1)[1])]  # the shard its id names
    home.hset(RunKeys.of(bad).run, "pending", pack({"plain": [{"id": "toolu_1"}]}))
    listed = {run.id: run.status for run in list_runs(connection=pool)}
    assert set(listed) == set(made) and listed[bad] == "unreadable"
    with pytest.raises(UnreadableRecord):
        get_run(bad, connection=pool)


def test_show_prints_content_of_any_shape():
    """``show`` is what a person runs on a damaged run: it prints what it finds, whatever its shape."""
    assert _describe(5) == ["(unexpected content: 5)"]
    lines = _describe(
        ["not a block", {"type": "tool_use", "id": "toolu_1"}, {"type": "text", "text": 3}, {"type": "tool_result"}]
    )
    assert lines == ["(unexpected block: 'not a block')", "-> ?(null)  [toolu_1]", "3", "<- null  [?]"]
