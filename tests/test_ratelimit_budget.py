"""The pool's rate-limit budget in Redis (store/ratelimit.py, store/lua/limit_*.lua): reservations,
corrections, what the API's headers teach, and the line waiting turns stand in."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time

import pytest
from redis import Redis
from redis.exceptions import ResponseError
from test_delivered_twice import load_scripts, script

from agentpool.runtime.settings import connect
from agentpool.store import ratelimit
from agentpool.store.keys import LimitKeys
from agentpool.store.ratelimit import Limits, Need, Reported, Reservation, Wait, parse_limits
from agentpool.testing.netfault import NetFault

MODEL = "claude-sonnet-5-5"
SLOW = 3600.0  # a "minute" of an hour: nothing refills visibly during a test
UNLIMITED = Limits()
NOTHING = Reported()


def take(r: Redis, ticket: str, need: Need, limits: Limits = UNLIMITED, minute: float = SLOW, rid: str | None = None):
    return ratelimit.reserve(
        r, MODEL, ticket=ticket, reservation_id=rid or f"res-{ticket}", need=need, limits=limits, minute_s=minute
    )


def in_flight(r: Redis) -> list[bytes]:
    """The reservation ids of the calls in flight: the budget's 'held:<id>' fields."""
    return sorted(k.removeprefix(b"held:") for k in r.hkeys(LimitKeys.of(MODEL).budget) if k.startswith(b"held:"))


def settle(r: Redis, got, used_in: int = 0, used_out: int = 0, reported: Reported = NOTHING, **kw) -> bool:
    return ratelimit.settle(
        r,
        MODEL,
        reservation=got,
        used_input=used_in,
        used_output=used_out,
        reported=reported,
        limits=kw.get("limits", UNLIMITED),
        minute_s=kw.get("minute", SLOW),
    )


def test_an_operator_limit_admits_that_many_requests_then_says_how_long_to_wait(r: Redis) -> None:
    limits = Limits(rpm=3)
    assert all(isinstance(take(r, f"t{i}", Need(10, 10), limits), Reservation) for i in range(3))
    waited = take(r, "t3", Need(10, 10), limits)
    assert isinstance(waited, Wait)
    assert 0 < waited.seconds <= SLOW / 3 + 1  # one request refills in a third of the minute
    assert [view.model for view in ratelimit.show(r)] == [MODEL], "a model with a budget is listed"


def test_waiting_turns_go_in_the_order_they_began_to_wait(r: Redis) -> None:
    limits = Limits(itpm=1000)
    assert isinstance(take(r, "first-call", Need(1000, 0), limits), Reservation)  # the bucket is empty now
    assert isinstance(take(r, "early", Need(600, 0), limits), Wait)
    assert isinstance(take(r, "late", Need(300, 0), limits), Wait)
    # 700 come back (the first call used only 300): enough for "late" alone, but "early" is ahead of it.
    assert settle(r, Reservation(MODEL, "res-first-call", Need(1000, 0)), used_in=300, limits=limits)
    assert isinstance(take(r, "late", Need(300, 0), limits), Wait)
    assert isinstance(take(r, "newcomer", Need(50, 0), limits), Wait)  # nor may one that never waited
    assert isinstance(take(r, "early", Need(600, 0), limits), Reservation)
    assert isinstance(take(r, "late", Need(300, 0), limits), Wait)  # 100 left, 300 needed
    assert r.zrange(LimitKeys.of(MODEL).waiting, 0, -1) == [b"late", b"newcomer"]
    assert set(r.hkeys(LimitKeys.of(MODEL).needs)) == {b"late", b"newcomer"}, "the granted one left the line whole"


