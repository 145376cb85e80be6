"""The store against a real redis-server: leases, fencing, save points, ledger, codec."""

from __future__ import annotations

import time

import msgpack
import pytest

from agentpool.store import checkpoint, events, ledger, ratelimit, spend, stats, window
from agentpool.store.codec import pack, unpack
from agentpool.store.errors import LeaseLost, RunNotActive, SchemaTooNew, UnreadableRecord
from agentpool.store.events import Event
from agentpool.store.keys import RunKeys
from agentpool.store.lease import Acquire, acquire, holder, release, release_dead_holder, renew
from agentpool.store.ledger import Outcome
from agentpool.store.records import SCHEMA_VERSION

RUN = "r_test0001"
KEYS = RunKeys.of(RUN)


def create(r, run_id=RUN):
    with r.pipeline(transaction=True) as pipe:
        pipe.multi()
        checkpoint.stage_create(pipe, run_id, agent="pool_agents:support", task="do it", limits={}, now=time.time())
        pipe.execute()


def take(r, turn=0, worker="w1.100", ttl_ms=5000):
    got = acquire(r, KEYS, turn=turn, worker_id=worker, ttl_ms=ttl_ms)
    assert got.code is Acquire.ACQUIRED, got
    return got.token


def reply(text="hi", tool_use=None):
    content = [{"type": "text", "text": text}]
    if tool_use:
        content.append({"type": "tool_use", **tool_use})
    return {"role": "assistant", "content": content}


def test_lease_is_exclusive_fenced_and_compare_and_delete(r):
    create(r)
    first = take(r)
    fence, _, owner = first.partition(":")
    assert owner == "w1.100" and int(fence) >= int(r.time()[0]) * 1000 - 60_000, "a fence is never below the clock"
    assert acquire(r, KEYS, turn=0, worker_id="w2.200", ttl_ms=5000).code is Acquire.HELD
    assert not release(r, KEYS, f"{fence}:someone-else")
    assert holder(r, KEYS) == first
    assert renew(r, KEYS, first, 5000)
    assert release(r, KEYS, first)
    second = take(r, worker="w2.200")
    assert int(second.partition(":")[0]) > int(fence), "every acquisition raises the fence"
    assert not renew(r, KEYS, first, 5000), "an old owner cannot extend a lease it lost"


def test_expired_lease_can_be_taken_and_the_old_token_is_dead(r):
    create(r)
    old = take(r, ttl_ms=100)
    time.sleep(0.2)
    new = take(r, worker="w2.200")
    assert new != old
    with pytest.raises(LeaseLost):
        checkpoint.commit_response(r, KEYS, old, turns_before=0, message=reply(), pending=[])
    assert r.llen(KEYS.messages) == 1, "the zombie's response was not appended"


