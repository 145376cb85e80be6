"""The run index (ap:runs) against a real redis-server: listings that find every match however old,
pages that neither repeat nor skip a run, and the sweep that drops runs whose retention ran out."""

from __future__ import annotations

import time

from agentpool import cancel_run, enqueue_run, get_run, list_runs
from agentpool.store import checkpoint, runs_index
from agentpool.store.keys import RUNS, RunKeys


def create(r, run_id: str, now: float) -> None:
    with r.pipeline(transaction=True) as pipe:
        pipe.multi()
        checkpoint.stage_create(pipe, run_id, agent="pool_agents:support", task="t", limits={}, now=now)
        pipe.execute()


def test_a_filtered_listing_finds_a_match_older_than_any_fixed_window(r):
    old = enqueue_run("pool_agents:support", "the old one", connection=r)
    cancel_run(old, connection=r)
    newer = [enqueue_run("pool_agents:support", f"task {i}", connection=r) for i in range(60)]
    assert [run.id for run in list_runs(connection=r, status="cancelled", limit=1)] == [old]
    unfiltered = list_runs(connection=r, limit=5)
    assert len(unfiltered) == 5 and {run.id for run in unfiltered} <= set(newer[-10:]), unfiltered
    created = [run.created_at for run in unfiltered]
    assert created == sorted(created, reverse=True) and created[0] == max(
        get_run(i, connection=r).created_at for i in newer
    )


def test_pages_through_runs_created_in_the_same_millisecond_once_each(r):
    now = time.time()
    ids = [f"r_tie{i:02d}" for i in range(7)]
    for run_id in ids:
        create(r, run_id, now)  # one score for all seven: every page boundary falls inside the tie
    create(r, "r_older", now - 1)
    seen = [run_id for run_id, _ in runs_index.iter_headers(r, page=3)]
    assert sorted(seen[:7]) == ids and seen[7:] == ["r_older"], seen
    assert [run_id for run_id, _ in runs_index.iter_headers(r, page=3, scan=4)] == seen[:4]


def test_a_run_created_while_listing_is_neither_repeated_nor_shifts_the_walk(r):
    for i in range(6):
        create(r, f"r_walk{i}", time.time() - 10 + i)
    walk = runs_index.iter_headers(r, page=2)
    first = [next(walk)[0], next(walk)[0]]
    create(r, "r_walk_new", time.time())  # by rank, this would push r_walk3 back onto the next page
    rest = [run_id for run_id, _ in walk]
    assert first + rest == [f"r_walk{i}" for i in range(5, -1, -1)]


def test_the_sweep_drops_expired_runs_from_the_index_and_keeps_the_rest(r):
    for i in range(450):
        create(r, f"r_sweep{i:03d}", time.time())
    expired = {f"r_sweep{i:03d}" for i in range(0, 450, 3)}
    for run_id in expired:
        r.pexpire(RunKeys.of(run_id).run, 1)  # what the retention does to a finished run's keys
    time.sleep(0.05)
    dropped, steps = 0, 0
    while True:  # one full pass of the cursor, as reaper scans take it a step at a time
        dropped += runs_index.sweep_expired(r, count=100)
        steps += 1
        if int(r.get("ap:runs:sweep")) == 0:
            break
    assert steps > 1, "a step looks at part of the index, not all of it"
    assert dropped == len(expired)
    indexed = {m.decode() for m in r.zrange(RUNS, 0, -1)}
    assert indexed == {f"r_sweep{i:03d}" for i in range(450)} - expired
    assert len({run_id for run_id, _ in runs_index.iter_headers(r)}) == 300


def test_a_pass_of_the_sweep_begins_at_most_every_ten_minutes(r):
    """A small index is looked at whole in one step; the next steps read where the sweep is and look at
    nothing until the next pass is due, so an idle pool does not look at every run every second."""
    for i in range(5):
        create(r, f"r_pace{i}", time.time())
    r.pexpire(RunKeys.of("r_pace0").run, 1)
    time.sleep(0.05)
    assert runs_index.sweep_expired(r) == 1  # one step: the whole pass
    assert int(r.get("ap:runs:sweep")) == 0
    r.pexpire(RunKeys.of("r_pace1").run, 1)
    time.sleep(0.05)
    r.config_resetstat()
    assert runs_index.sweep_expired(r) == 0, "a pass began before the last one was ten minutes old"
    ran = {name.removeprefix("cmdstat_"): stat["calls"] for name, stat in r.info("commandstats").items()}
    assert {c: n for c, n in ran.items() if not c.startswith(("config", "info"))} == {"mget": 1}
    assert runs_index.sweep_expired(r, pass_every=0) == 1  # once due, the next pass drops it
