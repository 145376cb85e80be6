"""Forks of runs caught between two save points: with messages still waiting in the inbox, stopped in
their tool phase by the turn timeout, and waiting for their sub-agents. Real Redis, real RQ workers, the
real anthropic client against the scripted Messages API."""

from __future__ import annotations

import signal

import pytest
from test_subagents import fan_out, research_scripts

from agentpool import (
    MessageRefused,
    cancel_run,
    enqueue_run,
    fork_run,
    get_run,
    list_runs,
    resume,
    send_message,
    wait_for_run,
)
from agentpool.store.keys import RunKeys
from agentpool.testing import assert_valid_conversation

from conftest import script_task, wait_for_status


def user_texts(run) -> list[str]:
    texts = []
    for m in run.messages:
        if m["role"] == "user":
            content = m["content"]
            texts += [content] if isinstance(content, str) else [b["text"] for b in content if b["type"] == "text"]
    return texts


def answers_once_it_sees(wanted: str, *, slow: float):
    """A script step that answers "Saw it." once the request holds ``wanted``, and is slow (``slow``
    seconds) to answer without it: the run is in its model call while the test sends and forks."""

    def step(request):
        sent = any(wanted in str(m["content"]) for m in request.messages if m["role"] == "user")
        return {"text": "Saw it."} if sent else {"text": "Working on it.", "delay": slow}

    return step


def test_a_fork_now_takes_the_messages_waiting_in_its_parents_inbox_and_answers_them(r, pool, model):
    """The user sent "also refund the shipping" while the run was busy, and the run accepted it; a fork made
    now is the conversation as the run goes on with it, so that message is in it (delivered at once: the
    fork's first model call sees it). A fork at an earlier turn goes back before it, as asked."""
    late = "Also refund the shipping."
    model.set_scripts(
        {"chat": [{"text": "First answer."}, answers_once_it_sees(late, slow=3), answers_once_it_sees(late, slow=3)]}
    )
    pool.start(1)
    parent = enqueue_run("pool_agents:support", script_task("chat"), connection=r)
    assert wait_for_run(parent, timeout=60, connection=r).result == "First answer."
    send_message(parent, "Refund the order.", connection=r)  # delivered at once: its model call runs
    wait_for_status(r, parent, "running")
    sent = send_message(parent, late, message_id="m-ship", connection=r)  # waits in the inbox
    assert [m["id"] for m in get_run(parent, connection=r).inbox] == [sent]

    now = get_run(fork_run(parent, connection=r), connection=r)
    back = get_run(fork_run(parent, at_turn=0, connection=r), connection=r)
    assert user_texts(now) == [script_task("chat"), "Refund the order.", late], "the waiting message is in the fork"
    assert (now.forked_at, now.turns, now.status, now.inbox) == (1, 1, "queued", [])
    assert user_texts(back) == [script_task("chat")] and back.inbox == [], "an earlier turn leaves it out"

    answered = wait_for_run(now.id, timeout=60, connection=r, after_message=sent)
    assert (answered.status, answered.result, answered.turns) == ("completed", "Saw it.", 2)
    assert send_message(now.id, late, message_id=sent, connection=r) == sent  # a retry: already in the fork
    assert get_run(now.id, connection=r).messages == answered.messages
    assert wait_for_run(back.id, timeout=60, connection=r).result == "First answer."

    # The parent, untouched, delivers it to itself once: the fork took a copy, not the message.
    done = wait_for_run(parent, timeout=60, connection=r, after_message=sent)
    assert done.result == "Saw it." and user_texts(done).count(late) == 1
    assert get_run(parent, connection=r).inbox == []
    for run_id in (parent, now.id, back.id):
        assert_valid_conversation(get_run(run_id, connection=r).messages)
    assert model.stats()["rejected"] == 0, model.stats()["rejections"]


