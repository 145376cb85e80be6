"""Conversations through real workers: follow-up messages (send_message, wait_for_run(after_message=))
and forks (fork_run), against the scripted model."""

from __future__ import annotations

import pytest

from agentpool import (
    MessageRefused,
    ResumeRefused,
    RunExists,
    approve,
    cancel_run,
    enqueue_run,
    fork_run,
    get_run,
    list_runs,
    resume,
    send_message,
    wait_for_run,
)
from agentpool.store import events
from agentpool.store.keys import RunKeys

from conftest import assert_valid_conversation, script_task, wait_for_status


def kinds(r, run_id):
    return [fields["kind"] for _id, fields in events.read(r, run_id)]


def user_texts(message):
    content = message["content"]
    if isinstance(content, str):
        return [content]
    return [b["text"] for b in content if b["type"] == "text"]


def test_a_follow_up_to_a_completed_run_goes_on_and_is_waited_for(r, pool, model):
    model.set_scripts({"chat": [{"text": "First answer."}, {"text": "Second answer."}, {"text": "Third answer."}]})
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("chat"), connection=r)
    first = wait_for_run(run_id, timeout=60, connection=r)
    assert first.status == "completed" and first.result == "First answer."

    sent = send_message(run_id, "And then?", message_id="req-1", connection=r)
    assert sent == "req-1"
    # The run was completed a moment ago: waiting for the answer to *this* message must not return it.
    second = wait_for_run(run_id, timeout=60, connection=r, after_message=sent)
    assert second.status == "completed" and second.result == "Second answer."
    assert second.turns == 2
    assert second.usage["output_tokens"] > first.usage["output_tokens"]
    assert [m["role"] for m in second.messages] == ["user", "assistant", "user", "assistant"]
    assert second.messages[2]["content"] == "And then?"

    # A retried request delivers nothing more; the same id for other content is refused.
    assert send_message(run_id, "And then?", message_id="req-1", connection=r) == "req-1"
    with pytest.raises(MessageRefused, match="already used"):
        send_message(run_id, "Something else", message_id="req-1", connection=r)
    assert get_run(run_id, connection=r).messages == second.messages

    third_id = send_message(run_id, [{"type": "text", "text": "One more."}], connection=r)
    third = wait_for_run(run_id, timeout=60, connection=r, after_message=third_id)
    assert third.result == "Third answer." and third.turns == 3
    assert_valid_conversation(third.messages)
    assert {"message_delivered", "status"} <= set(kinds(r, run_id))
    assert model.stats()["rejected"] == 0, model.stats()["rejections"]


def test_messages_sent_while_a_tool_runs_join_its_results_in_order(r, pool, model):
    model.set_scripts(
        {
            "slow": [
                {"tool_calls": [{"name": "slow_read", "input": {"seconds": 1.5}}]},
                {"text": "Noted both."},
            ]
        }
    )
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("slow"), connection=r)
    pool.wait_for_effect("slow_read")
    a = send_message(run_id, "First follow-up.", connection=r)
    b = send_message(run_id, "Second follow-up.", connection=r)
    assert [m["id"] for m in get_run(run_id, connection=r).inbox] == [a, b]
    run = wait_for_run(run_id, timeout=60, connection=r, after_message=b)

    assert run.status == "completed" and run.result == "Noted both." and run.turns == 2
    closing = run.messages[2]["content"]
    assert [blk["type"] for blk in closing] == ["tool_result", "text", "text"]  # results first, then in order
    assert user_texts(run.messages[2]) == ["First follow-up.", "Second follow-up."]
    assert run.inbox == []
    assert_valid_conversation(run.messages)
    assert kinds(r, run_id).count("message_queued") == 2
    assert model.stats()["rejected"] == 0, model.stats()["rejections"]