def test_a_line_that_emptied_holds_newcomers_again_once_a_turn_waits(r: Redis) -> None:
    """A call reads the line only when the budget says somebody may be in it: it must say so again as
    soon as a turn waits, and a budget an earlier version wrote, which never said, has its line read."""
    limits = Limits(itpm=1000)
    keys = LimitKeys.of(MODEL)
    first = take(r, "a", Need(1000, 0), limits)  # the bucket is empty now
    assert isinstance(take(r, "b", Need(600, 0), limits), Wait)
    assert settle(r, first, used_in=0, limits=limits)  # all 1000 back
    assert isinstance(take(r, "b", Need(600, 0), limits), Reservation)  # "b" leaves: nobody in line
    assert r.zcard(keys.waiting) == 0
    assert isinstance(take(r, "c", Need(600, 0), limits), Wait)  # 400 left
    assert isinstance(take(r, "d", Need(50, 0), limits), Wait), "a newcomer went ahead of a waiting turn"
    r.hdel(keys.budget, "line")  # as an earlier version left it
    assert isinstance(take(r, "e", Need(50, 0), limits), Wait), "a budget that never said was not read"
    assert r.zrange(keys.waiting, 0, -1) == [b"c", b"d", b"e"]


def test_a_ticket_nobody_comes_back_for_stops_holding_its_place(r: Redis) -> None:
    limits = Limits(rpm=1)
    take(r, "a", Need(1, 1), limits, minute=0.5)
    assert isinstance(take(r, "gone", Need(1, 1), limits, minute=0.5), Wait)
    keys = LimitKeys.of(MODEL)
    r.hset(keys.needs, "gone", "1 1 1 1")  # its expiry long past
    got = None
    for _ in range(400):  # the bucket refills in half a second; "gone" no longer stands in front
        got = take(r, "b", Need(1, 1), limits, minute=0.5)
        if isinstance(got, Reservation):
            break
        time.sleep(0.05)
    assert isinstance(got, Reservation)
    assert b"gone" not in r.zrange(keys.waiting, 0, -1)


SAMPLE = 8  # the live tickets a call reads at least, if so many are ahead of it (_reserve.lua)


def test_a_long_line_costs_a_call_a_few_reads_and_nobody_overtakes(r: Redis) -> None:
    """A pool saturated by its limit keeps many turns in line. A call reads the line from its head only as
    far as decides its answer: once the tickets it read ask more than the budget holds, it waits. A
    newcomer waits for what the whole line needs (the budget keeps its sum as tickets join and leave),
    exactly, whatever the tickets it read. So each call into a line of 2,000 costs a few reads, where
    reading every ticket ahead made a saturated pool's reservations cost Redis in proportion to its line;
    and a call is granted only once the budget covers every live ticket ahead of it."""
    limits = Limits(itpm=1000)
    keys = LimitKeys.of(MODEL)
    first = take(r, "first-call", Need(1000, 0), limits)  # the bucket is empty now
    assert isinstance(first, Reservation)
    # The first few in line need less than the rest: an estimate from them alone would be a third too short.
    needs = [50] * SAMPLE + [150] * (2000 - SAMPLE)
    r.config_resetstat()
    line = [take(r, f"w{i:04d}", Need(n, 0), limits) for i, n in enumerate(needs)]
    reads = r.info("commandstats")["cmdstat_hget"]["calls"]
    assert all(isinstance(got, Wait) for got in line) and r.zcard(keys.waiting) == 2000
    assert reads <= (SAMPLE + 2) * 2000, f"{reads} tickets read to put 2,000 in line"
    # 1,000 tokens refill in this test's "minute": each waits for those ahead of it and its own.
    expected = [(sum(needs[: i + 1])) * SLOW / 1000 for i in range(2000)]
    assert [got.seconds for got in line] == pytest.approx(expected, rel=0.001)
    ratelimit.leave_line(r, MODEL, "w0005")  # its turn will not call: its need leaves the line's sum
    late = take(r, "late", Need(150, 0), limits)
    assert isinstance(late, Wait) and late.seconds == pytest.approx((sum(needs) - 50 + 150) * SLOW / 1000, rel=0.001)
    # 150 come back (the first call used 850): enough for the first in line only.
    assert settle(r, first, used_in=850, limits=limits)
    r.config_resetstat()
    assert isinstance(take(r, "w1000", Need(150, 0), limits), Wait), "a ticket went ahead of 1,000 waiting"
    assert isinstance(take(r, "newcomer", Need(50, 0), limits), Wait), "a newcomer went ahead of the line"
    assert isinstance(take(r, "w0000", Need(50, 0), limits), Reservation)
    assert r.info("commandstats")["cmdstat_hget"]["calls"] <= 3 * (SAMPLE + 2)
    assert r.zrange(keys.waiting, 0, 1) == [b"w0001", b"w0002"]


