"""Sub-agents as durable child runs (issue 25): a fan-out that starts each child once, a join that wakes
the parent once when the last child ends, one budget for the tree, and control that reaches the children.
Real Redis, real RQ workers, the real anthropic client against the scripted Messages API."""

from __future__ import annotations

import random
import time

import pytest
from click.testing import CliRunner

from agentpool import Agent, Subagent, approve, cancel_run, enqueue_run, get_run, resume, send_message, wait_for_run
from agentpool.client import ResumeRefused
from agentpool.ops.cli import main
from agentpool.ops.dashboard import run_detail
from agentpool.runtime.jobs import turn_queue
from agentpool.store import checkpoint, events
from agentpool.store.children import child_id
from agentpool.store.errors import RunNotActive
from agentpool.store.keys import RUNS, RunKeys, check_run_id
from agentpool.testing import assert_valid_conversation
from agentpool.testing.localpool import WorkerProcesses

from conftest import script_task, wait_for_status


def research_scripts(n: int, *, delay: float = 0.0, report: bool = False) -> dict:
    """research0..research<n-1>: read notes (and file a report), then answer "answer <i>"."""
    scripts = {}
    for i in range(n):
        calls = [{"name": "read_notes", "input": {"topic": f"topic {i}"}}]
        if report:
            calls.append({"name": "file_report", "input": {"title": f"report {i}"}})
        scripts[f"research{i}"] = [{"tool_calls": calls, "delay": delay}, {"text": f"answer {i}"}]
    return scripts


def fan_out(n: int, tool: str = "researcher") -> dict:
    return {
        "tool_calls": [{"name": tool, "input": {"task": f"Look into topic {i} [script:research{i}]"}} for i in range(n)]
    }


def tool_results(run, index: int = -1) -> list[dict]:
    users = [m for m in run.messages if m["role"] == "user" and isinstance(m["content"], list)]
    return [b for b in users[index]["content"] if b.get("type") == "tool_result"]


def tool_uses(run, name: str) -> list[dict]:
    return [
        b
        for m in run.messages
        if m["role"] == "assistant" and isinstance(m["content"], list)
        for b in m["content"]
        if b.get("type") == "tool_use" and b["name"] == name
    ]


def tree_state(r, run_id: str) -> str:
    run = get_run(run_id, connection=r)
    lines = [f"{run_id} {run.status} turns={run.turns} joins={r.hgetall(RunKeys.of(run_id).joins)}"]
    lines += [f"  {c} {get_run(c, connection=r).status}" for c in run.children]
    lines += [str(fields) for _, fields in events.read(r, run_id)[-15:]]
    return "\n".join(lines)


def kinds(r, run_id: str, kind: str) -> list[dict]:
    return [fields for _, fields in events.read(r, run_id) if fields.get("kind") == kind]


# -- the definition ------------------------------------------------------------------------------


def test_a_sub_agent_is_offered_as_a_tool_taking_a_task():
    agent = Agent(
        model="claude-sonnet-5-5",
        subagents={"researcher": "subagent_agents:researcher", "writer": Subagent("x.y:w", description="Writes.")},
    )
    params = {p["name"]: p for p in agent.tool_params()}
    assert params["researcher"]["input_schema"]["required"] == ["task"]
    assert params["writer"]["description"] == "Writes."
    with pytest.raises(ValueError, match="duplicate tool names: read_notes"):
        from pool_agents import read_notes

        Agent(model="m", tools=[read_notes], subagents={"read_notes": "a.b:c"})
    with pytest.raises(ValueError, match="'module:attribute'"):
        Agent(model="m", subagents={"r": "no_colon"})
    with pytest.raises(ValueError, match="a tool name is 1 to 64"):
        Agent(model="m", subagents={"has space": "a.b:c"})


def test_a_child_id_is_derived_from_the_parent_and_the_tool_use_and_is_a_valid_job_id():
    one = child_id("r_0193abc", "toolu_01XYZ")
    assert one == child_id("r_0193abc", "toolu_01XYZ")
    assert one != child_id("r_0193abc", "toolu_01XYW") and one != child_id("r_0193abd", "toolu_01XYZ")
    assert check_run_id(one) == one
    deep = one
    for level in range(12):  # as deep as a tree may go, the id stays a valid run and RQ job id
        deep = child_id(deep, f"toolu_{level}")
        assert check_run_id(deep) == deep


# -- fan-out and join ----------------------------------------------------------------------------


