"""Every write is safe to deliver twice: each one's reply is lost once, on the wire, and it lands once.

The client is agentpool's own (``connect``: redis-py retrying on ConnectionError) talking to Redis
through ``agentpool.testing.netfault``, a TCP proxy that lets Redis apply a request and then closes
the client's connection instead of passing the reply on. redis-py re-sends a command, a script or an
unwatched MULTI; a watched transaction raises WatchError instead. Every assertion reads Redis directly.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from agentpool import RunExists, approve, cancel_run, enqueue_run, resume, wait_for_run
from agentpool.runtime.jobs import stage_turn, turn_queue
from agentpool.runtime.settings import connect
from agentpool.runtime.takeover import requeue_turn
from agentpool.store import checkpoint, events, handback, ledger, spend, stats, window
from agentpool.store.events import Event, emit
from agentpool.store.keys import TURNS_DEFERRED, RunKeys
from agentpool.store.lease import Acquire, acquire, release, renew
from agentpool.store.ledger import Outcome
from agentpool.store.scripts import run_script
from agentpool.testing.netfault import NetFault, resp_command

RUN = "r_twice0001"
KEYS = RunKeys.of(RUN)
EXEC = resp_command("EXEC")
LUA = Path(checkpoint.__file__).with_name("lua")
USAGE = {"input_tokens": 1000, "output_tokens": 100, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}


def script(name: str) -> bytes:
    return resp_command("EVALSHA", run_script._script(name).sha)


@pytest.fixture
def proxy(r: Redis, redis_server) -> Iterator[NetFault]:
    with NetFault.to(redis_server.url) as fault:
        yield fault


def load_scripts(r: Redis) -> None:
    """Every script in Redis's cache first: a cut must hit a request Redis applied, not a NOSCRIPT
    answer (which the client follows with SCRIPT LOAD and a clean second try)."""
    for path in LUA.glob("[a-z]*.lua"):
        r.script_load(run_script._script(path.stem).script)


@pytest.fixture
def lossy(r: Redis, proxy: NetFault) -> Iterator[Redis]:
    """agentpool's client, reaching Redis through the proxy."""
    load_scripts(r)
    client = connect(proxy.url)
    yield client
    client.close()


def cut(proxy: NetFault, pattern: bytes):
    """Arm the proxy; the block must make the request whose reply is lost (checked on the way out)."""

    class Armed:
        def __enter__(self) -> None:
            proxy.cut_next_reply(pattern)

        def __exit__(self, kind, exc, tb) -> None:
            if kind is None:
                assert proxy.pending_cuts() == 0, "the reply to cut was never sent"

    return Armed()


def create(r: Redis, run_id: str = RUN) -> None:
    with r.pipeline(transaction=True) as pipe:
        pipe.multi()
        checkpoint.stage_create(pipe, run_id, agent="pool_agents:support", task="do it", limits={}, now=time.time())
        pipe.execute()


def take(r: Redis, worker: str = "w1.100", ttl_ms: int = 10_000) -> str:
    got = acquire(r, KEYS, turn=0, worker_id=worker, ttl_ms=ttl_ms)
    assert got.code is Acquire.ACQUIRED, got
    return got.token


def kinds(r: Redis, run_id: str = RUN) -> Counter:
    return Counter(e["kind"] for _, e in events.read(r, run_id))


def reply(tool_use: dict | None = None) -> dict:
    content: list[dict] = [{"type": "text", "text": "hi"}]
    if tool_use:
        content.append({"type": "tool_use", **tool_use})
    return {"role": "assistant", "content": content}


CALL = {"id": "toolu_1", "name": "send_email", "input": {"to": "a"}}


def test_a_lease_acquire_delivered_twice_recognises_its_own_request(r, proxy, lossy):
    create(r)
    with cut(proxy, script("lease_acquire")):
        got = acquire(
            lossy,
            KEYS,
            turn=0,
            worker_id="w1.100",
            ttl_ms=10_000,
            event=Event.of(RUN, "turn_started", turn=0),
            then=lambda pipe: checkpoint.stage_load(pipe, RUN),
        )
    fence = r.hget(KEYS.run, "fence").decode()
    assert got.code is Acquire.ACQUIRED and got.token == f"{fence}:w1.100", got
    assert checkpoint.decode_run(RUN, *got.then).status == "running"
    assert r.get(KEYS.lease) == got.token.encode(), "one fence issued, the one the header records"
    assert kinds(r)["turn_started"] == 1 and stats.read_all(r)["turns"] == 1


