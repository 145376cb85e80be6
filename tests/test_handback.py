"""Hand-backs: a worker that cannot do a turn (no key, a key it does not have, a record too new for
it, an agent it cannot import) gives it back for another, never fails the run, counts no attempt, and
the run says why it waits. Real workers, some started without what the run needs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from redis import Redis
from rq.registry import FailedJobRegistry

from agentpool import approve, enqueue_run, get_run, resume, send_message, wait_for_run
from agentpool.runtime.jobs import turn_queue
from agentpool.store import crypto, handback, stats
from agentpool.store.codec import pack, unpack
from agentpool.store.crypto import Cipher, generate_key
from agentpool.store.events import read as read_events
from agentpool.store.keys import RunKeys
from agentpool.store.records import SCHEMA_VERSION
from agentpool.testing import settled_stats
from agentpool.testing.localpool import WorkerProcesses

from conftest import TESTS, OutputLines, Pool, assert_valid_conversation, event_kind, script_task, wait_for_status

TWO_TURNS = [{"tool_calls": [{"name": "read_notes", "input": {"topic": "x"}}]}, {"text": "ok"}]


@pytest.fixture
def key_in_this_process():
    def use(*keys: str) -> None:
        crypto.configure(Cipher(list(keys)) if keys else None)

    yield use
    crypto.configure(None)


def wait_for_handback(r: Redis, run_id: str, reason: str, count: int = 1, timeout: float = 120) -> handback.HandBack:
    deadline = time.monotonic() + timeout
    while True:
        record = handback.read(r, RunKeys.of(run_id))
        if record is not None and record.reason == reason and record.count >= count:
            return record
        assert time.monotonic() < deadline, f"run {run_id} never handed back {count}x for {reason}: {record}"
        time.sleep(0.05)


def no_failed_jobs(r: Redis) -> bool:
    return FailedJobRegistry(queue=turn_queue(r)).count == 0


# One turn: the run ends at save point A, which must clear the record itself (no save point B follows).
@pytest.mark.parametrize("steps", [TWO_TURNS, [{"text": "ok"}]], ids=["two_turns", "one_turn"])
def test_a_worker_without_the_key_hands_the_turn_to_one_with_it(r, pool, model, key_in_this_process, steps):
    key = generate_key()
    key_in_this_process(key)
    model.set_scripts({"two": steps})
    pool.start(1)  # no key
    run_id = enqueue_run("pool_agents:support", script_task("two"), connection=r)
    wait_for_handback(r, run_id, "key_missing")
    pool.start(1, AGENTPOOL_ENCRYPTION_KEY=key)
    run = wait_for_run(run_id, timeout=90, connection=r)

    assert run.status == "completed", (run.error, pool.logs())
    assert_valid_conversation(run.messages)
    assert no_failed_jobs(r), "a hand-back is not a failed job"
    counted = settled_stats(r)
    assert counted["turns"] == len(steps), "hand-backs are not counted as turns"
    assert counted["handbacks|reason=key_missing"] >= 1
    assert handback.read(r, RunKeys.of(run_id)) is None, "the record is gone once a worker made progress"


def test_a_keyless_worker_alone_never_fails_the_run_it_waits_and_says_why(r, pool, model, key_in_this_process):
    key = generate_key()
    key_in_this_process(key)
    model.set_scripts({"two": TWO_TURNS})
    pool.start(1)  # no key, and nobody else
    run_id = enqueue_run("pool_agents:support", script_task("two"), connection=r)
    record = wait_for_handback(r, run_id, "key_missing", count=3)

    assert r.hget(RunKeys.of(run_id).run, "attempt") in (None, b"0"), "hand-backs count no attempt"
    assert record.until - record.since >= 3, "it backs off instead of spinning"
    run = get_run(run_id, connection=r)
    assert run.status in ("queued", "running")
    assert run.waiting["kind"] == "handed_back" and run.waiting["reason"] == "key_missing"
    assert run.waiting["since"] == record.since and run.waiting["worker"] == record.worker
    shown = pool.cli("show", run_id, timeout=60, AGENTPOOL_ENCRYPTION_KEY=key)
    assert shown.returncode == 0, shown.stderr
    assert "handed back" in shown.stdout and "no encryption key" in shown.stdout, shown.stdout
    doc = json.loads(pool.cli("show", run_id, "--json", timeout=60, AGENTPOOL_ENCRYPTION_KEY=key).stdout)
    assert doc["waiting"]["kind"] == "handed_back" and doc["waiting"]["reason"] == "key_missing"
    listed = pool.cli("runs", timeout=60, AGENTPOOL_ENCRYPTION_KEY=key)
    assert "handed back" in listed.stdout and "key" in listed.stdout, listed.stdout
    assert no_failed_jobs(r)
    assert pool.logs().count("Traceback") == 0, "one clear line per hand-back, no traceback"
    assert "handed back (key_missing)" in pool.logs()


@pytest.mark.crash
def test_an_approval_a_keyed_worker_asked_for_is_handed_back_by_a_keyless_one_not_failed(
    r, pool, model, tmp_path, key_in_this_process
):
    """Encryption turned on in a rolling deploy: a keyless worker commits save point A (in clear) and dies;
    a worker with the key takes over and asks for the approval (its digest keyed); after the approval a
    keyless worker takes the turn. It cannot check a keyed digest, which is no mismatch: it hands the
    turn back, and a worker with the key runs the call, once."""
    key = generate_key()
    arms = tmp_path / "arms"
    arms.mkdir()
    model.set_scripts({"d": [{"tool_calls": [{"name": "deploy", "input": {"version": "2.4.1"}}]}, {"text": "ok"}]})
    run_id = "r_keyed_digest_1"
    (arms / f"after_save_a-{run_id}").write_text("\nworker")  # its worker dies with its horse
    plain = pool.start(1, AGENTPOOL_FAULT_ARMS=str(arms))[0]
    enqueue_run("pool_agents:guarded", script_task("d"), run_id=run_id, connection=r)
    assert plain.wait(timeout=60) == -signal.SIGKILL, pool.logs()
    keyed = pool.start(1, AGENTPOOL_ENCRYPTION_KEY=key)[0]
    key_in_this_process(key)  # the app is rolled too: it reads what the keyed worker sealed
    wait_for_status(r, run_id, "waiting_approval", timeout=60)
    wait = r.hget(RunKeys.of(run_id).approvals, f"{get_run(run_id, connection=r).pending[0]['id']}:wait")
    assert unpack(wait, "the request")["input"].startswith(crypto.DIGEST_PREFIX), "the request's digest is keyed"
    pool.kill(keyed)

    pool.start(1)  # a worker not rolled yet
    approve(run_id, connection=r)
    wait_for_handback(r, run_id, "key_missing")
    assert get_run(run_id, connection=r).status in ("queued", "running"), "not failed"
    pool.start(1, AGENTPOOL_ENCRYPTION_KEY=key)
    run = wait_for_run(run_id, timeout=90, connection=r)
    assert run.status == "completed", (run.error, pool.logs())
    assert [e["tool"] for e in pool.effects()].count("deploy") == 1


def test_an_old_key_worker_hands_back_what_the_new_key_sealed(r, pool, model, key_in_this_process):
    """A rotation during a rolling deploy: the app (and new workers) seal with the new key while an
    old worker still has only the old one."""
    old, new = generate_key(), generate_key()
    key_in_this_process(new, old)
    model.set_scripts({"two": TWO_TURNS})
    pool.start(1, AGENTPOOL_ENCRYPTION_KEY=old)
    run_id = enqueue_run("pool_agents:support", script_task("two"), connection=r)
    record = wait_for_handback(r, run_id, "key_not_held")
    assert "encrypted with a key this process does not have" in record.detail
    assert r.hget(RunKeys.of(run_id).run, "status") != b"failed"
    pool.start(1, AGENTPOOL_ENCRYPTION_KEY=new, AGENTPOOL_ENCRYPTION_OLD_KEYS=old)
    run = wait_for_run(run_id, timeout=90, connection=r)
    assert run.status == "completed", (run.error, pool.logs())
    assert "handed back (key_not_held)" in pool.logs()
    assert no_failed_jobs(r)


def test_a_message_too_new_for_the_worker_is_handed_back_not_failed(r, pool, model):
    model.set_scripts({"two": TWO_TURNS})
    run_id = enqueue_run("pool_agents:support", script_task("two"), connection=r)
    keys = RunKeys.of(run_id)
    record = unpack(r.lindex(keys.messages, 0), "task")
    r.lset(keys.messages, 0, pack({**record, "v": SCHEMA_VERSION + 1}))
    before = r.lrange(keys.messages, 0, -1)
    pool.start(1)
    found = wait_for_handback(r, run_id, "too_new")
    assert "schema version" in found.detail
    assert r.lrange(keys.messages, 0, -1) == before, "the newer data is left as found"
    assert r.hget(keys.run, "status") in (b"queued", b"running") and no_failed_jobs(r)


def _agent_module(directory: Path, version: int) -> None:
    directory.mkdir(exist_ok=True)
    (directory / "skew_agents.py").write_text(
        "import os, json\n"
        "from agentpool import Agent, tool\n"
        f"VERSION = {version}\n"
        "@tool(effect='read')\n"
        "def which_version() -> str:\n"
        '    """Tell which version of the code runs."""\n'
        "    with open(os.environ['AGENTPOOL_TEST_EFFECTS'], 'a') as f:\n"
        "        f.write(json.dumps({'tool': 'which_version', 'version': VERSION}) + '\\n')\n"
        "    return str(VERSION)\n"
        "helper = Agent(model='claude-sonnet-5-5', tools=[which_version], max_turns=4)\n"
    )


WHICH = [{"tool_calls": [{"name": "which_version", "input": {}}]}, {"text": "ok"}]


def test_a_worker_that_cannot_import_the_agent_hands_the_turn_to_one_that_can(r, pool, model, tmp_path):
    code = tmp_path / "newcode"
    _agent_module(code, 1)
    model.set_scripts({"which": WHICH})
    pool.start(1)  # deployed before the agent existed: skew_agents is not importable there
    run_id = enqueue_run("skew_agents:helper", script_task("which"), connection=r, check_agent=False)
    record = wait_for_handback(r, run_id, "agent_not_loadable")
    assert "cannot import module 'skew_agents'" in record.detail
    pool.start(1, PYTHONPATH=f"{TESTS}{os.pathsep}{code}")
    run = wait_for_run(run_id, timeout=90, connection=r)
    assert run.status == "completed", (run.error, pool.logs())
    assert no_failed_jobs(r)


def test_when_no_worker_can_load_the_agent_for_the_grace_period_the_run_stops_resumably(r, pool, model, tmp_path):
    code = tmp_path / "newcode"
    _agent_module(code, 1)
    model.set_scripts({"which": WHICH})
    pool.start(1, AGENTPOOL_AGENT_LOAD_GRACE="2")
    missing_attr = enqueue_run("pool_agents:quick", script_task("which"), connection=r, check_agent=False)
    run_id = enqueue_run("skew_agents:helper", script_task("which"), connection=r, check_agent=False)
    wait_for_status(r, run_id, "stopped", timeout=60)
    stopped = get_run(run_id, connection=r)
    assert "no worker could load the agent" in stopped.error and "skew_agents" in stopped.error
    wait_for_status(r, missing_attr, "stopped", timeout=60)
    assert "module 'pool_agents' has no attribute 'quick'" in get_run(missing_attr, connection=r).error
    assert no_failed_jobs(r)

    pool.stop()
    pool.start(1, PYTHONPATH=f"{TESTS}{os.pathsep}{code}")  # the rolling restart that brings the code
    resume(run_id, connection=r)
    run = wait_for_run(run_id, timeout=90, connection=r)
    assert run.status == "completed", (run.error, pool.logs())


@pytest.mark.parametrize("concurrency", ["1", "2"])
def test_both_worker_kinds_load_agent_code_once_per_process(concurrency, r, pool, model, tmp_path):
    """One rule for forking and threaded workers: agent code is imported once per worker process
    and new code arrives with a restart (before, a forking worker's horses imported it afresh)."""
    code = tmp_path / "code"
    _agent_module(code, 1)
    model.set_scripts({"which": WHICH})
    env = {"PYTHONPATH": f"{TESTS}{os.pathsep}{code}", "PYTHONDONTWRITEBYTECODE": "1"}
    _start(pool, concurrency, env)
    first = enqueue_run("skew_agents:helper", script_task("which"), connection=r, check_agent=False)
    assert wait_for_run(first, timeout=60, connection=r).status == "completed"
    _agent_module(code, 22)  # new code on disk while the worker runs
    second = enqueue_run("skew_agents:helper", script_task("which"), connection=r, check_agent=False)
    assert wait_for_run(second, timeout=60, connection=r).status == "completed"
    pool.stop()
    _start(pool, concurrency, env)  # restarted: the new code
    third = enqueue_run("skew_agents:helper", script_task("which"), connection=r, check_agent=False)
    assert wait_for_run(third, timeout=60, connection=r).status == "completed"
    versions = [e["version"] for e in pool.effects() if e["tool"] == "which_version"]
    assert versions == [1, 1, 22], versions


def _start(pool: Pool, concurrency: str, env: dict[str, str]) -> None:
    WorkerProcesses.start(pool, 1, "--log-level", "INFO", "--concurrency", concurrency, **env)


def test_a_run_waiting_for_a_worker_or_a_backoff_says_so_and_since_or_until_when(r, pool, model):
    model.set_scripts(
        {
            "busy": [
                {"error": {"status": 529, "type": "overloaded_error", "message": "Overloaded", "retry_after": 30}},
                {"text": "ok"},
            ]
        }
    )
    enqueued = time.time()
    run_id = enqueue_run("pool_agents:support", script_task("busy"), connection=r)
    waiting = get_run(run_id, connection=r).waiting  # no worker yet
    assert waiting["kind"] == "queued" and "waiting for a worker" in waiting["note"]
    assert abs(waiting["since"] - enqueued) < 5

    pool.start(1)
    deadline = time.monotonic() + 30
    while (waiting := get_run(run_id, connection=r).waiting)["kind"] != "backoff":
        assert time.monotonic() < deadline, waiting
        time.sleep(0.05)
    assert "overloaded_error" in waiting["note"] and waiting["until"] > time.time() + 20
    listed = pool.cli("runs", timeout=60)
    assert "backoff after overloaded_error" in listed.stdout, listed.stdout


@pytest.mark.parametrize("joins", ["at once", "after a requeue"])
def test_watch_says_when_a_run_is_handed_back(r, pool, model, joins):
    pool.start(1)
    run_id = enqueue_run("not_deployed_here:agent", script_task("two"), connection=r, check_agent=False)
    if joins == "after a requeue":  # the replay then holds a requeue whose cause also says "handed back"
        wait_for_handback(r, run_id, "agent_not_loadable", count=2)
    watch = subprocess.Popen(
        [sys.executable, "-m", "agentpool", "watch", run_id],
        env=pool.env,
        cwd=str(TESTS),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        # Each line asserted on is waited for by what it is, not by words another line may hold too.
        out = OutputLines(watch.stdout)
        event = out.wait_for(lambda line: event_kind(line) == "handed_back", "with the handed_back event")
        assert "reason=agent_not_loadable" in event and "not_deployed_here" in event
        said = out.wait_for(
            lambda line: (
                event_kind(line) == "waiting"
                and "note=waiting for a worker that can load its agent: handed back" in line
            ),
            "saying the run waits",
        )
        assert "cannot load the run's agent" in said and "not_deployed_here" in said
    finally:
        watch.terminate()
        watch.wait(timeout=10)
        watch.stdout.close()


def test_a_tool_the_guard_refuses_never_runs_and_is_not_counted_as_a_call(r, pool, model):
    """A lone Redis told to wait for a replica (`AGENTPOOL_REPLICA_ACKS=1`): the guard refuses every
    unsafe call, so the tool never runs, the turn is handed back (`not_replicated`) again and again,
    each refusal says so in an event, and the pool's call counter does not count calls that never ran."""
    model.set_scripts(
        {"mail": [{"tool_calls": [{"name": "send_email", "input": {"to": "a@b.c", "subject": "s", "body": "b"}}]}]}
    )
    pool.start(1, AGENTPOOL_REPLICA_ACKS="1", AGENTPOOL_REPLICA_ACK_TIMEOUT="0.2")
    run_id = enqueue_run("pool_agents:support", script_task("mail"), connection=r)
    wait_for_handback(r, run_id, "not_replicated", count=2)
    pool.stop()  # events and counters stand still while they are compared
    started = withdrawn = 0
    for _, event in read_events(r, run_id):
        started += event["kind"] == "tool_started"
        withdrawn += event["kind"] == "tool_withdrawn"
        if event["kind"] == "tool_withdrawn":
            assert (event["tool"], event["effect"], event["reason"]) == ("send_email", "unsafe", "not_replicated")
    assert started >= 2 and withdrawn >= started - 1, (started, withdrawn)  # the latest may be mid-guard
    assert [e for e in pool.effects() if e["tool"] == "send_email"] == [], "a refused call ran"
    counted = float(r.hget("ap:stats", "tool_calls|effect=unsafe") or 0)
    assert counted == started - withdrawn, (counted, started, withdrawn)
    assert get_run(run_id, connection=r).status in ("queued", "running")


def _turns_and_calls(r: Redis, expected: tuple[float, float] = (2, 2)) -> tuple[float, float]:
    """Turns started and model calls counted, once ``expected`` has been reached (or 30 s went by) and
    nothing changes any more (a count beyond ``expected`` shows too)."""

    def pair(counted: dict[str, float]) -> tuple[float, float]:
        return counted.get("turns", 0.0), counted.get("model_call_seconds_count", 0.0)

    return pair(settled_stats(r, until=lambda counted: pair(counted) == expected))


def test_turns_keep_up_with_model_calls_after_a_not_replicated_hand_back(r, pool, model):
    """The guard refuses the call after save point A committed the model's reply: the turn did happen
    (its retry only settles the tools and counts no turn start), so the hand-back must not take its
    turn start back: `agentpool_turns_total` would fall behind the model calls paid for."""
    email = {"name": "send_email", "input": {"to": "a@b.c", "subject": "s", "body": "b"}}
    model.set_scripts({"mail": [{"tool_calls": [email]}, {"text": "Sent."}]})
    pool.start(1, AGENTPOOL_REPLICA_ACKS="1", AGENTPOOL_REPLICA_ACK_TIMEOUT="0.2")
    run_id = enqueue_run("pool_agents:support", script_task("mail"), connection=r)
    wait_for_handback(r, run_id, "not_replicated")
    pool.stop(signal.SIGTERM)  # warm: a worker flushes its counters as it stops (a SIGKILL loses its last second)
    pool.start(1, AGENTPOOL_REPLICA_ACKS="0")  # an operator lowers the guard, knowingly
    run = wait_for_run(run_id, timeout=60, connection=r)
    assert run.status == "completed", (run.error, pool.logs())
    assert _turns_and_calls(r) == (2, 2), (stats.read_all(r), pool.logs())


def test_turns_keep_up_with_model_calls_after_a_key_not_held_hand_back_at_save_point_b(
    r, pool, model, key_in_this_process
):
    """A message sealed with a key the worker does not have arrives while the turn's tool runs: save
    point B, which delivers it, hands the turn back (key_not_held) after the model call was counted."""
    old, new = generate_key(), generate_key()
    key_in_this_process(old)
    model.set_scripts({"read": [{"tool_calls": [{"name": "slow_read", "input": {"seconds": 1.5}}]}, {"text": "ok"}]})
    pool.start(1, AGENTPOOL_ENCRYPTION_KEY=old)
    run_id = enqueue_run("pool_agents:support", script_task("read"), connection=r)
    pool.wait_for_effect("slow_read")
    key_in_this_process(new, old)  # the app rotated first: what it sends now is sealed with the new key
    send_message(run_id, "one more thing", connection=r)
    wait_for_handback(r, run_id, "key_not_held")
    pool.stop(signal.SIGTERM)  # warm: a worker flushes its counters as it stops (a SIGKILL loses its last second)
    pool.start(1, AGENTPOOL_ENCRYPTION_KEY=new, AGENTPOOL_ENCRYPTION_OLD_KEYS=old)
    run = wait_for_run(run_id, timeout=60, connection=r)
    assert run.status == "completed", (run.error, pool.logs())
    assert_valid_conversation(run.messages)
    assert _turns_and_calls(r) == (2, 2), (stats.read_all(r), pool.logs())