def test_an_orchestrator_waits_for_its_children_without_a_lease_and_gets_their_answers_in_order(r, pool, model):
    model.set_scripts({"orchestrate": [fan_out(3), {"text": "combined"}], **research_scripts(3, delay=0.5)})
    pool.start(2)
    parent = enqueue_run("subagent_agents:orchestrator", script_task("orchestrate"), connection=r)
    wait_for_status(r, parent, "waiting_children", timeout=120)
    waiting = get_run(parent, connection=r)
    assert not r.exists(RunKeys.of(parent).lease), "nothing is leased while the run waits for its children"
    assert len(waiting.children) == 3 and "child runs" in waiting.waiting["note"]
    listed = CliRunner().invoke(main, ["runs", "--url", pool.env["REDIS_URL"], "--status", "waiting_children"])
    assert parent in listed.output and "waiting_children" in listed.output, listed.output

    done = wait_for_run(parent, timeout=180, connection=r)
    assert done.status == "completed" and done.result == "combined"
    calls = tool_uses(done, "researcher")
    assert done.children == [child_id(parent, call["id"]) for call in calls]
    results = tool_results(done)
    assert [b["tool_use_id"] for b in results] == [call["id"] for call in calls]
    assert [b["content"] for b in results] == ["answer 0", "answer 1", "answer 2"]
    assert not any(b.get("is_error") for b in results)
    for i, child in enumerate(done.children):
        run = get_run(child, connection=r)
        assert run.status == "completed" and run.parent == parent and run.depth == 1
        assert run.messages[0]["content"] == f"Look into topic {i} [script:research{i}]"
        assert_valid_conversation(run.messages)
    assert_valid_conversation(done.messages)
    assert len(kinds(r, parent, "children_joined")) == 1
    shown = CliRunner().invoke(main, ["show", "--url", pool.env["REDIS_URL"], parent])
    assert shown.exit_code == 0, shown.output
    tree = shown.output.split("child runs:\n", 1)[1].splitlines()[:3]
    assert [line.split()[:2] for line in tree] == [[child, "completed"] for child in done.children]
    page = run_detail(r, parent, 0)["run"]
    assert [(n["id"], n["status"]) for n in page["tree"]] == [(c, "completed") for c in done.children]
    assert all(n["cost_usd"] > 0 for n in page["tree"]) and page["children"] == done.children


@pytest.mark.crash
def test_five_children_are_started_once_and_the_parent_woken_once_while_workers_are_killed(r, pool, model):
    model.set_scripts({"orchestrate": [fan_out(5), {"text": "combined"}], **research_scripts(5, report=True)})
    # Horses are killed at every save point of every run once, and right after the last child's end
    # (before its worker queues the parent); whole workers are killed as turns start, whatever the pace.
    env = {"AGENTPOOL_FAULTS": "after_save_a,after_tool_outcome,after_last_child_end,after_save_b"}
    pool.start(2, **env)
    parent = enqueue_run("subagent_agents:orchestrator", script_task("orchestrate"), connection=r)
    rng = random.Random(25)
    kills, killed_at = 0, 0
    deadline = time.monotonic() + 300
    while get_run(parent, connection=r).status not in ("completed", "failed", "stopped", "cancelled"):
        assert time.monotonic() < deadline, tree_state(r, parent)
        started = sum(len(kinds(r, run, "turn_started")) for run in [parent, *get_run(parent, connection=r).children])
        if kills < 4 and started >= killed_at + 3:
            pool.kill(rng.choice(pool.alive()))  # a whole worker and its horse, SIGKILL
            pool.start(1, **env)
            kills, killed_at = kills + 1, started
        time.sleep(0.1)
    done = get_run(parent, connection=r)
    assert done.status == "completed", (done.error, pool.logs())
    calls = tool_uses(done, "researcher")
    assert len(calls) == 5
    assert done.children == [child_id(parent, call["id"]) for call in calls], "each child started once, in order"
    assert r.zcard(RUNS) == 6, "no child was started twice"
    assert [b["content"] for b in tool_results(done)] == [f"answer {i}" for i in range(5)]
    assert len(kinds(r, parent, "children_joined")) == 1, "the parent was woken exactly once"
    reports = [e for e in pool.effects() if e["tool"] == "file_report"]
    for child in done.children:
        assert len([e for e in reports if e["run"] == child]) <= 1, "an unsafe effect in a child ran twice"
        assert_valid_conversation(get_run(child, connection=r).messages)
    assert_valid_conversation(done.messages)
    # The horses died at save points (the whole-worker kills can take the one moment a fault is armed
    # for, between a write and its marker, so each kind is asserted to have fired, not for every run).
    # The death right after the last child's end is asserted where nothing races it (the test below).
    for point in ("after_save_a", "after_tool_outcome", "after_save_b"):
        assert list(pool.tmp.glob(f"fault-{point}-*")), f"no horse died at {point}"
    assert kills > 0, "whole workers were killed too"  # (how many depends on the pace: up to four)


