"""A pool of real workers shares one rate-limit budget per model, learned from the scripted model's
``anthropic-ratelimit-*`` headers with no configuration: the turns that would overrun it wait (deferred,
holding no worker) instead of meeting 429s, and every run completes."""

from __future__ import annotations

import contextlib
import math
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from redis import Redis

from agentpool import cancel_run, enqueue_run, wait_for_run
from agentpool.runtime.deferred import promote_due
from agentpool.runtime.jobs import DEFERRED_META, job_id, stage_turn, turn_queue
from agentpool.store import checkpoint, events, ratelimit
from agentpool.store.codec import pack
from agentpool.store.keys import LimitKeys, RunKeys
from agentpool.store.ratelimit import UNLIMITED_TRUSTED_FOR
from agentpool.store.scripts import run_script
from agentpool.testing.localpool import WorkerProcesses
from agentpool.testing.scripted_model import RateLimits

from conftest import assert_valid_conversation, script_task

READ = {"name": "read_notes", "input": {"topic": "release"}}
STEPS = [{"tool_calls": [READ]}, {"tool_calls": [READ]}, {"text": "All done."}]
RUNS = 12


def _budget(r: Redis, held: int = 0) -> ratelimit.BudgetView:
    """The model's budget once ``held`` calls are left in flight. A call reserved with room to spare
    settles with its worker's others, up to a second after its turn (``DeferredSettles``): wait for that,
    not longer (a settle that never comes leaves the view as it is, and the test's assertion says so)."""
    deadline = time.monotonic() + 5
    while True:
        (view,) = ratelimit.show(r)
        if view.held["calls"] == held or time.monotonic() > deadline:
            return view
        time.sleep(0.05)


def test_runs_beyond_the_limit_wait_for_the_budget_instead_of_meeting_429s(r: Redis, pool, model) -> None:
    model.set_scripts({"steps": STEPS})
    # 8 requests a (scaled) minute of 2 s: 36 calls need several refills; 8 turns at once could all ask.
    model.set_rate_limits(RateLimits(rpm=8, minute=2.0))
    args = ("--log-level", "INFO", "--concurrency", "8")
    WorkerProcesses.start(pool, 1, *args, AGENTPOOL_RATE_LIMIT_MINUTE="2")
    run_ids = [enqueue_run("pool_agents:support", script_task("steps", f"task {i}"), connection=r) for i in range(RUNS)]
    runs = [wait_for_run(run_id, timeout=120, connection=r) for run_id in run_ids]
    assert [run.status for run in runs] == ["completed"] * RUNS, ([(x.status, x.error) for x in runs], pool.logs())
    for run in runs:
        assert run.turns == 3 and run.result == "All done."
        assert_valid_conversation(run.messages)
    # Without the limiter (AGENTPOOL_RATE_LIMITER=off) this load meets many 429s: each turn backs off alone.
    assert model.stats()["rate_limited"] == 0, model.stats()
    waits = [f for run_id in run_ids for _, f in events.read(r, run_id) if f["kind"] == "waiting_for_budget"]
    assert waits, "no turn ever waited for the budget: the limit was never reached"
    view = _budget(r)
    assert view.learned == {"requests": 8} and view.waiting == 0 and view.held["calls"] == 0
    shown = _cli(pool, "limits", "show")
    assert shown.returncode == 0, shown.stderr
    assert "claude-sonnet-5-5: 0 call(s) in flight, 0 turn(s) waiting" in shown.stdout
    (requests_row,) = [line for line in shown.stdout.splitlines() if "requests/min" in line]
    assert requests_row.split()[1:3] == ["8", "8"]  # learned, in force


