"""What deploy/ and the Procfile promise, checked without a container engine (none exists here).

Every manifest, unit file, compose file, Dockerfile and Procfile is parsed; every ``agentpool …``
command they run is extracted, and each must exist with the flags it is given, and must start for
real against the suite's redis-server and stop cleanly on SIGTERM (the stop signal every one of them
sends). ``honcho start`` runs the Procfile. deploy/redis.conf is loaded by a real redis-server.
The signal story the manifests rely on (KillMode=mixed, tini) is shown with a real pool.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from collections import Counter
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import RedisError
from rq import Queue, Worker
from rq.worker import WorkerStatus

from agentpool import Agent, enqueue_run, get_run, wait_for_run
from agentpool.runtime.settings import Settings
from agentpool.store import events
from agentpool.store.keys import TURN_QUEUE, rq_queue_name
from agentpool.testing.localpool import children_of, free_port

from conftest import ROOT, script_task

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SYSTEMD = DEPLOY / "systemd"

# A turn is one model call (AGENTPOOL_MODEL_CALL_TIMEOUT, 600 s by default in runtime/settings.py) plus the
# tools it asked for, one after another (Agent.tool_timeout each); every stop grace period must outlast a
# slow call and a slow tool at the least (deploy/README.md says how to size it for more).
MODEL_TIMEOUT = next(f.default for f in fields(Settings) if f.name == "model_call_timeout")
TOOL_TIMEOUT = next(f.default for f in fields(Agent) if f.name == "tool_timeout")
TURN_BOUND = MODEL_TIMEOUT + TOOL_TIMEOUT  # type: ignore[operator]

LONG_RUNNING = {"worker", "metrics", "dashboard"}
ONE_SHOT = {"check"}


def _yaml():  # PyYAML is a test-only need; the project's runtime deps do not include it
    return pytest.importorskip("yaml", reason="PyYAML is needed to read deploy/*.yaml (add pyyaml to the test extra)")


# --- Parsing ---------------------------------------------------------------------------------------


def dockerfile_instructions(path: Path = DEPLOY / "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _exec_form(rest: str) -> list[str]:
    return json.loads(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    starts = [i for i, (word, _) in enumerate(instructions) if word == "FROM"]
    return instructions[starts[-1] :]


def image_entrypoint_and_cmd() -> tuple[list[str], list[str]]:
    entrypoint: list[str] = []
    cmd: list[str] = []
    for word, rest in final_stage(dockerfile_instructions()):
        if word == "ENTRYPOINT":
            entrypoint = _exec_form(rest)
        elif word == "CMD":
            cmd = _exec_form(rest)
    return entrypoint, cmd


def unit_entries(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) for a systemd unit, in order (keys may repeat)."""
    section, out = "", []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def unit_value(path: Path, key: str) -> str | None:
    values = [v for _, k, v in unit_entries(path) if k == key]
    return values[-1] if values else None


def procfile() -> dict[str, str]:
    from honcho.environ import parse_procfile

    return dict(parse_procfile((ROOT / "Procfile").read_text()).processes)


def k8s_documents() -> list[tuple[str, dict]]:
    yaml = _yaml()
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = []
    for resource in kustomization["resources"]:
        for doc in yaml.safe_load_all((K8S / resource).read_text()):
            if doc:
                docs.append((resource, doc))
    return docs


def compose() -> dict:
    return _yaml().safe_load((DEPLOY / "compose.yaml").read_text())


# --- Every `agentpool …` command the deploy files run ------------------------------------------------


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]  # ("agentpool", subcommand, *args)
    where: str

    @property
    def sub(self) -> str:
        return self.argv[1]


def as_agentpool(argv: list[str]) -> tuple[str, ...] | None:
    """The part of ``argv`` from the agentpool executable on (past `tini --`, an absolute path)."""
    for i, word in enumerate(argv):
        if os.path.basename(word) == "agentpool":
            return ("agentpool", *argv[i + 1 :])
    return None


def _expand_like_systemd(word: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), ""), word)