@pytest.mark.crash
def test_the_last_childs_worker_killed_right_after_its_end_leaves_the_parent_woken_once_by_the_reaper(r, pool, model):
    """The last child's end is written (it woke its parent in that write) and its worker dies before it
    queues the parent's turn: the reaper queues it from the wake marker, once."""
    model.set_scripts({"orchestrate": [fan_out(2), {"text": "combined"}], **research_scripts(2, delay=1.0)})
    pool.start(2, AGENTPOOL_FAULTS="after_last_child_end")
    parent = enqueue_run("subagent_agents:orchestrator", script_task("orchestrate"), connection=r)
    done = wait_for_run(parent, timeout=180, connection=r)
    assert done.status == "completed", (done.error, tree_state(r, parent), pool.logs())
    fired = list(pool.tmp.glob("fault-after_last_child_end-*"))
    assert len(fired) == 1 and any(child in fired[0].name for child in done.children), fired
    assert len(kinds(r, parent, "children_joined")) == 1, "the parent was woken exactly once"
    assert [e["turn"] for e in kinds(r, parent, "turn_started")] == ["0", "1"], tree_state(r, parent)
    assert [b["content"] for b in tool_results(done)] == ["answer 0", "answer 1"]
    assert_valid_conversation(done.messages)


def test_nested_children_two_levels_deep_roll_their_usage_up_the_tree(r, pool, model):
    model.set_scripts(
        {
            "lead": [
                {"tool_calls": [{"name": "manager", "input": {"task": "Manage it [script:manage]"}}]},
                {"text": "led"},
            ],
            "manage": [fan_out(2), {"text": "managed"}],
            **research_scripts(2),
        }
    )
    pool.start(2)
    lead = enqueue_run("subagent_agents:lead", script_task("lead"), connection=r)
    done = wait_for_run(lead, timeout=180, connection=r)
    assert done.status == "completed" and tool_results(done)[0]["content"] == "managed"
    (manager,) = done.children
    middle = get_run(manager, connection=r)
    assert middle.parent == lead and middle.depth == 1 and len(middle.children) == 2
    leaves = [get_run(c, connection=r) for c in middle.children]
    assert [leaf.depth for leaf in leaves] == [2, 2] and all(leaf.parent == manager for leaf in leaves)
    for name in done.usage:
        assert middle.usage[name] == middle.own_usage[name] + sum(leaf.usage[name] for leaf in leaves)
        assert done.usage[name] == done.own_usage[name] + middle.usage[name]
    assert 0 < sum(done.own_usage.values()) < sum(done.usage.values())
    assert done.cost_usd == pytest.approx(done.own_cost_usd + middle.cost_usd)


# -- limits --------------------------------------------------------------------------------------


def test_an_agent_delegating_to_itself_stops_at_the_depth_limit_with_an_error_result(r, pool, model):
    model.set_scripts(
        {
            "recurse": [
                {"tool_calls": [{"name": "delegate", "input": {"task": "Go deeper [script:recurse]"}}]},
                {"text": "up"},
            ]
        }
    )
    pool.start(2)
    top = enqueue_run("subagent_agents:recursive", script_task("recurse"), connection=r)
    done = wait_for_run(top, timeout=120, connection=r)
    assert done.status == "completed"
    chain = [done]
    while chain[-1].children:
        chain.append(get_run(chain[-1].children[0], connection=r))
    assert [run.depth for run in chain] == list(range(11)), "ten levels below the top, no more"
    refused = tool_results(chain[-1])[0]
    assert refused["is_error"] and "10 levels deep" in refused["content"]
    assert all(run.status == "completed" for run in chain)