def test_renew_and_release_delivered_twice_change_nothing_more(r, proxy, lossy):
    create(r)
    token = take(r)
    with cut(proxy, script("lease_renew")):
        assert renew(lossy, KEYS, token, 20_000)
    assert r.pttl(KEYS.lease) > 10_000
    with cut(proxy, script("lease_release")):
        release(lossy, KEYS, token)
    assert not r.exists(KEYS.lease)


def test_save_point_a_delivered_twice_counts_its_spend_and_turn_once(r, proxy, lossy):
    create(r)
    token = take(r)
    with cut(proxy, script("commit_response")):
        checkpoint.commit_response(
            lossy,
            KEYS,
            token,
            turns_before=0,
            message=reply(CALL),
            pending=[CALL],
            usage=USAGE,
            cost_usd=0.5,
            responded=Event.of(RUN, "model_responded", turn=0, cost_usd=0.5, **USAGE),
            event=Event.of(RUN, "response_committed", turn=0),
        )
    state = checkpoint.load_run(r, RUN)
    assert (state.usage, state.cost_usd, state.turns, len(state.messages)) == (USAGE, 0.5, 1, 2)
    assert r.get(KEYS.lease) == token.encode(), "the turn goes on holding its lease"
    assert kinds(r)["model_responded"] == 1 and kinds(r)["response_committed"] == 1
    assert stats.read_all(r)["tokens|kind=input_tokens"] == 1000 and stats.read_all(r)["cost_usd"] == 0.5


def test_save_point_a_refused_and_delivered_twice_still_counts_its_spend_once(r, proxy, lossy):
    create(r)
    token = take(r)
    checkpoint.set_status_unfenced(r, RUN, "cancelled")
    with cut(proxy, script("commit_response")), pytest.raises(checkpoint.RunNotActive):
        checkpoint.commit_response(
            lossy, KEYS, token, turns_before=0, message=reply(), pending=[], usage=USAGE, cost_usd=0.5
        )
    state = checkpoint.load_run(r, RUN)
    assert (state.usage, state.cost_usd, state.turns) == (USAGE, 0.5, 0)


READ = {"id": "toolu_r", "name": "read_notes", "input": {"topic": "release"}}


def test_save_point_a_writes_the_intents_of_the_reads_run_next_once_and_only_if_it_commits(r, proxy, lossy):
    """A read the worker runs right after save point A gets its intent in that write (no write of its
    own): once however often A is delivered, and none from a worker that lost the lease."""
    create(r)
    token = take(r)
    intent = ledger.intent_record(READ, token, effect="read", attempt=1, now=time.time(), timeout=30)

    def commit(client: Redis) -> None:
        started = Event.of(RUN, "tool_started", tool="read_notes", tool_use_id="toolu_r", effect="read", attempt=1)
        checkpoint.commit_response(
            client,
            KEYS,
            token,
            turns_before=0,
            message=reply(READ),
            pending=[READ],
            event=Event.of(RUN, "response_committed", turn=0, tool_uses=1),
            intents=[("toolu_r", intent, started)],
        )

    r.set(KEYS.lease, "1:w2.200")  # another worker's lease: this one is a zombie
    with pytest.raises(checkpoint.LeaseLost):
        commit(r)
    assert not r.exists(KEYS.ledger) and kinds(r)["tool_started"] == 0
    r.set(KEYS.lease, token)
    with cut(proxy, script("commit_response")):
        commit(lossy)
    entry = ledger.read(r, KEYS, ["toolu_r"])["toolu_r"]
    assert entry.intent == intent and entry.outcome is None
    assert kinds(r)["tool_started"] == 1 and stats.read_all(r)["tool_calls|effect=read"] == 1
    assert checkpoint.load_run(r, RUN).pending == [READ]


