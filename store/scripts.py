"""The Lua scripts in ``store/lua``, loaded once and called by name (EVALSHA, EVAL on a cache miss).

A script that calls ``record_event`` gets ``store/lua/_event.lua`` prepended: Redis has no includes.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

from redis import Redis
from redis.client import Pipeline
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from agentpool.store.codec import safe_text

_LUA_DIR = Path(__file__).with_name("lua")


@cache
def _source(name: str) -> str:
    text = (_LUA_DIR / f"{name}.lua").read_text()
    return (_LUA_DIR / "_event.lua").read_text() + text if "record_event(" in text else text


def source(name: str) -> str:
    """A script's text, for an EVAL inside a pipeline whose other replies a NOSCRIPT must not spoil."""
    return _source(name)


class _Scripts:
    """Script objects are bound to no client: each call passes the connection (or pipeline) to use."""

    def __init__(self) -> None:
        self._loaded: dict[str, Script] = {}

    def _script(self, name: str) -> Script:
        script = self._loaded.get(name)
        if script is None:
            script = self._loaded[name] = Script(None, _source(name).encode())  # type: ignore[arg-type]
        return script

    def __call__(self, name: str, client: Redis | Pipeline, keys: list[str], args: list[object]) -> object:
        """Run the script now, on a client or on a pipeline in WATCH mode (whose commands run at once)."""
        script = self._script(name)
        try:
            return self._evalsha(client, script, keys, args)
        except NoScriptError:  # a restarted or flushed Redis
            client.script_load(script.script)
            return self._evalsha(client, script, keys, args)

    @staticmethod
    def _evalsha(client: Redis | Pipeline, script: Script, keys: list[str], args: list[object]) -> object:
        try:
            return client.evalsha(script.sha, len(keys), *keys, *args)
        except UnicodeEncodeError:
            # A text argument (an error, a result, an event field) with a lone surrogate: redis-py
            # refuses it before sending anything, so sending the cleaned arguments is the first send.
            return client.evalsha(script.sha, len(keys), *keys, *_safe_args(args))

    def pipelined(
        self,
        r: Redis,
        name: str,
        calls: list[tuple[list[str], list[object]]],
        stage: Callable[[Pipeline], None] | None = None,
    ) -> list[object]:
        """One round trip: the script once per ``(keys, args)``, then the commands ``stage`` adds,
        which see what the scripts wrote. Replies in that order.

        (redis-py's own scripts in a pipeline cost a SCRIPT EXISTS round trip first; here EVALSHA
        goes out as is, and a cache miss loads the script and sends the lot again.)"""
        script = self._script(name)
        for _ in range(2):
            with r.pipeline(transaction=False) as pipe:
                for keys, args in calls:
                    pipe.evalsha(script.sha, len(keys), *keys, *_safe_args(args))
                if stage:
                    stage(pipe)
                replies = pipe.execute(raise_on_error=False)
            if not any(isinstance(reply, NoScriptError) for reply in replies[: len(calls)]):
                break
            r.script_load(script.script)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies


def _safe_args(args: list[object]) -> list[object]:
    return [safe_text(a) if isinstance(a, str) else a for a in args]


run_script = _Scripts()
