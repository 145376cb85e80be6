"""A model call is counted once, pool-wide (the counters behind ``/metrics``) as in the run's own spend
and its events, by whichever side counts it, and never missed pool-wide:

- a worker that loses its lease while alive (frozen with SIGSTOP in the middle of a model call, past
  its lease) still gets the call's reply when it wakes, and its save (save point A, or a summary's) is
  refused after the worker that took the run over counted the call from its note: it counts only the
  rest of the call (the output its note did not know), in the refused write itself, so that a kill
  right after loses nothing of the run's usage;
- a fenced-out worker whose stream is cut counts the call although its lease is gone;
- a count whose reply was lost on the wire is sent again.

Real worker processes, real signals, the scripted model (which counts the calls and tokens it served)."""

from __future__ import annotations

import signal
import time

import pytest
from test_delivered_twice import load_scripts, script
from test_frozen_tool import alive
from test_long_runs import pages

from agentpool import enqueue_run, wait_for_run
from agentpool.store import spend, window
from agentpool.store.events import read as read_events
from agentpool.store.keys import RunKeys
from agentpool.store.stats import CALL_EVENTS, SPEND_EVENTS
from agentpool.testing import settled_stats
from agentpool.testing.localpool import horses_of
from agentpool.testing.netfault import NetFault

from conftest import Pool, assert_valid_conversation, script_task

pytestmark = pytest.mark.crash

PER_CALL = {"input_tokens": 1000, "output_tokens": 100, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}


def _stalled_once(seconds: float) -> list[dict]:
    """One reply whose first stream goes silent for ``seconds`` right after message_start (the call's note)."""
    cut = {"after": 2, "how": "stall", "seconds": seconds, "times": 1}
    return [{"text": "All done.", "usage": PER_CALL, "stream": {"cut": cut}}]


def _freeze_in_call(r, pool, model, worker, run_id: str, summaries: int = 0) -> list[int]:
    """SIGSTOP ``worker`` and its horse as soon as the run's call in flight is noted as billed (once the
    model began its ``summaries``-th summary, given); the horses."""
    deadline = time.monotonic() + 60
    while not (
        model.stats()["summaries"] >= summaries
        and spend.lost_call(r.get(RunKeys.of(run_id).call), window.load(r, run_id).last_call)
    ):
        assert time.monotonic() < deadline, "the call was never noted: " + pool.logs()
        time.sleep(0.01)
    horses = horses_of(worker.pid)
    pool.kill(worker, signal.SIGSTOP)
    return horses