@pytest.mark.parametrize("save", ["reply", "summary"])
@pytest.mark.parametrize("order", ["takeover-counts-first", "refusal-counts-first", "takeover-counts-two-first"])
def test_a_call_of_a_worker_fenced_out_alive_is_counted_once_with_its_takeovers_count(r, order, save):
    """A live worker loses its lease mid-turn (a silent connection). The takeover counts the call from
    the worker's billed-call note (spend id call:<id>); the worker's save (save point A, or a summary's)
    is refused and counts the call too (it was paid for). Whichever comes first, the call is counted
    once: in the run's spend, in its events and in the pool-wide counters; also when the takeover has
    counted a call of its own since (a cut stream), before the frozen worker woke."""
    create(r)
    usage = {"input_tokens": 1000, "output_tokens": 100, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    old = take(r, ttl_ms=100)
    time.sleep(0.2)
    new = take(r, worker="w2.200")

    def takeover_counts() -> None:
        spend.count_spend(
            r, KEYS, new, spend_id="call:msg_x", usage={**usage, "output_tokens": 1}, cost_usd=0.0,
            event=Event.of(RUN, "model_cut", turn=0, error_type="worker_lost", **{**usage, "output_tokens": 1}),
        )  # fmt: skip

    def refused_save_counts() -> None:
        with pytest.raises(LeaseLost):
            if save == "reply":
                checkpoint.commit_response(
                    r, KEYS, old, turns_before=0, message=reply(), meta={"id": "msg_x"}, pending=[], usage=usage,
                    responded=Event.of(RUN, "model_responded", turn=0, **usage),
                )  # fmt: skip
            else:
                summary = {"role": "user", "content": [{"type": "text", "text": "summary"}]}
                window.commit_summary(
                    r, KEYS, old, turns_before=0, index=1, message=summary,
                    meta={"id": "msg_x", "compaction": "summary"}, usage=usage, cost_usd=0.0,
                    event=Event.of(RUN, "compacted", turn=0, mode="summary", **usage),
                )  # fmt: skip

    def takeover_counts_its_own_cut_call() -> None:
        own = {"input_tokens": 500, "output_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
        spend.count_spend(
            r, KEYS, new, spend_id="call:msg_y", usage=own, cost_usd=0.0,
            event=Event.of(RUN, "model_cut", turn=0, error_type="stream_cut", **own),
        )  # fmt: skip

    steps = {
        "takeover-counts-first": (takeover_counts, refused_save_counts),
        "refusal-counts-first": (refused_save_counts, takeover_counts),
        "takeover-counts-two-first": (takeover_counts, takeover_counts_its_own_cut_call, refused_save_counts),
    }[order]
    for step in steps:
        step()
    counted = r.hmget(KEYS.run, ["input_tokens", "output_tokens"])
    other = 500 if order == "takeover-counts-two-first" else 0
    assert int(counted[0]) == 1000 + other, f"the call counted once, not {counted}"
    assert int(counted[1]) in (1, 100), "as whichever counted it first saw it"
    pool_wide = stats.read_all(r)
    assert (pool_wide["tokens|kind=input_tokens"], pool_wide["tokens|kind=output_tokens"]) == tuple(map(int, counted))
    reported = [e for _, e in events.read(r, RUN) if e["kind"] in stats.SPEND_EVENTS]
    assert len(reported) == 1 + bool(other), reported


def test_acquire_refuses_stale_turns_inactive_missing_and_newer_runs(r):
    assert acquire(r, KEYS, turn=0, worker_id="w", ttl_ms=1000).code is Acquire.NO_RUN
    create(r)
    assert acquire(r, KEYS, turn=3, worker_id="w", ttl_ms=1000).code is Acquire.STALE
    r.hset(KEYS.run, "status", "completed")
    assert acquire(r, KEYS, turn=0, worker_id="w", ttl_ms=1000).code is Acquire.NOT_ACTIVE
    r.hset(KEYS.run, mapping={"status": "queued", "v": SCHEMA_VERSION + 1})
    got = acquire(r, KEYS, turn=0, worker_id="w", ttl_ms=1000)
    assert (got.code, got.detail) == (Acquire.TOO_NEW, str(SCHEMA_VERSION + 1))
    r.hset(KEYS.run, "v", "garbage")
    assert acquire(r, KEYS, turn=0, worker_id="w", ttl_ms=1000).code is Acquire.UNREADABLE
    assert not r.exists(KEYS.lease)


def test_save_point_a_appends_counts_and_records_pending(r):
    create(r)
    token = take(r)
    call = {"id": "toolu_1", "name": "read_notes", "input": {"topic": "x"}}
    usage = {"input_tokens": 10, "output_tokens": 5, "cache_read_input_tokens": 3, "cache_creation_input_tokens": 2}
    checkpoint.commit_response(
        r, KEYS, token, turns_before=0, message=reply(tool_use=call), pending=[call], usage=usage, cost_usd=0.25
    )
    state = checkpoint.load_run(r, RUN)
    assert (state.turns, state.phase, state.pending, state.current_turn) == (1, "tools", [call], 0)
    assert state.usage == usage and state.cost_usd == 0.25
    with pytest.raises(LeaseLost):
        checkpoint.commit_response(
            r, KEYS, "9:zombie", turns_before=1, message=reply(), pending=[], usage=usage, cost_usd=1.0
        )
    doubled = {name: 2 * n for name, n in usage.items()}
    state = checkpoint.load_run(r, RUN)
    assert (state.usage, state.cost_usd) == (doubled, 1.25), "a fenced-out zombie's call was paid for: it counts"
    assert (state.turns, len(state.messages)) == (1, 2), "but nothing of its response is committed"
    with pytest.raises(LeaseLost):  # the same response twice: the checkpoint moved on
        checkpoint.commit_response(
            r, KEYS, token, turns_before=0, message=reply(), pending=[], usage=usage, cost_usd=0.25
        )
    assert r.llen(KEYS.messages) == 2
    assert checkpoint.load_run(r, RUN).cost_usd == 1.5, "a response refused still counts the call it cost"


def test_save_point_b_lands_with_its_enqueue_or_not_at_all(r):
    create(r)
    token = take(r)
    checkpoint.commit_response(r, KEYS, token, turns_before=0, message=reply(), pending=[])
    results = {"role": "user", "content": [{"type": "text", "text": "continue"}]}

    def enqueue(pipe):
        pipe.rpush("test:queue", "job-1")

    with pytest.raises(LeaseLost):
        checkpoint.commit_tool_results(r, KEYS, "9:intruder", message=results, enqueue_next=enqueue, turns=1)
    assert r.llen("test:queue") == 0 and r.llen(KEYS.messages) == 2

    checkpoint.commit_tool_results(r, KEYS, token, message=results, enqueue_next=enqueue, turns=1)
    assert r.lrange("test:queue", 0, -1) == [b"job-1"]
    state = checkpoint.load_run(r, RUN)
    assert (state.phase, state.current_turn, len(state.messages)) == ("model", 1, 3)
    assert not r.exists(KEYS.lease), "save point B hands the lease back"


def test_an_event_is_recorded_with_its_write_and_never_without_it(r):
    create(r)
    loaded = acquire(
        r,
        KEYS,
        turn=0,
        worker_id="w1.100",
        ttl_ms=5000,
        event=Event.of(RUN, "turn_started", turn=0),
        then=lambda pipe: checkpoint.stage_load(pipe, RUN),
    )
    state = checkpoint.decode_run(RUN, *loaded.then)
    assert (state.status, [m["content"] for m in state.messages]) == ("running", ["do it"]), "read after the lease"
    token = loaded.token
    usage = {"input_tokens": 7, "output_tokens": 3, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    responded = Event.of(RUN, "model_responded", turn=0, seconds=0.2, cost_usd=0.5, **usage)
    with pytest.raises(LeaseLost):
        checkpoint.commit_response(
            r,
            KEYS,
            "9:zombie",
            turns_before=0,
            message=reply(),
            pending=[],
            usage=usage,
            cost_usd=0.5,
            responded=responded,
            event=Event.of(RUN, "response_committed"),
        )
    call = {"id": "toolu_1", "name": "read_notes", "input": {"topic": "x"}}
    with pytest.raises(LeaseLost):
        ledger.write_intent(
            r,
            KEYS,
            "9:zombie",
            call,
            effect="read",
            attempt=1,
            now=1.0,
            event=Event.of(RUN, "tool_started", tool="read_notes", effect="read"),
        )
    assert [e["kind"] for _, e in events.read(r, RUN)] == ["turn_started", "model_responded"], (
        "a fenced-out write leaves no event; the zombie's call, paid for, is counted with its event"
    )
    assert stats.read_all(r)["turns"] == 1.0 and stats.read_all(r)["cost_usd"] == 0.5
    for event_id, _ in events.read(r, RUN)[1:]:
        r.xdel(KEYS.events, event_id)
    r.delete("ap:stats")

    checkpoint.commit_response(
        r,
        KEYS,
        token,
        turns_before=0,
        message=reply(),
        pending=[],
        final_status="completed",
        retention_s=60,
        usage=usage,
        cost_usd=0.5,
        responded=responded,
        event=Event.of(RUN, "status", status="completed"),
    )
    recorded = [e for _, e in events.read(r, RUN)]
    assert [e["kind"] for e in recorded] == ["turn_started", "model_responded", "status"]
    assert recorded[1] == {
        "kind": "model_responded",
        "turn": "0",
        "seconds": "0.2",
        "cost_usd": "0.5",
        **{k: str(v) for k, v in usage.items()},
    }
    counted = stats.read_all(r)
    assert (
        counted["tokens|kind=input_tokens"],
        counted["cost_usd"],
        counted["model_call_seconds_count"],
        counted["status_changes|status=completed"],
    ) == (7, 0.5, 1, 1)
    assert 0 < r.ttl(KEYS.events) <= 60, "the event stream expires with the finished run"


@pytest.mark.parametrize("extra", [(), ("children",), ("approvals", "received", "webhooks")])
def test_a_run_that_ends_keeps_every_key_it_has_for_its_retention_and_no_more(r, extra):
    """The keys a run often never has (children, approvals, messages sent to it, webhooks) are looked at
    together before the retention's EXPIRE of each: whichever it has expires with it."""
    create(r)
    token = take(r)
    for name in extra:
        if name == "children":
            r.rpush(KEYS.children, "r_child")
        else:
            r.hset(getattr(KEYS, name), "some", "thing")
    r.hset(KEYS.ledger, "toolu_1", "x")
    checkpoint.commit_response(
        r,
        KEYS,
        token,
        turns_before=0,
        message=reply(),
        pending=[],
        final_status="completed",
        retention_s=60,
        event=Event.of(RUN, "status", status="completed"),
    )
    for key in (KEYS.run, KEYS.messages, KEYS.events, KEYS.ledger, *(getattr(KEYS, name) for name in extra)):
        assert 0 < r.ttl(key) <= 60, key
    assert not r.exists(KEYS.inbox, KEYS.handback, KEYS.joins), "nothing was made for the retention"


def test_scripts_sent_in_a_pipeline_or_under_watch_survive_a_flushed_script_cache(r):
    create(r)
    r.script_flush()  # as after a Redis restart without persistence of the script cache
    got = acquire(r, KEYS, turn=0, worker_id="w1.100", ttl_ms=5000, then=lambda pipe: checkpoint.stage_load(pipe, RUN))
    assert got.code is Acquire.ACQUIRED and checkpoint.decode_run(RUN, *got.then).status == "running"
    # The call's rate-limit settle rides in save point A's round trip: both scripts are missing here.
    limits = ratelimit.Limits(rpm=10)
    need = ratelimit.Need(10, 10)
    held = ratelimit.reserve(r, "m", ticket="t", reservation_id="res", need=need, limits=limits, minute_s=60)
    assert isinstance(held, ratelimit.Reservation)
    assert r.hexists(ratelimit.LimitKeys.of("m").budget, "held:res"), "the call is in flight"
    r.script_flush()
    settle = ratelimit.settle_call(
        "m", reservation=held, used_input=5, used_output=5, reported=ratelimit.Reported(), limits=limits, minute_s=60
    )
    checkpoint.commit_response(r, KEYS, got.token, turns_before=0, message=reply(), pending=[], riders=[settle])
    assert settle.sent and settle.reply == 1, settle
    assert not r.hexists(ratelimit.LimitKeys.of("m").budget, "held:res"), "the reservation was settled"
    r.script_flush()
    checkpoint.commit_tool_results(r, KEYS, got.token, message=None, enqueue_next=lambda pipe: None, turns=1)
    assert checkpoint.load_run(r, RUN).phase == "model" and not r.exists(KEYS.lease)


def test_a_save_appends_and_never_rewrites_history(r):
    create(r)
    before = r.lrange(KEYS.messages, 0, -1)
    token = take(r)
    checkpoint.commit_response(r, KEYS, token, turns_before=0, message=reply(), pending=[])
    after = r.lrange(KEYS.messages, 0, -1)
    assert after[: len(before)] == before and len(after) == len(before) + 1


def test_cancel_fences_out_the_turn_in_flight(r):
    create(r)
    token = take(r)
    checkpoint.set_status_unfenced(r, RUN, "cancelled", error="stop")
    call = {"id": "toolu_1", "name": "send_email", "input": {}}
    with pytest.raises(RunNotActive):
        ledger.write_intent(r, KEYS, token, call, effect="unsafe", attempt=1, now=0)
    with pytest.raises(RunNotActive):
        checkpoint.commit_response(r, KEYS, token, turns_before=0, message=reply(), pending=[])
    assert checkpoint.set_status_unfenced(r, RUN, "running") == "cancelled", "a terminal status is final"


def test_ledger_records_intent_then_outcome_and_refuses_a_zombie(r):
    create(r)
    token = take(r)
    call = {"id": "toolu_1", "name": "send_email", "input": {"to": "a"}}
    ledger.write_intent(r, KEYS, token, call, effect="unsafe", attempt=1, now=1.0)
    entry = ledger.read(r, KEYS, ["toolu_1"])["toolu_1"]
    assert entry.intent["name"] == "send_email" and entry.outcome is None and entry.attempts == 1
    ledger.check_same_call(entry, call)
    with pytest.raises(Exception, match="other input"):
        ledger.check_same_call(entry, {**call, "input": {"to": "b"}})
    ledger.write_outcome(r, KEYS, token, "toolu_1", Outcome("sent", False), how="ran", now=2.0)
    assert ledger.read(r, KEYS, ["toolu_1"])["toolu_1"].outcome == Outcome("sent", False, how="ran")
    assert release_dead_holder(r, KEYS, "w1.100"), "a dead horse's lease is dropped by its suffix"
    with pytest.raises(LeaseLost):
        ledger.write_outcome(r, KEYS, token, "toolu_1", Outcome("again", False), how="ran", now=3.0)


def test_codec_refuses_ext_types_and_garbage():
    assert unpack(pack({"a": [1, "x", b"y"]}), "t") == {"a": [1, "x", b"y"]}
    with pytest.raises(UnreadableRecord, match="ext type"):
        unpack(msgpack.packb(msgpack.ExtType(1, b"x")), "t")
    with pytest.raises(UnreadableRecord, match="not valid msgpack"):
        unpack(b"\xc1\xff", "t")


def test_unknown_status_or_bad_numbers_are_unreadable(r):
    create(r)
    r.hset(KEYS.run, "status", "exploded")
    with pytest.raises(UnreadableRecord, match="unknown status"):
        checkpoint.load_run(r, RUN)
    r.hset(KEYS.run, mapping={"status": "queued", "turns": "many"})
    with pytest.raises(UnreadableRecord, match="turns"):
        checkpoint.load_run(r, RUN)


def test_save_point_b_keeps_a_tool_result_once(r):
    create(r)
    token = take(r)
    call = {"id": "toolu_big", "name": "read_notes", "input": {"topic": "x"}}
    checkpoint.commit_response(r, KEYS, token, turns_before=0, message=reply(tool_use=call), pending=[call])
    big = "x" * 10_000
    ledger.write_outcome(r, KEYS, token, "toolu_big", Outcome(big, False), how="ran", now=1.0)
    results = {"role": "user", "content": [Outcome(big, False).as_tool_result("toolu_big")]}
    checkpoint.commit_tool_results(
        r,
        KEYS,
        token,
        message=results,
        enqueue_next=lambda pipe: None,
        turns=1,
        outcomes={"toolu_big": Outcome(big, False, how="ran")},
    )
    assert len(r.hget(KEYS.ledger, "toolu_big:out")) < 200, "the ledger keeps a note, the conversation the result"
    assert checkpoint.load_run(r, RUN).messages[-1] == results
    assert ledger.read_all(r, KEYS)["toolu_big"]["outcome"]["how"] == "ran"


def test_every_save_that_appends_a_message_stamps_the_header_with_its_version(r):
    """A message is never newer than its header: a worker too old for it learns so from the header,
    when it takes the lease, before it touches anything (instead of failing on the message)."""
    create(r)
    token = take(r)
    call = {"id": "toolu_1", "name": "read_notes", "input": {"topic": "x"}}
    checkpoint.commit_response(r, KEYS, token, turns_before=0, message=reply(tool_use=call), pending=[call])
    r.hset(KEYS.run, "v", 1)  # as if an older agentpool had written the header
    results = {"role": "user", "content": [Outcome("ok", False).as_tool_result("toolu_1")]}
    checkpoint.commit_tool_results(r, KEYS, token, message=results, enqueue_next=lambda pipe: None, turns=1)
    assert r.hget(KEYS.run, "v") == str(SCHEMA_VERSION).encode(), "save point B"
    r.hset(KEYS.run, "v", 1)
    token = take(r, turn=1)
    checkpoint.finish(r, KEYS, token, status="stopped", message={"role": "user", "content": "x"}, phase="done")
    assert r.hget(KEYS.run, "v") == str(SCHEMA_VERSION).encode(), "finish"


def test_a_fence_lost_in_a_failover_is_not_handed_out_again(r):
    """A failover to a replica that missed the last acquisitions rolls the header's fence back; the
    next acquisition must still hand out a fence above every one handed out before."""
    create(r)
    first = take(r)
    release(r, KEYS, first)
    r.hset(KEYS.run, "fence", 0)  # the promoted replica never saw that acquisition
    time.sleep(0.01)  # a failover takes seconds: the clock has moved past the lost fence
    second = take(r)
    assert int(second.partition(":")[0]) > int(first.partition(":")[0])
    assert second != first, "the same worker taking the run again gets a token of its own"


def test_a_billed_calls_note_is_counted_only_if_no_saved_message_carries_it_and_dropped_only_by_its_own_id(r):
    keys = RunKeys.of("r_noted")
    usage = {"input_tokens": 1200, "output_tokens": 1, "cache_read_input_tokens": 300, "cache_creation_input_tokens": 0}
    spend.note_call(r, keys, call_id="msg_a", model="claude-sonnet-5-5", usage=usage)
    noted = r.get(keys.call)
    assert spend.lost_call(noted, last_saved="msg_a") is None, "its reply was saved: counted there"
    assert spend.lost_call(noted, last_saved="msg_older") == ("msg_a", "claude-sonnet-5-5", usage)
    assert spend.lost_call(None, last_saved="") is None and spend.lost_call(b"garbage", last_saved="") is None
    assert 0 < r.pttl(keys.call) <= spend.NOTE_TTL_MS

    spend.note_call(r, keys, call_id="msg_b", model="claude-sonnet-5-5", usage=usage)  # a newer attempt's call
    spend.forget_call(r, keys, "msg_a")  # a late forget for the older one
    assert spend.lost_call(r.get(keys.call), last_saved="")[0] == "msg_b", "another attempt's note stays"
    spend.forget_call(r, keys, "msg_b")
    assert r.get(keys.call) is None


def test_a_status_change_by_a_person_leaves_a_newer_agentpools_run_as_it_is(r):
    """cancel_run's write itself refuses a run a newer agentpool wrote (checked under WATCH, so a newer
    worker rewriting the run between an app's first look and its write is seen too)."""
    create(r)
    r.hset(KEYS.run, "v", SCHEMA_VERSION + 1)
    before = r.hgetall(KEYS.run)
    with pytest.raises(SchemaTooNew, match=f"schema version {SCHEMA_VERSION + 1}.*its status was not changed"):
        checkpoint.set_status_unfenced(r, RUN, "cancelled", error="cancelled")
    assert r.hgetall(KEYS.run) == before