def test_a_line_begun_before_the_budget_kept_its_sum_is_estimated_not_taken_for_short(r: Redis) -> None:
    """Workers of an earlier release put tickets in line without the line's sum: a newcomer then
    estimates what the unread tickets need from those it read, as a ticket in line does, instead of
    waiting only for those it read."""
    limits = Limits(itpm=1000)
    assert isinstance(take(r, "first-call", Need(1000, 0), limits), Reservation)  # the bucket is empty now
    assert all(isinstance(take(r, f"w{i:03d}", Need(100, 0), limits), Wait) for i in range(100))
    r.hdel(LimitKeys.of(MODEL).budget, "line:sum")  # as an earlier release left the budget
    late = take(r, "late", Need(100, 0), limits)
    assert isinstance(late, Wait) and late.seconds == pytest.approx(101 * 100 * SLOW / 1000, rel=0.001), late


def test_limits_show_says_what_the_turns_in_line_need_and_how_long_that_is(r: Redis, redis_server) -> None:
    limits = Limits(itpm=1000)
    assert isinstance(take(r, "first-call", Need(1000, 0), limits), Reservation)  # the bucket is empty now
    assert all(isinstance(take(r, f"w{i}", Need(200, 10), limits), Wait) for i in range(3))
    (view,) = ratelimit.show(r)
    assert view.waiting == 3 and view.in_line == {"requests": 3, "input": 600, "output": 30}
    env = {**os.environ, "REDIS_URL": redis_server.url, "AGENTPOOL_RATE_LIMITS": f"{MODEL}=itpm:1000"}
    env["AGENTPOOL_RATE_LIMIT_MINUTE"] = str(SLOW)
    shown = subprocess.run(
        [sys.executable, "-m", "agentpool", "limits", "show"], env=env, capture_output=True, text=True, check=False
    )
    assert shown.returncode == 0, shown.stderr
    (row,) = [line.split() for line in shown.stdout.splitlines() if "input tokens/min" in line]
    assert row[-1] == "600", shown.stdout  # the column "in line"
    # 600 tokens at 1,000 a "minute" of an hour: 2,160 s of refill.
    seconds = re.search(r"the turns in line need about (\d+) s of refill", shown.stdout)
    assert seconds and abs(int(seconds.group(1)) - 2160) <= 5, shown.stdout
    take(r, "w0", Need(200, 10), limits)  # back again, still waiting: counted once
    ratelimit.leave_line(r, MODEL, "w1")
    (view,) = ratelimit.show(r)
    assert view.waiting == 2 and view.in_line == {"requests": 2, "input": 400, "output": 20}


def test_settling_gives_back_what_the_call_did_not_use_once(r: Redis) -> None:
    limits = Limits(otpm=1000)
    got = take(r, "t", Need(10, 900), limits)
    assert isinstance(take(r, "u", Need(10, 900), limits), Wait)
    assert settle(r, got, used_out=100, limits=limits)
    assert not settle(r, got, used_out=100, limits=limits)  # a re-sent settle gives nothing back twice
    assert isinstance(take(r, "u", Need(10, 900), limits), Reservation)  # 900 were back
    assert isinstance(take(r, "v", Need(10, 200), limits), Wait)  # ...and only once: 100 left


