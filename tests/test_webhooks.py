"""Completion webhooks: ``enqueue_run(..., webhook=URL)`` (or the workers' ``AGENTPOOL_WEBHOOK_URL``) is POSTed
a signed summary of the run when it ends, at least once, by any worker, whatever dies meanwhile; receivers
check it with ``agentpool.webhooks.verify``. A real HTTP receiver runs in this process."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from redis import Redis

from agentpool import cancel_run, enqueue_run, get_run, wait_for_run
from agentpool.ops.dashboard import run_detail
from agentpool.store import crypto
from agentpool.store import webhooks as deliveries
from agentpool.store.crypto import Cipher, generate_key
from agentpool.store.keys import RUNS, WEBHOOKS_DUE, RunKeys
from agentpool.webhooks import WebhookSignatureError, sign, verify

from conftest import TESTS, script_task, wait_for_status

SECRET = "whsec-test-0123456789abcdef"
WORKER_ENV = {"AGENTPOOL_WEBHOOK_SECRET": SECRET, "AGENTPOOL_WEBHOOK_TIMEOUT": "2"}
FAILED = "no 2xx answer (the reason is in the worker's log)"  # all a reader of a run learns of a failure
DONE = [{"text": "All done: the notes are summarized."}]
READ = {"name": "read_notes", "input": {"topic": "weekly"}}


class Receiver:
    """An HTTP server in a thread that verifies every delivery with agentpool.webhooks.verify and
    answers ``fail_first`` of them with a 500 before answering 2xx."""

    def __init__(self, secret: str = SECRET, fail_first: int = 0) -> None:
        self.secret, self.fail_first = secret, fail_first
        self.received: list[dict[str, Any]] = []  # delivery id, event (None if refused), why, status sent
        self.changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    event, why = verify(body, self.headers.get("Agentpool-Signature"), receiver.secret), None
                except WebhookSignatureError as exc:
                    event, why = None, str(exc)
                with receiver.changed:
                    failing = len(receiver.received) < receiver.fail_first
                    status = 500 if failing or event is None else 200
                    receiver.received.append(
                        {
                            "delivery": self.headers.get("Agentpool-Delivery"),
                            "event": event,
                            "refused": why,
                            "status": status,
                            "body": body,
                        }
                    )
                    receiver.changed.notify_all()
                self.send_response(status)
                self.end_headers()
                self.wfile.write(b"nope" if status != 200 else b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/agentpool?team=qa"

    def wait_for(self, wanted: Callable[[list[dict[str, Any]]], bool], what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not wanted(self.received):
                left = deadline - time.monotonic()
                assert left > 0, f"receiver never got {what}: {[(d['delivery'], d['status']) for d in self.received]}"
                self.changed.wait(left)

    def accepted(self) -> dict[str, dict[str, Any]]:
        """Verified deliveries answered 2xx, by run id (the last one of each run)."""
        return {d["event"]["run"]["id"]: d["event"] for d in self.received if d["status"] == 200}

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made: list[Receiver] = []

    def make(**options: Any) -> Receiver:
        made.append(Receiver(**options))
        return made[-1]

    yield make
    for one in made:
        one.stop()


def _delivered(r: Redis, run_id: str, timeout: float = 120) -> list[dict[str, Any]]:
    """The run's deliveries once none is pending (read from Redis: works without the encryption key)."""
    deadline = time.monotonic() + timeout
    while True:
        found = deliveries.deliveries(r, RunKeys.of(run_id))
        if found and all(d["state"] != "pending" for d in found):
            return found
        assert time.monotonic() < deadline, f"deliveries of {run_id} still pending: {found}"
        time.sleep(0.05)