def test_a_fork_of_a_cancelled_run_goes_on_with_the_message_it_never_delivered(r, pool, model):
    """A cancelled run refuses messages and says to fork it instead; the message it had accepted before the
    cancel was never answered, and the fork that goes on from its history answers it."""
    late = "Please answer this one."
    model.set_scripts({"chat": [answers_once_it_sees(late, slow=3), answers_once_it_sees(late, slow=3)]})
    pool.start(1)
    parent = enqueue_run("pool_agents:support", script_task("chat"), connection=r)
    wait_for_status(r, parent, "running")
    sent = send_message(parent, late, connection=r)
    cancel_run(parent, connection=r)
    assert get_run(parent, connection=r).inbox == [{"id": sent, "content": late}]
    with pytest.raises(MessageRefused, match="fork_run"):
        send_message(parent, "Hello?", connection=r)

    fork = fork_run(parent, connection=r)
    answered = wait_for_run(fork, timeout=60, connection=r, after_message=sent)
    assert (answered.status, answered.result) == ("completed", "Saw it.")
    assert user_texts(answered) == [script_task("chat"), late]
    assert get_run(parent, connection=r).status == "cancelled"
    assert_valid_conversation(answered.messages)


def test_a_fork_of_a_run_waiting_for_its_children_is_refused_and_delegates_nothing_again(r, pool, model):
    """The parent's reply started two sub-agents, which file reports (an effect that must not happen twice).
    A fork "now" would leave that reply out and its model would start them again: refused, as when a tool
    has run, whichever way the latest turn is asked for. Once the turn is saved, the copy holds their
    answers and starts no child."""
    model.set_scripts({"orchestrate": [fan_out(2), {"text": "combined"}], **research_scripts(2, delay=2, report=True)})
    pool.start(2)
    parent = enqueue_run("subagent_agents:orchestrator", script_task("orchestrate"), connection=r)
    wait_for_status(r, parent, "waiting_children")
    for latest in (None, 1):
        with pytest.raises(ValueError, match=r"tool calls of its turn 1, and some have run.*at_turn=0"):
            fork_run(parent, at_turn=latest, connection=r)
    children = get_run(parent, connection=r).children
    assert sorted(run.id for run in list_runs(connection=r)) == sorted([parent, *children]), "no fork was made"

    done = wait_for_run(parent, timeout=120, connection=r)
    assert done.status == "completed" and done.result == "combined"
    copy = get_run(fork_run(parent, connection=r), connection=r)
    assert (copy.status, copy.messages, copy.children) == ("completed", done.messages, [])
    reports = [e["run"] for e in pool.effects() if e["tool"] == "file_report"]
    assert sorted(reports) == sorted(done.children), "each child filed its report once, and no other run did"
    assert_valid_conversation(copy.messages)


def test_a_fork_of_a_run_stopped_in_its_tool_phase_by_the_turn_timeout_sends_nothing_again(r, pool, model):
    """The turn timeout cut the run while its reply's tools ran: the email had gone out, the read had not
    finished. The run is stopped with that reply's calls on record, so the latest fork is refused as for a
    running turn, and once a resume saves the turn the whole copy is forked; the email went out once."""
    email = {"name": "send_email", "input": {"to": "c@example.com", "subject": "Refund", "body": "Done."}}
    model.set_scripts(
        {"mail": [{"tool_calls": [email, {"name": "slow_read", "input": {"seconds": 5}}]}, {"text": "Done."}]}
    )
    pool.start(1, AGENTPOOL_TURN_TIMEOUT="3")
    parent = enqueue_run("pool_agents:support", script_task("mail"), connection=r)
    wait_for_status(r, parent, "stopped", timeout=60)
    assert "AGENTPOOL_TURN_TIMEOUT" in get_run(parent, connection=r).error
    assert r.hget(RunKeys.of(parent).run, "phase") == b"tools", "stopped between its save points A and B"
    for latest in (None, 1):
        with pytest.raises(ValueError, match=r"tool calls of its turn 1, and some have run.*at_turn=0"):
            fork_run(parent, at_turn=latest, connection=r)
    assert [run.id for run in list_runs(connection=r)] == [parent], "no fork was made"

    pool.stop(signal.SIGTERM)  # workers that let the read finish this time
    pool.start(1)
    resume(parent, connection=r)
    done = wait_for_run(parent, timeout=60, connection=r)
    assert done.status == "completed" and done.result == "Done.", done.error
    copy = get_run(fork_run(parent, connection=r), connection=r)
    assert copy.status == "completed" and copy.messages == done.messages
    assert [e["run"] for e in pool.effects() if e["tool"] == "send_email"] == [parent]
    assert_valid_conversation(copy.messages)