def test_a_give_back_never_lifts_the_budget_above_what_the_api_said_was_left(r: Redis) -> None:
    """The API's remaining already counts a call's input (admitted on its input), and none of a call it
    refused: only a reply's unused output (held at max_tokens until the reply ends) goes back on top.
    Before, every give-back went on top: a reply saying 1,000 input tokens were left lifted the bucket
    to 59,000, and a 429 saying nothing was left let the next call straight through into another 429."""
    limits = Limits(itpm=60_000, otpm=10_000)
    level = LimitKeys.of(MODEL).budget
    got = take(r, "t", Need(40_000, 8_000), limits)  # estimated high: the cached context, max_tokens
    answered = Reported(limits={"input": 60_000, "output": 10_000}, remaining={"input": 1_000, "output": 2_000})
    assert settle(r, got, used_in=2_000, used_out=500, reported=answered, limits=limits)
    assert int(r.hget(level, "level:input")) == 1_000, "no more than the API said was left"
    assert int(r.hget(level, "level:output")) == 2_000 + 7_500, "the unused max_tokens back on top"
    r.delete(level)
    got = take(r, "u", Need(30_000, 8_000), limits)
    refused = ratelimit.settle(
        r,
        MODEL,
        reservation=got,
        used_input=0,
        used_output=0,
        reported=Reported(limits={"input": 60_000, "output": 10_000}, remaining={"input": 0, "output": 0}),
        limits=limits,
        minute_s=SLOW,
        answered=False,
    )
    assert refused and [int(v) for v in r.hmget(level, ["level:input", "level:output"])] == [0, 0]
    assert isinstance(take(r, "v", Need(30_000, 8_000), limits), Wait), "turns behind a 429 wait"


def test_a_reservation_says_whether_it_left_room_to_spare(r: Redis) -> None:
    """Roomy: nobody in line and every limited bucket at least half full once the call is taken (its
    settle may then wait a second to go with others)."""
    limits = Limits(rpm=4, otpm=1000)
    assert take(r, "a", Need(1, 100), limits).roomy  # 3 requests and 900 tokens left
    assert take(r, "b", Need(1, 100), limits).roomy  # 2 and 800: half the requests, still half
    assert not take(r, "c", Need(1, 100), limits).roomy  # 1 request left: under half
    r.delete(LimitKeys.of(MODEL).budget)  # full again
    limits = Limits(otpm=1000)
    assert not take(r, "x", Need(1, 900), limits).roomy  # 100 tokens left
    assert isinstance(take(r, "y", Need(1, 200), limits), Wait)  # in line
    r.hdel(LimitKeys.of(MODEL).budget, "level:output")  # the bucket full again; "y" still in line
    newcomer = take(r, "z", Need(1, 10), limits)
    assert isinstance(newcomer, Reservation) and not newcomer.roomy, "granted with a turn in line: not roomy"
    waited = take(r, "y", Need(1, 200), limits)
    assert isinstance(waited, Reservation) and waited.roomy  # 790 left and the line empty
    assert not take(r, "y", Need(1, 200), limits).roomy, "a re-sent reservation is answered, not roomy"


def test_settles_sent_together_give_back_each_once_as_they_would_one_by_one(r: Redis) -> None:
    """A worker's deferred settles go in one script call (``DeferredSettles``): each reservation gives
    back what its call did not use, once, though the batch is sent again; the budget ends where the
    same settles sent one by one leave it, and what the headers report is learned."""
    limits = Limits(otpm=10_000)
    keys = LimitKeys.of(MODEL)
    got = [take(r, f"t{i}", Need(10, 1000), limits) for i in range(5)]  # 5000 tokens taken
    assert all(isinstance(g, Reservation) for g in got)
    reported = Reported(limits={"requests": 500}, remaining={"requests": 400})
    batch = ratelimit.DeferredSettles()
    for g in got[:4]:
        batch.add(
            MODEL,
            limits,
            SLOW,
            ratelimit.settle_entry(reservation=g, used_input=10, used_output=100, reported=reported),
        )
    batch.add(
        MODEL,
        limits,
        SLOW,
        ratelimit.settle_entry(reservation=got[0], used_input=10, used_output=100, reported=reported),
    )
    resent = batch.take()
    batch.adopt(resent)
    batch.send(r)
    assert batch.take() == [], "everything was sent"
    assert [k for k in r.hkeys(keys.budget) if k.startswith(b"held:")] == [b"held:res-t4"], "the four settled left"
    (view,) = ratelimit.show(r)
    assert math.floor(view.levels["output"]) == 10_000 - 5000 + 4 * 900  # got[0] twice, given back once
    assert view.learned == {"requests": 500} and math.floor(view.levels["requests"]) == 400
    batch.adopt(resent)  # the same batch again, as after a reply lost to a dropped connection
    batch.send(r)
    (again,) = ratelimit.show(r)
    assert math.floor(again.levels["output"]) == math.floor(view.levels["output"]), "a settle gave back twice"