def commit_summary(client: Redis, token: str) -> None:
    window.commit_summary(
        client,
        KEYS,
        token,
        turns_before=0,
        index=1,
        message={"role": "user", "content": [{"type": "text", "text": "summary"}]},
        meta={"compaction": "summary"},
        usage=USAGE,
        cost_usd=0.5,
        event=Event.of(RUN, "compacted", turn=0, mode="summary", cost_usd=0.5, **USAGE),
    )


def test_a_summary_delivered_twice_counts_its_spend_once_and_is_saved_once(r, proxy, lossy):
    create(r)
    token = take(r)
    with cut(proxy, script("commit_summary")):
        commit_summary(lossy, token)
    state = window.load(r, RUN)
    assert (state.usage, state.cost_usd, state.window_start) == (USAGE, 0.5, 1)
    assert r.llen(KEYS.messages) == 2 and kinds(r)["compacted"] == 1
    assert stats.read_all(r)["cost_usd"] == 0.5


def test_a_fenced_out_summary_is_not_saved_but_its_call_is_counted_once(r, proxy, lossy):
    """A zombie's summary call was paid for: usage covers every call paid for, as at save point A."""
    create(r)
    token = take(r)
    r.delete(KEYS.lease)
    take(r, worker="w2.200")
    with cut(proxy, script("commit_summary")), pytest.raises(checkpoint.LeaseLost):
        commit_summary(lossy, token)
    state = window.load(r, RUN)
    assert (state.usage, state.cost_usd, state.window_start) == (USAGE, 0.5, 0)
    assert r.llen(KEYS.messages) == 1, "the fenced-out summary is not in the conversation"
    assert stats.read_all(r)["cost_usd"] == 0.5


def test_a_cut_streams_spend_is_counted_once_even_by_a_fenced_out_worker(r, proxy, lossy):
    create(r)
    token = take(r)
    r.delete(KEYS.lease)
    take(r, worker="w2.200")
    cut_event = Event.of(RUN, "model_cut", turn=0, cost_usd=0.5, **USAGE)
    with cut(proxy, script("count_spend")), pytest.raises(checkpoint.LeaseLost):
        spend.count_spend(lossy, KEYS, token, spend_id="call1", usage=USAGE, cost_usd=0.5, event=cut_event)
    with pytest.raises(checkpoint.LeaseLost):  # the worker's own retry of the same call
        spend.count_spend(r, KEYS, token, spend_id="call1", usage=USAGE, cost_usd=0.5, event=cut_event)
    state = checkpoint.load_run(r, RUN)
    assert (state.usage, state.cost_usd) == (USAGE, 0.5) and kinds(r)["model_cut"] == 1
    assert stats.read_all(r)["cost_usd"] == 0.5


def test_ledger_writes_delivered_twice_record_one_event_each(r, proxy, lossy):
    create(r)
    token = take(r)
    checkpoint.commit_response(r, KEYS, token, turns_before=0, message=reply(CALL), pending=[CALL])
    started = Event.of(RUN, "tool_started", tool="send_email", effect="unsafe")
    with cut(proxy, script("fenced_hset")):
        ledger.write_intent(lossy, KEYS, token, CALL, effect="unsafe", attempt=1, now=1.0, event=started)
    finished = Event.of(RUN, "tool_finished", tool="send_email", effect="unsafe")
    with cut(proxy, script("fenced_hset")):
        ledger.write_outcome(lossy, KEYS, token, "toolu_1", Outcome("sent", False), how="ran", now=2.0, event=finished)
    entry = ledger.read(r, KEYS, ["toolu_1"])["toolu_1"]
    assert entry.intent["attempt"] == 1 and entry.outcome == Outcome("sent", False, how="ran")
    assert (kinds(r)["tool_started"], kinds(r)["tool_finished"]) == (1, 1)
    assert stats.read_all(r)["tool_calls|effect=unsafe"] == 1


def test_finish_delivered_twice_appends_its_message_once(r, proxy, lossy):
    create(r)
    token = take(r)
    last = {"role": "user", "content": "the end"}
    with cut(proxy, script("finish")):
        checkpoint.finish(
            lossy,
            KEYS,
            token,
            status="stopped",
            error="a limit",
            message=last,
            phase="done",
            event=Event.of(RUN, "status", status="stopped"),
        )
    state = checkpoint.load_run(r, RUN)
    assert (state.status, len(state.messages), kinds(r)["status"]) == ("stopped", 2, 1)


