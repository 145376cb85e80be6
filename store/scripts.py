"""The Lua scripts in ``store/lua``, loaded once and called by name (EVALSHA, EVAL on a cache miss).

A script that calls ``record_event`` gets ``store/lua/_event.lua`` prepended, one that calls
``remember``/``replayed`` gets ``store/lua/_once.lua``, one that calls ``add_spend``, ``spend_fields`` or
``fenced_call`` (or ``spent_ring``) gets ``store/lua/_spend.lua``, one that calls ``join_parent`` gets ``store/lua/_join.lua``,
one that calls ``roll_up_spend`` or ``tree_exhausted`` gets ``store/lua/_tree.lua``, one that calls
``count_rest`` gets ``store/lua/_rest.lua``, one that calls
``take_webhook`` gets ``store/lua/_webhook.lua``, one that calls ``expire_run_keys`` gets
``store/lua/_retention.lua``, one that calls ``reserve_budget`` gets ``store/lua/_reserve.lua``, one that calls
``read_budget`` (``_reserve.lua`` does) gets ``store/lua/_budget.lua``, one that walks or sums a line of
waiters (``walk_line``, ``numbers_of``, ``sum_text``) gets ``store/lua/_line.lua``: Redis has no includes.

A helper's top level runs at every call of every script it is prepended to, so it only defines
functions and numbers: a table there (a list of field names) would be made at every save point whether
the function that reads it runs or not (a few thousand Redis instructions each, measured with
``agentpool bench --only instructions``); such tables are made inside the functions that use them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from redis import Redis
from redis.client import Pipeline
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from agentpool.store.codec import safe_text

_LUA_DIR = Path(__file__).with_name("lua")


# Helper files and a call that needs each: Redis has no includes, so they are prepended.
_HELPERS = (
    ("_event", "record_event("),
    ("_once", "remember("),
    ("_once", "replayed("),
    ("_once", "replayed_in("),
    ("_once", "ring_with("),
    ("_spend", "add_spend("),
    ("_spend", "spend_fields("),
    ("_spend", "fenced_call("),
    ("_spend", "spent_ring("),
    ("_join", "join_parent("),
    ("_tree", "roll_up_spend("),
    ("_tree", "tree_exhausted("),
    ("_rest", "count_rest("),
    ("_webhook", "take_webhook("),
    ("_retention", "expire_run_keys("),
    ("_line", "walk_line("),
    ("_line", "numbers_of("),
    ("_line", "sum_text("),
    ("_budget", "read_budget("),
    ("_budget", "held_entries("),
    ("_budget", "as_hashtable("),
    ("_budget", "budget_fields("),
    ("_budget", "limit_in_force("),
    ("_budget", "refilled("),
    ("_reserve", "reserve_budget("),
)


@cache
def _helper(name: str) -> str:
    return (_LUA_DIR / f"{name}.lua").read_text()


@cache
def source(name: str) -> str:
    """The script's text with the helpers it calls prepended, and the helpers those call, each once in
    ``_HELPERS``' order (a helper another one calls comes before it: Lua resolves a local when it compiles)."""
    text = (_LUA_DIR / f"{name}.lua").read_text()
    needed: set[str] = set()
    searched = text
    while more := {helper for helper, call in _HELPERS if call in searched} - needed:
        needed |= more
        searched = "".join(_helper(helper) for helper in more)
    return "".join(_helper(helper) for helper in dict.fromkeys(h for h, _ in _HELPERS) if helper in needed) + text


@cache
def compact_source(name: str) -> str:
    """``source`` without its comment lines: for a script sent whole with EVAL (inside a MULTI, where
    EVALSHA could meet an empty script cache), so a save does not send Redis the documentation."""
    lines = [line for line in source(name).splitlines() if line.strip() and not line.lstrip().startswith("--")]
    return "\n".join(lines) + "\n"


@dataclass
class Rider:
    """A script call that rides in another script's round trip (``run_script.with_riders``) instead of
    making one of its own. ``sent`` once Redis had it; ``reply`` is then its reply, or the error it met."""

    name: str
    keys: list[str]
    args: list[object]
    sent: bool = False
    reply: object = None

    def run(self, r: Redis) -> object:
        """Sent now, on its own round trip."""
        return run_script(self.name, r, self.keys, self.args)


class _Scripts:
    """Script objects are bound to no client: each call passes the connection (or pipeline) to use."""

    def __init__(self) -> None:
        self._loaded: dict[str, Script] = {}

    def _script(self, name: str) -> Script:
        script = self._loaded.get(name)
        if script is None:
            script = self._loaded[name] = Script(None, source(name).encode())  # type: ignore[arg-type]
        return script

    def sha(self, name: str) -> str:
        """The SHA1 that EVALSHA names the script by."""
        return self._script(name).sha

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
        which see what the scripts wrote. Replies in that order. ``stage`` is called again for the
        round trip sent after a script cache miss: what it stages must depend on that call only.

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

    def with_riders(self, name: str, r: Redis, keys: list[str], args: list[object], riders: Sequence[Rider]) -> object:
        """``name`` run now, as a call does, with the ``riders`` after it in the same round trip. The
        scripts must not depend on one another (after a script cache miss only the ones that missed are
        sent again). Only ``name``'s error is raised; each rider keeps its own reply or error."""
        first = Rider(name, keys, args)
        todo = [first, *riders]
        for attempt in range(2):
            with r.pipeline(transaction=False) as pipe:
                for call in todo:
                    script = self._script(call.name)
                    pipe.evalsha(script.sha, len(call.keys), *call.keys, *_safe_args(call.args))
                replies = pipe.execute(raise_on_error=False)
            missed = []
            for call, reply in zip(todo, replies, strict=True):
                if attempt == 0 and isinstance(reply, NoScriptError):  # a restarted or flushed Redis
                    missed.append(call)
                else:
                    call.sent, call.reply = True, reply
            for script_name in dict.fromkeys(call.name for call in missed):
                r.script_load(self._script(script_name).script)
            todo = missed
            if not todo:
                break
        if isinstance(first.reply, Exception):
            raise first.reply
        return first.reply


def _safe_args(args: list[object]) -> list[object]:
    return [safe_text(a) if isinstance(a, str) else a for a in args]


run_script = _Scripts()
