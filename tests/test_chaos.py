"""Chaos: many runs across several real workers while a killer SIGKILLs random work horses and whole
workers, and freezes one worker past its lease. Then every invariant is checked over every run, and
the tools' real executions (counted in a file outside the pool) show no repeated side effect."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter, defaultdict

import pytest

from agentpool import enqueue_run, wait_for_run
from agentpool.testing.localpool import horses_of

from conftest import assert_valid_conversation, script_task

pytestmark = [pytest.mark.chaos, pytest.mark.crash]

MIXED = [
    {
        "tool_calls": [
            {"name": "read_notes", "input": {"topic": "q3"}},
            {"name": "slow_read", "input": {"seconds": 0.3}},
        ]
    },
    {"tool_calls": [{"name": "create_ticket", "input": {"title": "Follow up", "body": "details"}}], "delay": 0.1},
    {
        "tool_calls": [
            {"name": "send_email", "input": {"to": "boss@example.com", "subject": "Status", "body": "All good"}},
            {"name": "charge_card", "input": {"amount_cents": 1200}},
        ]
    },
    {"tool_calls": [{"name": "slow_read", "input": {"seconds": 0.2}}], "delay": 0.1},
    {"text": "Finished the job."},
]
RUNS = 30
WORKERS = 4


def test_pool_under_random_kills_loses_nothing_and_repeats_no_effect(r, pool, model):
    model.set_scripts({"mixed": MIXED})
    pool.start(WORKERS)
    run_ids = [enqueue_run("pool_agents:support", script_task("mixed", f"job {i}"), connection=r) for i in range(RUNS)]
    rng = random.Random(7)
    done = threading.Event()
    actions: Counter = Counter()

    def committed_turns() -> int:
        return int(float(r.hget("ap:stats", "turn_seconds_count") or 0))

    def killer() -> None:
        # Kill at random, but only once the pool has made some progress since the last kill: a fixed
        # kill rate above the pool's turn rate (a loaded CI machine) would be a livelock, not a test.
        frozen = None
        progress_mark = committed_turns()
        thawed_at = 0.0
        while not done.wait(rng.uniform(0.3, 0.9)):
            if frozen is not None and time.monotonic() > thawed_at:
                pool.kill(frozen, signal.SIGCONT)  # the zombie wakes after its lease was taken over
                frozen = None
                actions["sigcont"] += 1
                continue
            if committed_turns() < progress_mark + 2:
                continue
            progress_mark = committed_turns()
            alive = pool.alive()
            busy = [(w, kids) for w in alive if (kids := horses_of(w.pid))]
            if frozen is None and actions["sigstop"] == 0 and busy and len(alive) > 2:
                frozen, _ = rng.choice(busy)
                pool.kill(frozen, signal.SIGSTOP)
                thawed_at = time.monotonic() + 3 + 2  # lease TTL 3 s in tests, then some
                actions["sigstop"] += 1
                continue
            if not busy:
                continue
            worker, horses = rng.choice(busy)
            if rng.random() < 0.7:
                for pid in horses:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                actions["horse_kill"] += 1
            elif worker is not frozen:
                pool.kill(worker)
                pool.start(1)  # a replacement, as an orchestrator would start
                actions["worker_kill"] += 1
        if frozen is not None:
            pool.kill(frozen, signal.SIGCONT)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        runs = [wait_for_run(run_id, timeout=240, connection=r) for run_id in run_ids]
    except Exception:  # noqa: BLE001 - any failure to finish is reported with the pool's state
        pytest.fail(f"{_diagnose(r, run_ids)}\nactions {dict(actions)}\n{pool.logs(tail=3000)}")
    finally:
        done.set()
        thread.join(timeout=10)
    time.sleep(1)  # a thawed zombie has had its chance to misbehave

    assert actions["horse_kill"] + actions["worker_kill"] >= 5, actions
    assert model.stats()["rejected"] == 0, model.stats()["rejections"]
    effects = defaultdict(Counter)
    keys = defaultdict(set)
    for e in pool.effects():
        effects[e["run"]][e["tool"]] += 1
        if e["tool"] == "create_ticket":
            keys[e["run"]].add(e["key"])
    for run in runs:
        assert run.status == "completed", (run.id, run.status, run.error)
        assert run.turns == len(MIXED), (run.id, run.turns)
        assert_valid_conversation(run.messages)
        assert effects[run.id]["send_email"] <= 1, f"{run.id} sent an email twice"
        assert effects[run.id]["charge_card"] == 1, f"{run.id} charged {effects[run.id]['charge_card']} times"
        assert effects[run.id]["create_ticket"] >= 1 and len(keys[run.id]) == 1, f"{run.id} ticket keys {keys[run.id]}"
        email_result = next(
            b
            for m in run.messages
            if m["role"] == "user" and isinstance(m["content"], list)
            for b in m["content"]
            if b["type"] == "tool_result"
            and "email" in str(b["content"]).lower()
            or (b["type"] == "tool_result" and "send_email" in str(b["content"]))
        )
        if effects[run.id]["send_email"] == 0:
            assert email_result.get("is_error"), "an email that never went out was not reported as sent"
    print(f"chaos actions: {dict(actions)}")


def _diagnose(r, run_ids) -> str:
    """Everything that says why a run is stuck: header, lease, watch score, its job, last events."""
    from rq.job import Job

    from agentpool.runtime.serializer import MsgpackSerializer
    from agentpool.store.events import read as read_events
    from agentpool.store.keys import RUNS_WATCH, RunKeys

    lines = []
    for run_id in run_ids:
        keys = RunKeys.of(run_id)
        header = {k.decode(): v for k, v in r.hgetall(keys.run).items() if k != b"pending"}
        if header.get("status") in (b"completed",):
            continue
        job = header.get("job", b"").decode()
        try:
            fetched = Job.fetch(job, connection=r, serializer=MsgpackSerializer)
            job_state = (fetched.get_status(), fetched.worker_name, fetched.latest_result())
        except Exception as exc:  # noqa: BLE001 - diagnostics print whatever went wrong
            job_state = repr(exc)
        lines.append(
            f"{run_id}: {header} lease={r.get(keys.lease)} pttl={r.pttl(keys.lease)} "
            f"watch={r.zscore(RUNS_WATCH, run_id)} now={time.time() * 1000:.0f} job={job} {job_state}"
        )
        lines.extend(f"    {e}" for e in read_events(r, run_id)[-8:])
    return "\n".join(lines)