def test_save_point_b_whose_exec_reply_is_lost_knows_it_landed(r, proxy, lossy):
    create(r)
    token = take(r)
    checkpoint.commit_response(r, KEYS, token, turns_before=0, message=reply(CALL), pending=[CALL])
    results = {"role": "user", "content": [Outcome("sent", False).as_tool_result("toolu_1")]}
    with cut(proxy, EXEC):
        checkpoint.commit_tool_results(
            lossy,
            KEYS,
            token,
            message=results,
            enqueue_next=lambda pipe: stage_turn(pipe, lossy, RUN, 1),
            turns=1,
            event=Event.of(RUN, "turn_committed", turn=0),
        )  # before: LeaseLost, though it had committed
    state = checkpoint.load_run(r, RUN)
    assert (state.phase, len(state.messages), turn_queue(r).count, kinds(r)["turn_committed"]) == ("model", 3, 1, 1)


def test_a_deferral_whose_exec_reply_is_lost_knows_it_landed(r, proxy, lossy):
    create(r)
    token = take(r)
    with cut(proxy, EXEC):
        checkpoint.defer_turn(
            lossy,
            KEYS,
            token,
            model_errors=1,
            delay_ms=60_000,
            enqueue_later=lambda pipe, n: stage_turn(pipe, lossy, RUN, 0, n, delay=60),
            reason="overloaded_error",
        )
    assert r.hmget(KEYS.run, ["attempt", "requeues", "model_errors"]) == [b"0", b"1", b"1"]
    assert r.zrange(TURNS_DEFERRED, 0, -1) == [f"{RUN}:0:1".encode()]
    assert turn_queue(r).count == 0  # not an RQ job until due


def test_an_enqueue_delivered_twice_creates_one_run_and_one_job(r, proxy, lossy):
    with cut(proxy, EXEC):
        run_id = enqueue_run("pool_agents:support", "do it", run_id=RUN, connection=lossy)
    assert run_id == RUN
    assert (r.llen(KEYS.messages), turn_queue(r).count, kinds(r)["status"]) == (1, 1, 1)


def test_enqueue_with_an_existing_id_returns_the_same_run_untouched_or_refuses_another(r):
    run_id = enqueue_run("pool_agents:support", "do it", run_id=RUN, max_turns=5, connection=r)
    token = take(r)
    checkpoint.commit_response(r, KEYS, token, turns_before=0, message=reply(), pending=[], usage=USAGE)
    before = {k: r.dump(k) for k in (KEYS.run, KEYS.messages, KEYS.lease)}
    assert enqueue_run("pool_agents:support", "do it", run_id=run_id, max_turns=5, connection=r) == run_id
    assert {k: r.dump(k) for k in before} == before, "the run was not touched: no reset, no second task"
    assert turn_queue(r).count == 1, "no second first turn"
    for other in (
        {"agent": "pool_agents:short", "task": "do it", "max_turns": 5},
        {"agent": "pool_agents:support", "task": "do something else", "max_turns": 5},
        {"agent": "pool_agents:support", "task": "do it", "max_turns": 6},
    ):
        with pytest.raises(RunExists, match="already exists"):
            enqueue_run(other.pop("agent"), other.pop("task"), run_id=run_id, connection=r, **other)
    assert {k: r.dump(k) for k in before} == before
    assert r.hget(KEYS.run, "fence") == token.partition(":")[0].encode(), "fence numbers are never issued again"


def test_an_approval_delivered_twice_is_decided_once_and_queues_one_turn(r, proxy, lossy):
    create(r)
    token = take(r)
    call = {"id": "toolu_d", "name": "deploy", "input": {"version": "1"}}
    checkpoint.commit_response(r, KEYS, token, turns_before=0, message=reply(call), pending=[call])
    from agentpool.store import approvals

    approvals.request(r, KEYS, token, call, now=time.time(), deadline=None)
    checkpoint.finish(r, KEYS, token, status="waiting_approval")
    with cut(proxy, EXEC):
        assert approve(RUN, connection=lossy) == ["toolu_d"]  # before: "run is running, not waiting"
    assert r.hget(KEYS.run, "status") == b"running" and turn_queue(r).count == 1
    assert kinds(r)["approval"] <= 1


