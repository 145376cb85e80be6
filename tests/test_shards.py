"""A pool spread over two Redis shards (AGENTPOOL_SHARDS, agentpool.Shards): two real redis-servers, real
workers per shard, real SIGKILLs. Runs spread evenly, survive kills on either shard with no unsafe
effect repeated, and every client reads every run: the API (sync and asyncio, with Shards or from the
environment), the CLI, the dashboard's JSON and the metrics. A child run and a fork stay on their
parent's shard; a caller's own id is found; a bad shard list is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import redis.asyncio as aredis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

import agentpool
import agentpool.aio
from agentpool import Shards, fork_run, get_run, list_runs
from agentpool.ops.metrics import registry_for
from agentpool.runtime.shards import rendezvous, rule
from agentpool.store.children import child_id
from agentpool.store.keys import RunKeys
from agentpool.testing import LocalPool

from conftest import ROOT, TESTS, run_loop, script_task
from pool_agents import effects
from test_dashboard import dashboard_process, expect

pytestmark = pytest.mark.crash

# Read notes, send an email (unsafe: must never go out twice), answer.
EMAIL_RUN = [
    {"tool_calls": [{"name": "read_notes", "input": {"topic": "release"}}]},
    {"tool_calls": [{"name": "send_email", "input": {"to": "ana@example.com", "subject": "s", "body": "b"}}]},
    {"text": "done"},
]
RESEARCH = {
    "orchestrate": [
        {"tool_calls": [{"name": "researcher", "input": {"task": "Look into it [script:research]"}}]},
        {"text": "combined"},
    ],
    "research": [{"tool_calls": [{"name": "read_notes", "input": {"topic": "t"}}]}, {"text": "answer"}],
}


def sharded_pool(tmp_path: Path, env: dict[str, str] | None = None, **options) -> LocalPool:
    return LocalPool(
        shards=2,
        cwd=TESTS,
        env={"AGENTPOOL_TEST_EFFECTS": str(tmp_path / "effects.jsonl"), **(env or {})},
        tool_timeout=2,  # a takeover after a lost worker waits this (+ the margin) before it decides
        takeover_margin=0.5,
        **options,
    )


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentpool", *args],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def shard_env(pool: LocalPool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    return {**env, "AGENTPOOL_SHARDS": " ".join(pool.redis_urls)}


def holder(pool: LocalPool, run_id: str) -> list[int]:
    """The shards whose Redis has the run's header (one, always)."""
    return [n for n in range(2) if pool.shard(n).exists(RunKeys.of(run_id).run)]


