"""Running the sync API's own code on a ``redis.asyncio`` client, without a thread and without blocking
the event loop: the technique SQLAlchemy's asyncio extension uses.

The sync function runs in a greenlet. Every Redis command it sends goes through ``GreenRedis``, a
stand-in for the sync client whose methods hand the ``redis.asyncio`` call to the event loop's side
(``await_only`` switches to the coroutine that started the greenlet, which awaits it and switches back
with the reply). So the keys, scripts, transactions and record decoding of ``agentpool.client``,
``agentpool.conversation`` and ``agentpool.store`` are the very same code for both APIs: nothing is
written twice, and a fix to one is a fix to both. The greenlet only ever waits on Redis; pauses
(``wait_for_run``'s polling) are done by the async side with ``asyncio.sleep``.
"""

from __future__ import annotations

import contextvars
import inspect
import sys
from collections.abc import Callable
from typing import Any, TypeVar

try:
    import greenlet
except ImportError:  # pragma: no cover - the aio extra's one dependency
    raise ImportError("agentpool.aio needs the aio extra: pip install 'agentpool[aio]'") from None

T = TypeVar("T")


class _Bridged(greenlet.greenlet):  # type: ignore[misc]
    """A greenlet running sync agentpool code on behalf of a coroutine."""


def await_only(awaitable: Any) -> Any:
    """From sync code in a bridged greenlet: the result of ``awaitable``, awaited by the event loop side."""
    current = greenlet.getcurrent()
    if not isinstance(current, _Bridged):
        raise RuntimeError("an async Redis client was used from sync code outside agentpool.aio")  # noqa: TRY004
    return current.parent.switch(awaitable)


async def run_sync(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, whose Redis commands are awaited on this loop."""
    child = _Bridged(fn, greenlet.getcurrent())
    # A new greenlet starts with an empty context: the sync code would not see the caller's context
    # variables (the app's current OpenTelemetry span, which enqueue_run keeps with the run). A copy,
    # as asyncio gives each task and asyncio.to_thread its function.
    child.gr_context = contextvars.copy_context()
    result = child.switch(*args, **kwargs)
    while not child.dead:
        try:
            value = await result
        except BaseException:  # noqa: BLE001 - raised into the sync code, where it would have been raised
            result = child.throw(*sys.exc_info())
        else:
            result = child.switch(value)
    return result  # type: ignore[no-any-return]


class _Green:
    """Calls into the wrapped ``redis.asyncio`` object; awaitables are awaited (``await_only``), and
    pipelines come back wrapped too."""

    def __init__(self, target: Any) -> None:
        object.__setattr__(self, "_target", target)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if not callable(value) or inspect.isclass(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            out = value(*args, **kwargs)
            if inspect.isawaitable(out):
                out = await_only(out)
            if out is self._target:  # a buffered pipeline command returns its pipeline
                return self
            return _wrap(out)

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target, name, value)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        await_only(self._target.reset())

    def __bool__(self) -> bool:
        return True  # a pipeline has a length (its buffered commands); a client or pipeline is never falsy

    def __len__(self) -> int:
        return len(self._target)


def _wrap(value: Any) -> Any:
    from redis.asyncio.client import Pipeline, PubSub

    return _Green(value) if isinstance(value, (Pipeline, PubSub)) else value


class GreenRedis(_Green):
    """What the sync API is given as its ``connection``: a ``redis.asyncio`` client seen as a sync one."""
