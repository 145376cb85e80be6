"""Sub-agents as durable child runs (issue 25): a fan-out that starts each child once, a join that wakes
the parent once when the last child ends, one budget for the tree, and control that reaches the children.
Real Redis, real RQ workers, the real anthropic client against the scripted Messages API."""

from __future__ import annotations

import random
import time

import pytest
from click.testing import CliRunner

from agentpool import Agent, Subagent, cancel_run, enqueue_run, get_run, wait_for_run
from agentpool.ops.cli import main
from agentpool.ops.dashboard import run_detail
from agentpool.store import events
from agentpool.store.children import child_id
from agentpool.store.keys import RUNS, RunKeys, check_run_id
from agentpool.testing import assert_valid_conversation

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
    assert list(pool.tmp.glob("fault-after_last_child_end-*")), "the last child's worker died right after its end"


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


def test_a_child_cannot_outspend_what_its_parent_has_left_and_the_parent_stops_on_the_tree_budget(r, pool, model):
    model.set_scripts(
        {
            "orchestrate": [fan_out(1), {"text": "never"}],
            "research0": [
                {"tool_calls": [{"name": "read_notes", "input": {"topic": "x"}}], "usage": {"output_tokens": 30_000}}
            ],
        }
    )
    pool.start(1)
    parent = enqueue_run(
        "subagent_agents:orchestrator", script_task("orchestrate"), connection=r, max_total_tokens=20_000
    )
    done = wait_for_run(parent, timeout=180, connection=r)
    (child,) = done.children
    kid = get_run(child, connection=r)
    assert kid.status == "stopped" and "max_total_tokens" in (kid.error or "")
    assert kid.limits["max_total_tokens"] < 20_000, "the child's budget is what the parent had left"
    result = tool_results(done)[0]
    assert result["is_error"] and "stopped" in result["content"]
    assert done.status == "stopped" and "max_total_tokens=20000" in (done.error or ""), "the tree's budget holds"
    assert done.usage["output_tokens"] >= 30_000 and done.own_usage["output_tokens"] < 30_000
    assert_valid_conversation(done.messages)


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