def test_settles_sent_on_a_connection_that_goes_silent_give_back_once_after_the_socket_timeout(
    r: Redis, redis_server
) -> None:
    """The flush thread's batch reaches Redis, which applies it; the connection then goes silent (no
    reply, no close: a dropped NAT entry). The send gives up on it within the socket timeout, sends the
    batch again on a new connection, and each reservation is given back once: the budget ends where one
    delivery leaves it, and nothing waits to be sent again."""
    limits = Limits(otpm=10_000)
    got = [take(r, f"t{i}", Need(10, 1000), limits) for i in range(3)]
    batch = ratelimit.DeferredSettles()
    for g in got:
        batch.add(
            MODEL, limits, SLOW, ratelimit.settle_entry(reservation=g, used_input=10, used_output=100, reported=NOTHING)
        )
    load_scripts(r)
    with NetFault.to(redis_server.url) as proxy:
        silent = connect(proxy.url)
        proxy.black_hole_next(script("limit_settle"))
        batch.send(silent)
        assert proxy.pending_cuts() == 0 and proxy.black_holed == 1, "the first delivery's reply was swallowed"
        silent.close()
    assert batch.take() == [], "sent: nothing kept for the next flush"
    assert in_flight(r) == [], "every call settled"
    (view,) = ratelimit.show(r)
    # 10,000 - 3 x 100 used, plus what refilled during the socket timeout (under 3 a second: a "minute" of
    # an hour); a batch that gave back twice would have filled the bucket (9,700 + 3 x 900, capped).
    assert 9_700 <= view.levels["output"] < 9_800, "each unused estimate given back once"


def test_more_settles_than_one_script_call_takes_go_in_several(r: Redis) -> None:
    limits = Limits(rpm=10_000)
    count = ratelimit.SETTLE_BATCH + 50
    batch = ratelimit.DeferredSettles()
    for i in range(count):
        got = take(r, f"t{i}", Need(1, 1), limits)
        batch.add(
            MODEL, limits, SLOW, ratelimit.settle_entry(reservation=got, used_input=1, used_output=1, reported=NOTHING)
        )
    r.config_resetstat()
    batch.send(r)
    ran = r.info("commandstats")
    scripts = sum(ran.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("evalsha", "eval"))
    scripts -= sum(ran.get(f"cmdstat_{c}", {}).get("failed_calls", 0) for c in ("evalsha", "eval"))  # NOSCRIPT
    assert scripts == 2, ("one script call per SETTLE_BATCH settles", ran)
    assert in_flight(r) == [] and batch.take() == []
    (view,) = ratelimit.show(r)
    assert math.floor(view.levels["requests"]) == 10_000 - count


def test_settles_the_script_refuses_are_dropped_not_sent_again_for_ever(r: Redis) -> None:
    """A budget hash the script cannot read (a level that is not a number) fails the batch with the
    script's error; sent again every second it would fail again, so it is dropped (as a settle sent with
    its turn would be), and the settles of another model are kept."""
    limits = Limits(rpm=100)
    batch = ratelimit.DeferredSettles()
    got = take(r, "t", Need(1, 1), limits)
    batch.add(
        MODEL, limits, SLOW, ratelimit.settle_entry(reservation=got, used_input=1, used_output=1, reported=NOTHING)
    )
    other = ratelimit.reserve(
        r, "other-model", ticket="o", reservation_id="res-o", need=Need(1, 1), limits=limits, minute_s=SLOW
    )
    batch.add(
        "other-model",
        limits,
        SLOW,
        ratelimit.settle_entry(reservation=other, used_input=1, used_output=1, reported=NOTHING),
    )
    r.hset(LimitKeys.of(MODEL).budget, "level:requests", "not a number")
    with pytest.raises(ResponseError):
        batch.send(r)
    left = batch.take()
    assert [model for model, *_ in left] == ["other-model"], left
    batch.adopt(left)
    batch.send(r)
    assert batch.take() == []


