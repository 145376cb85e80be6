"""A sharded pool when one shard does not answer, and where runs go: two real redis-servers and a
third shard whose port nobody listens on. The runs on the shards that answer stay readable from the
API, the CLI, the dashboard and the metrics, each saying which shard is missing; nothing is reported
missing, or made twice, because a shard was silent. A concurrency key's runs share one shard whatever
their ids, and the dashboard forks on its parent's shard."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq.job import Job
from test_shards import cli

from agentpool import RedisUnreachable, Shards, enqueue_run, get_run, list_runs
from agentpool.ops.metrics import registry_for
from agentpool.runtime.shards import rendezvous, rule
from agentpool.store.keys import RUNS_WATCH, RunKeys
from agentpool.testing.localpool import RedisServer, free_port
from agentpool.testing.netfault import NetFault

from conftest import ROOT, _redis_server
from test_dashboard import dashboard_process, expect

AGENT = "pool_agents:support"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisServer]]:
    started = [_redis_server(tmp_path_factory.mktemp(f"shard{n}")).start() for n in range(2)]
    yield started
    for server in started:
        server.stop()


@pytest.fixture
def live(servers: list[RedisServer]) -> list[str]:
    """The two shards that answer, emptied."""
    for server in servers:
        with Redis.from_url(server.url) as client:
            client.flushall()
    return [server.url for server in servers]


def holders(urls: list[str], run_id: str) -> list[int]:
    found = []
    for n, url in enumerate(urls):
        with Redis.from_url(url) as client:
            if client.exists(RunKeys.of(run_id).run):
                found.append(n)
    return found


def with_a_silent_shard(live: list[str]) -> tuple[Shards, str]:
    """The two live shards and a third that refuses connections, as clients that fail at once."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    clients = [Redis.from_url(url, socket_connect_timeout=2) for url in (*live, dead)]
    return Shards(clients), dead


def test_a_concurrency_keys_runs_go_to_its_shard_whatever_their_ids(live):
    """The key's cap is counted on one shard: runs given ids of their own used to go where their ids
    hash, and a key spread over two shards let twice its limit run."""
    pool = Shards(live)
    home = rendezvous("ckey:acme", 2)
    ids = [f"order-{i}" for i in range(12)]
    assert {rule(run_id, 2) for run_id in ids} == {0, 1}, "by their ids alone they would spread"
    made = [
        enqueue_run(AGENT, "t", run_id=run_id, concurrency_key="acme", max_concurrency=1, connection=pool)
        for run_id in ids
    ]
    assert made == ids and all(holders(live, run_id) == [home] for run_id in ids)
    assert {get_run(run_id, connection=pool).status for run_id in ids} == {"queued"}
    again = [
        enqueue_run(AGENT, "t", run_id=run_id, concurrency_key="acme", max_concurrency=1, connection=pool)
        for run_id in ids
    ]
    assert again == ids and all(holders(live, run_id) == [home] for run_id in ids), "idempotent where they are"


