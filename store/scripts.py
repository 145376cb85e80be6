"""The Lua scripts in ``store/lua``, loaded once and called by name (EVALSHA, EVAL on a cache miss)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from redis import Redis
from redis.commands.core import Script

_LUA_DIR = Path(__file__).with_name("lua")


@cache
def _source(name: str) -> str:
    return (_LUA_DIR / f"{name}.lua").read_text()


class _Scripts:
    """Script objects are bound to no client: each call passes the connection (or pipeline) to use."""

    def __init__(self) -> None:
        self._loaded: dict[str, Script] = {}

    def __call__(self, name: str, client: Redis, keys: list[str], args: list[object]) -> object:
        script = self._loaded.get(name)
        if script is None:
            script = self._loaded[name] = Script(None, _source(name).encode())  # type: ignore[arg-type]
        return script(keys=keys, args=args, client=client)


run_script = _Scripts()