def test_runs_spread_over_two_shards_survive_sigkills_and_every_client_reads_them(tmp_path, monkeypatch, browser):
    with sharded_pool(tmp_path, scripts={"default": EMAIL_RUN}, workers=2) as pool:
        plain = [pool.enqueue("pool_agents:support", f"plain {i}") for i in range(6)]
        # Killed in the email tool, after its effect: the work horse alone (an OOM kill; its worker sees it
        # die) and whole workers (a lost machine: the lease expires, the shard's reaper takes over).
        horse = [
            pool.enqueue("pool_agents:support", f"horse {i}", kill_at="in_tool", kill_tool="send_email")
            for i in range(2)
        ]
        whole = [
            pool.enqueue(
                "pool_agents:support", f"whole {i}", kill_at="in_tool", kill_tool="send_email", whole_worker=True
            )
            for i in range(2)
        ]
        mine = pool.enqueue("pool_agents:support", "a caller's own id", run_id="order-1234")
        killed = [pool.killed(run_id, timeout=120) for run_id in horse + whole]
        every = [*plain, *horse, *whole, mine]
        done = {run_id: pool.wait(run_id, timeout=150) for run_id in every}

        assert {run.status for run in done.values()} == {"completed"}, {r: x.status for r, x in done.items()}
        assert {kill.what for kill in killed} == {"in_tool"}
        # Spread evenly (ids made in turn), the horse kills and the whole-worker kills on both shards.
        homes = {run_id: holder(pool, run_id) for run_id in every}
        assert all(len(found) == 1 for found in homes.values()), homes
        generated = Counter(homes[run_id][0] for run_id in plain + horse + whole)
        assert abs(generated[0] - generated[1]) <= 1, generated
        assert {homes[r][0] for r in horse} == {0, 1} and {homes[r][0] for r in whole} == {0, 1}
        assert homes[mine] == [rule("order-1234", 2)], "a caller's id lives where its hash puts it"
        # No email went out twice (each killed one went out once, before its worker died).
        sent = Counter(e["run"] for e in effects(str(tmp_path / "effects.jsonl")) if e["tool"] == "send_email")
        assert sent == Counter(every), sent

        # Every run, from any client: this Shards, another made from URLs, the environment, asyncio.
        listed = list_runs(connection=pool.redis, limit=100)
        assert sorted(run.id for run in listed) == sorted(every), "nothing lost, nothing twice"
        assert [run.created_at for run in listed] == sorted((run.created_at for run in listed), reverse=True)
        other = Shards(pool.redis_urls)
        assert all(get_run(run_id, connection=other).status == "completed" for run_id in every)
        monkeypatch.setenv("AGENTPOOL_SHARDS", " ".join(pool.redis_urls))
        assert agentpool.get_run(mine).result == "done"
        assert len(agentpool.list_runs(limit=3)) == 3

        async def from_asyncio() -> list[str]:
            clients = [aredis.Redis.from_url(url) for url in pool.redis_urls]
            shards = Shards(clients)
            statuses = [(await agentpool.aio.get_run(r, connection=shards)).status for r in every]
            statuses.append((await agentpool.aio.get_run(mine)).status)  # AGENTPOOL_SHARDS's
            for client in clients:
                await client.aclose()
            await agentpool.aio.aclose()
            return statuses

        assert set(run_loop(from_asyncio())) == {"completed"}

        # The CLI, the dashboard's JSON and the metrics, each reading both shards.
        env = shard_env(pool)
        runs = cli(env, "runs", "--limit", "100")
        assert runs.returncode == 0, runs.stderr
        assert all(run_id in runs.stdout for run_id in every), runs.stdout
        for run_id in (horse[0], horse[1], mine):
            shown = cli(env, "show", run_id)
            assert shown.returncode == 0 and "status completed" in shown.stdout, shown.stderr
            assert f"shard {homes[run_id][0]}" in shown.stdout.splitlines()[0]
            watched = cli(env, "watch", run_id, "--events-only")
            assert watched.returncode == 0 and "completed after 3 turns" in watched.stdout, watched.stderr
        checked = cli(env, "check")
        assert checked.returncode == 0 and checked.stdout.strip() == "ok", checked.stderr
        limits = cli(env, "limits", "show")
        assert limits.returncode == 0 and "shard 0 (" in limits.stdout and "shard 1 (" in limits.stdout
        with dashboard_process(env, tmp_path) as board:
            rows = board.get("/api/runs?limit=100")["runs"]
            assert sorted(row["id"] for row in rows) == sorted(every)
            assert all(row["shard"] == homes[row["id"]][0] for row in rows)
            for run_id in (whole[0], whole[1], mine):
                header = board.get(f"/api/runs/{run_id}")["run"]
                assert header["status"] == "completed" and header["shard"] == homes[run_id][0]
            # The page says it too: in the list, and on the run's own page.
            context = browser.new_context()
            try:
                tab = context.new_page()
                tab.set_default_timeout(60_000)
                tab.goto(board.base + "/")
                for run_id in (whole[0], whole[1], mine):
                    shard = tab.locator(f'#runs-table tr[data-run-id="{run_id}"] .shard')
                    expect(shard).to_have_text(f" · shard {homes[run_id][0]}")
                    tab.goto(f"{board.base}/runs/{run_id}")
                    expect(tab.locator("#run-shard")).to_have_text(f"shard {homes[run_id][0]}")
                    tab.goto(board.base + "/")
            finally:
                context.close()
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(generate_latest(registry_for(pool.redis)).decode())
            for s in family.samples
        }
        assert samples[("agentpool_redis_up", ())] == 1
        assert samples[("agentpool_runs", (("status", "completed"),))] == len(every)
        per_shard = [samples[("agentpool_shard_turns_total", (("shard", str(n)),))] for n in (0, 1)]
        assert all(turns > 0 for turns in per_shard)
        assert samples[("agentpool_turns_total", ())] == sum(per_shard)


