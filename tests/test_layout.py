"""The package layout as users and readers meet it: one `agentpool` namespace, layers that import only
downwards (import-linter's contracts in pyproject.toml), and an app with its own `workers` package and
`store` module working beside agentpool."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from agentpool import get_run, wait_for_run
from agentpool.testing.localpool import WorkerProcesses

from conftest import ROOT, script_task


def _stage_installed_tree(dest: Path) -> Path:
    """The tree as a wheel installs it (workers/ is `agentpool`, store/ is `agentpool.store`): import-linter
    finds modules by walking the package's folder, so it cannot see through the editable install's mapping."""
    shutil.copytree(ROOT / "workers", dest / "agentpool", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "store", dest / "agentpool" / "store", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _lint_imports(staged: Path) -> subprocess.CompletedProcess[str]:
    # `lint-imports`, run by this interpreter (a venv with system site-packages has no script of its own).
    command = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    return subprocess.run(
        [sys.executable, "-c", command, str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=staged,
        env={**os.environ, "PYTHONPATH": str(staged)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_every_import_points_down_the_layers(tmp_path):
    checked = _lint_imports(_stage_installed_tree(tmp_path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert " kept, 0 broken" in checked.stdout


def test_an_import_against_the_layers_is_caught(tmp_path):
    staged = _stage_installed_tree(tmp_path)
    keys = staged / "agentpool" / "store" / "keys.py"
    keys.write_text(keys.read_text() + "\nimport rq  # the store must not know RQ\n")
    reaper = staged / "agentpool" / "runtime" / "reaper.py"
    reaper.write_text(reaper.read_text() + "\nfrom agentpool.worker import threaded  # the runtime reaching up\n")
    checked = _lint_imports(staged)
    assert checked.returncode != 0
    assert "agentpool.store is not allowed to import rq" in checked.stdout
    assert "agentpool.runtime.reaper -> agentpool.worker.threaded" in checked.stdout


def test_no_top_level_workers_or_store_package_is_installed(tmp_path):
    found = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; print(u.find_spec('workers'), u.find_spec('store'))"],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert found.stdout.strip() == "None None"


APP_AGENTS = '''
import store      # the app's own store.py
import workers    # the app's own workers/ package
from agentpool import Agent, tool

@tool(effect="read")
def price_of(item: str) -> str:
    """Look up an item's price."""
    return f"{item}: {store.PRICES[item]} {workers.CURRENCY}"

shop = Agent(model="claude-sonnet-5-5", system="You answer price questions.", tools=[price_of], max_turns=4)
'''


def test_an_app_with_its_own_workers_package_and_store_module_runs_beside_agentpool(r, redis_server, model, tmp_path):
    app = tmp_path / "app"
    (app / "workers").mkdir(parents=True)
    (app / "workers" / "__init__.py").write_text('CURRENCY = "EUR"\n')
    (app / "store.py").write_text('PRICES = {"kettle": 42}\n')
    (app / "shop_agents.py").write_text(textwrap.dedent(APP_AGENTS))
    model.set_scripts(
        {"price": [{"tool_calls": [{"name": "price_of", "input": {"item": "kettle"}}]}, {"text": "42 EUR."}]}
    )
    env = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        "REDIS_URL": redis_server.url,
        "ANTHROPIC_BASE_URL": model.base_url,
        "ANTHROPIC_API_KEY": "sk-test-not-a-secret",
    }
    enqueued = subprocess.run(
        [sys.executable, "-m", "agentpool", "enqueue", "shop_agents:shop", script_task("price", "Kettle price?")],
        cwd=app,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert enqueued.returncode == 0, enqueued.stderr
    run_id = enqueued.stdout.strip()
    workers = WorkerProcesses(env, tmp_path, cwd=str(app))
    workers.start(1, "--burst")
    try:
        run = wait_for_run(run_id, timeout=60, connection=r)
    finally:
        workers.stop()
    assert run.status == "completed", (run.error, workers.logs())
    results = [
        b
        for m in get_run(run_id, connection=r).messages
        if m["role"] == "user"
        for b in m["content"]
        if isinstance(b, dict) and b.get("type") == "tool_result"
    ]
    assert results and results[0]["content"] == "kettle: 42 EUR"