def test_a_bad_rate_limit_is_refused_in_one_line_at_worker_start(pool) -> None:
    for bad in ("claude-sonnet-5-5=rpm:-1", "claude-sonnet-5-5=itpm:nan", "*=rpm"):
        proc = subprocess.run(
            [sys.executable, "-m", "agentpool", "worker", "--burst"],
            env={**pool.env, "AGENTPOOL_RATE_LIMITS": bad},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode != 0
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "AGENTPOOL_RATE_LIMITS" in lines[0], proc.stderr


def _cli(pool, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentpool", *args],
        env=pool.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_failed_calls_settle_their_reservations_though_no_save_point_a_follows(r: Redis, pool, model) -> None:
    """A call's settle rides in save point A's round trip; a call that fails (a 500, the turn deferred,
    no save point A) settles on its own, so nothing stays held against the budget."""
    model.set_scripts(
        {"down": [{"error": {"status": 500, "type": "api_error", "message": "boom", "times": 2}, "text": "back"}]}
    )
    model.set_rate_limits(RateLimits(rpm=1000))
    pool.start(1, AGENTPOOL_MODEL_RETRIES="5")
    run_id = enqueue_run("pool_agents:support", script_task("down"), connection=r)
    run = wait_for_run(run_id, timeout=60, connection=r)
    assert run.status == "completed" and run.result == "back", (run.status, run.error, pool.logs())
    assert model.stats()["requests"] == 3, model.stats()
    view = _budget(r)
    assert view.learned == {"requests": 1000}
    assert view.held["calls"] == 0, "a failed call's reservation is still held"
    assert "could not settle" not in pool.logs()


@pytest.mark.parametrize("kind", [["--concurrency", "2"], []], ids=["threaded", "forking"])
def test_a_model_whose_replies_carry_no_rate_limit_headers_is_called_without_a_budget_read_each_time(
    r: Redis, pool, model, kind: list[str]
) -> None:
    """A worker process that found a model unlimited, its replies without rate-limit headers, calls it
    for a second without reading its budget (one round trip a turn less; a forking worker's horse hands
    what it found to the worker, whose next horses inherit it); once the model's replies carry the
    headers, the pool learns the limits and reserves within them again."""
    calls = 10
    model.set_scripts(
        {"many": [{"tool_calls": [READ]}] * (calls - 1) + [{"text": "All done."}], "one": [{"text": "Hi."}]}
    )
    WorkerProcesses.start(pool, 1, "--log-level", "INFO", *kind)
    # A first run finds the model's replies headerless (and has the worker up and warm).
    first = wait_for_run(enqueue_run("pool_agents:support", script_task("one"), connection=r), timeout=60, connection=r)
    assert first.status == "completed", (first.status, first.error, pool.logs())
    budget = LimitKeys.of("claude-sonnet-5-5").budget
    with _commands_seen(pool) as seen:
        started = time.monotonic()
        run = wait_for_run(
            enqueue_run("pool_agents:support", script_task("many"), connection=r), timeout=60, connection=r
        )
        took = time.monotonic() - started
    assert run.status == "completed" and run.turns == calls, (run.status, run.error, pool.logs())
    reads = [c for c in seen if c.startswith("HMGET") and budget in c]
    # One read a second at most, where reading at every call would make it `calls`.
    most = math.ceil(took / UNLIMITED_TRUSTED_FOR)
    assert most < calls, f"the run took {took:.1f} s: too long to tell a read a call from a read a second"
    assert len(reads) <= most, (len(reads), took, seen)

    model.set_rate_limits(RateLimits(rpm=1000))
    again = wait_for_run(
        enqueue_run("pool_agents:support", script_task("many"), connection=r), timeout=60, connection=r
    )
    assert again.status == "completed", (again.status, again.error, pool.logs())
    view = _budget(r)
    assert view.learned == {"requests": 1000} and view.held["calls"] == 0
    # The calls after the first reply with headers took their request from the budget.
    assert view.levels["requests"] < 1000


@pytest.mark.parametrize("kind", [["--concurrency", "2"], []], ids=["threaded", "forking"])
def test_calls_with_room_to_spare_settle_together_in_one_script_call(r: Redis, pool, model, kind: list[str]) -> None:
    """Far from the limits (the budget more than half full, the API saying more than half is left), a
    call's settle waits for the worker's next flush and goes with the others in one script call, instead
    of one a turn (a forking worker's horse hands it to its worker). Here the flush is a minute away, so
    every call waits until the worker's warm stop sends them; then the budget is exact: every call
    settled once, nothing held."""
    calls = 12
    model.set_scripts(
        {"many": [{"tool_calls": [READ]}] * (calls - 1) + [{"text": "All done."}], "one": [{"text": "Hi."}]}
    )
    model.set_rate_limits(RateLimits(rpm=100_000))
    WorkerProcesses.start(pool, 1, *kind, AGENTPOOL_FLUSH_INTERVAL="60")
    first = wait_for_run(enqueue_run("pool_agents:support", script_task("one"), connection=r), timeout=60, connection=r)
    assert first.status == "completed", (first.status, first.error, pool.logs())  # its reply taught the limits
    settle_sha = run_script._script("limit_settle").sha
    with _commands_seen(pool) as seen:
        run = wait_for_run(
            enqueue_run("pool_agents:support", script_task("many"), connection=r), timeout=60, connection=r
        )
        assert run.status == "completed" and run.turns == calls, (run.status, run.error, pool.logs())
        (waiting,) = ratelimit.show(r)
        during = sum(c.startswith(f"EVALSHA {settle_sha} ") for c in seen)
        pool.stop(signal.SIGTERM)
        (view,) = ratelimit.show(r)
        after = sum(c.startswith(f"EVALSHA {settle_sha} ") for c in seen) - during
    assert during == 0, f"{during} settles sent with their turns"
    assert waiting.held["calls"] == calls, waiting.held  # every call's settle waits in the worker
    assert after == 1, f"the warm stop sent {after} script calls"
    assert view.held["calls"] == 0, "the warm stop did not settle every call"
    assert math.floor(view.levels["requests"]) >= 100_000 - 2 * calls, view.levels
    assert "could not settle" not in pool.logs() and "could not flush" not in pool.logs()


# Operator limits (no headers to learn from) and a minute so long that nothing refills during a test: the
# budget's levels count exactly what was taken and given back.
SLOW_MINUTE = {"AGENTPOOL_RATE_LIMIT_MINUTE": "100000"}


def _operator_rpm(rpm: int) -> dict[str, str]:
    return {"AGENTPOOL_RATE_LIMITS": f"claude-sonnet-5-5=rpm:{rpm}", **SLOW_MINUTE}


@pytest.mark.parametrize("kind", [["--concurrency", "2"], []], ids=["threaded", "forking"])
@pytest.mark.parametrize("check_agent", [True, False], ids=["agent-loaded", "agent-unknown"])
def test_a_turn_reserves_its_call_with_its_lease(r: Redis, pool, model, kind: list[str], check_agent: bool) -> None:
    """The turn before knows what the next call needs, so the next turn's lease reserves it in the same
    script: one round trip and one script a turn less on the API's path. The first turn's call is
    estimated by ``enqueue_run``, which loads the agent; an app that enqueues without the agents' code
    (``check_agent=False``) cannot, and that run's first turn reserves on its own. The turn a message to
    the completed run queues reserves with its lease too: the completing turn recorded its next call."""
    from agentpool import send_message

    model.set_scripts({"steps": [{"tool_calls": [READ]}] * 4 + [{"text": "All done."}, {"text": "Answered."}]})
    WorkerProcesses.start(pool, 1, *kind, **_operator_rpm(1000))
    with _commands_seen(pool) as seen:
        run_id = enqueue_run("pool_agents:support", script_task("steps"), connection=r, check_agent=check_agent)
        assert wait_for_run(run_id, timeout=60, connection=r).status == "completed"
        sent = send_message(run_id, "And one more thing?", connection=r)
        run = wait_for_run(run_id, timeout=60, connection=r, after_message=sent)
    assert run.status == "completed" and run.turns == 6, (run.status, run.error, pool.logs())
    budget = LimitKeys.of("claude-sonnet-5-5").budget
    reserve_sha, lease_sha = (run_script._script(name).sha for name in ("limit_reserve", "lease_acquire"))
    # The tickets (run:turn) reserved: a script Redis did not have yet is sent twice (NOSCRIPT, then loaded).
    alone = {c.split()[11] for c in seen if c.startswith(f"EVALSHA {reserve_sha} ")}
    with_lease = {c.split()[24] for c in seen if c.startswith(f"EVALSHA {lease_sha} ") and budget in c}
    first = 0 if check_agent else 1
    assert alone == ({f"{run_id}:0"} if first else set()), alone
    assert with_lease == {f"{run_id}:{turn}" for turn in range(first, 6)}, with_lease
    view = _budget(r)
    assert view.held["calls"] == 0 and view.waiting == 0
    assert math.floor(view.levels["requests"]) == 1000 - 6  # one request a call, each taken once


SLOW_READ = {"delay": 0.4, "tool_calls": [READ]}


@pytest.mark.parametrize("cause", ["budget", "model_error", "slot"])
def test_a_deferred_turn_reserves_its_call_and_reads_its_window_with_its_lease(
    r: Redis, pool, model, cause: str
) -> None:
    """A turn deferred (to wait for the budget, after a model error, to wait for a concurrency slot) leaves
    its call and where the run's window starts with its deferral, and the job the reaper makes of it
    carries them: coming back, its lease reserves the call and reads the window in the lease's one round
    trip, as a turn its predecessor queued does, instead of in a reservation script of its own and a
    script that looks at the header for the window first."""
    steps = [SLOW_READ, SLOW_READ, {"text": "All done."}]
    env = _operator_rpm(1000)
    runs = [{}]
    if cause == "budget":  # one request a 2 s minute: each call after the first waits for the refill
        env = {"AGENTPOOL_RATE_LIMITS": "claude-sonnet-5-5=rpm:1", "AGENTPOOL_RATE_LIMIT_MINUTE": "2"}
    elif cause == "model_error":
        overloaded = {"status": 529, "type": "overloaded_error", "message": "Overloaded", "times": 1}
        steps[1] = {**SLOW_READ, "error": overloaded}
    else:  # two runs, one slot between them: each turn of one waits while the other's turn runs
        runs = [{"concurrency_key": "team", "max_concurrency": 1}] * 2
    waited = {"budget": "waiting_for_budget", "model_error": "model_error", "slot": "waiting_for_slot"}[cause]
    model.set_scripts({"steps": steps})
    WorkerProcesses.start(pool, 1, "--concurrency", "2", **env)
    with _commands_seen(pool) as seen:
        run_ids = [
            enqueue_run("pool_agents:support", script_task("steps", f"task {n}"), connection=r, **options)
            for n, options in enumerate(runs)
        ]
        done = [wait_for_run(run_id, timeout=60, connection=r) for run_id in run_ids]
    assert [run.status for run in done] == ["completed"] * len(runs), ([x.error for x in done], pool.logs())
    deferred = [f for run_id in run_ids for _, f in events.read(r, run_id) if f["kind"] == waited]
    assert deferred, f"no turn was deferred ({waited}): the test did not test the deferred path"
    budget = LimitKeys.of("claude-sonnet-5-5").budget
    reserve_sha, lease_sha = (run_script._script(name).sha for name in ("limit_reserve", "lease_acquire"))
    alone = {c.split()[11] for c in seen if c.startswith(f"EVALSHA {reserve_sha} ")}
    with_lease = {c.split()[24] for c in seen if c.startswith(f"EVALSHA {lease_sha} ") and budget in c}
    assert alone == set(), f"turns that reserved in a script of their own: {alone}"
    assert with_lease == {f"{run_id}:{turn}" for run_id in run_ids for turn in range(3)}, with_lease
    window_scripts = [c for c in seen if c.startswith("EVAL ") and ":messages" in c]
    assert window_scripts == [], "a turn looked at the header for its window in a script"
    view = _budget(r)
    assert view.held["calls"] == 0 and view.waiting == 0


def test_the_reaper_gives_a_deferred_job_only_what_its_own_deferral_carried(r: Redis) -> None:
    """What a deferral leaves in the header is tied to its job's id. A turn deferred by an older release
    (which left nothing), one whose header a later deferral has written since, and one whose record is
    unreadable are enqueued as before this existed: with no window and no call, which the turn then
    reads and reserves itself."""
    call = ("claude-sonnet-5-5", 1200, 4096)
    runs = ("r_carried", "r_older", "r_garbled", "r_overwritten")
    with r.pipeline(transaction=True) as pipe:
        pipe.multi()
        for run_id in runs:
            stage_turn(pipe, r, run_id, 3, 2, delay=0.001, window=6, call=call)
        pipe.execute()
    r.hdel(RunKeys.of("r_older").run, DEFERRED_META)
    r.hset(RunKeys.of("r_garbled").run, DEFERRED_META, b"\xc1 not msgpack")
    r.hset(RunKeys.of("r_overwritten").run, DEFERRED_META, pack([job_id("r_overwritten", 3, 3), 6, list(call)]))
    time.sleep(0.01)  # all due
    moved = {one.run_id: one.job_id for one in promote_due(r)}
    assert moved == {run_id: job_id(run_id, 3, 2) for run_id in runs}
    metas = {run_id: turn_queue(r).fetch_job(jid).meta for run_id, jid in moved.items()}
    assert metas == {
        "r_carried": {"window": 6, "call": list(call)},
        "r_older": {},
        "r_garbled": {},
        "r_overwritten": {},
    }, metas


@pytest.mark.parametrize("rpm", [4, 3], ids=["granted", "waiting"])
def test_a_call_reserved_with_the_lease_but_never_made_goes_back_to_the_budget(r: Redis, pool, model, rpm: int) -> None:
    """A run stopped by max_turns after its third call: the fourth turn's lease reserved a call (rpm 4:
    the last request left) or put it in line (rpm 3: none left) before the turn found the run must stop.
    The request goes back, or the place in line is left, so no budget and no turn behind it is held for
    a call that is never made."""
    model.set_scripts({"steps": [{"tool_calls": [READ]}] * 4 + [{"text": "All done."}]})
    pool.start(1, **_operator_rpm(rpm))
    run = wait_for_run(
        enqueue_run("pool_agents:support", script_task("steps"), max_turns=3, connection=r), timeout=60, connection=r
    )
    assert run.status == "stopped" and "max_turns=3" in (run.error or ""), (run.status, run.error, pool.logs())
    assert model.stats()["requests"] == 3
    view = _budget(r)
    assert view.held["calls"] == 0, "the call reserved with the lease is still held"
    assert view.waiting == 0, "the stopped turn still holds a place in line"
    assert math.floor(view.levels["requests"]) == rpm - 3, view.levels
    assert "could not give back" not in pool.logs()


@pytest.mark.crash
def test_a_work_horse_killed_after_its_lease_reserved_the_call_costs_the_budget_that_call_only(
    r: Redis, pool, model
) -> None:
    """Every turn's work horse is SIGKILLed once between its lease (which reserved the call: the first
    turn's as ``enqueue_run`` estimated it, the others' as the turn before did) and the call. The turn
    taken over reserves again, with its lease too (the job its worker queues for the takeover carries
    the dead job's call), and the run completes; a dead attempt's reservation stays held (its worker
    never comes back to settle it) until the hourly sweep, and nothing else is taken twice."""
    model.set_scripts({"steps": [{"tool_calls": [READ]}] * 2 + [{"text": "All done."}]})
    pool.start(2, AGENTPOOL_FAULTS="before_model_call", **_operator_rpm(1000))
    with _commands_seen(pool) as seen:
        run_id = enqueue_run("pool_agents:support", script_task("steps"), connection=r)
        run = wait_for_run(run_id, timeout=120, connection=r)
    reserve_sha = run_script._script("limit_reserve").sha
    alone = [c.split()[11] for c in seen if c.startswith(f"EVALSHA {reserve_sha} ")]
    assert alone == [], f"turns that reserved in a script of their own: {alone}"
    assert run.status == "completed" and run.turns == 3, (run.status, run.error, pool.logs())
    assert_valid_conversation(run.messages)
    assert model.stats()["requests"] == 3, model.stats()
    kills = len(list(pool.tmp.glob(f"fault-before_model_call-{run_id}-*")))
    takeovers = [f for _, f in events.read(r, run_id) if f["kind"] == "takeover"]
    assert kills == 3 and len(takeovers) == 3, (kills, takeovers)
    # Each turn's first attempt reserved with its lease and died: three calls held, three made.
    view = _budget(r, held=3)
    assert view.held["calls"] == 3, view.held
    assert math.floor(view.levels["requests"]) == 1000 - 3 - 3, view.levels


@pytest.mark.crash
def test_a_worker_killed_after_its_lease_reserved_the_call_is_taken_over_with_that_call(
    r: Redis, pool, model, tmp_path
) -> None:
    """A threaded worker is SIGKILLed, whole, between its first turn's lease (which reserved the call)
    and the call: nobody sees it die, its lease expires, and another worker's reaper queues the turn
    again. The job it queues carries the dead job's call (read from that job's meta), so the attempt
    that takes over reserves with its lease as the first did, not in a script of its own; each attempt
    takes the budget once."""
    arms = tmp_path / "arms"
    arms.mkdir()
    run_id = "r_reaped_with_its_call"
    (arms / f"before_model_call-{run_id}").write_text("\nworker")  # once: the worker and its supervisor
    model.set_scripts({"steps": [{"tool_calls": [READ]}, {"text": "All done."}]})
    budget = LimitKeys.of("claude-sonnet-5-5").budget
    reserve_sha, lease_sha = (run_script._script(name).sha for name in ("limit_reserve", "lease_acquire"))
    r.script_load(run_script._script("lease_acquire").script)  # no NOSCRIPT: each lease is sent once
    with _commands_seen(pool) as seen:
        doomed = WorkerProcesses.start(
            pool, 1, "--concurrency", "2", AGENTPOOL_FAULT_ARMS=str(arms), **_operator_rpm(1000)
        )[0]
        enqueue_run("pool_agents:support", script_task("steps"), run_id=run_id, connection=r)
        assert doomed.wait(timeout=60) == -signal.SIGKILL, pool.logs()
        WorkerProcesses.start(pool, 1, "--concurrency", "2", **_operator_rpm(1000))
        run = wait_for_run(run_id, timeout=120, connection=r)
    assert run.status == "completed" and run.turns == 2, (run.status, run.error, pool.logs())
    takeovers = [f for _, f in events.read(r, run_id) if f["kind"] == "takeover"]
    assert [t["cause_kind"] for t in takeovers] == ["lease_expiry"], takeovers
    alone = [c.split()[11] for c in seen if c.startswith(f"EVALSHA {reserve_sha} ")]
    assert alone == [], f"turns that reserved in a script of their own: {alone}"
    with_lease = sorted(c.split()[24] for c in seen if c.startswith(f"EVALSHA {lease_sha} ") and budget in c)
    assert with_lease == [f"{run_id}:0", f"{run_id}:0", f"{run_id}:1"], with_lease
    assert model.stats()["requests"] == 2, model.stats()
    # The dead attempt's reservation stays held (nobody settles it until the hourly sweep); the two calls
    # made were taken once each.
    view = _budget(r, held=1)
    assert view.held["calls"] == 1 and math.floor(view.levels["requests"]) == 1000 - 3, (view.held, view.levels)


@contextlib.contextmanager
def _commands_seen(pool) -> Iterator[list[str]]:
    """Every command Redis ran meanwhile (Lua's included), from its MONITOR feed, as 'NAME key ...'."""
    seen: list[str] = []
    watcher = Redis.from_url(pool.env["REDIS_URL"])
    started, stop = threading.Event(), threading.Event()

    def listen() -> None:
        with watcher.monitor() as feed:
            started.set()
            for entry in feed.listen():
                if stop.is_set():
                    return
                seen.append(entry["command"])

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    started.wait(10)
    try:
        yield seen
    finally:
        stop.set()
        with Redis.from_url(pool.env["REDIS_URL"]) as waker:
            waker.ping()  # one more command wakes the feed up to see the stop
        thread.join(10)
        watcher.close()


@pytest.mark.parametrize("media", ["image", "pdf"])
def test_an_image_or_a_pdf_reserves_what_it_costs_the_model_not_a_minutes_budget(
    r: Redis, pool, model, media: str
) -> None:
    """A photo's base64 is no measure of its tokens (the API scales an image down: at most about 4,800),
    nor is a report's (the API counts a PDF by its pages). Counted as text, 300 KB would reserve the
    whole minute's input budget for one call and hold the turn (and the pool's others) until it
    refilled; counted as what it is, the call fits what is left."""
    from test_long_runs import pdf_block, png

    from agentpool import send_message

    model.set_scripts({"chat": [{"text": "Read it."}, {"text": "Read."}]})
    model.set_rate_limits(RateLimits(itpm=100_000))  # a real minute: what the first call used refills slowly
    pool.start(1)
    # The first call uses about a tenth of the minute's input (about 6 s to refill): the budget is learned.
    long_task = script_task("chat", "Read this: " + "lorem ipsum dolor " * 2_000)
    run_id = enqueue_run("pool_agents:support", long_task, connection=r)
    assert wait_for_run(run_id, timeout=60, connection=r).status == "completed"
    assert _budget(r).learned.get("input") == 100_000, _budget(r)
    if media == "image":
        block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png(400, 300)}}
    else:
        block = pdf_block(3, noise=250_000)  # 3 pages: at most 13,800 tokens
    assert len(block["source"]["data"]) // 3 > 100_000, "as text it would be more than the minute's budget"
    sent = send_message(run_id, [block, {"type": "text", "text": "What is this?"}], connection=r)
    run = wait_for_run(run_id, timeout=60, connection=r, after_message=sent)
    assert run.status == "completed" and run.result == "Read.", (run.error, pool.logs())
    waits = [f for _, f in events.read(r, run_id) if f["kind"] == "waiting_for_budget"]
    assert not waits, f"the image's call waited for a budget it fits in: {waits}"
    assert model.stats()["rate_limited"] == 0 and model.stats()["rejected"] == 0, model.stats()