def test_every_end_status_is_posted_signed_with_the_runs_summary(r: Redis, pool, model, receiver) -> None:
    hook = receiver()
    model.set_scripts(
        {
            "done": DONE,
            "broken": [{"error": {"status": 400, "message": "messages: the request is malformed"}}],
            "looping": [{"tool_calls": [READ]}] * 3,
            "asks": [{"tool_calls": [{"name": "deploy", "input": {"version": "1.2"}}]}],
        }
    )
    pool.start(1, **WORKER_ENV)
    completed = enqueue_run("pool_agents:support", script_task("done"), connection=r, webhook=hook.url)
    failed = enqueue_run("pool_agents:support", script_task("broken"), connection=r, webhook=hook.url)
    stopped = enqueue_run("pool_agents:short", script_task("looping"), connection=r, webhook=hook.url)
    asks = enqueue_run(
        "pool_agents:guarded",
        script_task("asks"),
        connection=r,
        webhook=hook.url,
        webhook_events=("ended", "waiting_approval"),
    )
    hook.wait_for(lambda got: len(got) >= 4, "four deliveries")
    wait_for_status(r, asks, "waiting_approval")
    (waited,) = get_run(asks, connection=r).pending
    cancel_run(asks, connection=r)
    hook.wait_for(lambda got: len(got) >= 5, "the cancel's delivery")

    assert all(d["refused"] is None for d in hook.received), hook.received
    events = {(d["event"]["run"]["id"], d["event"]["type"]): d["event"] for d in hook.received}
    statuses = {key: event["run"]["status"] for key, event in events.items()}
    assert statuses == {
        (completed, "run.ended"): "completed",
        (failed, "run.ended"): "failed",
        (stopped, "run.ended"): "stopped",
        (asks, "run.waiting_approval"): "waiting_approval",
        (asks, "run.ended"): "cancelled",
    }
    done = events[(completed, "run.ended")]["run"]
    run = get_run(completed, connection=r)
    assert done["result"] == run.result == "All done: the notes are summarized."
    assert done["agent"] == "pool_agents:support" and done["turns"] == run.turns == 1
    assert done["usage"] == run.usage and sum(done["usage"].values()) > 0
    assert done["cost_usd"] == pytest.approx(run.cost_usd) and done["error"] is None and done["parent"] is None
    # A run waiting for a person names the calls it waits on, each decided by its id.
    assert events[(asks, "run.waiting_approval")]["run"]["awaiting"] == [
        {"tool_use_id": waited["id"], "tool": "deploy"}
    ]
    assert "awaiting" not in events[(asks, "run.ended")]["run"] and "awaiting" not in done
    assert "400" in events[(failed, "run.ended")]["run"]["error"]
    assert "max_turns" in events[(stopped, "run.ended")]["run"]["error"]
    # Each delivery's id is in its header and its body; nothing of the pool's secrets is in a body.
    for d in hook.received:
        assert d["delivery"] == d["event"]["delivery"] and d["delivery"].startswith(d["event"]["run"]["id"] + ".")
        assert SECRET.encode() not in d["body"] and b"sk-test" not in d["body"] and b"redis://" not in d["body"]
    # Recorded as delivered (once the worker has heard the answer), shown with the run; nothing is left due.
    for run_id in (completed, failed, stopped, asks):
        _delivered(r, run_id)
    shown = get_run(completed, connection=r).webhooks
    assert [(w["event"], w["status"], w["state"], w["attempts"]) for w in shown] == [
        ("ended", "completed", "delivered", 1)
    ]
    assert r.zcard(WEBHOOKS_DUE) == 0


def test_a_failing_receiver_gets_the_same_delivery_again_until_it_answers_2xx(r: Redis, pool, model, receiver) -> None:
    hook = receiver(fail_first=3)
    model.set_scripts({"done": DONE})
    pool.start(1, **WORKER_ENV)
    run_id = enqueue_run("pool_agents:support", script_task("done"), connection=r, webhook=hook.url)
    hook.wait_for(lambda got: any(d["status"] == 200 for d in got), "a delivery answered 2xx")
    assert [d["status"] for d in hook.received] == [500, 500, 500, 200]
    assert len({d["delivery"] for d in hook.received}) == 1, "a retry is the same delivery"
    assert all(d["event"] is not None for d in hook.received), "each retry is signed anew and verifies"
    [shown] = _delivered(r, run_id)
    assert shown["state"] == "delivered" and shown["attempts"] == 4
    assert shown["error"] == FAILED, "the last failure is kept"
    # The receiver's answer, and even its status, go to the worker's log, not to readers of the run: a
    # webhook pointed at an internal service must not read its answers (or whether it is there) back
    # through the run.
    assert "HTTP 500: nope" in pool.logs()
    assert "nope" not in json.dumps(get_run(run_id, connection=r).webhooks) and "500" not in shown["error"]
    # The URL is shown as scheme, host, port and a digest: never its path or query, where Slack's and
    # Discord's webhooks (path) and others (query) carry their secret; nor in the worker's log.
    show = pool.cli("show", run_id, timeout=60)
    line = next(line for line in show.stdout.splitlines() if shown["id"] in line)
    assert "delivered (4 attempts)" in line and "hooks/agentpool" not in line and "team=qa" not in line, line
    assert shown["url"].startswith(f"http://127.0.0.1:{hook.server.server_address[1]} (#"), shown["url"]
    other = hook.url.replace("team=qa", "team=ops")
    with r.pipeline() as pipe:  # a run of another team, to the same host: its receiver is told apart
        pipe.multi()
        r.hset(RunKeys.of("r-other").run, mapping={"webhook": other, "created_at": 1})
        deliveries.stage_record(pipe, RunKeys.of("r-other"), "completed", "")
        pipe.execute()
    [theirs] = deliveries.deliveries(r, RunKeys.of("r-other"))
    assert theirs["url"] != shown["url"] and theirs["url"].split(" ")[0] == shown["url"].split(" ")[0]
    for shown_to in (json.dumps(run_detail(r, run_id, 0)), json.dumps(get_run(run_id, connection=r).webhooks)):
        assert shown["url"] in shown_to and "hooks/agentpool" not in shown_to and "team=qa" not in shown_to
    assert "hooks/agentpool" not in pool.logs(tail=10_000_000)