def test_a_child_that_spends_the_trees_budget_stops_the_tree_and_resume_goes_on_with_it(r, pool, model):
    model.set_scripts(
        {
            "orchestrate": [fan_out(1), {"text": "combined"}],
            "research0": [
                {"tool_calls": [{"name": "read_notes", "input": {"topic": "x"}}], "usage": {"output_tokens": 30_000}},
                {"text": "answer 0"},
            ],
        }
    )
    pool.start(1)
    parent = enqueue_run(
        "subagent_agents:orchestrator",
        script_task("orchestrate"),
        connection=r,
        max_total_tokens=20_000,
        webhook="http://127.0.0.1:9/hooks",  # nobody listens (and no worker has the secret): recorded, kept
    )
    done = wait_for_run(parent, timeout=180, connection=r)
    (child,) = done.children
    assert [(w["event"], w["status"]) for w in done.webhooks] == [("ended", "stopped")], "the hold's stop posts"
    kid = get_run(child, connection=r)
    # The child is held before its next call: its parent gets no error result, the whole tree stops.
    assert kid.status == "stopped" and f"run {parent}" in (kid.error or "") and "max_total_tokens" in kid.error
    assert done.status == "stopped" and "max_total_tokens=20000" in (done.error or ""), "the tree's budget holds"
    assert [m["role"] for m in done.messages] == ["user", "assistant"], "no tool_result: the join stays open"
    assert done.usage["output_tokens"] >= 30_000 and done.own_usage["output_tokens"] < 30_000, "the tree's usage, live"
    assert run_detail(r, parent, 0)["run"]["tree"][0]["held_by"] == parent
    shown = CliRunner().invoke(main, ["show", "--url", pool.env["REDIS_URL"], parent])
    assert f"{child}  stopped" in shown.output and f"(held by the budget of {parent})" in shown.output, shown.output
    with pytest.raises(ResumeRefused, match=f"resume run {parent}"):
        resume(child, add_tokens=100_000, connection=r)  # held by its parent's budget: resume the parent
    with pytest.raises(ResumeRefused, match="add_tokens>="):
        resume(parent, add_tokens=1, connection=r)

    resumed = CliRunner().invoke(main, ["resume", "--url", pool.env["REDIS_URL"], parent, "--add-tokens", "100000"])
    assert resumed.exit_code == 0 and f"sub-agent runs resumed with it: {child}" in resumed.output, resumed.output
    assert get_run(child, connection=r).status in ("queued", "running", "completed"), "the child goes on with it"
    done = wait_for_run(parent, timeout=180, connection=r)
    assert done.status == "completed" and done.result == "combined", (done.error, pool.logs())
    result = tool_results(done)[0]
    assert result["content"] == "answer 0" and not result.get("is_error"), "its real answer, not an error"
    assert get_run(child, connection=r).status == "completed"
    for name in done.usage:
        assert done.usage[name] == done.own_usage[name] + get_run(child, connection=r).usage[name], "counted once"
    assert_valid_conversation(done.messages)


def calls_spent(r, run_ids: list[str]) -> list[int]:
    """The tokens of each model call the runs made, as their model_responded events report them."""
    fields = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    return [sum(int(e.get(f) or 0) for f in fields) for run in run_ids for e in kinds(r, run, "model_responded")]


@pytest.mark.crash
def test_parallel_children_stop_within_a_call_each_of_their_parents_budget_and_resume_together(r, pool, model):
    def busy(i: int) -> list:  # five calls of 3,000 output tokens each, then the answer
        steps = [{"tool_calls": [{"name": "read_notes", "input": {"topic": f"t{i}.{k}"}}]} for k in range(5)]
        return [{**step, "usage": {"output_tokens": 3000}} for step in steps] + [{"text": f"answer {i}"}]

    model.set_scripts(
        {"orchestrate": [fan_out(3), {"text": "combined"}], **{f"research{i}": busy(i) for i in range(3)}}
    )
    # Every turn's horse is killed once right after its save point A: spend is counted once, whatever dies.
    pool.start(2, AGENTPOOL_FAULTS="after_save_a")
    cap = 20_000  # the three children would spend about 50,000 together
    parent = enqueue_run("subagent_agents:orchestrator", script_task("orchestrate"), connection=r, max_total_tokens=cap)
    done = wait_for_run(parent, timeout=240, connection=r)
    assert done.status == "stopped" and f"max_total_tokens={cap}" in (done.error or ""), (done.error, pool.logs())
    for child in done.children:  # a child's turn in flight when the tree stopped stops at its next guard
        wait_for_status(r, child, "stopped")
    done = get_run(parent, connection=r)
    kids = [get_run(child, connection=r) for child in done.children]
    assert all(f"run {parent}" in (kid.error or "") for kid in kids), "each held by its parent's budget"
    biggest = max(calls_spent(r, done.children))
    assert list(pool.tmp.glob("fault-after_save_a-sub_*")), "children's workers were killed"
    assert cap <= done.total_tokens <= cap + 3 * biggest, "each child stops within one call of the tree's budget"
    for name in done.usage:
        assert done.usage[name] == done.own_usage[name] + sum(kid.usage[name] for kid in kids), "counted once"

    resume(parent, add_tokens=100_000, connection=r)
    done = wait_for_run(parent, timeout=300, connection=r)
    assert done.status == "completed" and done.result == "combined", (done.error, tree_state(r, parent))
    assert [b["content"] for b in tool_results(done)] == ["answer 0", "answer 1", "answer 2"]
    assert not any(b.get("is_error") for b in tool_results(done)), "held children answer as if nothing had stopped"
    kids = [get_run(child, connection=r) for child in done.children]
    assert all(kid.status == "completed" for kid in kids)
    for name in done.usage:
        assert done.usage[name] == done.own_usage[name] + sum(kid.usage[name] for kid in kids), "counted once"
    assert r.zcard(RUNS) == 4 and len(kinds(r, parent, "children_joined")) == 1
    for kid in kids:
        assert_valid_conversation(kid.messages)
    assert_valid_conversation(done.messages)