# A gateway's 429 with a retry-after, and the API's rate_limit_error as an `error` event after the 200
# (no status, no retry-after): either pauses the model's calls when no rate-limit header came with it.
GATES = {
    "429": {"error": {"status": 429, "type": "rate_limit_error", "message": "Too many requests", "retry_after": 4}},
    "mid-stream": {"stream": {"cut": {"after": 2, "how": "error", "type": "rate_limit_error", "message": "Slow down"}}},
}


@pytest.mark.parametrize("gate", sorted(GATES))
def test_a_429_without_rate_limit_headers_pauses_the_models_calls_pool_wide(r: Redis, pool, model, gate: str) -> None:
    """A gateway's 429 carries a retry-after and no ``anthropic-ratelimit-*`` headers: nothing for the
    budget to learn. Its retry-after holds for the whole pool: the turns of other runs, in the other
    worker process too, wait it out instead of each calling into a 429 of its own (and coming back
    together the moment theirs runs out). A ``rate_limit_error`` in the middle of a stream pauses the
    same way, for the short pause a 429 without retry-after gets."""
    model_name = "claude-sonnet-5-5"
    others = [f"other{i}" for i in range(4)]
    model.set_scripts(
        {"warm": [{"text": "Warm."}], "gate": [{**GATES[gate], "text": "Through."}]}
        | {name: [{"text": "Done."}] for name in others}
    )
    pool.start(2)
    # With a 429's retry-after (4 s) there is time for this: a first reply with no rate-limit headers,
    # so the model is known to teach nothing, and a worker process that learned so trusts it for a
    # second and calls without asking the budget. The mid-stream pause (2 s) is checked without it.
    trusted = gate == "429"
    if trusted:
        warm = enqueue_run("pool_agents:support", script_task("warm"), connection=r)
        assert wait_for_run(warm, timeout=60, connection=r).status == "completed", pool.logs()
    gated = enqueue_run("pool_agents:support", script_task("gate"), connection=r)
    deadline = time.monotonic() + 30
    while not any(f["kind"] == "model_error" for _, f in events.read(r, gated)):
        assert time.monotonic() < deadline, pool.logs()
        time.sleep(0.02)
    paused_until = int(r.hget(LimitKeys.of(model_name).budget, "pause") or 0)
    assert paused_until, "the 429 paused nothing"
    if trusted:
        time.sleep(UNLIMITED_TRUSTED_FOR + 0.1)  # past any trust a process had: the pause is in Redis
    run_ids = [enqueue_run("pool_agents:support", script_task(name), connection=r) for name in others]

    for run_id in [gated, *run_ids]:
        run = wait_for_run(run_id, timeout=60, connection=r)
        assert run.status == "completed", (run.status, run.error, pool.logs())
    met = model.stats()["errors_injected"] + model.stats()["streams_cut"]
    assert met == 1, f"only the gated call met a 429: {model.stats()}"
    for run_id in run_ids:
        kinds = [(int(i.split("-")[0]), f) for i, f in events.read(r, run_id)]
        waits = [f for _, f in kinds if f["kind"] == "waiting_for_budget"]
        assert waits and all(f.get("paused") == "True" for f in waits), (kinds, pool.logs())
        (answered_at,) = [at for at, f in kinds if f["kind"] == "model_responded"]
        assert answered_at >= paused_until, f"{run_id} called {paused_until - answered_at} ms before the pause ended"


