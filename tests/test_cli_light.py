"""The CLI answers at once: a command that only reads or writes Redis loads neither the anthropic SDK, nor
pydantic, nor Prometheus's client, nor the dashboard's stack (what `python -X importtime -m agentpool runs`
showed cost a second per call); and many approvals are one command with a confirmation."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from agentpool import enqueue_run, get_run, wait_for_run

from conftest import TESTS, script_task, wait_for_status

# Run the command as `python -m agentpool` does, then print which of these it had imported.
PROBE = """
import json, runpy, sys
sys.argv = ["agentpool", *sys.argv[1:]]
try:
    runpy.run_module("agentpool", run_name="__main__")
except SystemExit:
    pass
heavy = ("anthropic", "pydantic", "prometheus_client", "httpx", "rq", "agentpool.ops.dashboard", "agentpool.testing")
print(json.dumps(sorted(m for m in heavy if m in sys.modules)), file=sys.stderr)
"""

NEVER = ["agentpool.ops.dashboard", "agentpool.testing", "anthropic", "httpx", "prometheus_client", "pydantic"]


def _run(argv: list[str], url: str, stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        env={**_env(), "REDIS_URL": url},
        cwd=str(TESTS),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _loaded(url: str, *args: str, stdin: str = "") -> tuple[list[str], subprocess.CompletedProcess[str]]:
    out = _run([sys.executable, "-c", PROBE, *args], url, stdin)
    return json.loads(out.stderr.strip().splitlines()[-1]), out


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "AGENTPOOL_FAULTS")}


@pytest.fixture
def waiting_run(r, pool, model):
    """A run waiting for an approval, its worker stopped: nothing else moves while the CLI looks."""
    model.set_scripts({"deploy": [{"tool_calls": [{"name": "deploy", "input": {"version": "9"}}]}, {"text": "ok"}]})
    (worker,) = pool.start(1)
    run_id = enqueue_run("pool_agents:guarded", script_task("deploy"), connection=r)
    wait_for_status(r, run_id, "waiting_approval")
    pool.kill(worker)
    return run_id


def test_reading_runs_loads_neither_the_sdk_nor_pydantic_nor_rq(r, redis_server, waiting_run):
    queued = enqueue_run("pool_agents:guarded", "no worker takes it", connection=r)  # its turn is an RQ job
    for args in (("runs",), ("show", waiting_run), ("show", queued), ("runs", "--status", "waiting_approval")):
        loaded, out = _loaded(redis_server.url, *args)
        assert out.stdout and "Traceback" not in out.stderr, out.stderr
        assert loaded == [], (args, loaded)
    row = next(line for line in out.stdout.splitlines() if line.startswith(waiting_run))  # `runs`, filtered
    assert row.endswith(f"waiting for a person's decision: agentpool approve {waiting_run} [--deny]"), row
    assert "waiting for a worker since" in _loaded(redis_server.url, "show", queued)[1].stdout


def test_reading_runs_names_rqs_job_keys_as_rq_does():
    from rq.job import Job

    from agentpool.runtime.progress import rq_job_key

    assert rq_job_key("r_1-t0") == Job.key_for("r_1-t0")


def test_approving_and_sending_load_rq_to_queue_the_turn_but_nothing_heavier(redis_server, waiting_run):
    loaded, out = _loaded(redis_server.url, "approve", waiting_run)
    # Without a TOOL_USE_ID, what was decided is printed whole: the call's name and its input.
    assert re.fullmatch(r'approved: toolu_\w+ deploy \{"version": "9"\}\n', out.stdout), out.stdout
    assert [m for m in loaded if m in NEVER] == [], loaded

    loaded, out = _loaded(redis_server.url, "send", waiting_run, "and then?")
    assert out.stdout.strip(), out.stderr
    assert [m for m in loaded if m in NEVER] == [], loaded


def test_the_servers_commands_are_still_there_when_named(redis_server):
    out = subprocess.run(
        [sys.executable, "-m", "agentpool", "--help"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert all(f"  {name} " in out.stdout for name in ("bench", "dashboard", "demo", "metrics", "runs")), out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "agentpool", "dashboard", "--help"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "--port" in out.stdout


def _cli(url: str, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-m", "agentpool", *args], url, stdin)


def test_approve_all_of_an_agent_asks_first_and_decides_exactly_what_it_showed(r, redis_server, pool, model):
    model.set_scripts({"deploy": [{"tool_calls": [{"name": "deploy", "input": {"version": "9"}}]}, {"text": "ok"}]})
    (worker,) = pool.start(1)
    guarded = [enqueue_run("pool_agents:guarded", script_task("deploy"), connection=r) for _ in range(3)]
    for run_id in guarded:
        wait_for_status(r, run_id, "waiting_approval")
    pool.kill(worker)

    refused = _cli(redis_server.url, "approve", "--all", "--agent", "guarded", stdin="n\n")
    assert refused.returncode == 1 and "nothing decided" in refused.stderr, refused
    assert all(get_run(run_id, connection=r).status == "waiting_approval" for run_id in guarded)
    shown = [line for line in refused.stdout.splitlines() if " deploy " in line]
    assert sorted(line.split()[0] for line in shown) == sorted(guarded), refused.stdout
    assert "Approve these 3 call(s) in 3 run(s)?" in refused.stdout

    none = _cli(redis_server.url, "approve", "--all", "--agent", "support", "--yes")
    assert none.returncode == 0 and "nothing to approve: no run of support waits" in none.stdout, none

    denied = _cli(redis_server.url, "approve", "--all", "--agent", "guarded", "--deny", "--reason", "freeze", "--yes")
    assert denied.returncode == 0, denied
    assert denied.stdout.count(": denied: toolu_") == 3, denied.stdout
    pool.start(1)
    for run_id in guarded:
        done = wait_for_run(run_id, timeout=60, connection=r)
        assert done.status == "completed"
    assert "deploy" not in [e["tool"] for e in pool.effects()]


def test_approve_says_how_to_name_what_to_decide():
    for args, says in (
        ((), "give the RUN_ID to decide on, or --all"),
        (("r_x", "--all"), "give a RUN_ID or --all, not both"),
        (("r_x", "--agent", "a"), "--agent and --yes go with --all"),
    ):
        out = _cli("redis://127.0.0.1:1/0", "approve", *args)
        assert out.returncode == 2 and says in out.stderr, (args, out.stderr)


def test_approve_records_who_decided(r, redis_server, waiting_run):
    """``--by`` (``approve(..., by=...)``) names who decided, in the decision and the run's event; a name
    that could be misread (a space, the reaper's "expiry") is refused before anything is decided."""
    from agentpool import approve
    from agentpool.store import events

    bad = _cli(redis_server.url, "approve", waiting_run, "--by", "alice smith")
    assert bad.returncode == 2 and "--by" in bad.stderr, bad.stderr
    with pytest.raises(ValueError, match="expired"):
        approve(waiting_run, by="expiry", connection=r)
    assert get_run(waiting_run, connection=r).status == "waiting_approval", "nothing was decided"

    (call,) = get_run(waiting_run, connection=r).awaiting_approval
    out = _cli(redis_server.url, "approve", waiting_run, "--by", "alice@example.com")
    assert out.returncode == 0, out.stderr
    decided = [f for _, f in events.read(r, waiting_run) if f["kind"] == "approval"]
    assert [(f["tool_use_id"], f["by"]) for f in decided] == [(call["id"], "alice@example.com")]
    late = _cli(redis_server.url, "approve", waiting_run, call["id"], "--deny", "--by", "bob")
    assert late.returncode != 0 and f"{call['id']} was approved already, by alice@example.com" in late.stderr, late


def test_cancel_resume_send_and_fork_record_who_acted(r, redis_server, pool, model):
    """``--by`` on ``cancel``, ``resume``, ``send`` and ``fork`` (``by=`` in the API) is kept in the event
    each writes; a cancel by a name says so in the run's error. A name that could be misread is refused
    before anything changes."""
    from agentpool.store import events

    model.set_scripts(
        {
            "loop": [{"tool_calls": [{"name": "read_notes", "input": {"topic": str(i)}}]} for i in range(2)]
            + [{"text": "finished"}, {"text": "answered"}]
        }
    )
    pool.start(1)
    run_id = enqueue_run("pool_agents:budgeted", script_task("loop"), connection=r, max_turns=1)
    idle = enqueue_run("pool_agents:budgeted", script_task("loop"), queue="nobody", connection=r)
    assert wait_for_run(run_id, timeout=60, connection=r).status == "stopped"

    def who(run: str, kind: str) -> list[str | None]:
        return [f.get("by") for _, f in events.read(r, run) if f["kind"] == kind]

    bad = _cli(redis_server.url, "cancel", idle, "--by", "frank smith")
    assert bad.returncode == 2 and "--by" in bad.stderr, bad.stderr
    assert get_run(idle, connection=r).status == "queued", "nothing was cancelled"

    out = _cli(redis_server.url, "resume", run_id, "--add-turns", "5", "--by", "carol")
    assert out.returncode == 0, out.stderr
    # The resume's own event: the pool may have run the next turn (and completed the run) by now.
    resumed = [f.get("by") for _, f in events.read(r, run_id) if f["kind"] == "status" and f.get("reason") == "resumed"]
    assert resumed == ["carol"], "the resumed run's status event"
    assert wait_for_run(run_id, timeout=60, connection=r).status == "completed"
    out = _cli(redis_server.url, "send", run_id, "One more thing?", "--by", "dave@example.com", "--wait")
    assert out.returncode == 0, out.stderr
    assert "dave@example.com" in who(run_id, "status"), "the status event of the message that set it going"
    out = _cli(redis_server.url, "fork", run_id, "--by", "erin")
    assert out.returncode == 0, out.stderr
    assert who(out.stdout.split()[0], "forked") == ["erin"]
    out = _cli(redis_server.url, "cancel", idle, "--by", "frank")
    assert out.returncode == 0, out.stderr
    cancelled = get_run(idle, connection=r)
    assert cancelled.status == "cancelled" and cancelled.error == "cancelled by frank", cancelled
    assert who(idle, "status")[-1] == "frank"