def test_a_grandchild_held_by_the_top_runs_budget_goes_on_when_the_top_run_is_resumed(r, pool, model):
    model.set_scripts(
        {
            "lead": [
                {"tool_calls": [{"name": "manager", "input": {"task": "Manage it [script:manage]"}}]},
                {"text": "led"},
            ],
            "manage": [fan_out(2), {"text": "managed"}],
            "research0": [
                {"tool_calls": [{"name": "read_notes", "input": {"topic": "x"}}], "usage": {"output_tokens": 30_000}},
                {"text": "answer 0"},
            ],
            "research1": [{"tool_calls": [{"name": "read_notes", "input": {"topic": "y"}}]}, {"text": "answer 1"}],
        }
    )
    pool.start(2)
    lead = enqueue_run("subagent_agents:lead", script_task("lead"), connection=r, max_total_tokens=20_000)
    done = wait_for_run(lead, timeout=180, connection=r)
    assert done.status == "stopped" and "max_total_tokens=20000" in (done.error or ""), (done.error, pool.logs())
    (manager,) = done.children
    assert get_run(manager, connection=r).status == "waiting_children", "the middle run still waits for its children"
    spender = get_run(manager, connection=r).children[0]
    wait_for_status(r, spender, "stopped")  # (its turn in flight when the tree stopped goes to its next guard)
    held = get_run(spender, connection=r)
    assert f"run {lead}" in (held.error or ""), "held by the top run's budget, two levels up"
    assert get_run(manager, connection=r).status == "waiting_children"

    resume(lead, add_tokens=100_000, connection=r)
    done = wait_for_run(lead, timeout=180, connection=r)
    assert done.status == "completed" and done.result == "led", (done.error, tree_state(r, lead))
    middle = get_run(manager, connection=r)
    assert middle.status == "completed" and [b["content"] for b in tool_results(middle)] == ["answer 0", "answer 1"]
    leaves = [get_run(c, connection=r) for c in middle.children]
    for name in done.usage:
        assert middle.usage[name] == middle.own_usage[name] + sum(leaf.usage[name] for leaf in leaves)
        assert done.usage[name] == done.own_usage[name] + middle.usage[name]


def test_a_child_stopped_by_its_own_limit_answers_with_an_error_and_later_as_a_message_once_resumed(r, pool, model):
    model.set_scripts(
        {
            "orchestrate": [
                fan_out(1),
                {"tool_calls": [{"name": "read_notes", "input": {"topic": "what is left"}}]},
                {"tool_calls": [{"name": "deploy", "input": {"version": "1.2"}}]},
                {"text": "deployed"},
            ],
            "research0": [{"tool_calls": [{"name": "read_notes", "input": {"topic": "x"}}]}, {"text": "answer 0"}],
        }
    )
    pool.start(2)
    parent = enqueue_run("subagent_agents:patient", script_task("orchestrate"), connection=r)
    done = wait_for_run(parent, timeout=180, connection=r)
    (child,) = done.children
    # The child stopped on its own max_turns=1: its parent got an error result at once and went on, until
    # its own max_turns=2 stopped it.
    assert get_run(child, connection=r).status == "stopped"
    first = tool_results(done, 0)[0]
    assert first["is_error"] and "stopped without an answer" in first["content"] and "max_turns=1" in first["content"]
    assert done.status == "stopped" and "max_turns=2" in (done.error or "")

    resume(parent, add_turns=2, connection=r)  # the stopped child goes on with it
    assert [e.get("resumed") for e in kinds(r, parent, "tree_resumed")] == [child]
    wait_for_status(r, child, "completed")
    wait_for_status(r, parent, "waiting_approval")  # (a person holds it at a turn boundary meanwhile)
    waiting = get_run(parent, connection=r).inbox
    assert [m["id"] for m in waiting] == [f"{child}.t2"] and "answer 0" in waiting[0]["content"]
    approve(parent, connection=r)
    done = wait_for_run(parent, timeout=180, connection=r)
    assert done.status == "completed" and done.result == "deployed", (done.error, pool.logs())
    late = [
        b["text"]
        for m in done.messages
        if m["role"] == "user" and isinstance(m["content"], list)
        for b in m["content"]
        if b.get("type") == "text" and child in b.get("text", "")
    ]
    assert len(late) == 1 and "answer 0" in late[0] and tool_uses(done, "researcher")[0]["id"] in late[0], "once"
    assert [e["messages"] for e in kinds(r, parent, "message_delivered")] == [f"{child}.t2"]
    assert not get_run(parent, connection=r).inbox
    assert_valid_conversation(done.messages)