def test_a_message_sent_while_the_model_writes_its_final_answer_is_answered_first(r, pool, model):
    model.set_scripts({"late": [{"text": "Working on it.", "delay": 2.0}, {"text": "Answering the follow-up."}]})
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("late"), connection=r)
    wait_for_status(r, run_id, "running")
    sent = send_message(run_id, "Also check the invoices.", connection=r)
    run = wait_for_run(run_id, timeout=60, connection=r, after_message=sent)

    assert "message_queued" in kinds(r, run_id)  # it reached the inbox while the run was running
    assert run.status == "completed" and run.result == "Answering the follow-up."
    assert [m["role"] for m in run.messages] == ["user", "assistant", "user", "assistant"]
    assert user_texts(run.messages[2]) == ["Also check the invoices."]
    assert_valid_conversation(run.messages)


def test_a_message_to_a_run_waiting_for_approval_waits_for_the_decision(r, pool, model):
    model.set_scripts(
        {"deploy": [{"tool_calls": [{"name": "deploy", "input": {"version": "1.2"}}]}, {"text": "Deployed 1.2."}]}
    )
    pool.start(1)
    run_id = enqueue_run("pool_agents:guarded", script_task("deploy"), connection=r)
    wait_for_status(r, run_id, "waiting_approval")
    sent = send_message(run_id, "Tell the team when done.", connection=r)
    waiting = get_run(run_id, connection=r)
    assert waiting.status == "waiting_approval" and [m["content"] for m in waiting.inbox] == [
        "Tell the team when done."
    ]
    approve(run_id, connection=r)
    run = wait_for_run(run_id, timeout=60, connection=r, after_message=sent)

    assert run.status == "completed" and run.result == "Deployed 1.2."
    assert [blk["type"] for blk in run.messages[2]["content"]] == ["tool_result", "text"]
    assert sum(1 for e in pool.effects() if e["tool"] == "deploy") == 1
    assert_valid_conversation(run.messages)


def test_cancelled_failed_and_budget_stopped_runs_refuse_or_say_what_to_do(r, pool, model):
    reads = [{"tool_calls": [{"name": "read_notes", "input": {"topic": "x"}}]}] * 3
    model.set_scripts({"long": [*reads, {"text": "Done at last."}], "chat": [{"text": "Hi."}, {"text": "Yes."}]})
    pool.start(1)
    stopped = enqueue_run("pool_agents:short", script_task("long"), connection=r)
    assert wait_for_run(stopped, timeout=60, connection=r).status == "stopped"
    with pytest.raises(MessageRefused, match=r"resume\(.*add_turns=1"):
        send_message(stopped, "Go on.", connection=r)
    resume(stopped, add_turns=3, connection=r)
    sent = send_message(stopped, "Then summarize.", connection=r)
    run = wait_for_run(stopped, timeout=60, connection=r, after_message=sent)
    assert run.status == "completed" and run.result == "Done at last."
    assert "Then summarize." in user_texts(run.messages[-2])
    assert_valid_conversation(run.messages)

    cancelled = enqueue_run("pool_agents:support", script_task("chat"), connection=r)
    wait_for_run(cancelled, timeout=60, connection=r)
    cancel_run(cancelled, connection=r)  # a completed run stays completed, and takes messages
    still = send_message(cancelled, "Still there?", connection=r)
    assert wait_for_run(cancelled, timeout=60, connection=r, after_message=still).result == "Yes."
    queued = enqueue_run(
        "pool_agents:nowhere", script_task("chat"), connection=r, check_agent=False, run_id="r_cancel_me"
    )
    cancel_run(queued, connection=r)
    with pytest.raises(MessageRefused, match="cancelled"):
        send_message(queued, "Hello?", connection=r)
    assert get_run(queued, connection=r).inbox == []