def _wait_gone(pids: list[int], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"{pids} never ended"
        time.sleep(0.05)


def _taken_over_while_frozen(
    r, pool, model, agent: str, script: str, refused: str, summaries: int = 0, *, killed: bool = False
) -> str:
    """A run whose worker is frozen in a call (its ``summaries``-th summary's, given) once the call is
    noted as billed; a second worker takes the run over and completes it; then the frozen worker wakes,
    says its save (``refused``) was refused, and its horses end. ``killed``: the process that made the
    refused save is SIGKILLed right after it, before it could write anything more. The run's id."""
    frozen = pool.start(1, **({"AGENTPOOL_FAULTS": "after_spend_refused"} if killed else {}))[0]
    run_id = enqueue_run(agent, script_task(script, "Read the archive"), connection=r)
    horses = _freeze_in_call(r, pool, model, frozen, run_id, summaries=summaries)
    pool.start(1)
    run = wait_for_run(run_id, timeout=60, connection=r)
    assert run.status == "completed", (run.status, run.error, pool.logs())
    assert_valid_conversation(run.messages)

    pool.kill(frozen, signal.SIGCONT)
    if killed:
        deadline = time.monotonic() + 60
        while not list(pool.tmp.glob(f"fault-after_spend_refused-{run_id}-*")):
            assert time.monotonic() < deadline, f"{refused} was never refused: " + pool.logs()
            time.sleep(0.05)
    else:
        pool.wait_for_log(lambda line: f"lost the lease on run {run_id}" in line, f"saying {refused} was refused")
    _wait_gone(horses)
    return run_id


def _assert_counted_once(r, pool, model, run_id: str, *, corrected: int = 0, killed: bool = False) -> None:
    """The pool-wide counters hold what the model served, as the run's own spend does, and the run's
    events report each call served once. A call a takeover counted from its note (what its
    message_start reported) has the rest counted by its worker once that has the whole reply: the
    ``corrected`` calls, each with a ``spend_corrected`` event and no call of its own. Output may count
    less only for a stream cut midway (what the API wrote after its last report only the API knows).
    ``killed``: the worker that counted the rest was killed right after; the pool-wide counters it
    tallied in its process and had not flushed yet (that rest) are lost, as the README says a kill's
    second is, but never the run's own spend."""
    run = wait_for_run(run_id, timeout=60, connection=r)
    pool.stop(signal.SIGTERM)  # a warm stop flushes what each worker holds
    counted = settled_stats(r)
    served = model.stats()
    pool_wide = {kind: counted.get(f"tokens|kind={kind}", 0) for kind in run.usage}
    rests = [e for _, e in read_events(r, run_id) if e["kind"] == "spend_corrected"]
    unflushed = {kind: sum(int(e[kind]) for e in rests) for kind in run.usage}
    allowed = [run.usage, {kind: n - unflushed[kind] for kind, n in run.usage.items()}][: 2 if killed else 1]
    assert pool_wide in allowed, (pool_wide, run.usage, served["tokens"], pool.logs())
    if pool_wide == run.usage:
        assert counted.get("cost_usd") == pytest.approx(run.cost_usd)
    assert {k: v for k, v in run.usage.items() if k != "output_tokens"} == {
        k: v for k, v in served["tokens"].items() if k != "output_tokens"
    }, (run.usage, served["tokens"])
    events = [e for _, e in read_events(r, run_id) if e["kind"] in SPEND_EVENTS]
    # A model_cut "worker_lost" is a takeover's count of a call from its note: its rest is counted too.
    cut = any(e["kind"] == "model_cut" and e["error_type"] != "worker_lost" for e in events)
    assert run.usage["output_tokens"] <= served["tokens"]["output_tokens"] if cut else run.usage == served["tokens"]
    calls = [e for e in events if e["kind"] in CALL_EVENTS]
    assert len(calls) == served["responses"], ("each call served is reported once", calls, pool.logs())
    assert len(events) - len(calls) == corrected, (events, pool.logs())
    responded = [e for e in calls if e["kind"] == "model_responded"]
    assert counted.get("model_call_seconds_count") == len(responded), (counted, calls)


# The frozen worker, once woken, goes on as it would, or is killed right after its save is refused: the
# rest of its call must count either way (it counts in the refused write itself).
WAKES = pytest.mark.parametrize("killed", [False, True], ids=["goes_on", "killed_right_after"])


@WAKES
def test_a_call_a_takeover_counted_from_its_note_is_not_counted_again_when_its_frozen_worker_wakes(
    r, pool, model, killed
):
    """The worker is frozen right after its call's reply began; the worker that takes the run over
    counts the call from its note and completes the run. The frozen worker then wakes, gets the whole
    reply, and its save point A is refused: it must not count the call again, pool-wide or in the events,
    only the rest of it (the output after its note, which no one else knows)."""
    model.set_scripts({"fenced": _stalled_once(3)})
    run_id = _taken_over_while_frozen(r, pool, model, "pool_agents:support", "fenced", "save point A", killed=killed)
    assert model.stats()["by_script"]["fenced"] == 2, "the frozen worker's call and the takeover's"
    _assert_counted_once(r, pool, model, run_id, corrected=1, killed=killed)


@WAKES
def test_a_summary_call_a_takeover_counted_from_its_note_is_not_counted_again_when_its_frozen_worker_wakes(
    r, pool, model, killed
):
    """The same, for the summary call agentpool's own compaction makes: its save is refused, and the
    call counted once."""
    steps = pages(8)  # the window is compacted before step 6
    steps[6] = {**steps[6], "summary": {"stream": {"cut": {"after": 2, "how": "stall", "seconds": 3, "times": 1}}}}
    model.set_scripts({"pages": steps})
    run_id = _taken_over_while_frozen(
        r, pool, model, "long_agents:summarizing", "pages", "the summary's save", 1, killed=killed
    )
    assert model.stats()["summaries"] == 2, "the frozen worker's summary call and the takeover's"
    _assert_counted_once(r, pool, model, run_id, corrected=1, killed=killed)


@WAKES
def test_a_cut_stream_a_takeover_counted_from_its_note_has_its_rest_counted_when_its_frozen_worker_wakes(
    r, pool, model, killed
):
    """The same, for a call whose stream is then cut: the worker is frozen right after the reply began,
    the takeover counts the call from its note and completes the run. Woken, the frozen worker reads its
    stream up to the message_delta that reports the whole output, then an error event cuts it: it counts
    what the note did not know, and the call no second time."""
    # message_start, ping, content_block_start, a delta, content_block_stop, message_delta: then the cut.
    cut = {"after": 6, "how": "error", "times": 1}
    model.set_scripts({"fenced": [{"text": "All done.", "usage": PER_CALL, "stream": {"interval": 1.0, "cut": cut}}]})
    run_id = _taken_over_while_frozen(
        r, pool, model, "pool_agents:support", "fenced", "its cut stream's count", killed=killed
    )
    assert model.stats()["by_script"]["fenced"] == 2, "the frozen worker's call and the takeover's"
    _assert_counted_once(r, pool, model, run_id, corrected=1, killed=killed)


def test_a_cut_stream_counted_by_a_fenced_out_worker_is_counted_pool_wide_too(r, pool, model):
    """The lone worker is frozen right after its call's reply began and loses its lease. Woken, its
    stream (still silent) times out: it counts the tokens the call reported, although its lease is gone
    (the call was paid for), and gives the turn up. Counted in the run's spend, and pool-wide too."""
    model.set_scripts({"fenced": _stalled_once(10)})
    worker = pool.start(1, AGENTPOOL_MODEL_TIMEOUT="2")[0]
    run_id = enqueue_run("pool_agents:support", script_task("fenced"), connection=r)
    _freeze_in_call(r, pool, model, worker, run_id)
    deadline = time.monotonic() + 30
    while r.exists(RunKeys.of(run_id).lease):
        assert time.monotonic() < deadline, "the frozen worker's lease never expired"
        time.sleep(0.05)
    pool.kill(worker, signal.SIGCONT)
    run = wait_for_run(run_id, timeout=60, connection=r)
    assert run.status == "completed", (run.status, run.error, pool.logs())
    cut = [e for _, e in read_events(r, run_id) if e["kind"] == "model_cut"]
    assert [e["error_type"] for e in cut] == ["timeout"], (cut, pool.logs())
    _assert_counted_once(r, pool, model, run_id)


def test_a_cut_streams_spend_whose_reply_was_lost_is_counted_pool_wide_once(r, redis_server, model, tmp_path):
    """The worker counts a cut stream's spend; Redis applies it and the reply is lost on the wire. The
    client sends it again: the worker must still learn that its first delivery counted the call, or the
    pool-wide counters (which it adds up itself) never count it."""
    cut = {"after": 3, "how": "error", "times": 1}
    model.set_scripts({"fenced": [{"text": "All done.", "usage": PER_CALL, "stream": {"cut": cut}}]})
    load_scripts(r)
    with NetFault.to(redis_server.url) as proxy:
        proxy.cut_next_reply(script("count_spend"))
        pool = Pool(proxy.url, model, tmp_path)
        try:
            pool.start(1)
            run_id = enqueue_run("pool_agents:support", script_task("fenced"), connection=r)
            run = wait_for_run(run_id, timeout=60, connection=r)
            assert run.status == "completed", (run.status, run.error, pool.logs())
            assert proxy.pending_cuts() == 0, "the reply to count_spend was never lost"
            _assert_counted_once(r, pool, model, run_id)
        finally:
            pool.stop()