@pytest.mark.parametrize("down", ["refused", "silent"])
def test_with_a_shard_down_the_api_reads_the_runs_of_the_others_and_makes_none_twice(live, down):
    """``refused``: nothing listens on its port. ``silent``: a partitioned link, whose connections are
    accepted and never answered (a lost node, a dropped conntrack entry): only a socket timeout ends a
    call to it."""
    made = [enqueue_run(AGENT, "t", run_id=f"order-{i}", connection=Shards(live)) for i in range(24)]
    with ExitStack() as stack:
        if down == "refused":
            pool, _dead = with_a_silent_shard(live)
        else:
            link = stack.enter_context(NetFault.to(live[0]))
            link.partition()
            hung = Redis.from_url(link.url, socket_timeout=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
            pool = Shards([*(Redis.from_url(url) for url in live), hung])
        _a_shard_down(live, pool, made)


def _a_shard_down(live: list[str], pool: Shards, made: list[str]) -> None:
    asked_first = [run_id for run_id in made if rule(run_id, 3) == 2][:3]
    assert asked_first, "some ids name the silent shard first"
    for run_id in asked_first:  # found on the shard that holds it, past the silent one
        assert get_run(run_id, connection=pool).status == "queued"
    # A run no answering shard holds may be on the silent one: that is said, never "no such run".
    with pytest.raises(RedisUnreachable, match="shard 2 .*which may hold run nowhere-1"):
        get_run("nowhere-1", connection=pool)
    # An enqueue of an id of yours cannot know it is new: it refuses rather than risk a second run.
    fresh = next(f"new-{i}" for i in range(100) if rule(f"new-{i}", 3) != 2)
    with pytest.raises(RedisUnreachable, match="shard 2"):
        enqueue_run(AGENT, "t", run_id=fresh, connection=pool)
    assert holders(live, fresh) == []
    # A list short of a shard's runs would mislead an app: it gets all of them or an error.
    with pytest.raises(RedisUnreachable, match="shard 2 "):
        list_runs(connection=pool)
    # Enqueued again, a run that exists is found and left as it is.
    assert enqueue_run(AGENT, "t", run_id=asked_first[0], connection=pool) == asked_first[0]


def test_with_a_shard_down_the_cli_dashboard_and_metrics_show_the_others_and_name_it(live, tmp_path, browser):
    # One pool object: new runs go round its shards (a fresh object per run starts at a random shard:
    # all six on one, 1 time in 32).
    both = Shards(live)
    made = [enqueue_run(AGENT, "t", connection=both) for _ in range(6)]
    assert {run_id[-3:] for run_id in made} == {"-s0", "-s1"}
    pool, dead = with_a_silent_shard(live)
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["AGENTPOOL_SHARDS"] = " ".join([*live, dead])

    listed = cli(env, "runs")
    assert listed.returncode == 1, "a partial list is not a success"
    assert all(run_id in listed.stdout for run_id in made), listed.stdout
    assert "shard 2" in listed.stderr and "did not answer" in listed.stderr, listed.stderr
    shown = cli(env, "show", made[0])
    assert shown.returncode == 0 and made[0] in shown.stdout, shown.stderr
    reaped = cli(env, "reap", "--once")
    assert reaped.returncode == 1 and "not reaped" in reaped.stderr and dead.split("//")[1] in reaped.stderr, (
        reaped.stdout,
        reaped.stderr,
    )

    with dashboard_process(env, tmp_path) as board:
        page = board.get("/api/runs?limit=100")
        assert sorted(row["id"] for row in page["runs"]) == sorted(made)
        (missing,) = page["unavailable"]
        assert missing.startswith("shard 2 (") and "refused" in missing.lower(), missing
        context = browser.new_context()
        try:  # the page lists the others' runs and says which shard it could not read
            tab = context.new_page()
            tab.set_default_timeout(60_000)
            tab.goto(board.base + "/")
            expect(tab.locator(f'#runs-table tr[data-run-id="{made[0]}"]')).to_be_visible()
            expect(tab.locator("#conn")).to_have_text("1 shard unavailable")
            expect(tab.locator("#runs-summary")).to_contain_text("did not answer: shard 2 (")
        finally:
            context.close()
        # A fork from the page goes to its parent's shard, with that shard's ending, and a fork_id
        # taken on another shard is refused there rather than made a second time.
        parent = next(run_id for run_id in made if run_id.endswith("-s1"))
        status, forked = board.request("POST", f"/api/runs/{parent}/fork", {})
        assert status == 200 and forked["run_id"].endswith("-s1") and holders(live, forked["run_id"]) == [1], forked
        taken = next(run_id for run_id in made if run_id.endswith("-s0"))
        status, refused = board.request("POST", f"/api/runs/{parent}/fork", {"fork_id": taken})
        assert status == 409 and "shard 0" in refused["error"], refused
        assert holders(live, taken) == [0]

    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(registry_for(pool)).decode())
        for s in family.samples
    }
    assert samples[("agentpool_redis_up", ())] == 0
    assert [samples[("agentpool_shard_up", (("shard", str(n)),))] for n in range(3)] == [1, 1, 0]
    runs_by_shard = {
        labels: value for (name, labels), value in samples.items() if name == "agentpool_shard_runs_active"
    }
    assert {dict(labels)["shard"] for labels in runs_by_shard} == {"0", "1"}, "each shard that answered, by its number"
    assert not any(name == "agentpool_turns_total" for name, _ in samples), "no pool-wide sum missing a shard"


def test_the_reap_loop_repairs_the_shards_that_answer_while_the_first_one_does_not(live):
    """`agentpool reap` (the loop) with a shard nobody listens on listed first: that shard's client rides
    out ~15 s of retries at every scan, and a loop over the shards in turn made every other shard wait
    for them. Each shard has a thread of its own now: a run of a live shard whose job was lost is
    re-enqueued within seconds, while the dead shard is still being retried."""
    run_id = enqueue_run(AGENT, "t", connection=Shards(live))
    shard = Redis.from_url(live[holders(live, run_id)[0]])
    shard.delete(Job.key_for(shard.hget(RunKeys.of(run_id).run, "job").decode()))  # a flushed job
    shard.zadd(RUNS_WATCH, {run_id: 0})
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["AGENTPOOL_SHARDS"] = " ".join([f"redis://127.0.0.1:{free_port()}/0", *live])
    reaper = subprocess.Popen(
        [sys.executable, "-m", "agentpool", "reap", "--interval", "0.2"],
        env=env,
        cwd=str(ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reading = threading.Thread(target=lambda: [lines.put(line) for line in reaper.stdout], daemon=True)
    reading.start()
    seen = []
    try:
        deadline = time.monotonic() + 12  # under the dead shard's first round of retries
        while not any(run_id in line and "re-enqueued" in line for line in seen):
            assert time.monotonic() < deadline, seen
            try:
                seen.append(lines.get(timeout=0.5))
            except queue.Empty:
                pass
    finally:
        reaper.kill()
        reaper.wait(timeout=30)
        reading.join(timeout=30)  # to the pipe's end
        reaper.stdout.close()
    assert shard.hget(RunKeys.of(run_id).run, "requeues") == b"1"
    shard.close()