def test_a_run_completed_at_its_turn_limit_refuses_a_message_until_its_limits_are_raised(r, pool, model):
    model.set_scripts(
        {
            "two": [
                {"tool_calls": [{"name": "read_notes", "input": {"topic": "x"}}]},
                {"text": "Done."},
                {"text": "More."},
            ]
        }
    )
    pool.start(1)
    run_id = enqueue_run("pool_agents:short", script_task("two"), connection=r)  # max_turns=2
    done = wait_for_run(run_id, timeout=60, connection=r)
    assert (done.status, done.turns, done.result) == ("completed", 2, "Done.")

    with pytest.raises(MessageRefused, match=r"completed at a limit \(2 of max_turns=2\).*resume\(.*add_turns=1\)"):
        send_message(run_id, "And then?", connection=r)
    after = get_run(run_id, connection=r)
    assert (after.status, after.messages, after.inbox) == ("completed", done.messages, [])  # nothing stored
    with pytest.raises(ResumeRefused, match="add_turns>=1"):
        resume(run_id, connection=r)
    fork = fork_run(run_id, connection=r)  # completed too, with the parent's limits
    with pytest.raises(MessageRefused, match=r"completed at a limit \(2 of max_turns=2\)"):
        send_message(fork, "And then?", connection=r)

    assert resume(run_id, add_turns=1, connection=r).status == "completed"  # raised; nothing to do yet
    sent = send_message(run_id, "And then?", connection=r)
    answered = wait_for_run(run_id, timeout=60, connection=r, after_message=sent)
    assert (answered.status, answered.turns, answered.result) == ("completed", 3, "More.")
    assert_valid_conversation(answered.messages)
    # At its raised limit again: refused again, saying so.
    with pytest.raises(MessageRefused, match=r"3 of max_turns=3"):
        send_message(run_id, "Once more?", connection=r)


def test_message_content_is_checked(r):
    run_id = enqueue_run("pool_agents:support", "task", connection=r)
    for bad in ("", "  ", [], [{"type": "tool_result", "tool_use_id": "x", "content": "y"}], [{"type": "text"}], 5):
        with pytest.raises(ValueError):
            send_message(run_id, bad, connection=r)
    with pytest.raises(ValueError, match="message_id"):
        send_message(run_id, "ok", message_id="has space", connection=r)
    with pytest.raises(ValueError, match="message_id"):  # "m1:at" is where m1's delivery is marked
        send_message(run_id, "ok", message_id="m1:at", connection=r)
    assert get_run(run_id, connection=r).inbox == []


def test_a_run_or_fork_id_that_could_not_name_a_job_is_refused_up_front(r):
    """RQ job ids take letters, digits, "_" and "-": a completed fork named "fork.v1" would be created
    (it enqueues nothing) and could then never be continued."""
    run_id = enqueue_run("pool_agents:support", "task", connection=r)
    for bad in ("fork.v1", "a:b", "", "x" * 101):
        with pytest.raises(ValueError, match="a run id is"):
            fork_run(run_id, fork_id=bad, connection=r)
        with pytest.raises(ValueError, match="a run id is"):
            enqueue_run("pool_agents:support", "task", run_id=bad, connection=r)
    assert fork_run(run_id, fork_id="fork-v1_2", connection=r) == "fork-v1_2"


MEETING = [
    {"text": "Let me read the notes.", "tool_calls": [{"name": "read_notes", "input": {"topic": "release"}}]},
    {"tool_calls": [{"name": "create_ticket", "input": {"title": "Changelog", "body": "Ana writes it"}}]},
    {"text": "A ticket is open."},
    {"text": "Follow-up answered."},
]