def test_a_message_sent_to_a_completed_child_is_answered_to_its_sender_not_to_the_parent(r, pool, model):
    """A person follows up with a sub-agent's run (the dashboard, send_message): the child goes on and
    answers them. Its parent had its answer already: the new one stays with the child, and the parent
    finishes as it would have, with no "late answer" that claims the child had stopped."""
    model.set_scripts(
        {
            "orchestrate": [fan_out(1), {"text": "Final report written.", "delay": 6.0}, {"text": "an extra turn"}],
            "research0": [{"text": "answer 0"}, {"text": "answer to the follow-up"}],
        }
    )
    pool.start(2)
    parent = enqueue_run("subagent_agents:orchestrator", script_task("orchestrate"), connection=r)
    answered_parent = lambda p: get_run(p.children[0], connection=r).status == "completed" and p.status == "running"
    (child,) = _children_when(r, parent, answered_parent)
    sent = send_message(child, "Please also check topic 0b.", connection=r)  # the parent is in its 6 s call
    answered = wait_for_run(child, after_message=sent, timeout=60, connection=r)
    assert answered.result == "answer to the follow-up"
    assert get_run(parent, connection=r).status == "running", "the child answered while its parent ran"
    done = wait_for_run(parent, timeout=60, connection=r)
    assert done.status == "completed" and done.result == "Final report written." and done.turns == 2
    assert tool_results(done, 0)[0]["content"] == "answer 0"
    assert not any(child in str(m["content"]) for m in done.messages[3:]), "nothing of the child's after its result"
    assert not kinds(r, parent, "message_queued")