def test_a_child_run_and_a_fork_stay_on_their_parents_shard(tmp_path):
    with sharded_pool(tmp_path, scripts={**RESEARCH, "default": EMAIL_RUN[2:]}, workers=1) as pool:
        parents = [pool.enqueue("subagent_agents:orchestrator", script_task("orchestrate")) for _ in range(2)]
        for parent in parents:
            done = pool.wait(parent, timeout=120)
            assert done.status == "completed" and done.result == "combined"
            (child,) = done.children
            (call,) = [b for b in done.messages[1]["content"] if b["type"] == "tool_use"]
            assert child == child_id(parent, call["id"])
            assert child.endswith(parent[-3:]), "a child's id ends with its parent's shard"
            assert holder(pool, child) == holder(pool, parent)
            assert get_run(child, connection=pool.redis).status == "completed"
        assert {holder(pool, parent)[0] for parent in parents} == {0, 1}
        for parent in parents:
            fork = fork_run(parent, at_turn=0, connection=pool.redis)
            assert fork.endswith(parent[-3:]) and holder(pool, fork) == holder(pool, parent)
            given = fork_run(parent, at_turn=0, fork_id=f"fork-of-{parent}", connection=pool.redis)
            assert holder(pool, given) == holder(pool, parent), "a fork with a caller's id: its parent's shard too"
            assert get_run(given, connection=Shards(pool.redis_urls)).forked_from == parent


def test_each_shard_holds_an_equal_part_of_the_pools_rate_limit(tmp_path):
    """Two shards' budgets together make the pool's limit: 600 requests a minute is 300 on each."""
    from agentpool.store import ratelimit

    limits = {"AGENTPOOL_RATE_LIMITS": "claude-sonnet-5-5=rpm:600"}
    with sharded_pool(tmp_path, limits, scripts={"default": EMAIL_RUN[2:]}, workers=1) as pool:
        runs = [pool.enqueue("pool_agents:support", f"t{i}") for i in range(2)]
        assert {pool.wait(run_id).status for run_id in runs} == {"completed"}
        assert {holder(pool, run_id)[0] for run_id in runs} == {0, 1}
        for n in (0, 1):
            (budget,) = ratelimit.show(pool.shard(n))
            # A full bucket is the shard's share: 300 (a call taken from it refills in 0.2 s at 300 a minute).
            assert 290 <= budget.levels["requests"] <= 300, budget
        shown = cli({**shard_env(pool), **limits}, "limits", "show")
        per_shard = [line.split() for line in shown.stdout.splitlines() if line.strip().startswith("requests/min")]
        assert [row[1] for row in per_shard] == ["300", "300"], shown.stdout