def test_forks_copy_committed_turns_and_run_nothing_of_the_parent_again(r, pool, model):
    model.set_scripts({"meeting": MEETING})
    pool.start(1)
    parent = enqueue_run("pool_agents:support", script_task("meeting"), connection=r)
    done = wait_for_run(parent, timeout=60, connection=r)
    assert done.status == "completed" and done.turns == 3

    at_one = fork_run(parent, at_turn=1, fork_id="f_at_one", connection=r)
    assert fork_run(parent, at_turn=1, fork_id="f_at_one", connection=r) == at_one  # a retry: one fork
    with pytest.raises(RunExists):
        fork_run(parent, at_turn=2, fork_id="f_at_one", connection=r)
    fork = get_run(at_one, connection=r)
    assert (fork.forked_from, fork.forked_at, fork.turns) == (parent, 1, 1)
    assert fork.messages == done.messages[:3] and sum(fork.usage.values()) == 0
    forked = wait_for_run(at_one, timeout=60, connection=r)
    assert forked.status == "completed" and forked.result == "A ticket is open." and forked.turns == 3

    latest = fork_run(parent, connection=r)
    copy = get_run(latest, connection=r)
    assert copy.status == "completed" and copy.result == done.result and copy.messages == done.messages
    sent = send_message(latest, "One more thing.", connection=r)
    answered = wait_for_run(latest, timeout=60, connection=r, after_message=sent)
    assert answered.result == "Follow-up answered." and answered.turns == 4

    # The parent is untouched, and each tool ran once per run that asked for it.
    assert get_run(parent, connection=r).messages == done.messages
    runs_of = [(e["tool"], e["run"]) for e in pool.effects()]
    assert runs_of.count(("read_notes", parent)) == 1 and runs_of.count(("create_ticket", parent)) == 1
    assert ("read_notes", at_one) not in runs_of and runs_of.count(("create_ticket", at_one)) == 1
    assert not any(run == latest for _tool, run in runs_of)
    for run_id in (at_one, latest):
        assert_valid_conversation(get_run(run_id, connection=r).messages)
    assert "forked" in kinds(r, at_one)
    assert model.stats()["rejected"] == 0, model.stats()["rejections"]


def test_a_fork_mid_turn_starts_from_the_last_committed_turn(r, pool, model):
    model.set_scripts(
        {"deploy": [{"tool_calls": [{"name": "deploy", "input": {"version": "2.0"}}]}, {"text": "Deployed."}]}
    )
    pool.start(1)
    parent = enqueue_run("pool_agents:guarded", script_task("deploy"), connection=r)
    wait_for_status(r, parent, "waiting_approval")
    fork = get_run(fork_run(parent, at_turn=1, connection=r), connection=r)
    assert fork.turns == 0 and fork.forked_at == 0 and len(fork.messages) == 1 and fork.pending == []
    with pytest.raises(ValueError, match="at_turn"):
        fork_run(parent, at_turn=5, connection=r)
    assert get_run(parent, connection=r).status == "waiting_approval"


def test_the_latest_fork_of_a_run_whose_tools_have_run_is_refused_not_sent_again(r, pool, model):
    """A fork "now" of a run in its tool phase would leave out the reply in flight; once one of its calls
    has run (the email is sent), the fork's model would be asked again without it and send it again. So
    it is refused, saying how to fork; the turn asked for by number forks from before it, as asked."""
    email = {"name": "send_email", "input": {"to": "c@example.com", "subject": "Refund", "body": "Done."}}
    model.set_scripts(
        {"mail": [{"tool_calls": [email, {"name": "slow_read", "input": {"seconds": 4}}]}, {"text": "Done."}]}
    )
    pool.start(1)
    parent = enqueue_run("pool_agents:support", script_task("mail"), connection=r)
    pool.wait_for_effect("send_email")
    with pytest.raises(ValueError, match=r"tool calls of its turn 1, and some have run.*at_turn=0"):
        fork_run(parent, connection=r)
    with pytest.raises(ValueError, match=r"tool calls of its turn 1, and some have run.*at_turn=0"):
        fork_run(parent, at_turn=1, connection=r)  # turn 1 is the one in flight: the latest fork by its number
    assert [run.id for run in list_runs(connection=r)] == [parent], "no fork was made"
    before = fork_run(parent, at_turn=0, connection=r)  # from before the email, as asked: its own branch
    assert get_run(before, connection=r).forked_at == 0
    done = wait_for_run(parent, timeout=60, connection=r)
    assert done.status == "completed"
    latest = get_run(fork_run(parent, connection=r), connection=r)  # once the turn is saved: the whole copy
    assert latest.status == "completed" and latest.messages == done.messages
    assert wait_for_run(before, timeout=60, connection=r).status == "completed"
    emails = [e["run"] for e in pool.effects() if e["tool"] == "send_email"]
    assert sorted(emails) == sorted([parent, before]), "once by the parent, once by the fork that went back"