def _children_when(r, parent: str, ready, timeout: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = get_run(parent, connection=r)
        if run.children and ready(run):
            return run.children
        time.sleep(0.05)
    raise AssertionError(f"run {parent} did not get there: {get_run(parent, connection=r).status}")


def test_a_child_resumed_alone_after_its_parent_completed_is_not_held_by_the_parents_spent_budget(r, pool, model):
    """The parent answered without the child (stopped by its own limit) and spent its tree's budget: a
    person resuming the child alone lets it finish. Before, the child was held by that budget at its next
    call, and resuming the completed parent, as the hold's message said, raised nothing below it."""
    model.set_scripts(
        {
            "orchestrate": [fan_out(1), {"text": "done without it"}],
            "research0": [
                {"tool_calls": [{"name": "read_notes", "input": {"topic": "x"}}]},
                {"tool_calls": [{"name": "read_notes", "input": {"topic": "y"}}], "usage": {"output_tokens": 30_000}},
                {"text": "answer 0"},
            ],
        }
    )
    pool.start(2)
    parent = enqueue_run("subagent_agents:patient", script_task("orchestrate"), connection=r, max_total_tokens=20_000)
    done = wait_for_run(parent, timeout=180, connection=r)
    (child,) = done.children
    assert done.status == "completed" and get_run(child, connection=r).status == "stopped"
    resume(child, add_turns=5, connection=r)
    kid = wait_for_run(child, timeout=180, connection=r)
    assert kid.status == "completed" and kid.result == "answer 0", (kid.status, kid.error, pool.logs())
    assert get_run(parent, connection=r).status == "completed", "an ended parent is left as it is"


def test_calls_past_the_fanout_limit_get_an_error_result_and_start_nothing(r, pool, model):
    model.set_scripts({"orchestrate": [fan_out(3), {"text": "done"}], **research_scripts(3)})
    pool.start(1)
    parent = enqueue_run("subagent_agents:narrow", script_task("orchestrate"), connection=r)
    done = wait_for_run(parent, timeout=180, connection=r)
    assert done.status == "completed" and len(done.children) == 2 and r.zcard(RUNS) == 3
    results = tool_results(done)
    assert [b["content"] for b in results[:2]] == ["answer 0", "answer 1"]
    assert results[2]["is_error"] and "at most 2 sub-agents" in results[2]["content"]


def test_a_child_runs_on_its_parents_queue_and_key_unless_its_sub_agent_names_its_own(r, pool, model):
    calls = [
        {"name": "researcher", "input": {"task": "Topic 0 [script:research0]"}},
        {"name": "researcher", "input": {"task": "Topic 1 [script:research1]"}},
        {"name": "escalate", "input": {"task": "Topic 2 [script:research2]"}},
    ]
    model.set_scripts({"route": [{"tool_calls": calls}, {"text": "routed"}], **research_scripts(3, delay=1.0)})
    # Nobody serves the default queue: children left there would never run.
    for queues in (["batch"], ["batch"], ["urgent"]):
        WorkerProcesses.start(pool, 1, *queues, "--log-level", "INFO")
    parent = enqueue_run(
        "subagent_agents:router",
        script_task("route"),
        connection=r,
        queue="batch",
        concurrency_key="acme",
        max_concurrency=1,
    )
    done = wait_for_run(parent, timeout=180, connection=r)
    assert done.status == "completed", (done.error, tree_state(r, parent), pool.logs())
    assert [b["content"] for b in tool_results(done)] == ["answer 0", "answer 1", "answer 2"]
    kids = [checkpoint.load_run(r, child, with_messages=False) for child in done.children]
    assert [kid.queue for kid in kids] == ["batch", "batch", "urgent"]
    assert [(kid.concurrency_key, kid.max_concurrency) for kid in kids] == [("acme", 1), ("acme", 1), ("vip", 3)]
    slots = [e for kid in kids[:2] for e in kinds(r, kid.id, "waiting_for_slot")]
    assert slots and {e["key"] for e in slots} == {"acme"}, "the parent's key holds its children to its limit"
    assert turn_queue(r).count == 0


def test_a_child_is_never_started_for_a_parent_cancelled_meanwhile(r):
    from agentpool.store import children

    parent = enqueue_run("subagent_agents:orchestrator", "Split it", connection=r)
    keys = RunKeys.of(parent)
    r.set(keys.lease, "1:worker")  # its turn holds the lease and is about to start a child...
    r.hset(keys.run, "status", "running")
    cancel_run(parent, connection=r)  # ...when it is cancelled, and the cancel has read its (empty) children
    child = child_id(parent, "toolu_1")
    with pytest.raises(RunNotActive):
        children.spawn(
            r,
            keys,
            "1:worker",
            child,
            agent="subagent_agents:researcher",
            task="Look into it",
            limits={},
            fields={"parent": parent},
            caps={},
            stage_enqueue=lambda pipe: None,
            now=time.time(),
        )
    assert not r.exists(RunKeys.of(child).run) and children.children(r, keys) == []


def test_a_long_child_answer_is_cut_to_the_parents_max_result_chars(r, pool, model):
    model.set_scripts({"orchestrate": [fan_out(1), {"text": "ok"}], "research0": [{"text": "word " * 400}]})
    pool.start(1)
    parent = enqueue_run("subagent_agents:terse", script_task("orchestrate"), connection=r)
    done = wait_for_run(parent, timeout=180, connection=r)
    (child,) = done.children
    content = tool_results(done)[0]["content"]
    assert len(content) <= 200 and child in content
    assert len(get_run(child, connection=r).result or "") == len("word " * 400), "the whole answer stays on the child"


# -- control -------------------------------------------------------------------------------------


def test_cancelling_a_parent_mid_fan_out_cancels_every_child(r, pool, model):
    model.set_scripts({"orchestrate": [fan_out(3), {"text": "never"}], **research_scripts(3, delay=5)})
    pool.start(2)
    parent = enqueue_run("subagent_agents:orchestrator", script_task("orchestrate"), connection=r)
    wait_for_status(r, parent, "waiting_children", timeout=120)
    cancel_run(parent, connection=r)
    run = get_run(parent, connection=r)
    assert run.status == "cancelled" and len(run.children) == 3
    for child in run.children:
        assert get_run(child, connection=r).status == "cancelled"
    time.sleep(0.5)  # the children's turns in flight find them cancelled and commit nothing further
    for child in run.children:
        kid = wait_for_run(child, timeout=30, connection=r)
        assert kid.status == "cancelled" and kid.turns <= 1
    assert get_run(parent, connection=r).status == "cancelled"


# -- the join, in the store ----------------------------------------------------------------------


def test_the_last_childs_end_wakes_its_parent_exactly_once_whichever_way_it_ends(r):
    from agentpool.runtime.subagents import wake
    from agentpool.store import checkpoint

    parent = enqueue_run("subagent_agents:orchestrator", "Split it", connection=r)
    kids = [enqueue_run("subagent_agents:researcher", f"Part {i}", connection=r) for i in range(2)]
    keys = RunKeys.of(parent)
    r.hset(keys.run, mapping={"status": "waiting_children", "turns": 1, "phase": "tools"})
    for kid in kids:
        r.hset(RunKeys.of(kid).run, mapping={"parent": parent, "output_tokens": 7})
        r.hset(keys.joins, kid, "open")
        r.rpush(keys.children, kid)

    checkpoint.fail_unfenced(r, kids[0], "its records are unreadable", retention_s=0)
    assert r.hget(keys.run, "status") == b"waiting_children", "one child is still open"
    cancel_run(kids[1], connection=r)  # the last one ends by a cancel: its MULTI tells the parent...
    assert r.hget(keys.run, "status") == b"running" and len(kinds(r, parent, "children_joined")) == 1
    assert get_run(parent, connection=r).usage["output_tokens"] == 14, "both children's usage rolled up"
    # ...and cancel_run queues the parent's turn from the wake marker at once, which it consumes.
    assert r.hget(keys.run, "wake") is None and r.hget(keys.run, "job").decode().endswith("-r1")
    assert wake(r, parent) is None, "the wake marker is acted on once"
    woken = [e for e in kinds(r, parent, "status") if e.get("reason") == "children ended"]
    assert len(woken) == 1
    checkpoint.fail_unfenced(r, kids[1], "again", retention_s=0)  # an ended child ending again changes nothing
    cancel_run(kids[0], connection=r)
    assert len(kinds(r, parent, "children_joined")) == 1
    assert get_run(parent, connection=r).usage["output_tokens"] == 14


def _forget(r, run_id: str) -> None:
    """The child's record gone, as its retention or an eviction leaves it (every key of the run)."""
    r.delete(*r.keys(f"*{run_id}*"))


def test_a_child_whose_record_is_gone_is_joined_by_the_reaper_and_the_scan_goes_on(r):
    """Its end was never joined (the record went first): the reaper's backstop joins it as expired.
    Before, the join's script failed on the missing status, and that error ended the whole scan: the
    parent waited for ever and no run due after it was ever looked at."""
    from agentpool.runtime.reaper import reap_once
    from agentpool.store.keys import RUNS_WATCH

    parent = enqueue_run("subagent_agents:orchestrator", "Split it", connection=r)
    kids = [enqueue_run("subagent_agents:researcher", f"Part {i}", connection=r) for i in range(2)]
    keys = RunKeys.of(parent)
    r.hset(keys.run, mapping={"status": "waiting_children", "turns": 1, "phase": "tools"})
    for kid in kids:
        r.hset(RunKeys.of(kid).run, mapping={"parent": parent})
        r.hset(keys.joins, kid, "open")
        r.rpush(keys.children, kid)
    _forget(r, kids[0])
    checkpoint.fail_unfenced(r, kids[1], "it failed", retention_s=0)  # joined by its own end
    # A run due after the parent, whose job is lost from the queue: the scan must reach it.
    lost = enqueue_run("subagent_agents:researcher", "Lost", connection=r)
    r.lrem(turn_queue(r).key, 0, r.hget(RunKeys.of(lost).run, "job"))
    r.delete(b"rq:job:" + r.hget(RunKeys.of(lost).run, "job"))
    r.zadd(RUNS_WATCH, {parent: 1, lost: 2})
    assert reap_once(r) == [lost]
    assert r.hget(keys.joins, f"{kids[0]}:end") == b"expired"
    assert r.hget(keys.run, "status") == b"running", "its last open child joined: the parent goes on"


def test_a_damaged_run_does_not_stop_the_reapers_scan(r, caplog):
    from agentpool.runtime.reaper import reap_once
    from agentpool.store.keys import RUNS_WATCH

    parent = enqueue_run("subagent_agents:orchestrator", "Split it", connection=r)
    keys = RunKeys.of(parent)
    r.hset(keys.run, mapping={"status": "waiting_children", "turns": 1, "phase": "tools"})
    r.delete(keys.joins)
    r.set(keys.joins, "not a hash")  # Redis answers the reaper's reads of it with WRONGTYPE
    lost = enqueue_run("subagent_agents:researcher", "Lost", connection=r)
    r.lrem(turn_queue(r).key, 0, r.hget(RunKeys.of(lost).run, "job"))
    r.delete(b"rq:job:" + r.hget(RunKeys.of(lost).run, "job"))
    r.zadd(RUNS_WATCH, {parent: 1, lost: 2})
    assert reap_once(r) == [lost]
    assert f"could not check run {parent}" in caplog.text
    assert r.zscore(RUNS_WATCH, parent) > time.time() * 1000, "looked at again after a recheck, not every scan"


def test_cancelling_a_parent_cancels_its_children_past_one_whose_record_expired(r):
    parent = enqueue_run("subagent_agents:orchestrator", "Split it", connection=r)
    kids = [enqueue_run("subagent_agents:researcher", f"Part {i}", connection=r) for i in range(3)]
    keys = RunKeys.of(parent)
    for kid in kids:
        r.hset(RunKeys.of(kid).run, mapping={"parent": parent})
        r.hset(keys.joins, kid, "open")
        r.rpush(keys.children, kid)
    _forget(r, kids[0])  # an earlier turn's child, long expired (its join had ended)
    r.hset(keys.joins, kids[0], "ended")
    assert cancel_run(parent, connection=r) == "queued"
    assert [get_run(kid, connection=r).status for kid in kids[1:]] == ["cancelled", "cancelled"]