def test_a_run_failed_while_it_waited_for_the_budget_leaves_the_line_when_its_turn_comes(r: Redis, pool, model) -> None:
    """A run that fails while its turn waits in the budget's line (failed from outside its turn: the
    reaper's attempts ran out, a record found corrupt) cannot take its ticket out itself. Its deferred
    turn comes due at its place in line and finds the run failed: it takes the ticket out then, instead of
    leaving it to hold back every call behind it until its place expires, half a minute later."""
    model.set_scripts({"steps": [{"text": "All done."}]})
    # One request a 6 s minute: the first run's call takes it, the two others wait 6 and 12 s in line.
    WorkerProcesses.start(
        pool,
        1,
        "--concurrency",
        "2",
        "--log-level",
        "INFO",
        AGENTPOOL_RATE_LIMITS="claude-sonnet-5-5=rpm:1",
        AGENTPOOL_RATE_LIMIT_MINUTE="6",
    )
    run_ids = [enqueue_run("pool_agents:support", script_task("steps", f"task {n}"), connection=r) for n in range(3)]
    keys = LimitKeys.of("claude-sonnet-5-5")
    deadline = time.monotonic() + 60
    while r.zcard(keys.waiting) < 2:
        assert time.monotonic() < deadline, ("the other runs never waited in line", pool.logs())
        time.sleep(0.05)
    head, behind = [m.decode() for m in r.zrange(keys.waiting, 0, -1)]
    failed = head.removesuffix(":0")
    assert failed in run_ids, head
    assert checkpoint.fail_unfenced(r, failed, "failed from outside its turn", retention_s=3600)
    pool.wait_for_log(lambda line: f"run {failed} turn 0: not_active (failed)" in line, "of the failed run's turn")
    assert [m.decode() for m in r.zrange(keys.waiting, 0, -1)] in ([behind], []), "the failed run's ticket left"
    assert head.encode() not in r.hkeys(keys.needs)
    others = [run_id for run_id in run_ids if run_id != failed]
    assert [wait_for_run(run_id, timeout=90, connection=r).status for run_id in others] == ["completed"] * 2