def test_a_fork_keeps_its_parents_tenant_share_and_webhook(r):
    """A fork of a tenant's run counts against the same fair share, and its end is posted to the same
    webhook: it is the same agent's work for the same customer."""
    parent = enqueue_run(
        "pool_agents:support",
        script_task("x"),
        concurrency_key="acme",
        max_concurrency=1,
        webhook="https://hooks.example.com/runs",
        webhook_events=("ended", "waiting_approval"),
        connection=r,
    )
    fork = fork_run(parent, connection=r)
    fields = ["ckey", "cmax", "webhook", "webhook_events", "queue"]
    assert r.hmget(RunKeys.of(fork).run, fields) == r.hmget(RunKeys.of(parent).run, fields)


def test_the_cli_sends_waits_for_the_answer_and_forks(r, redis_server, pool, model):
    from test_usability import agentpool_cli

    model.set_scripts({"chat": [{"text": "Hello."}, {"text": "Fine, thanks."}, {"text": "From the fork."}]})
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("chat"), connection=r)
    wait_for_run(run_id, timeout=60, connection=r)

    sent = agentpool_cli("send", run_id, "How are you?", "--message-id", "cli-1", "--wait", url=redis_server.url)
    assert sent.returncode == 0, sent.stderr
    assert sent.stdout.splitlines() == ["cli-1", "completed after 2 turns: Fine, thanks."]
    again = agentpool_cli("send", run_id, "How are you?", "--message-id", "cli-1", url=redis_server.url)
    assert again.returncode == 0 and get_run(run_id, connection=r).turns == 2  # delivered once

    forked = agentpool_cli("fork", run_id, "--at-turn", "1", url=redis_server.url)
    assert forked.returncode == 0, forked.stderr
    fork_id = forked.stdout.strip()
    # Turn 1 ends with the message delivered after its reply: the fork answers it again, its own way.
    assert "at turn 1: queued" in forked.stderr
    shown = agentpool_cli("show", fork_id, url=redis_server.url)
    assert f"forked from {run_id} at turn 1" in shown.stdout
    assert wait_for_run(fork_id, timeout=60, connection=r).result == "Fine, thanks."
    answer = agentpool_cli("send", fork_id, "And you?", "--wait", url=redis_server.url)
    assert answer.stdout.splitlines()[-1] == "completed after 3 turns: From the fork."
    assert get_run(run_id, connection=r).turns == 2  # the parent is untouched
    watched = agentpool_cli("watch", run_id, "--events-only", url=redis_server.url)  # a finished run replays
    assert "message_delivered" in watched.stdout and "messages=cli-1" in watched.stdout
    assert "forked" in agentpool_cli("watch", fork_id, "--events-only", url=redis_server.url).stdout

    queued = enqueue_run("pool_agents:nowhere", "task", connection=r, check_agent=False)
    cancel_run(queued, connection=r)
    refused = agentpool_cli("send", queued, "Hi", url=redis_server.url)
    assert refused.returncode == 1 and "cancelled" in refused.stderr


def test_a_message_to_a_completed_run_lifts_its_retention_until_it_completes_again(r, pool, model):
    from agentpool.store.keys import RunKeys

    model.set_scripts({"chat": [{"text": "One.", "delay": 0}, {"text": "Two.", "delay": 1.0}]})
    pool.start(1, AGENTPOOL_RETENTION_SECONDS="600")
    run_id = enqueue_run("pool_agents:support", script_task("chat"), connection=r)
    wait_for_run(run_id, timeout=60, connection=r)
    keys = RunKeys.of(run_id)
    assert 0 < r.ttl(keys.run) <= 600
    sent = send_message(run_id, "Still there?", connection=r)
    assert r.ttl(keys.run) == -1 and r.ttl(keys.messages) == -1 and r.ttl(keys.received) == -1
    wait_for_run(run_id, timeout=60, connection=r, after_message=sent)
    assert all(0 < r.ttl(key) <= 600 for key in (keys.run, keys.messages, keys.received, keys.events))