def test_a_delivery_nobody_accepts_is_given_up_after_its_max_age_and_shown_undelivered(
    r: Redis, pool, model, receiver
) -> None:
    hook = receiver(fail_first=10**6)
    model.set_scripts({"done": DONE})
    pool.start(1, AGENTPOOL_WEBHOOK_MAX_AGE="3", **WORKER_ENV)
    run_id = enqueue_run("pool_agents:support", script_task("done"), connection=r, webhook=hook.url)
    [given_up] = _delivered(r, run_id)
    assert given_up["state"] == "undelivered" and given_up["error"] == FAILED
    assert given_up["attempts"] == len(hook.received) >= 2 and r.zcard(WEBHOOKS_DUE) == 0
    show = pool.cli("show", run_id, timeout=60)
    assert f"UNDELIVERED, given up after {given_up['attempts']} attempts; last error: {FAILED}" in show.stdout
    pool.wait_for_log(lambda line: "undelivered after" in line, "about the delivery given up")


def test_a_worker_killed_while_delivering_leaves_the_delivery_to_another(r: Redis, pool, model, receiver) -> None:
    hook = receiver()
    model.set_scripts({"done": DONE})
    # Whichever worker delivers first dies once the receiver has answered, before it records that.
    env = {**WORKER_ENV, "AGENTPOOL_FAULTS": "after_webhook_answered", "AGENTPOOL_WEBHOOK_TIMEOUT": "1"}
    workers = pool.start(2, **env)
    run_id = enqueue_run("pool_agents:support", script_task("done"), connection=r, webhook=hook.url)
    hook.wait_for(lambda got: len(got) >= 2, "the delivery from the second worker")
    assert len({d["delivery"] for d in hook.received}) == 1 and all(d["status"] == 200 for d in hook.received)
    deadline = time.monotonic() + 60
    while all(w.poll() is None for w in workers):
        assert time.monotonic() < deadline, "no worker was killed while delivering"
        time.sleep(0.05)
    [shown] = _delivered(r, run_id)
    assert shown["state"] == "delivered" and shown["attempts"] == 2, shown


def test_a_delivery_waits_for_a_worker_with_the_secret(r: Redis, pool, model, receiver) -> None:
    hook = receiver()
    model.set_scripts({"done": DONE})
    pool.start(1)  # no AGENTPOOL_WEBHOOK_SECRET: it runs the turn, it cannot sign the delivery
    run_id = enqueue_run("pool_agents:support", script_task("done"), connection=r, webhook=hook.url)
    assert wait_for_run(run_id, timeout=120, connection=r).status == "completed"
    pool.wait_for_log(lambda line: "waits for a worker with AGENTPOOL_WEBHOOK_SECRET" in line, "about the secret")
    [waiting] = get_run(run_id, connection=r).webhooks
    assert waiting["state"] == "pending" and waiting["attempts"] == 0 and hook.received == []
    assert "AGENTPOOL_WEBHOOK_SECRET" in waiting["waiting"]
    pool.start(1, **WORKER_ENV)
    hook.wait_for(lambda got: len(got) == 1, "the delivery, from the worker that has the secret")
    assert hook.accepted()[run_id]["run"]["status"] == "completed"
    assert _delivered(r, run_id)[0]["waiting"] is None