def test_a_cancelled_run_leaves_the_line_for_the_budget_at_once(r: Redis, pool, model) -> None:
    """Runs that wait for the budget hold places in its line, and a call new to the line waits for what
    they all need. Cancelled, a run leaves the line there and then (its need out of the line's sum), not
    when its place would have expired (its wait and half a minute more): an operator who cancels a
    runaway batch frees the limit for the others at once."""
    model.set_scripts({"steps": [{"text": "All done."}]})
    # One request a 60 s minute: the first run's call takes it, every other one waits most of a minute.
    WorkerProcesses.start(
        pool, 1, "--concurrency", "2", AGENTPOOL_RATE_LIMITS="claude-sonnet-5-5=rpm:1", AGENTPOOL_RATE_LIMIT_MINUTE="60"
    )
    run_ids = [enqueue_run("pool_agents:support", script_task("steps", f"task {n}"), connection=r) for n in range(4)]
    keys = LimitKeys.of("claude-sonnet-5-5")
    deadline = time.monotonic() + 60
    while r.zcard(keys.waiting) < 3:  # whichever run's call came first, the other three wait in line
        assert time.monotonic() < deadline, ("the other runs never waited in line", pool.logs())
        time.sleep(0.05)
    tickets = [m.decode() for m in r.zrange(keys.waiting, 0, -1)]
    waiting = [ticket.removesuffix(":0") for ticket in tickets]
    assert len(set(waiting)) == 3 and set(waiting) <= set(run_ids), tickets
    (view,) = ratelimit.show(r)
    assert view.in_line["requests"] == 3, view
    for run_id in waiting[:2]:  # the two at the head: every call behind them waits for them
        assert cancel_run(run_id, connection=r) in ("queued", "running"), "it had not ended"
    assert [m.decode() for m in r.zrange(keys.waiting, 0, -1)] == tickets[2:]
    assert not set(tickets[:2]) & {field.decode() for field in r.hkeys(keys.needs)}
    (view,) = ratelimit.show(r)
    assert (view.waiting, view.in_line["requests"]) == (1, 1), view