def test_a_run_stopped_by_a_spend_limit_429_goes_on_with_a_message(r, pool, model):
    limit = "This request would exceed your organization's monthly usage limit."
    model.set_scripts(
        {"broke": [{"error": {"status": 429, "type": "rate_limit_error", "times": 1, "message": limit}, "text": "Ok."}]}
    )
    pool.start(1)
    run_id = enqueue_run("pool_agents:budgeted", script_task("broke"), connection=r)
    stopped = wait_for_run(run_id, timeout=60, connection=r)
    assert stopped.status == "stopped" and "usage limit" in stopped.error
    # No limit of the run's own stopped it: the message goes straight in and the run goes on.
    sent = send_message(run_id, "Try again now.", connection=r)
    run = wait_for_run(run_id, timeout=60, connection=r, after_message=sent)
    assert run.status == "completed" and run.result == "Ok." and run.turns == 1
    assert [m["role"] for m in run.messages] == ["user", "user", "assistant"]  # the API joins the two
    assert model.stats()["rejected"] == 0, model.stats()["rejections"]


def test_a_fork_retried_after_its_parent_moved_on_returns_the_fork_it_made(r):
    """The app's fork request landed but its reply was lost; the parent then committed another turn.
    The retry with the same fork_id is the same request: it returns the fork, it does not refuse it."""
    from agentpool.store import checkpoint
    from agentpool.store.keys import RunKeys
    from agentpool.store.lease import Acquire, acquire

    run_id = enqueue_run("pool_agents:support", "task", connection=r)
    keys = RunKeys.of(run_id)

    def commit_a_turn(turn: int) -> None:
        got = acquire(r, keys, turn=turn, worker_id="w1.1", ttl_ms=10_000)
        assert got.code is Acquire.ACQUIRED, got
        reply = {"role": "assistant", "content": [{"type": "text", "text": f"turn {turn}"}]}
        checkpoint.commit_response(r, keys, got.token, turns_before=turn, message=reply, pending=[])
        checkpoint.commit_tool_results(
            r,
            keys,
            got.token,
            message={"role": "user", "content": "go on"},
            enqueue_next=lambda pipe: None,
            turns=turn + 1,
        )

    commit_a_turn(0)
    assert fork_run(run_id, fork_id="fork-retried", connection=r) == "fork-retried"
    commit_a_turn(1)
    assert fork_run(run_id, fork_id="fork-retried", connection=r) == "fork-retried"
    assert get_run("fork-retried", connection=r).turns == 1
    with pytest.raises(RunExists):
        fork_run(run_id, at_turn=0, fork_id="fork-retried", connection=r)  # another request under that id


def _arrives_just_before_the_stop(r, run_id: str, message_id: str, text: str) -> None:
    """What a send_message in the instant between a turn's save point B and the next turn's limit check
    leaves: the message kept and waiting in the inbox of the run the check then stops (the same two
    writes send_message makes for a running run)."""
    from agentpool.store import inbox
    from agentpool.store.keys import RunKeys

    keys = RunKeys.of(run_id)
    r.hset(keys.received, message_id, inbox.pack_content(text))
    r.rpush(keys.inbox, message_id)


def test_a_message_left_waiting_by_a_limit_stop_reaches_the_model_call_that_resumes_the_run(r, pool, model):
    """resume(add_turns=1) gives the run one turn: the model call of that turn must see the message that
    waited, or the turn is spent without it and the message is delivered after, never answered."""
    reads = [{"tool_calls": [{"name": "read_notes", "input": {"topic": "x"}}]}] * 2
    model.set_scripts({"long": [*reads, {"text": "Summarized."}]})
    pool.start(1)
    run_id = enqueue_run("pool_agents:short", script_task("long"), connection=r)  # max_turns=2
    assert wait_for_run(run_id, timeout=60, connection=r).status == "stopped"
    _arrives_just_before_the_stop(r, run_id, "late-1", "Then summarize.")
    assert get_run(run_id, connection=r).inbox == [{"id": "late-1", "content": "Then summarize."}]

    resume(run_id, add_turns=1, connection=r)
    run = wait_for_run(run_id, timeout=60, connection=r, after_message="late-1")
    assert (run.status, run.turns, run.result) == ("completed", 3, "Summarized."), run.error
    assert "Then summarize." in user_texts(run.messages[-2]), "the resumed turn's model call saw it"
    assert run.inbox == []
    assert_valid_conversation(run.messages)


