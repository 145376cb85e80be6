"""``python -m agentpool.testing.scripted_model --port 8765 [--scripts f.json]``."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from agentpool.testing.scripted_model.ratelimit import RateLimits
from agentpool.testing.scripted_model.scripts import load_scripts
from agentpool.testing.scripted_model.server import ScriptedModel


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m agentpool.testing.scripted_model",
        description="Scripted stand-in for the Anthropic Messages API.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--scripts", help="JSON file mapping script names to lists of steps")
    parser.add_argument("--cache-min-tokens", type=int, default=1024)
    parser.add_argument("--context-window", type=int, default=200_000, help="tokens a request may hold")
    parser.add_argument("--rpm", type=int, help="requests per minute (default: no limit)")
    parser.add_argument("--itpm", type=int, help="input tokens per minute (cache reads do not count)")
    parser.add_argument("--otpm", type=int, help="output tokens per minute")
    parser.add_argument("--minute", type=float, default=60.0, help="seconds a rate-limit minute lasts (tests)")
    args = parser.parse_args(argv)
    try:
        limits = RateLimits(rpm=args.rpm, itpm=args.itpm, otpm=args.otpm, minute=args.minute)
    except ValueError as exc:
        parser.error(str(exc))

    scripts = load_scripts(args.scripts) if args.scripts else None
    model = ScriptedModel(
        scripts,
        host=args.host,
        port=args.port,
        cache_min_tokens=args.cache_min_tokens,
        context_window=args.context_window,
        rate_limits=limits,
    ).start()
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    print(f"listening on {model.base_url}", flush=True)
    try:
        # Poll so the signal handler gets to run promptly in the main thread.
        while not stopping.wait(0.2):
            pass
    finally:
        model.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