def test_the_pool_default_gets_runs_without_a_webhook_and_an_apps_cancel_where_there_is_one(
    r: Redis, pool, model, receiver
) -> None:
    hook = receiver()
    model.set_scripts({"done": DONE})
    queued = enqueue_run("pool_agents:support", script_task("done", "never started"), connection=r)
    cancel_run(queued, connection=r)  # by an app that does not know the workers' default
    pool.start(1, AGENTPOOL_WEBHOOK_URL=hook.url, **WORKER_ENV)
    run_id = enqueue_run("pool_agents:support", script_task("done"), connection=r)
    hook.wait_for(lambda got: len(hook.accepted()) == 2, "both runs' deliveries")
    assert {k: v["run"]["status"] for k, v in hook.accepted().items()} == {queued: "cancelled", run_id: "completed"}


def test_an_apps_cancel_in_a_pool_without_a_default_is_dropped(r: Redis, pool, model) -> None:
    run_id = enqueue_run("pool_agents:support", script_task("done"), connection=r)
    cancel_run(run_id, connection=r)
    assert r.zcard(WEBHOOKS_DUE) == 1  # recorded for a default the app could not know about
    pool.start(1)
    deadline = time.monotonic() + 120
    while r.zcard(WEBHOOKS_DUE):
        assert time.monotonic() < deadline, "the cancel's delivery was never dropped"
        time.sleep(0.05)
    assert get_run(run_id, connection=r).webhooks == []


@pytest.fixture
def key_in_this_process():
    def use(key: str | None) -> None:
        crypto.configure(Cipher([key]) if key else None)

    yield use
    crypto.configure(None)


def test_with_encryption_at_rest_the_body_carries_no_result(r: Redis, pool, model, receiver, key_in_this_process):
    hook = receiver()
    model.set_scripts({"done": [{"text": "The Bluebird offer is 41 per share."}]})
    key = generate_key()
    key_in_this_process(key)
    pool.start(1, AGENTPOOL_ENCRYPTION_KEY=key, **WORKER_ENV)
    run_id = enqueue_run("pool_agents:support", script_task("done"), connection=r, webhook=hook.url)
    hook.wait_for(lambda got: len(got) == 1, "the delivery")
    [got] = hook.received
    assert got["event"]["run"]["status"] == "completed" and got["event"]["run"]["result"] is None
    assert b"Bluebird" not in got["body"] and b"41 per share" not in got["body"]
    assert b"Bluebird" not in b"".join(r.hgetall(RunKeys.of(run_id).webhooks).values())
    assert "Bluebird" in get_run(run_id, connection=r).result  # the result itself is kept, sealed


def test_the_status_write_itself_records_the_delivery_and_a_child_runs_names_its_parent(r: Redis) -> None:
    from agentpool.store import checkpoint
    from agentpool.webhooks import body_of

    with r.pipeline() as pipe:
        pipe.multi()
        checkpoint.stage_create(
            pipe, "child-1", agent="pool_agents:support", task="t", limits={}, now=time.time(), extra={"parent": "p-1"}
        )
        pipe.execute()
    # No worker runs: the failure's own script records the delivery (for the pool default here), or nothing.
    assert checkpoint.fail_unfenced(r, "child-1", "its records are unreadable", retention_s=60, pool_webhook="")
    assert r.zcard(WEBHOOKS_DUE) == 0
    r.hset(RunKeys.of("child-1").run, "status", "running")
    assert checkpoint.fail_unfenced(r, "child-1", "its turn keeps dying", retention_s=60, pool_webhook="ended")
    [due] = deliveries.due(r)
    claim = deliveries.claim(r, due, lease_ms=10_000, secret=True, default=True)
    assert isinstance(claim, deliveries.Claim) and claim.attempt == 1
    body = body_of(claim.delivery_id, claim.run_id, claim.summary, claim.result, with_result=True)
    assert body["run"] == {**body["run"], "id": "child-1", "status": "failed", "parent": "p-1"}
    assert body["run"]["error"] == "its turn keeps dying" and body["delivery"] == due
    assert 0 < r.ttl(RunKeys.of("child-1").webhooks) <= 60, "it expires with the run"