def test_a_message_to_a_stopped_run_with_one_waiting_goes_in_behind_it_before_the_model_call(r, pool, model):
    """A run stopped for a reason other than a limit (a spend-limit 429) takes a message at once; one
    that waited since before the stop goes in with it, first, and the next model call sees both."""
    limit = "This request would exceed your organization's monthly usage limit."
    model.set_scripts(
        {"broke": [{"error": {"status": 429, "type": "rate_limit_error", "times": 1, "message": limit}, "text": "Ok."}]}
    )
    pool.start(1)
    run_id = enqueue_run("pool_agents:budgeted", script_task("broke"), connection=r)
    assert wait_for_run(run_id, timeout=60, connection=r).status == "stopped"
    _arrives_just_before_the_stop(r, run_id, "early-1", "First this.")
    sent = send_message(run_id, "Then this.", connection=r)
    run = wait_for_run(run_id, timeout=60, connection=r, after_message=sent)
    assert (run.status, run.turns, run.result) == ("completed", 1, "Ok."), run.error
    assert user_texts(run.messages[-2]) == ["First this.", "Then this."], "in the order they were sent"
    assert run.inbox == []
    assert model.stats()["rejected"] == 0, model.stats()["rejections"]


def test_an_inbox_id_whose_content_is_missing_is_dropped_and_no_message_is_delivered_twice(r, pool, model):
    """A damaged inbox (an id whose kept content is gone) must not shift what delivery takes out of the
    inbox: the messages around it are delivered once each, in order, and the inbox ends empty."""
    limit = "This request would exceed your organization's monthly usage limit."
    model.set_scripts(
        {
            "broke": [
                {"error": {"status": 429, "type": "rate_limit_error", "times": 1, "message": limit}, "text": "Ok."},
                {"text": "And again."},
            ]
        }
    )
    pool.start(1)
    run_id = enqueue_run("pool_agents:budgeted", script_task("broke"), connection=r)
    assert wait_for_run(run_id, timeout=60, connection=r).status == "stopped"
    _arrives_just_before_the_stop(r, run_id, "early-1", "First this.")
    inbox_key = RunKeys.of(run_id).inbox
    r.rpush(inbox_key, "gone")  # its content was never kept (a damaged record)
    _arrives_just_before_the_stop(r, run_id, "early-2", "Second this.")
    assert [m["id"] for m in get_run(run_id, connection=r).inbox] == ["early-1", "early-2"]

    sent = send_message(run_id, "Then this.", connection=r)
    run = wait_for_run(run_id, timeout=60, connection=r, after_message=sent)
    assert (run.status, run.result) == ("completed", "Ok."), run.error
    assert user_texts(run.messages[-2]) == ["First this.", "Second this.", "Then this."]
    assert run.inbox == [] and r.llen(inbox_key) == 0
    delivered = [f for _id, f in events.read(r, run_id) if f["kind"] == "message_delivered"]
    assert [(f["messages"], f.get("lost")) for f in delivered] == [("early-1,early-2," + sent, "gone")]

    again = send_message(run_id, "Once more.", connection=r)  # the next delivery takes only the new message
    run = wait_for_run(run_id, timeout=60, connection=r, after_message=again)
    assert run.result == "And again.", run.error
    texts = [t for m in run.messages if m["role"] == "user" for t in user_texts(m)]
    assert texts.count("Then this.") == 1 and texts.count("Second this.") == 1
    assert_valid_conversation(run.messages)