def test_the_budget_is_kept_a_hash_table_where_a_field_is_found_without_scanning_the_calls_in_flight(
    r: Redis,
) -> None:
    """The calls in flight are fields of the budget: as a listpack (Redis's small-hash encoding, up to
    128 or 512 fields) every field a reservation reads or writes would be found by scanning them all.
    A budget written before this field existed is converted by its next write."""
    keys = LimitKeys.of(MODEL)
    limits = Limits(rpm=1000)
    assert isinstance(take(r, "a", Need(1, 1), limits), Reservation)
    assert r.object("encoding", keys.budget) == b"hashtable"
    r.delete(keys.budget)
    r.hset(keys.budget, mapping={"at": 1, "level:requests": 500, "line": 0})  # as an earlier version left it
    assert r.object("encoding", keys.budget) == b"listpack"
    assert isinstance(take(r, "b", Need(1, 1), limits), Reservation)
    assert r.object("encoding", keys.budget) == b"hashtable"


def test_the_budget_stays_a_hash_table_on_a_server_tuned_to_keep_long_values_in_listpacks(r: Redis) -> None:
    """An operator who raised ``hash-max-listpack-value`` (64 bytes by default) keeps short hashes with
    longer values as listpacks (here up to 200 bytes); the budget's marker field (256 bytes) is longer than
    any tuning up to four times the default, and one an earlier version wrote (85 bytes) is lengthened by
    the next write."""
    keys = LimitKeys.of(MODEL)
    limits = Limits(rpm=1000)
    default = r.config_get("hash-max-listpack-value")["hash-max-listpack-value"]
    r.config_set("hash-max-listpack-value", 200)
    try:
        r.hset(keys.budget, mapping={"at": 1, "level:requests": 500, "line": 0, "hashtable": "x" * 85})
        assert r.object("encoding", keys.budget) == b"listpack", "an 85-byte marker no longer converts it"
        assert isinstance(take(r, "c", Need(1, 1), limits), Reservation)
        assert r.object("encoding", keys.budget) == b"hashtable"
    finally:
        r.config_set("hash-max-listpack-value", default)


def test_a_resent_reservation_takes_the_budget_once(r: Redis) -> None:
    limits = Limits(rpm=2)
    assert isinstance(take(r, "t", Need(1, 1), limits, rid="same"), Reservation)
    assert isinstance(take(r, "t", Need(1, 1), limits, rid="same"), Reservation)
    assert isinstance(take(r, "u", Need(1, 1), limits), Reservation)


def test_limits_and_remaining_are_learned_from_the_api_headers_with_no_configuration(r: Redis) -> None:
    first = take(r, "t", Need(10, 10))
    assert isinstance(first, ratelimit.Unlimited)  # nothing known: not limited, no budget taken
    assert ratelimit.show(r) == []
    learned = Reported(limits={"requests": 50, "input": 10_000}, remaining={"requests": 1, "input": 9000})
    assert settle(r, first, reported=learned)  # its reply teaches the limits; it is in flight no more
    assert isinstance(take(r, "u", Need(10, 10)), Reservation)
    assert isinstance(take(r, "v", Need(10, 10)), Wait)  # the API said one request was left
    (view,) = ratelimit.show(r)
    assert view.model == MODEL and view.learned == {"requests": 50, "input": 10_000}
    assert view.waiting == 1 and view.held == {"calls": 1, "input": 10, "output": 10}