def test_a_cancel_delivered_twice_reports_what_it_replaced(r, proxy, lossy):
    create(r)
    take(r)
    with cut(proxy, EXEC):
        assert cancel_run(RUN, connection=lossy) == "running"
    assert r.hget(KEYS.run, "status") == b"cancelled"


def test_a_resume_delivered_twice_resumes_once_with_a_job_of_its_own(r, proxy, lossy):
    create(r)
    token = take(r)
    checkpoint.finish(r, KEYS, token, status="stopped", error="max_turns")
    stopped_job = r.hget(KEYS.run, "job")
    with cut(proxy, EXEC):
        resume(RUN, add_turns=3, connection=lossy)  # before: "only a stopped run can be resumed"
    jobs = turn_queue(r).get_job_ids()
    assert r.hget(KEYS.run, "status") == b"running" and len(jobs) == 1
    assert jobs[0] != stopped_job and jobs[0] == f"{RUN}-t0000-r1", "not the stopped turn's job id"
    assert checkpoint.load_run(r, RUN, with_messages=False).limits["extra_turns"] == 3


def test_a_takeover_whose_exec_reply_is_lost_requeues_once_and_counts_one_attempt(r, proxy, lossy):
    create(r)
    take(r, ttl_ms=50)
    time.sleep(0.1)
    with cut(proxy, EXEC):
        jid = requeue_turn(lossy, RUN, cause="lease expired", cause_kind="lease_expiry")
    assert jid == f"{RUN}-t0000-r1"
    assert r.hmget(KEYS.run, ["attempt", "requeues"]) == [b"1", b"1"] and turn_queue(r).count == 1
    assert kinds(r)["takeover"] == 1


def test_an_event_delivered_twice_is_counted_once(r, proxy, lossy):
    create(r)
    with cut(proxy, script("emit_event")):
        emit(lossy, RUN, "takeover", cause="x", cause_kind="lease_expiry")
    assert kinds(r)["takeover"] == 1 and stats.read_all(r)["takeovers|cause=lease_expiry"] == 1


def test_a_hand_back_delivered_twice_is_counted_once(r, proxy, lossy):
    create(r)
    token = take(r)
    event = Event(RUN, "handed_back", {"reason": "key_missing"}, {"handbacks|reason=key_missing": 1.0})
    with cut(proxy, script("hand_back")):
        record = handback.hand_back(
            lossy, KEYS, token=token, reason="key_missing", detail="no key", worker="w1.100", job="j", event=event
        )
    assert record is not None and record.count == 1
    assert handback.read(r, KEYS).count == 1 and not r.exists(KEYS.lease)
    assert stats.read_all(r)["handbacks|reason=key_missing"] == 1


def test_fail_unfenced_delivered_twice_and_never_over_a_cancel(r, proxy, lossy):
    create(r)
    with cut(proxy, script("fail_unfenced")):
        checkpoint.fail_unfenced(lossy, RUN, "broken", retention_s=0)
    assert r.hmget(KEYS.run, ["status", "error"]) == [b"failed", b"broken"]
    create(r, "r_twice0002")
    checkpoint.set_status_unfenced(r, "r_twice0002", "cancelled", error="by a person")
    assert not checkpoint.fail_unfenced(r, "r_twice0002", "broken", retention_s=0)
    assert r.hget(RunKeys.of("r_twice0002").run, "status") == b"cancelled", "a cancel is never turned into a failure"


# -- a whole pool behind a proxy that loses one reply in a hundred ----------------------------------