def test_verify_refuses_a_forged_a_replayed_and_an_unsigned_delivery() -> None:
    body = json.dumps({"type": "run.ended", "delivery": "r_1.1.1", "run": {"id": "r_1", "status": "completed"}})
    header = sign(body.encode(), SECRET)
    now = int(time.time())
    other_digits = "".join(chr(0x660 + int(digit)) for digit in str(now))  # now, in Arabic-Indic digits
    assert verify(body.encode(), header, SECRET)["run"]["status"] == "completed"
    assert verify(body, header, ["an-old-secret-rotated-out", SECRET])["delivery"] == "r_1.1.1"
    forged = body.replace("completed", "failed")
    refusals = {
        "forged body": (forged, header, SECRET),
        "another secret": (body, sign(body.encode(), "an-attackers-own-secret"), SECRET),
        "replayed an hour later": (body, sign(body.encode(), SECRET, at=int(time.time()) - 3600), SECRET),
        "unsigned": (body, None, SECRET),
        "malformed": (body, "v1=abc", SECRET),
        # Only ASCII digits and hex: other characters are refused as malformed, never a TypeError.
        "non-ASCII signature": (body, f"t={int(time.time())},v1=\u00e9abc", SECRET),
        "non-ASCII digits": (body, f"t={other_digits},{sign(body.encode(), SECRET, at=now).split(',')[1]}", SECRET),
    }
    for what, (text, signature, secret) in refusals.items():
        with pytest.raises(WebhookSignatureError) as caught:
            verify(text, signature, secret)
        assert "\n" not in str(caught.value), what
    with pytest.raises(WebhookSignatureError, match="beyond the tolerance"):
        verify(body, sign(body.encode(), SECRET, at=int(time.time()) - 301), SECRET)
    assert verify(body, sign(body.encode(), SECRET, at=int(time.time()) - 3600), SECRET, tolerance=None)