def test_calls_started_before_the_limits_were_learned_count_against_what_the_first_reply_reports(r: Redis) -> None:
    # A pool's first calls go out before any reply has taught it the limits. The first reply's remaining
    # was counted when the API admitted that call: the two calls started after it are not in it yet.
    first, second, third = (take(r, t, Need(10, 10)) for t in ("a", "b", "c"))
    assert all(isinstance(got, ratelimit.Unlimited) for got in (first, second, third))
    said = Reported(limits={"requests": 3}, remaining={"requests": 2})
    assert settle(r, first, reported=said)  # it was held as in flight, no budget taken
    assert not settle(r, first, reported=said)  # ...and settles once
    assert isinstance(take(r, "d", Need(10, 10)), Wait)  # the API has 0 left, not 2
    # The last call started has none started after it: its remaining (0) is the level as it stands.
    settle(r, third, reported=Reported(limits={"requests": 3}, remaining={"requests": 0}))
    assert isinstance(take(r, "d", Need(10, 10)), Wait)


def test_a_call_started_earlier_but_admitted_later_counts_against_an_earlier_reply(r: Redis) -> None:
    # A and B go out while nothing limits the model, A first; the API admits B first. B's reply counts B
    # only: A is in neither its remaining nor the calls started after B, yet the API will count it.
    a, b = take(r, "a", Need(10, 10)), take(r, "b", Need(10, 10))
    assert isinstance(a, ratelimit.Unlimited) and isinstance(b, ratelimit.Unlimited)
    settle(r, b, reported=Reported(limits={"requests": 5}, remaining={"requests": 4}))
    granted = [take(r, f"n{i}", Need(10, 10)) for i in range(5)]
    assert sum(isinstance(got, Reservation) for got in granted) == 3  # 5 less B less A, still in flight


def test_a_call_started_unlimited_that_never_settles_stops_counting_after_a_minute(r: Redis) -> None:
    keys = LimitKeys.of(MODEL)
    take(r, "dead", Need(10, 10))  # its worker dies: it never settles
    time.sleep(0.3)
    b = take(r, "b", Need(10, 10))
    # A minute (of 0.2 s) after the dead call started, the API has admitted it if it ever will.
    said = Reported(limits={"requests": 5}, remaining={"requests": 4})
    assert settle(r, b, reported=said, minute=0.2)
    assert float(r.hget(keys.budget, "level:requests")) == 4  # not 3: the dead call no longer counts
    assert in_flight(r) == []  # ...nor is it kept


def test_a_dead_call_still_counted_when_the_limits_are_learned_is_dropped_a_minute_later(r: Redis) -> None:
    keys = LimitKeys.of(MODEL)
    take(r, "dead", Need(10, 10))  # its worker dies: it never settles
    b = take(r, "b", Need(10, 10))
    said = Reported(limits={"requests": 5}, remaining={"requests": 4})
    assert settle(r, b, reported=said)
    assert float(r.hget(keys.budget, "level:requests")) == 3  # it may still be admitted: it counts
    assert in_flight(r) == [b"res-dead"]
    time.sleep(0.3)
    # Within the limits now, no call started unlimited settles again: the next settle a minute (of
    # 0.2 s) after the last of them started drops what is left of them.
    got = take(r, "c", Need(10, 10), Limits(), minute=0.2)
    assert isinstance(got, Reservation)
    assert settle(r, got, minute=0.2)
    assert in_flight(r) == [] and not r.hexists(keys.budget, "started:at")
    (view,) = ratelimit.show(r)
    assert view.held == {"calls": 0, "input": 0, "output": 0}


