"""The reconcile table, and a turn settling calls a dead worker left, against a real Redis."""

from __future__ import annotations

import time

import pytest

from agentpool.runtime.reconcile import Action, idempotency_key, plan
from agentpool.runtime.settle import Settlement
from agentpool.store import checkpoint, ledger
from agentpool.store.keys import RunKeys
from agentpool.store.lease import acquire
from agentpool.store.ledger import Entry, Outcome

STARTED = Entry(intent={"name": "t", "input": "x", "attempt": 1}, outcome=None)
DONE = Entry(intent={"name": "t", "input": "x", "attempt": 1}, outcome=Outcome("ok", False))
NOTHING = Entry(intent=None, outcome=None)


@pytest.mark.parametrize(
    "effect, entry, has_verify, action",
    [
        ("read", DONE, False, Action.REPLAY),
        ("read", STARTED, False, Action.RUN),
        ("read", NOTHING, False, Action.RUN),
        ("idempotent", DONE, False, Action.REPLAY),
        ("idempotent", STARTED, False, Action.RUN),
        ("idempotent", NOTHING, False, Action.RUN),
        ("unsafe", DONE, True, Action.REPLAY),
        ("unsafe", STARTED, True, Action.VERIFY),
        ("unsafe", STARTED, False, Action.UNKNOWN),
        ("unsafe", NOTHING, False, Action.RUN),
        (None, STARTED, False, Action.UNKNOWN),  # the tool is gone since the call started
    ],
)
def test_the_reconcile_table(effect, entry, has_verify, action):
    assert plan(effect, entry, has_verify=has_verify) is action


def test_the_idempotency_key_is_stable_per_tool_use_and_differs_between_them():
    assert idempotency_key("r_1", "toolu_a") == idempotency_key("r_1", "toolu_a")
    assert idempotency_key("r_1", "toolu_a") != idempotency_key("r_1", "toolu_b")
    assert idempotency_key("r_1", "toolu_a") != idempotency_key("r_2", "toolu_a")


def test_calls_to_tools_the_agent_no_longer_has_get_is_error_results(r):
    from pool_agents import short  # an agent without "retired_tool"

    run_id = "r_reconcile01"
    keys = RunKeys.of(run_id)
    with r.pipeline(transaction=True) as pipe:
        pipe.multi()
        checkpoint.stage_create(pipe, run_id, agent="pool_agents:short", task="t", limits={}, now=time.time())
        pipe.execute()
    token = acquire(r, keys, turn=0, worker_id="test.1", ttl_ms=10_000).token
    never = {"id": "toolu_never", "name": "retired_tool", "input": {}}
    started = {"id": "toolu_started", "name": "retired_tool", "input": {"a": 1}}
    message = {"role": "assistant", "content": [{"type": "tool_use", **never}, {"type": "tool_use", **started}]}
    checkpoint.commit_response(r, keys, token, turns_before=0, message=message, pending=[never, started])
    ledger.write_intent(r, keys, token, started, effect="unsafe", attempt=1, now=1.0)

    results = Settlement(r, keys, token, 0).settle(short, [never, started], turns=1)
    assert [b["tool_use_id"] for b in results] == ["toolu_never", "toolu_started"]
    assert results[0]["is_error"] and "no tool named 'retired_tool'" in results[0]["content"]
    assert results[1]["is_error"] and "status of this retired_tool call is unknown" in results[1]["content"]


def test_ensure_owned_refuses_once_the_run_is_another_workers_or_the_turn_gave_up_on_the_call(r):
    """What a tool calls just before an effect (current_call().ensure_owned()): fine while its worker
    holds the run; CallNotOwned once another worker took the run over (a worker frozen past its lease
    wakes inside the tool), and once its own turn gave up on it (a timeout: the turn went on)."""
    from agentpool.context import CallNotOwned, ToolCall
    from agentpool.runtime.toolcall import Ownership
    from agentpool.store.lease import release

    run_id = "r_owned01"
    keys = RunKeys.of(run_id)
    with r.pipeline(transaction=True) as pipe:
        pipe.multi()
        checkpoint.stage_create(pipe, run_id, agent="pool_agents:short", task="t", limits={}, now=time.time())
        pipe.execute()
    first = acquire(r, keys, turn=0, worker_id="frozen.1", ttl_ms=10_000).token
    ownership = Ownership(r, keys, first)
    call = ToolCall(run_id, 0, "toolu_pay", idempotency_key(run_id, "toolu_pay"), 1, owner_check=ownership)
    call.ensure_owned()
    assert call.still_owned()

    release(r, keys, first)  # its lease lapsed while it was frozen; another worker took the run
    acquire(r, keys, turn=0, worker_id="other.2", ttl_ms=10_000)
    with pytest.raises(CallNotOwned, match=f"tool call toolu_pay of run {run_id}"):
        call.ensure_owned()

    mine = Ownership(r, keys, first)
    mine.abandon()  # the turn's wait for the tool timed out: it went on without this attempt
    with pytest.raises(CallNotOwned, match="outlived its timeout"):
        ToolCall(run_id, 0, "toolu_pay", "k", 1, owner_check=mine).ensure_owned()