def _expand_like_sh(command: str) -> list[str]:
    """The argv ``sh -c`` would run for a Procfile line (honcho runs each line with the shell)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("METRICS_PORT", "PORT"))}
    out = subprocess.run(
        ["sh", "-c", f"set -- {command}; printf '%s\\0' \"$@\""], capture_output=True, env=env, check=True
    ).stdout
    return out.decode().split("\0")[:-1]


def deploy_commands() -> list[Command]:
    found: list[Command] = []

    def add(argv: list[str] | None, where: str) -> None:
        command = as_agentpool(argv or [])
        if command is not None:
            found.append(Command(command, where))

    # Dockerfile: the default command and the HEALTHCHECK.
    entrypoint, cmd = image_entrypoint_and_cmd()
    add(entrypoint + cmd, "deploy/Dockerfile ENTRYPOINT+CMD")
    for word, rest in final_stage(dockerfile_instructions()):
        if word == "HEALTHCHECK":
            add(_exec_form(rest.split(" CMD ", 1)[1].strip()), "deploy/Dockerfile HEALTHCHECK")

    # Procfile
    for name, command in procfile().items():
        add(_expand_like_sh(command), f"Procfile {name}")

    # systemd: ExecStart, with Environment= defaults expanded as systemd would.
    for unit in sorted(SYSTEMD.glob("*.service")):
        env = {}
        for _, key, value in unit_entries(unit):
            if key == "Environment":
                for assignment in shlex.split(value):
                    k, _, v = assignment.partition("=")
                    env[k] = v
            if key == "ExecStart":
                argv = [_expand_like_systemd(w, env) for w in shlex.split(value.lstrip("-@:+!"))]
                add(argv, f"deploy/systemd/{unit.name} ExecStart")

    try:
        import yaml  # noqa: F401
    except ImportError:
        return found

    # compose: services built from the Dockerfile run its entrypoint with their command.
    for name, service in compose()["services"].items():
        if str(service.get("image", "")).startswith("agentpool"):
            argv = service.get("entrypoint") or entrypoint
            add(list(argv) + list(service.get("command") or cmd), f"deploy/compose.yaml services.{name}")
        test = (service.get("healthcheck") or {}).get("test")
        if test and test[0] in ("CMD", "CMD-SHELL"):
            add(test[1:] if test[0] == "CMD" else shlex.split(test[1]), f"deploy/compose.yaml {name} healthcheck")

    # Kubernetes: containers of the agentpool image, and exec probes.
    for resource, doc in k8s_documents():
        pod = (doc.get("spec", {}).get("template") or {}).get("spec") or {}
        for container in pod.get("containers", []):
            where = f"deploy/k8s/{resource} {doc['metadata']['name']}/{container['name']}"
            if str(container.get("image", "")).startswith("agentpool"):
                argv = container.get("command") or entrypoint
                add(list(argv) + list(container.get("args") or ([] if container.get("command") else cmd)), where)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                exec_ = (container.get(probe) or {}).get("exec")
                if exec_:
                    add(exec_["command"], f"{where} {probe}")
    return found


COMMANDS = deploy_commands()


def _unique(commands: list[Command]) -> dict[tuple[str, ...], list[str]]:
    by_argv: dict[tuple[str, ...], list[str]] = {}
    for command in commands:
        by_argv.setdefault(command.argv, []).append(command.where)
    return by_argv


UNIQUE = _unique(COMMANDS)


# --- Running agentpool as the deploy files do --------------------------------------------------------


@pytest.fixture(scope="module")
def agentpool_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A PATH whose `agentpool` is this checkout (the installed one may be another tree's)."""
    bin_dir = tmp_path_factory.mktemp("bin")
    shim = bin_dir / "agentpool"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m agentpool "$@"\n')
    shim.chmod(0o755)
    return os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])


def _env(agentpool_path: str, redis_url: str, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": agentpool_path,
        "REDIS_URL": redis_url,
        "ANTHROPIC_API_KEY": "sk-test-not-a-secret",
        **extra,
    }


def _with_free_ports(argv: tuple[str, ...]) -> tuple[list[str], int | None]:
    out, port = list(argv), None
    for i, word in enumerate(out[:-1]):
        if word in ("--port", "--metrics-port"):
            port = free_port()
            out[i + 1] = str(port)
    return out, port