def test_a_reservation_within_limits_whose_worker_died_stops_counting_as_in_flight_after_an_hour(r: Redis) -> None:
    keys = LimitKeys.of(MODEL)
    rpm = Limits(rpm=100)
    alive = take(r, "alive", Need(10, 10), rpm)
    # A reservation made two hours ago by a worker that died before its call settled, and one an earlier
    # version left in the held hash it kept the calls in flight in.
    (seconds, micros) = r.time()
    two_hours_ago = seconds * 1000 + micros // 1000 - 2 * 3_600_000
    r.hset(keys.budget, "held:res-dead", f"10 10 {two_hours_ago}")
    r.hset(
        keys.held,
        mapping={"res-dead-earlier": f"10 10 {two_hours_ago}", "res-earlier": f"10 10 {two_hours_ago + 7_000_000}"},
    )
    done = take(r, "done", Need(10, 10), rpm)
    assert settle(r, done, limits=rpm)
    assert in_flight(r) == [b"res-alive"], "the dead one is gone, the call in flight is kept"
    assert r.hkeys(keys.held) == [b"res-earlier"], "the earlier version's dead one is gone, its call in flight kept"
    (view,) = ratelimit.show(r)
    assert view.held["calls"] == 1
    assert settle(r, alive, limits=rpm)


def test_a_resent_reservation_while_unlimited_counts_once(r: Redis) -> None:
    got = take(r, "a", Need(10, 10), rid="same")
    assert isinstance(got, ratelimit.Unlimited) and got.started == (1, 10, 10)
    assert take(r, "a", Need(10, 10), rid="same") == got  # the first answer again, nothing counted twice
    assert r.hget(LimitKeys.of(MODEL).budget, "started:requests") == b"1"
    assert in_flight(r) == [b"same"]
    # Re-sent after the limits were learned, it is still the call that started unlimited.
    settle(r, None, reported=Reported(limits={"requests": 5}))
    assert take(r, "a", Need(10, 10), rid="same") == got


def test_a_model_whose_replies_carry_no_rate_limit_headers_stops_counting_its_calls(r: Redis) -> None:
    got = take(r, "a", Need(10, 10))
    assert isinstance(got, ratelimit.Unlimited) and got.started == (1, 10, 10)
    ratelimit.mark_headerless(r, MODEL)
    keys = LimitKeys.of(MODEL)
    assert in_flight(r) == []  # nothing will be learned: the calls started unlimited are not kept
    r.config_resetstat()
    assert take(r, "b", Need(10, 10)) == ratelimit.Unlimited(None)
    ran = {name.removeprefix("cmdstat_"): stat["calls"] for name, stat in r.info("commandstats").items()}
    aside = ("config", "client", "hello", "info", "script", "evalsha")  # the test's and the connection's
    assert {cmd: n for cmd, n in ran.items() if not cmd.startswith(aside)} == {"hmget": 1}  # one read
    assert r.hget(keys.budget, "started:requests") == b"1"  # nothing more counted
    assert not settle(r, got)  # a call in flight then settles to nothing
    assert in_flight(r) == []
    # An operator's limit still holds for it.
    assert isinstance(take(r, "c", Need(10, 10), Limits(rpm=5)), Reservation)


def test_an_operator_limit_caps_a_learned_one(r: Redis) -> None:
    settle(r, None, reported=Reported(limits={"requests": 1000}))
    capped = Limits(rpm=2)
    assert isinstance(take(r, "a", Need(1, 1), capped), Reservation)
    assert isinstance(take(r, "b", Need(1, 1), capped), Reservation)
    assert isinstance(take(r, "c", Need(1, 1), capped), Wait)


def test_the_env_form_parses_and_bad_limits_get_one_clear_line() -> None:
    parsed = parse_limits("claude-sonnet-5-5=rpm:600,itpm:200000,otpm:40000;*=rpm:50")
    assert parsed == {"claude-sonnet-5-5": Limits(600, 200_000, 40_000), "*": Limits(rpm=50)}
    for bad, words in [
        ("claude-sonnet-5-5=rpm:-1", "rpm"),
        ("claude-sonnet-5-5=itpm:nan", "itpm"),
        ("claude-sonnet-5-5=tpm:5", "tpm"),
        ("rpm:5", "AGENTPOOL_RATE_LIMITS"),
        ("x=rpm:1.5", "rpm"),
        ("bad model=rpm:1", "model"),
    ]:
        with pytest.raises(ValueError) as caught:
            parse_limits(bad)
        message = str(caught.value)
        assert words in message and "\n" not in message
    assert not math.isnan(Limits(rpm=5).rpm or 0)