def test_a_bad_shard_list_is_refused_in_one_line_without_its_password(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    cases = {
        "redis://:hunter2@a:6379/0,redis://:hunter2@b:6379/0": "separate the shards' URLs with spaces",
        "redis://:hunter2@a:6379/0 b:6379": "shard 1 of AGENTPOOL_SHARDS is not a Redis URL",
        "redis://:hunter2@a:6379/0 redis://:hunter2@a:6379/0": "shard 1 is shard 0 again",
    }
    for shards, said in cases.items():
        for args in (["runs"], ["worker", "--burst"], ["check"]):
            out = cli({**env, "AGENTPOOL_SHARDS": shards}, *args)
            lines = out.stderr.strip().splitlines()
            assert out.returncode != 0 and len(lines) == 1 and said in lines[0], (args, out.stderr)
            assert "hunter2" not in out.stderr + out.stdout
        with pytest.raises(ValueError, match="shard") as caught:
            Shards(shards.split())
        assert "hunter2" not in str(caught.value) and "\n" not in str(caught.value)
    out = cli({**env, "AGENTPOOL_SHARDS": "redis://127.0.0.1:1/0 redis://127.0.0.1:2/0"}, "worker", "--shard", "2")
    assert out.returncode == 2 and "0 to 1" in out.stderr


def test_a_worker_serving_both_shards_runs_a_process_per_shard_and_replaces_one_killed(tmp_path):
    with sharded_pool(tmp_path, scripts={"default": EMAIL_RUN}, workers=0) as pool:
        both = pool.workers.start(1, "--log-level", "INFO")[0]  # no --shard: every shard of AGENTPOOL_SHARDS
        first = [pool.enqueue("pool_agents:support", f"first {i}") for i in range(4)]
        assert {pool.wait(run_id).status for run_id in first} == {"completed"}
        assert {holder(pool, run_id)[0] for run_id in first} == {0, 1}
        from agentpool.testing.localpool import children_of

        before = children_of(both.pid)
        assert len(before) == 2, "a worker process per shard"
        os.kill(before[0], 9)
        run_id = pool.enqueue("pool_agents:support", "after the kill", kill_at="in_tool", kill_tool="send_email")
        second = [run_id, *(pool.enqueue("pool_agents:support", f"second {i}") for i in range(3))]
        pool.killed(run_id, timeout=120)
        assert {pool.wait(r, timeout=120).status for r in second} == {"completed"}, pool.logs()
        assert len(children_of(both.pid)) == 2 and before[0] not in children_of(both.pid)
        sent = Counter(e["run"] for e in effects(str(tmp_path / "effects.jsonl")) if e["tool"] == "send_email")
        assert sent == Counter(first + second)


def test_enqueueing_a_callers_id_again_finds_it_on_the_shard_it_was_made_on(tmp_path):
    """Ids placed by hash move when a shard is added: the enqueue finds the run where it is, and a
    reader too, instead of making a second one."""
    with sharded_pool(tmp_path, scripts={"default": EMAIL_RUN[2:]}, workers=0) as pool:
        one = Shards(pool.redis_urls[:1])
        made = [
            agentpool.enqueue_run("pool_agents:support", "t", run_id=f"order-{i}", connection=one) for i in range(8)
        ]
        moved = [run_id for run_id in made if rule(run_id, 2) == 1]
        assert moved, "some ids hash to the added shard"
        again = [agentpool.enqueue_run("pool_agents:support", "t", run_id=r, connection=pool.redis) for r in made]
        assert again == made and all(holder(pool, run_id) == [0] for run_id in made)
        assert get_run(moved[0], connection=pool.redis).status == "queued"
        with pytest.raises(agentpool.RunExists):
            agentpool.enqueue_run("pool_agents:support", "another task", run_id=moved[0], connection=pool.redis)
        fresh = [_dbsize(url) for url in pool.redis_urls]
        assert fresh[1] == 0, "nothing was written on the shard the hash now names"
        assert json.loads(cli(shard_env(pool), "show", "--json", moved[0]).stdout)["shard"] == 0


def _dbsize(url: str) -> int:
    with Redis.from_url(url) as client:
        return int(client.dbsize())


def _race(urls: list[str], make: list, start: float, results) -> None:
    """In a process of its own: ``make(Shards)`` at ``start``, and what came of it."""
    import time

    pool = Shards(urls)
    while time.time() < start:
        pass
    try:
        results.put(("made", make[0](pool, *make[1:])))
    except agentpool.RunExists as exc:
        results.put(("exists", str(exc)))


def _fork(pool, parent, fork_id):
    return fork_run(parent, fork_id=fork_id, connection=pool)


def _enqueue(pool, run_id, key):
    return agentpool.enqueue_run("pool_agents:support", "t", run_id=run_id, concurrency_key=key, connection=pool)


def test_a_callers_id_raced_onto_two_shards_is_made_on_one(tmp_path):
    """Two requests that would make one id on two shards at the same instant (forks of parents on
    different shards; enqueues with concurrency keys of different shards): one is made, the other gets
    RunExists, never one id naming two runs (a reader would find either)."""
    import multiprocessing
    import time

    keys = {rendezvous(f"ckey:{k}", 2): k for k in ("acme", "globex", "initech", "umbrella", "hooli")}
    assert set(keys) == {0, 1}
    context = multiprocessing.get_context("fork")
    with sharded_pool(tmp_path, workers=0) as pool:
        parents = [
            agentpool.enqueue_run("pool_agents:support", "t", run_id=f"parent-s{n}", connection=pool.redis)
            for n in (0, 1)
        ]
        for i in range(12):
            for requests in (
                [[_fork, parent, f"fork-{i}"] for parent in parents],
                [[_enqueue, f"order-{i}", keys[n]] for n in (0, 1)],
            ):
                results = context.Queue()
                start = time.time() + 0.2
                racers = [context.Process(target=_race, args=(pool.redis_urls, r, start, results)) for r in requests]
                for racer in racers:
                    racer.start()
                for racer in racers:
                    racer.join(30)
                outcomes = sorted(results.get(timeout=5)[0] for _ in racers)
                run_id = requests[0][2] if requests[0][0] is _fork else requests[0][1]
                assert outcomes == ["exists", "made"], (run_id, outcomes)
                assert len(holder(pool, run_id)) == 1, f"{run_id} was made on both shards"
