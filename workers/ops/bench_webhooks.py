"""``agentpool bench --only limits``, its webhook row: every run's webhook arrives, signed, at least once,
at a receiver that fails its first 3 deliveries and then is down (connections refused) for a while,
with one worker SIGKILLed while it is down and another started in its place.

The receiver runs in the bench's process and checks each delivery with ``agentpool.webhooks.verify``.
Latency is from the run's end (the body's ``created``) to the first delivery the receiver accepted.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from agentpool.ops.bench import Lab

SECRET = "bench-webhook-secret-not-a-real-one"


class FlakyReceiver:
    """Answers 500 to its first ``fail_first`` deliveries, then closes its socket for ``down`` seconds
    (connections refused), then accepts; counts what it got, by delivery id."""

    def __init__(self, fail_first: int, down: float) -> None:
        self.fail_first, self.down = fail_first, down
        self.requests = 0
        self.unsigned = 0
        self.accepted: dict[str, list[float]] = {}  # delivery id -> when each accepted copy came
        self.ended_at: dict[str, float] = {}  # run id -> when it ended (the body's created)
        self.lock = threading.Lock()
        self.up_again_at: float | None = None
        self.server = self._serve(0)
        self.port = self.server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/agentpool"

    def _serve(self, port: int) -> ThreadingHTTPServer:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                receiver.handle(self)

            def log_message(self, *args: Any) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def handle(self, request: BaseHTTPRequestHandler) -> None:
        from agentpool.webhooks import WebhookSignatureError, verify

        body = request.rfile.read(int(request.headers.get("Content-Length") or 0))
        with self.lock:
            self.requests += 1
            failing = self.requests <= self.fail_first
            go_down = self.requests == self.fail_first
        status = 500
        if not failing:
            try:
                event = verify(body, request.headers.get("Agentpool-Signature"), SECRET)
            except WebhookSignatureError:
                with self.lock:
                    self.unsigned += 1
            else:
                status = 200
                with self.lock:
                    self.accepted.setdefault(event["delivery"], []).append(time.time())
                    self.ended_at[event["run"]["id"]] = event["created"]
        request.send_response(status)
        request.end_headers()
        if go_down:
            threading.Thread(target=self._down_for_a_while, daemon=True).start()

    def _down_for_a_while(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        time.sleep(self.down)
        self.server = self._serve(self.port)
        self.up_again_at = time.time()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def bench_webhooks(lab: Lab, runs: int, down: float, workers: int) -> None:
    from agentpool.client import enqueue_run
    from agentpool.ops.bench import pct, table, task, tool_steps
    from agentpool.ops.bench_limits import LIMITED_AGENT

    lab.reset({"webhooks": tool_steps(2)})
    lab.model.set_rate_limits(None)
    env = {"AGENTPOOL_WEBHOOK_SECRET": SECRET, "AGENTPOOL_WEBHOOK_TIMEOUT": "2"}
    procs = [lab.start("--concurrency", "4", **env)[0] for _ in range(max(2, workers))]
    receiver = FlakyReceiver(fail_first=3, down=down)
    try:
        started = time.monotonic()
        ids = [
            enqueue_run(LIMITED_AGENT, task("webhooks", n), connection=lab.r, webhook=receiver.url, check_agent=False)
            for n in range(runs)
        ]
        killed = False
        deadline = started + down + 600
        while len(receiver.ended_at) < runs or receiver.up_again_at is None:
            if not killed and receiver.requests >= 3 and time.monotonic() > started + down / 2:
                lab.workers.kill(procs[0])  # a worker dies while the receiver is down
                lab.start("--concurrency", "4", **env)
                killed = True
            if time.monotonic() > deadline:
                raise click.ClickException(
                    f"{runs - len(receiver.ended_at)} webhooks never arrived; logs:\n{lab.workers.logs(2000)}"
                )
            time.sleep(0.05)
        time.sleep(1.0)  # a duplicate from a worker killed mid-delivery would come now
    finally:
        receiver.stop()
        lab.workers.stop()
    delivered = {run_id for run_id in receiver.ended_at if run_id in set(ids)}
    copies = sum(len(times) for times in receiver.accepted.values())
    # A delivery id is "<run id>.<created ms>.<n>".
    latencies = [min(times) - receiver.ended_at[d.partition(".")[0]] for d, times in receiver.accepted.items()]
    table(
        f"webhooks: {runs} runs posted to a receiver that fails its first 3 deliveries, then is down for "
        f"{down:g} s; a worker SIGKILLed meanwhile",
        [
            "receiver",
            "delivered/expected",
            "requests",
            "accepted",
            "duplicates",
            "unsigned",
            "latency p50 s",
            "latency max s",
            "target",
        ],
        [
            [
                f"fails 3, down {down:g} s",
                f"{len(delivered)}/{runs}",
                str(receiver.requests),
                str(copies),
                str(copies - len(receiver.accepted)),
                str(receiver.unsigned),
                f"{pct(latencies, 50):.1f}",
                f"{max(latencies):.1f}",
                "every run delivered, signed, at least once",
            ]
        ],
        (
            (
                "requests: the POSTs the receiver read (none while it was down: connections refused); accepted: "
                "signed and answered 2xx; duplicates: accepted copies of a delivery already accepted"
            ),
            "latency: from the run's end to its first accepted delivery (backoff doubles from 1 s, with jitter)",
        ),
    )