def _http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def _wait(condition, timeout: float, proc: subprocess.Popen, log: Path, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if proc.poll() is not None:
            pytest.fail(f"{what}: exited with {proc.returncode} before it came up:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    pytest.fail(f"{what}: did not come up within {timeout} s:\n{log.read_text()[-3000:]}")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _descendants(pid: int) -> list[int]:
    out = []
    for child in children_of(pid):
        out += [child, *_descendants(child)]
    return out


# --- The commands exist, with their flags -----------------------------------------------------------


def test_the_deploy_files_run_the_commands_they_are_meant_to():
    subs = {c.sub for c in COMMANDS}
    assert {"worker", "check"} <= subs, COMMANDS
    sources = {c.where.split(" ")[0] for c in COMMANDS}
    expected = {"deploy/Dockerfile", "Procfile", "deploy/systemd/agentpool-worker@.service"}
    assert expected <= sources, sources
    assert ("agentpool", "worker") in UNIQUE, "the image's default command is the worker"


@pytest.mark.parametrize("argv", list(UNIQUE), ids=[" ".join(a[1:]) for a in UNIQUE])
def test_each_command_exists_with_the_flags_it_is_given(argv, agentpool_path):
    where = "; ".join(UNIQUE[argv])
    result = subprocess.run(
        ["agentpool", argv[1], "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(agentpool_path, "redis://127.0.0.1:1/0"),
        cwd=ROOT,
    )
    assert result.returncode == 0, f"`agentpool {argv[1]} --help` failed (used by {where}):\n{result.stderr}"
    for word in argv[2:]:
        if word.startswith("-"):
            flag = word.split("=", 1)[0]
            assert re.search(rf"(^|[\s,/]){re.escape(flag)}\b", result.stdout, re.MULTILINE), (
                f"`agentpool {argv[1]}` has no {flag} (used by {where}):\n{result.stdout}"
            )


# --- The commands start against Redis and stop on SIGTERM -------------------------------------------

LONG = [a for a in UNIQUE if a[1] in LONG_RUNNING]


@pytest.mark.parametrize("argv", LONG, ids=[" ".join(a[1:]) for a in LONG])
def test_each_long_running_command_starts_and_stops_cleanly_on_sigterm(argv, r, redis_server, agentpool_path, tmp_path):
    where = "; ".join(UNIQUE[argv])
    run_argv, port = _with_free_ports(argv)
    log = tmp_path / "out.log"
    env = _env(agentpool_path, redis_server.url, AGENTPOOL_DASHBOARD_TOKEN="test-token")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            run_argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        if argv[1] == "worker":
            # Idle, not merely registered: RQ installs its SIGTERM handler after registering the worker
            # (a SIGTERM in between kills it outright, harmlessly: it has no turn yet).
            _wait(
                lambda: any(w.pid == proc.pid and w.get_state() == WorkerStatus.IDLE for w in Worker.all(connection=r)),
                30,
                proc,
                log,
                where,
            )
        elif argv[1] == "metrics":
            _wait(lambda: _http_status(f"http://127.0.0.1:{port}/metrics") == 200, 30, proc, log, where)
        else:
            _wait(lambda: _http_status(f"http://127.0.0.1:{port}/") is not None, 30, proc, log, where)
        if "--metrics-port" in argv:
            _wait(lambda: _http_status(f"http://127.0.0.1:{port}/metrics") == 200, 30, proc, log, where)

        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{where}: still running 15 s after SIGTERM:\n{log.read_text()[-3000:]}")
        # The worker's warm shutdown exits 0. A stateless server may also die of the signal itself:
        # systemd, tini, Docker and Kubernetes all count a SIGTERM death as a clean stop.
        clean = (0,) if argv[1] == "worker" else (0, -signal.SIGTERM)
        assert rc in clean, f"{where}: exit status {rc} after SIGTERM:\n{log.read_text()[-3000:]}"
        if argv[1] == "worker":
            assert not any(w.pid == proc.pid for w in Worker.all(connection=r)), "the worker deregistered"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


ONE = [a for a in UNIQUE if a[1] in ONE_SHOT]


@pytest.mark.parametrize("argv", ONE, ids=[" ".join(a[1:]) for a in ONE])
def test_each_probe_command_passes_with_redis_and_fails_without(argv, redis_server, agentpool_path, tmp_path):
    ready = {"AGENTPOOL_READY_DIR": str(tmp_path / "ready")}  # `check --worker`: this machine's workers
    worker = None
    if "--worker" in argv:  # passes once a worker here is registered (tests/test_worker_registration.py)
        worker = subprocess.Popen(
            ["agentpool", "worker", "--no-scheduler"],
            env=_env(agentpool_path, redis_server.url, **ready),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            ok = subprocess.run(
                list(argv),
                env=_env(agentpool_path, redis_server.url, **ready),
                cwd=ROOT,
                check=False,
                capture_output=True,
                text=True,
                timeout=30,
            )
            if ok.returncode == 0 or worker is None or time.monotonic() > deadline:
                break
            time.sleep(0.3)
    finally:
        if worker is not None:
            worker.kill()
            worker.wait()
    assert ok.returncode == 0, ok.stderr
    started = time.monotonic()
    down = subprocess.run(
        list(argv),
        env=_env(agentpool_path, f"redis://127.0.0.1:{free_port()}/0", **ready),
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert down.returncode != 0, "a probe must fail when Redis is unreachable"
    assert time.monotonic() - started < 10, "within the probes' timeouts"


def test_every_subcommand_is_one_the_tests_know_how_to_start():
    unknown = {c.sub for c in COMMANDS} - LONG_RUNNING - ONE_SHOT
    assert not unknown, f"add {unknown} to LONG_RUNNING or ONE_SHOT so their start is tested"


# --- Procfile: honcho start runs the pool and stops it ----------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_honcho_start_runs_the_pool_and_a_signal_lets_the_turn_in_flight_finish(
    sig, r, redis_server, model, agentpool_path, tmp_path
):
    """Ctrl-C (or SIGTERM) to honcho: every process gets SIGTERM, the worker's turn finishes and commits,
    everything exits with no SIGKILL, and the next turn waits in Redis for any later worker."""
    # Longer than honcho's KILL_WAIT (5 s): honcho SIGKILLs what is left 5 s after any process exits.
    model.set_scripts({"slow": [{"tool_calls": [{"name": "slow_read", "input": {"seconds": 6}}]}, {"text": "done"}]})
    effects = tmp_path / "effects.jsonl"
    log = tmp_path / "honcho.log"
    env = _env(
        agentpool_path,
        redis_server.url,
        ANTHROPIC_BASE_URL=model.base_url,
        AGENTPOOL_TEST_EFFECTS=str(effects),
        PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
        METRICS_PORT=str(free_port()),
    )
    with open(log, "wb") as out:
        honcho = subprocess.Popen(
            [sys.executable, "-m", "honcho", "-f", str(ROOT / "Procfile"), "-d", str(ROOT), "start"],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        workers_expected = sum(1 for command in procfile().values() if _expand_like_sh(command)[1:2] == ["worker"])
        _wait(lambda: len(Worker.all(connection=r)) == workers_expected, 30, honcho, log, "honcho start")
        run_id = enqueue_run("pool_agents:support", script_task("slow"), connection=r)
        _wait(effects.exists, 30, honcho, log, "the first turn's tool")
        spawned = _descendants(honcho.pid)

        honcho.send_signal(sig)
        try:
            honcho.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"honcho still running 30 s after {sig.name}:\n{log.read_text()[-3000:]}")
        output = log.read_text()
        assert "SIGKILL" not in output, f"every process stopped on its own:\n{output[-3000:]}"
        assert not [pid for pid in spawned if _alive(pid)], f"left running:\n{output[-3000:]}"
        assert Worker.all(connection=r) == [], "the workers deregistered"
        assert get_run(run_id, connection=r).turns == 1, "the turn in flight committed before the worker left"
    finally:
        if honcho.poll() is None:
            for pid in _descendants(honcho.pid):
                os.kill(pid, signal.SIGKILL)
            honcho.kill()
            honcho.wait()
    ran = [json.loads(line)["tool"] for line in effects.read_text().splitlines()]
    assert ran == ["slow_read"], "the tool ran once: the turn was not cut"


# --- redis.conf -------------------------------------------------------------------------------------


def test_redis_conf_loads_in_redis_server_and_sets_what_agentpool_needs(tmp_path):
    port = free_port()
    log = tmp_path / "redis.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                "redis-server",
                str(DEPLOY / "redis.conf"),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(tmp_path),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    client = Redis(port=port, socket_connect_timeout=1)
    try:
        for _ in range(100):
            try:
                client.ping()
                break
            except RedisError:
                if proc.poll() is not None:
                    pytest.fail(f"redis-server refused deploy/redis.conf:\n{log.read_text()}")
                time.sleep(0.05)
        config = {
            k: client.config_get(k)[k]
            for k in ("appendonly", "appendfsync", "maxmemory-policy", "no-appendfsync-on-rewrite")
        }
        assert config == {
            "appendonly": "yes",
            "appendfsync": "everysec",
            "maxmemory-policy": "noeviction",
            "no-appendfsync-on-rewrite": "no",
        }
        client.set("k", "v")
        assert (tmp_path / "appendonlydir").is_dir()
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)


def test_redis_conf_explains_each_durability_setting():
    lines = (DEPLOY / "redis.conf").read_text().splitlines()
    for directive in ("appendonly", "appendfsync", "maxmemory-policy"):
        i = next(n for n, line in enumerate(lines) if line.startswith(directive + " "))
        assert lines[i - 1].startswith("#"), f"{directive} has no comment above it"


# --- Managed Redis: an ACL user without CONFIG, KEYS, FLUSHALL, DEBUG, ... ---------------------------

MANAGED_ACL = ["~*", "&*", "+@all", "-@dangerous"]  # the user deploy/README.md suggests


def test_a_redis_user_without_dangerous_commands_runs_the_pool(r, redis_server, model, agentpool_path, tmp_path):
    from redis.exceptions import ResponseError

    from agentpool.testing.localpool import WorkerProcesses

    r.execute_command("ACL", "SETUSER", "agentpool-acl", "reset", "on", ">not-a-secret", *MANAGED_ACL)
    url = redis_server.url.replace("redis://", "redis://agentpool-acl:not-a-secret@")
    limited = Redis.from_url(url)
    env = _env(
        agentpool_path,
        url,
        ANTHROPIC_BASE_URL=model.base_url,
        PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
    )
    pool = WorkerProcesses(env, tmp_path, cwd=str(ROOT / "tests"))
    try:
        with pytest.raises(ResponseError):
            limited.config_get("maxmemory-policy")  # as on ElastiCache, Memorystore, Upstash
        model.set_scripts(
            {
                "acl": [
                    # A tool with an effect: the durability guard must see that this lone Redis has no
                    # replica to wait for although INFO is refused, or the run never gets past it.
                    {
                        "tool_calls": [
                            {"name": "send_email", "input": {"to": "a@example.com", "subject": "s", "body": "b"}}
                        ]
                    },
                    {"tool_calls": [{"name": "read_notes", "input": {"topic": "acl"}}]},
                    {"text": "done"},
                ]
            }
        )
        pool.start(1)
        run = wait_for_run(
            enqueue_run("pool_agents:support", script_task("acl"), connection=limited), timeout=60, connection=limited
        )
        assert run.status == "completed", (run.error, pool.logs())
        for argv in (
            ["agentpool", "check"],
            ["agentpool", "runs"],
            [str(Path(sys.executable).with_name("rq")), "info", "-u", url],
        ):
            done = subprocess.run(argv, env=env, cwd=ROOT, check=False, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, (argv, done.stdout, done.stderr)
        # Without INFO nothing can tell whether Redis may evict: said, and a strict check fails on it.
        strict = subprocess.run(
            ["agentpool", "check", "--strict"], env=env, cwd=ROOT, check=False, capture_output=True, text=True
        )
        assert strict.returncode == 1 and "INFO was refused" in strict.stderr, (strict.stdout, strict.stderr)
    finally:
        pool.stop(signal.SIGTERM)
        limited.close()
        r.execute_command("ACL", "DELUSER", "agentpool-acl")


def test_workers_and_check_say_when_redis_would_evict_runs(model, agentpool_path, tmp_path):
    from agentpool.testing.localpool import RedisServer

    evicting = RedisServer(tmp_path, extra_args=("--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")).start()
    env = _env(agentpool_path, evicting.url, ANTHROPIC_BASE_URL=model.base_url)

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=env, cwd=ROOT, check=False, capture_output=True, text=True, timeout=60)

    try:
        plain, strict, worker = (
            run("agentpool", "check"),
            run("agentpool", "check", "--strict"),
            run("agentpool", "worker", "--burst"),
        )
        warning = "maxmemory-policy allkeys-lru"
        assert plain.returncode == 0 and plain.stdout.strip() == "ok" and warning in plain.stderr, plain
        assert strict.returncode == 1 and warning in strict.stderr, strict
        assert worker.returncode == 0 and warning in worker.stderr, worker
        with Redis.from_url(evicting.url) as admin:
            admin.config_set("maxmemory-policy", "noeviction")
        fixed = run("agentpool", "check", "--strict")
        assert fixed.returncode == 0 and fixed.stderr == "", fixed
    finally:
        evicting.stop()


# --- Dockerfile -------------------------------------------------------------------------------------


def _dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent directories wins."""

    def regex(pattern: str) -> re.Pattern:
        out = re.escape(pattern.strip("/")).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        return re.compile("^" + out.replace(r"\*", "[^/]*").replace(r"\?", "[^/]") + "$")

    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        rx = regex(pattern.lstrip("!"))
        if any(rx.match(c) for c in candidates):
            excluded = not negate
    return excluded


def _build_context() -> set[str]:
    patterns = [
        line.strip()
        for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return {p for p in tracked if (ROOT / p).is_file() and not _dockerignore_excludes(p, patterns)}


def test_dockerfile_is_small_non_root_and_stops_and_checks_health_with_agentpool():
    instructions = dockerfile_instructions()
    final = final_stage(instructions)
    assert all(rest.split()[0] in ("${PYTHON_IMAGE}", "python:3.11-slim") for w, rest in instructions if w == "FROM")
    assert any(w == "ARG" and rest == "PYTHON_IMAGE=python:3.11-slim" for w, rest in instructions)
    user = [rest for w, rest in final if w == "USER"]
    assert user and user[-1].split(":")[0].isdigit() and user[-1].split(":")[0] != "0", "numeric non-root USER"
    assert ("STOPSIGNAL", "SIGTERM") in final
    entrypoint, cmd = image_entrypoint_and_cmd()
    assert entrypoint[:2] == ["tini", "--"], "tini forwards SIGTERM to the worker alone and reaps orphans"
    assert as_agentpool(entrypoint + cmd) == ("agentpool", "worker")
    assert next(c for c in COMMANDS if c.where == "deploy/Dockerfile HEALTHCHECK").argv == ("agentpool", "check")


def test_docker_build_context_holds_what_the_dockerfile_copies_and_nothing_else(tmp_path):
    context = _build_context()
    assert not any(p.startswith(("tests/", ".git/", "deploy/")) for p in context), sorted(context)
    copied = []
    for word, rest in dockerfile_instructions():
        if word == "COPY" and not rest.startswith("--from"):
            copied += rest.split()[:-1]
    assert copied
    for source in copied:
        source = source.rstrip("/")
        assert source in context or any(p.startswith(source + "/") for p in context), f"COPY {source}: not in context"
    # The wheel `pip install .` builds from exactly those files has the Lua scripts and the CLI.
    ctx = tmp_path / "ctx"
    for path in context:
        if any(path == s.rstrip("/") or path.startswith(s.rstrip("/") + "/") for s in copied):
            (ctx / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / path, ctx / path)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "out"), str(ctx)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    wheel = zipfile.ZipFile(next((tmp_path / "out").glob("agentpool-*.whl")))
    names = wheel.namelist()
    # Installed under one namespace: store/ is agentpool/store/, workers/ is agentpool/ (no top-level
    # `workers` or `store` package to clash with an app's own).
    installed = {
        "agentpool/store/" + p.removeprefix("store/")
        if p.startswith("store/")
        else "agentpool/" + p.removeprefix("workers/")
        for p in context
        if p.startswith(("store/", "workers/"))
    }
    installed = {p for p in installed if "__pycache__" not in p}
    assert installed and not installed - set(names), f"in the context but not installed: {installed - set(names)}"
    assert not [n for n in names if n.startswith(("workers/", "store/"))], "a top-level workers or store package"
    entry_points = wheel.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "agentpool = agentpool.ops.cli:main" in entry_points


# --- compose ----------------------------------------------------------------------------------------


def _go_duration(text: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text}"
    return sum(float(n) * units[u] for n, u in parts)


def test_compose_scales_workers_with_a_grace_period_longer_than_a_turn():
    spec = compose()
    services = spec["services"]
    worker = services["worker"]
    assert "container_name" not in worker and "ports" not in worker, "several workers need neither"
    assert worker["scale"] == "${WORKERS:-2}", "a later `up` keeps the count: it is in the file"
    assert worker.get("stop_signal", "SIGTERM") == "SIGTERM"
    assert _go_duration(worker["stop_grace_period"]) > TURN_BOUND
    assert worker["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile"}
    assert (DEPLOY / worker["build"]["context"] / worker["build"]["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    assert worker["environment"]["REDIS_URL"].startswith("redis://redis:")
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"


def test_compose_takes_secrets_from_the_host_environment_and_keeps_the_dashboard_on_loopback():
    services = compose()["services"]
    for name, service in services.items():
        for key, value in (service.get("environment") or {}).items():
            if "KEY" in key or "TOKEN" in key or "PASSWORD" in key:
                assert value is None or str(value).startswith("${"), f"{name}.{key} is hard-coded"
    assert "ANTHROPIC_API_KEY" in services["worker"]["environment"]
    for name in ("metrics", "dashboard"):
        assert services[name].get("profiles"), f"{name} is optional"
        assert all(str(p).startswith("127.0.0.1:") for p in services[name].get("ports", []))
    assert any("TOKEN" in k for k in services["dashboard"]["environment"])


def test_metrics_listen_beyond_loopback_only_where_a_service_or_published_port_must_reach_them():
    # `agentpool metrics` binds 127.0.0.1 unless told otherwise, as the dashboard does.
    for command in COMMANDS:
        if command.sub != "metrics":
            continue
        host = command.argv[command.argv.index("--host") + 1] if "--host" in command.argv else "127.0.0.1"
        behind_a_network = command.where.startswith(("deploy/k8s", "deploy/compose.yaml"))
        assert host == ("0.0.0.0" if behind_a_network else "127.0.0.1"), command


def test_the_dashboard_token_compose_passes_is_the_one_the_dashboard_reads(agentpool_path):
    names = [k for k in compose()["services"]["dashboard"]["environment"] if "TOKEN" in k]
    help_text = subprocess.run(
        ["agentpool", "dashboard", "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(agentpool_path, "redis://127.0.0.1:1/0"),
        cwd=ROOT,
    ).stdout
    assert names and all(name in help_text for name in names), help_text


def test_compose_redis_runs_the_shipped_conf_on_a_volume():
    spec = compose()
    redis = spec["services"]["redis"]
    assert redis["image"].startswith("redis:7")
    mounts = {m.split(":")[0]: m.split(":")[1] for m in redis["volumes"]}
    assert mounts["./redis.conf"] in redis["command"], "redis-server is started with the mounted conf"
    assert (DEPLOY / "redis.conf").is_file()
    data = [src for src, dst in mounts.items() if dst == "/data"]
    assert data and data[0] in spec["volumes"], "AOF lives on a named volume"
    assert "ports" not in redis


# --- Kubernetes -------------------------------------------------------------------------------------


def _by_kind(kind: str) -> list[dict]:
    return [doc for _, doc in k8s_documents() if doc["kind"] == kind]


def test_k8s_worker_deployment_probes_grace_resources_and_security():
    deployment = next(d for d in _by_kind("Deployment") if d["metadata"]["name"] == "agentpool-worker")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > TURN_BOUND
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    (container,) = pod["containers"]
    # Ready once the pod's worker is registered (a rollout waits for it); alive while Redis answers.
    for probe, argv in (
        ("readinessProbe", ("agentpool", "check", "--worker")),
        ("livenessProbe", ("agentpool", "check")),
    ):
        assert as_agentpool(container[probe]["exec"]["command"]) == argv
        assert container[probe]["timeoutSeconds"] > 2, "`agentpool check` itself waits up to 2 s"
    assert container["resources"]["requests"]["memory"] and container["resources"]["limits"]["memory"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    assert {"REDIS_URL", "ANTHROPIC_API_KEY"} <= set(secrets)
    assert not [e for e in container["env"] if e["name"] == "ANTHROPIC_API_KEY" and "value" in e]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_k8s_pdb_and_scaledobject_target_the_worker_deployment():
    deployment = next(d for d in _by_kind("Deployment") if d["metadata"]["name"] == "agentpool-worker")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    (pdb,) = _by_kind("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (scaled,) = _by_kind("ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert scaled["spec"]["minReplicaCount"] >= 1, "the reaper lives in the workers: never scale to zero"
    triggers = scaled["spec"]["triggers"]
    assert triggers[0]["metadata"]["listName"] == Queue(TURN_QUEUE, connection=Redis()).key
    auth = {a["metadata"]["name"]: a for a in _by_kind("TriggerAuthentication")}
    # One trigger per queue the workers serve, in the Deployment's args: KEDA scales on all of them.
    served = deployment["spec"]["template"]["spec"]["containers"][0]["args"][1:] or ["default"]
    lists = {Queue(rq_queue_name(q), connection=Redis()).key for q in served}
    assert {t["metadata"]["listName"] for t in triggers} == lists
    for trigger in triggers:
        assert trigger["type"] == "redis"
        assert int(trigger["metadata"]["listLength"]) >= 1
        assert trigger["authenticationRef"]["name"] in auth


def test_the_list_keda_watches_is_where_turns_wait(r):
    from agentpool.runtime.jobs import turn_queue

    (scaled,) = _by_kind("ScaledObject")
    list_name = scaled["spec"]["triggers"][0]["metadata"]["listName"]
    turn_queue(r).enqueue("agentpool.runtime.turn.run_turn", "r_deploytest", 1)
    assert r.type(list_name) == b"list" and r.llen(list_name) == 1


def test_kustomize_renders_the_manifests():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (the YAML itself is checked above)")
    result = subprocess.run([kubectl, "kustomize", str(K8S)], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    kinds = Counter(doc["kind"] for doc in _yaml().safe_load_all(result.stdout) if doc)
    assert kinds["Deployment"] >= 1 and kinds["PodDisruptionBudget"] == 1 and kinds["ScaledObject"] == 1
    assert "namespace: agentpool" in result.stdout


# --- systemd ----------------------------------------------------------------------------------------


def _timespan(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600}
    if text.isdigit():
        return float(text)
    parts = re.findall(r"(\d+)\s*(ms|sec|min|hr|s|m|h)", text)
    assert parts, f"not a time span: {text}"
    return sum(int(n) * units[u] for n, u in parts)


def test_systemd_worker_unit_stops_warm_and_restarts():
    unit = SYSTEMD / "agentpool-worker@.service"
    assert unit_value(unit, "KillSignal") == "SIGTERM"
    assert unit_value(unit, "KillMode") == "mixed", "SIGTERM to the worker only, never to the work horse"
    assert _timespan(unit_value(unit, "TimeoutStopSec")) > TURN_BOUND
    assert unit_value(unit, "Restart") == "always"
    assert unit_value(unit, "EnvironmentFile") == "/etc/agentpool/env"
    assert unit_value(unit, "User") and unit_value(unit, "NoNewPrivileges") == "yes"
    assert unit_value(unit, "ProtectSystem") == "strict"
    assert "--name" not in unit_value(unit, "ExecStart"), "a fixed name blocks restarts after a crash"
    assert unit_value(unit, "WantedBy") == "agentpool.target"
    assert (SYSTEMD / "agentpool.target").is_file()


def test_systemd_analyze_accepts_the_units(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    real = str(Path(sys.executable).with_name("agentpool"))
    if not os.access(real, os.X_OK):
        pytest.skip("no agentpool executable beside this Python to stand in for /opt/agentpool/bin/agentpool")
    names = []
    for unit in SYSTEMD.iterdir():
        text = unit.read_text().replace("/opt/agentpool/bin/agentpool", real)
        name = unit.name.replace("@.", "@1.")
        (tmp_path / name).write_text(text)
        if unit.name.endswith("@.service"):
            (tmp_path / unit.name).write_text(text)
        names.append(str(tmp_path / name))
    result = subprocess.run(
        [analyze, "verify", "--man=no", *names], check=False, capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


# --- The signal story the manifests rely on ---------------------------------------------------------


def test_sigterm_to_every_process_cuts_the_turn_which_is_why_the_units_use_killmode_mixed(r, pool, model):
    """systemd's default KillMode=control-group sends SIGTERM to every process of the unit. The work
    horse dies of it (RQ leaves SIGTERM at its default there), so the turn is cut and re-run, where
    SIGTERM to the worker alone (KillMode=mixed, tini, `docker stop`, the kubelet) lets it finish
    (tests/test_resilience.py::test_sigterm_lets_the_turn_in_flight_finish)."""
    model.set_scripts({"slow": [{"tool_calls": [{"name": "slow_read", "input": {"seconds": 3}}]}, {"text": "done"}]})
    worker = pool.start(1)[0]
    run_id = enqueue_run("pool_agents:support", script_task("slow"), connection=r)
    pool.wait_for_effect("slow_read")
    for pid in [worker.pid, *children_of(worker.pid)]:
        os.kill(pid, signal.SIGTERM)
    worker.wait(timeout=30)
    pool.start(1)
    run = wait_for_run(run_id, timeout=60, connection=r)
    assert run.status == "completed", (run.error, pool.logs())
    assert Counter(e["tool"] for e in pool.effects())["slow_read"] == 2, "the horse died mid-tool; the read re-ran"


def test_a_second_sigterm_is_a_cold_shutdown_and_the_turn_is_taken_over_after_the_lease(r, pool, model):
    """What a grace period too short for a double signal looks like: the horse is killed mid-turn and
    another worker takes the turn over once the lease (3 s in the test pool) expires."""
    model.set_scripts({"slow": [{"tool_calls": [{"name": "slow_read", "input": {"seconds": 4}}]}, {"text": "done"}]})
    worker = pool.start(1)[0]
    run_id = enqueue_run("pool_agents:support", script_task("slow"), connection=r)
    pool.wait_for_effect("slow_read")
    worker.send_signal(signal.SIGTERM)
    time.sleep(1.2)  # RQ ignores a second signal within 1 s of the first
    worker.send_signal(signal.SIGTERM)
    worker.wait(timeout=15)
    pool.start(1)
    run = wait_for_run(run_id, timeout=120, connection=r)
    assert run.status == "completed", (run.error, pool.logs())
    # Taken over by the lease's expiry (not by RQ's abandoned-job cleanup, minutes later): said by the
    # takeover's cause, not by a stopwatch, which a loaded machine fails (how fast: `agentpool bench recovery`).
    takeovers = [e["cause_kind"] for _, e in events.read(r, run_id) if e["kind"] == "takeover"]
    assert takeovers == ["lease_expiry"], takeovers
    assert Counter(e["tool"] for e in pool.effects())["slow_read"] == 2, "the cut read was re-run"