PER_CALL = {"input_tokens": 1000, "output_tokens": 100, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
LOSSY_STEPS = [
    {"tool_calls": [{"name": "read_notes", "input": {"topic": "release"}}], "usage": PER_CALL},
    {"tool_calls": [{"name": "create_ticket", "input": {"title": "Changelog", "body": "Ana"}}], "usage": PER_CALL},
    {"text": "All done.", "usage": PER_CALL},
]


def _successful_jobs(r: Redis) -> dict[str, int]:
    from rq import Worker

    return {w.name: w.successful_job_count for w in Worker.all(connection=r)}


@pytest.mark.crash
def test_a_pool_losing_one_reply_in_a_hundred_finishes_every_run_with_exact_usage(r, redis_server, model, tmp_path):
    from agentpool.pricing import price_of

    from conftest import Pool, assert_valid_conversation, script_task

    names = [f"lossy{i}" for i in range(8)]
    model.set_scripts(dict.fromkeys(names, LOSSY_STEPS))
    load_scripts(r)
    with NetFault.to(redis_server.url, reply_loss=0.01, seed=3) as proxy:
        # Besides one reply in a hundred at random, the replies of the writes that did harm before are
        # sure to be lost a few times each: the lease acquire, save point A, a ledger write, a MULTI.
        for name in ("lease_acquire", "commit_response", "fenced_hset"):
            proxy.cut_next_reply(script(name), times=3)
        proxy.cut_next_reply(EXEC, times=3)
        pool = Pool(proxy.url, model, tmp_path)
        try:
            pool.start(2)
            app = connect(proxy.url)  # the app's enqueues go through the lossy link too
            runs = {enqueue_run("pool_agents:support", script_task(name), connection=app): name for name in names}
            price = price_of("claude-sonnet-5-5")
            for run_id, name in runs.items():
                run = wait_for_run(run_id, timeout=240, connection=r)
                assert run.status == "completed", (run_id, run.status, run.error, pool.logs())
                assert_valid_conversation(run.messages)
                calls = model.stats()["by_script"][name]  # every call the model served for this run, paid for
                assert calls >= len(LOSSY_STEPS)
                assert run.usage == {k: v * calls for k, v in PER_CALL.items()}, (run_id, calls, run.usage)
                assert run.cost_usd == pytest.approx(calls * price.cost(PER_CALL))
            assert len(r.keys("ap:{run:*}:run")) == len(names), "no run was created twice"
            assert proxy.pending_cuts() == 0 and proxy.replies_cut > 12, proxy.replies_cut

            # No worker is stuck: both are alive and both still take turns.
            assert len(pool.alive()) == 2, pool.logs()
            before = _successful_jobs(r)
            proxy.reply_loss = 0.0
            more = [enqueue_run("pool_agents:support", script_task("lossy0"), connection=r) for _ in range(6)]
            for run_id in more:
                assert wait_for_run(run_id, timeout=120, connection=r).status == "completed", pool.logs()
            # A worker adds the jobs it ended to its RQ record with its heartbeat, every few seconds.
            deadline = time.monotonic() + 120
            while True:
                after = _successful_jobs(r)
                took_turns = len(after) == 2 and all(after[name] > before.get(name, 0) for name in after)
                if took_turns or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert took_turns, (before, after)
        finally:
            pool.stop()


def test_a_save_point_re_sent_after_a_burst_of_app_writes_is_still_recognised(r, monkeypatch):
    """redis-py re-sends save point A (same write id) after a lost reply; meanwhile the app sent 20
    messages to the run. Their write ids must not push the save point's out of the ring it is
    recognised by, or the re-send counts the call's spend twice and the worker drops a committed turn."""
    from agentpool import send_message
    from agentpool.store import writes

    create(r)
    token = take(r)
    monkeypatch.setattr(writes, "new_id", lambda: "feedfacecafe")  # what a re-send carries: the same id

    def save_point_a() -> None:
        checkpoint.commit_response(
            r, KEYS, token, turns_before=0, message=reply(CALL), pending=[CALL], usage=USAGE, cost_usd=0.5
        )

    save_point_a()
    monkeypatch.undo()
    for i in range(20):
        send_message(RUN, f"message {i}", message_id=f"burst{i}", connection=r)
    monkeypatch.setattr(writes, "new_id", lambda: "feedfacecafe")
    save_point_a()  # the re-send: recognised, nothing applied twice
    state = checkpoint.load_run(r, RUN)
    assert (state.usage, state.cost_usd, state.turns) == (USAGE, 0.5, 1)
    assert r.get(KEYS.lease) == token.encode()


def test_save_point_b_outlasts_a_burst_of_messages_that_keeps_changing_what_it_watches(r, monkeypatch):
    """Each message sent to the run between save point B's read and its EXEC makes the EXEC fail (the
    inbox is watched). B must not give up while the lease is its own: 30 in a row, then B lands with
    every message delivered once, in order."""
    from agentpool import send_message
    from agentpool.store import inbox

    create(r)
    token = take(r)
    checkpoint.commit_response(r, KEYS, token, turns_before=0, message=reply(CALL), pending=[CALL], usage=USAGE)
    read_waiting, sent = inbox.read_waiting, []

    def a_message_lands_meanwhile(pipe, keys):
        found = read_waiting(pipe, keys)
        if len(sent) < 30:
            sent.append(send_message(RUN, f"message {len(sent)}", message_id=f"burst{len(sent)}", connection=r))
        return found

    monkeypatch.setattr(inbox, "read_waiting", a_message_lands_meanwhile)
    result = {"role": "user", "content": [Outcome("sent", False).as_tool_result(CALL["id"])]}
    checkpoint.commit_tool_results(
        r, KEYS, token, message=result, enqueue_next=lambda pipe: stage_turn(pipe, r, RUN, 1), turns=1
    )
    assert len(sent) == 30
    last = checkpoint.load_run(r, RUN).messages[-1]
    texts = [block["text"] for block in last["content"] if block.get("type") == "text"]
    assert texts == [f"message {i}" for i in range(30)], texts


NOTED = {"input_tokens": 1000, "output_tokens": 1, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
REST = {"input_tokens": 0, "output_tokens": 99, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}


@pytest.mark.parametrize("refused", ["commit_response", "commit_summary", "count_spend"])
def test_the_rest_of_a_call_a_takeover_counted_from_its_note_counts_once_in_the_refused_write(r, proxy, lossy, refused):
    """A worker fenced out while the model answered: the turn that took the run over counted its call
    from the note made at message_start (input, and 1 output token). The worker's save of the call (save
    point A, a summary's save, or a cut stream's count) is refused, and counts what the note did not know
    (99 output tokens) in that very write, with its spend_corrected event: once, though delivered twice,
    and the call itself no second time."""
    create(r)
    zombie = take(r)
    r.delete(KEYS.lease)
    takeover = take(r, worker="w2.200")
    worker_lost = Event.of(RUN, "model_cut", turn=0, error_type="worker_lost", cost_usd=0.4, **NOTED)
    assert spend.count_spend(r, KEYS, takeover, spend_id="call:msg_1", usage=NOTED, cost_usd=0.4, event=worker_lost)
    rest = spend.Rest("msg_1", REST, 0.1, Event.of(RUN, "spend_corrected", turn=0, call="msg_1", cost_usd=0.1, **REST))
    meta = {"id": "msg_1"}
    with cut(proxy, script(refused)), pytest.raises(checkpoint.LeaseLost):
        if refused == "commit_response":
            checkpoint.commit_response(
                lossy, KEYS, zombie, turns_before=0, message=reply(), meta=meta, pending=[], usage=USAGE, cost_usd=0.5,
                responded=Event.of(RUN, "model_responded", turn=0, cost_usd=0.5, **USAGE), rest=rest,
            )  # fmt: skip
        elif refused == "commit_summary":
            window.commit_summary(
                lossy, KEYS, zombie, turns_before=0, index=1, message=reply(), meta={**meta, "compaction": "summary"},
                usage=USAGE, cost_usd=0.5, event=Event.of(RUN, "compacted", turn=0, mode="summary", **USAGE),
                rest=rest,
            )  # fmt: skip
        else:
            spend.count_spend(
                lossy, KEYS, zombie, spend_id="call:msg_1", usage=USAGE, cost_usd=0.5, rest=rest,
                event=Event.of(RUN, "model_cut", turn=0, error_type="timeout", cost_usd=0.5, **USAGE),
            )  # fmt: skip
    state = checkpoint.load_run(r, RUN)
    assert (state.usage, state.cost_usd) == (USAGE, pytest.approx(0.5)), "the note's count and the rest, once each"
    assert kinds(r) == Counter({"model_cut": 1, "spend_corrected": 1}), kinds(r)
    assert stats.read_all(r)["tokens|kind=output_tokens"] == 100 and stats.read_all(r)["cost_usd"] == pytest.approx(0.5)
    assert r.llen(KEYS.messages) == 1, "nothing of the fenced-out worker's saved"
    assert r.get(KEYS.lease) == takeover.encode()