def _worker_start(pool, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentpool", "worker", "--burst"],
        env={**pool.env, **env},
        cwd=str(TESTS),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_worker_refuses_to_start_with_a_default_webhook_and_no_secret_or_a_bad_setting(pool) -> None:
    cases = {
        "AGENTPOOL_WEBHOOK_SECRET is not": {"AGENTPOOL_WEBHOOK_URL": "https://hooks.example.com/agentpool"},
        "http:// or https://": {"AGENTPOOL_WEBHOOK_URL": "ftp://hooks.example.com/x", **WORKER_ENV},
        "too short": {"AGENTPOOL_WEBHOOK_URL": "https://hooks.example.com/x", "AGENTPOOL_WEBHOOK_SECRET": "abc"},
        "AGENTPOOL_WEBHOOK_EVENTS": {"AGENTPOOL_WEBHOOK_EVENTS": "ended,finished", **WORKER_ENV},
        "'any' or 'public'": {"AGENTPOOL_WEBHOOK_NETWORKS": "private", **WORKER_ENV},
        "'10.0.0.0/33' is not a network": {"AGENTPOOL_WEBHOOK_NETWORKS": "public 10.0.0.0/33", **WORKER_ENV},
        "169.254.169.254 is not a public address": {
            "AGENTPOOL_WEBHOOK_NETWORKS": "public",
            "AGENTPOOL_WEBHOOK_URL": "http://169.254.169.254/latest/meta-data",
            **WORKER_ENV,
        },
    }
    for words, env in cases.items():
        done = _worker_start(pool, **env)
        assert done.returncode != 0, (words, done.stdout, done.stderr)
        last = done.stderr.strip().splitlines()
        assert len(last) == 1 and words in last[0], (words, done.stderr)
    assert _worker_start(pool, **WORKER_ENV).returncode == 0  # a secret and no default: fine


def test_a_bad_webhook_is_refused_at_enqueue_in_one_line_and_makes_nothing(r: Redis, pool) -> None:
    for webhook, words in [
        ("ftp://hooks.example.com/x", "http:// or https://"),
        ("hooks.example.com/x", "http:// or https://"),
        ("https://", "must name a host"),
        ("https://user:s3cr3t@hooks.example.com/x", "credentials"),
        ("https://hooks.example.com:port/x", "not a valid URL"),
        # An HTTP request line is ASCII: such a URL could never be POSTed.
        ("https://hooks.example.com/caf\u00e9", "must be ASCII"),
        ("https://hooks.example.com/x?token=\u00fc", "must be ASCII"),
        ("https://b\u00fccher.example/x", "must be ASCII"),
    ]:
        with pytest.raises(ValueError) as caught:
            enqueue_run("pool_agents:support", "task", connection=r, webhook=webhook)
        assert words in str(caught.value) and "\n" not in str(caught.value), caught.value
        assert "s3cr3t" not in str(caught.value)
    with pytest.raises(ValueError, match="webhook_events"):
        enqueue_run("pool_agents:support", "task", connection=r, webhook="https://h.example/x", webhook_events=["done"])
    with pytest.raises(ValueError, match="needs a webhook"):
        enqueue_run("pool_agents:support", "task", connection=r, webhook_events=["waiting_approval"])
    cli = subprocess.run(
        [sys.executable, "-m", "agentpool", "enqueue", "pool_agents:support", "task", "--webhook", "ftp://h/x"],
        env=pool.env,
        cwd=str(TESTS),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert cli.returncode != 0 and "http:// or https://" in cli.stderr and len(cli.stderr.strip().splitlines()) == 1
    assert r.zcard(RUNS) == 0


class TricklingReceiver:
    """A receiver that reads the request, then answers one byte every second, never finishing: each
    socket read of the worker gets a byte well within AGENTPOOL_WEBHOOK_TIMEOUT (2 s). ``silent``: it
    reads the request and never answers at all (a hung app behind an open port)."""

    def __init__(self, *, silent: bool = False) -> None:
        self.silent = silent
        self.posts: list[float] = []  # when each request arrived (monotonic)
        self.stopping = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/hook"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(65536)
            self.posts.append(time.monotonic())
            if self.silent:
                self.stopping.wait()
                return
            try:
                for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10_000:
                    if self.stopping.wait(1.0):
                        return
                    conn.send(bytes([byte]))
            except OSError:  # the worker gave up on us
                return

    def stop(self) -> None:
        self.stopping.set()
        self.listener.close()


@pytest.mark.parametrize("kind", ["trickling", "silent"])
def test_a_receiver_trickling_its_answer_holds_the_delivery_thread_no_longer_than_the_timeout(
    kind, r: Redis, pool, model, receiver
) -> None:
    slow, good = TricklingReceiver(silent=kind == "silent"), receiver()
    try:
        model.set_scripts({"done": DONE})
        pool.start(1, **WORKER_ENV)  # one worker, one delivery thread; the claim's lease is 11 s
        slowed = enqueue_run("pool_agents:support", script_task("done", "slow"), connection=r, webhook=slow.url)
        deadline = time.monotonic() + 60
        while not slow.posts:
            assert time.monotonic() < deadline, f"the {kind} receiver was never POSTed"
            time.sleep(0.05)
        # Another tenant's run, to a healthy receiver, while the thread is in the trickling one: the
        # attempt ends at its timeout (2 s) whatever the receiver does, so this one is delivered soon,
        # well before the slow delivery's lease would end (the pool is not stuck behind one receiver).
        other = enqueue_run("pool_agents:support", script_task("done", "other"), connection=r, webhook=good.url)
        good.wait_for(lambda got: len(got) == 1, "the other tenant's delivery", timeout=20)
        assert good.accepted()[other]["run"]["status"] == "completed"
        # The slow attempt was recorded as a failure, to be retried, by the worker that made it.
        [stuck] = deliveries.deliveries(r, RunKeys.of(slowed))
        assert stuck["state"] == "pending" and stuck["attempts"] >= 1 and stuck["error"] == FAILED, stuck
        pool.wait_for_log(lambda line: "no answer within 2 s" in line, "about the slow receiver", timeout=10)
    finally:
        slow.stop()


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def test_a_delivery_that_cannot_be_made_is_given_up_and_readers_never_learn_why(r: Redis, pool, model, receiver):
    hook = receiver(fail_first=10**6)
    model.set_scripts({"done": DONE})
    odd = enqueue_run("pool_agents:support", script_task("done", "odd"), connection=r, webhook=hook.url)
    # A URL an older version let through (check_url now refuses it): http.client cannot send it at all.
    r.hset(RunKeys.of(odd).run, "webhook", hook.url.replace("agentpool", "caf\u00e9"))
    refused = f"http://127.0.0.1:{_free_port()}/hook"  # nothing listens there
    closed = enqueue_run("pool_agents:support", script_task("done", "closed"), connection=r, webhook=refused)
    failing = enqueue_run("pool_agents:support", script_task("done", "failing"), connection=r, webhook=hook.url)
    pool.start(1, AGENTPOOL_WEBHOOK_MAX_AGE="3", **WORKER_ENV)
    for run_id in (odd, closed, failing):
        [given_up] = _delivered(r, run_id, timeout=60)
        # Retried and given up like any failure; and one error text for all: whoever reads runs must not
        # learn which ports are open, or which speak HTTP, through a webhook pointed at them.
        assert given_up["state"] == "undelivered" and given_up["attempts"] >= 1, given_up
        assert given_up["error"] == FAILED, given_up
    logs = pool.logs(tail=10_000_000)
    assert "UnicodeEncodeError" in logs and "Connection refused" in logs and "HTTP 500: nope" in logs
    assert "unexpected error" not in logs and "Traceback" not in logs


def test_with_public_networks_only_an_internal_receiver_is_never_posted_to(r: Redis, pool, model, receiver):
    """AGENTPOOL_WEBHOOK_NETWORKS=public: a webhook pointing at an internal address (loopback here, as the
    cloud metadata service or a Redis would be) is refused before anything is connected, by address or by
    a name that resolves to one, and given up at once; a network named after `public` is allowed."""
    hook = receiver()
    model.set_scripts({"done": DONE})
    by_address = enqueue_run("pool_agents:support", script_task("done", "a"), connection=r, webhook=hook.url)
    by_name = hook.url.replace("127.0.0.1", "localhost")
    named = enqueue_run("pool_agents:support", script_task("done", "n"), connection=r, webhook=by_name)
    [strict] = pool.start(1, AGENTPOOL_WEBHOOK_NETWORKS="public", **WORKER_ENV)
    for run_id in (by_address, named):
        [refused] = _delivered(r, run_id, timeout=60)
        assert (refused["state"], refused["attempts"]) == ("undelivered", 1), refused  # not retried for a day
        assert refused["error"] == (
            "not sent: the receiver's address is not one the pool's workers may post to (AGENTPOOL_WEBHOOK_NETWORKS)"
        ), refused
    assert hook.received == [], "nothing reached the receiver"
    logs = pool.logs(tail=10_000_000)
    assert "127.0.0.1 is not a public address (AGENTPOOL_WEBHOOK_NETWORKS=public)" in logs
    assert "hooks/agentpool" not in logs and "Traceback" not in logs
    pool.kill(strict)
    strict.wait(timeout=30)

    trusted = enqueue_run("pool_agents:support", script_task("done", "t"), connection=r, webhook=by_name)
    pool.start(1, AGENTPOOL_WEBHOOK_NETWORKS="public 127.0.0.0/8 ::1", **WORKER_ENV)
    [delivered] = _delivered(r, trusted, timeout=60)
    assert (delivered["state"], delivered["attempts"]) == ("delivered", 1), delivered
    assert set(hook.accepted()) == {trusted}


def test_a_claimer_whose_clock_runs_ahead_takes_no_live_claim(r: Redis, redis_server) -> None:
    keys = RunKeys.of("r-skewed")
    with r.pipeline() as pipe:
        pipe.multi()
        r.hset(keys.run, mapping={"webhook": "http://hooks.example.com/x", "created_at": 1})
        deliveries.stage_record(pipe, keys, "completed", "")
        pipe.execute()
    [due] = deliveries.due(r)
    first = deliveries.claim(r, due, lease_ms=35_000, secret=True, default=False)
    assert isinstance(first, deliveries.Claim)
    # Another worker, a process whose wall clock runs a minute ahead, looks for due deliveries and
    # tries to claim this one: the lease is Redis's time, so it is still live for that worker too.
    skewed = (
        "import time; real = time.time; time.time = lambda: real() + 60\n"
        "from redis import Redis\n"
        "from agentpool.store import webhooks as d\n"
        f"r = Redis.from_url({redis_server.url!r})\n"
        f"got = d.claim(r, {due!r}, lease_ms=35_000, secret=True, default=False)\n"
        "print(d.due(r), 'claimed' if isinstance(got, d.Claim) else got)\n"
    )
    done = subprocess.run([sys.executable, "-c", skewed], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["[]", str(deliveries.NOT_DUE)], done.stdout
    assert deliveries.done(r, first, "retry", error=FAILED, retry_in_ms=1000), "the first claim still holds"
    assert deliveries.deliveries(r, keys)[0]["attempts"] == 1
