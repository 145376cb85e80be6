"""Publishing a streamed model call for watchers (``agentpool.store.live``), at next to no cost.

The model adapter hands every block start and delta to a ``LiveOutput``. While nobody watches, that is
an append to a string and, about once a second, one EXISTS (whether a watcher arrived); nothing is
written. Once somebody watches, deltas are coalesced and written at most every ``INTERVAL`` seconds:
one pipelined round trip carries everything since the last write (a quiet stream is written at once;
a burst goes out as one write, the rest of it from the per-process flusher thread a little later). A
watcher that arrived mid-call gets the call's text so far first. Publishing never fails a call: a Redis
error turns it off for the rest of the call.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from typing import Any

from redis import Redis
from redis.exceptions import RedisError

from agentpool.runtime.faults import fault
from agentpool.store import live
from agentpool.store.keys import RunKeys

log = logging.getLogger("agentpool.live")

INTERVAL = 0.025  # seconds between writes while watched: coalesced deltas reach a watcher within this
RECHECK = 1.0  # seconds between looks for a watcher while nobody watches (and for one leaving)


class LiveOutput:
    """One model call's output, published while somebody watches the run."""

    def __init__(self, r: Redis, keys: RunKeys, *, turn: int, watched: bool, purpose: str = "reply") -> None:
        self.r, self.keys, self.turn, self.purpose = r, keys, turn, purpose
        self.call = f"{turn}-{secrets.token_hex(4)}"
        self.watched = watched
        self._started = False  # the stream was reset and the call announced
        self._blocks: dict[int, dict[str, Any]] = {}  # index -> type, name, text so far (for a late watcher)
        self._pending: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._last_write = 0.0
        self._next_look = time.monotonic() + RECHECK
        self._off = False
        self._first_delta = True

    # -- what the model adapter calls ------------------------------------------------------------

    def block_start(self, index: int, block: str, name: str | None = None) -> None:
        self._blocks[index] = {"block": block, "name": name, "text": []}
        self._add({"kind": "block_start", "index": index, "block": block, "name": name})

    def delta(self, index: int, kind: str, text: str) -> None:
        """``kind`` is ``text_delta``, ``thinking_delta`` or ``input_json_delta``."""
        if self._first_delta:
            self._first_delta = False
            fault("mid_stream", self.keys.run_id, self.turn)  # the call is streaming; nothing is saved yet
        block = self._blocks.setdefault(index, {"block": "text", "name": None, "text": []})
        block["text"].append(text)
        self._add({"kind": kind, "index": index, "text": text, "name": block["name"]})

    def close(self, outcome: str) -> None:
        """The call ended (``complete``, or how it was cut); the last deltas go out now."""
        if self.watched and not self._off:
            with self._lock:
                self._pending.append({"kind": "call_end", "outcome": outcome})
            self.flush()
        _flusher.forget(self)

    # -- publishing -------------------------------------------------------------------------------

    def _add(self, entry: dict[str, Any]) -> None:
        if self._off:
            return
        now = time.monotonic()
        if now >= self._next_look:
            self._next_look = now + RECHECK
            if self._look():  # a watcher arrived: the snapshot holds this entry already
                self.flush()
                return
        if not self.watched:
            return
        with self._lock:
            last = self._pending[-1] if self._pending else None
            if last and entry.get("text") and last["kind"] == entry["kind"] and last.get("index") == entry["index"]:
                last["text"] += entry["text"]
            else:
                self._pending.append(entry)
        if now - self._last_write >= INTERVAL:
            self.flush()
        else:
            _flusher.wake(self)

    def _look(self) -> bool:
        """Whether somebody watches; True when a watcher just arrived (the call so far is then pending)."""
        try:
            watched = live.is_watched(self.r, self.keys)
        except RedisError as exc:
            self._disable(exc)
            return False
        arrived = watched and not self.watched
        if arrived:
            with self._lock:
                self._pending = self._snapshot()
                self._started = False
        self.watched = watched
        return arrived

    def _snapshot(self) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = []
        for index, block in sorted(self._blocks.items()):
            entries.append({"kind": "block_start", "index": index, "block": block["block"], "name": block["name"]})
            text = "".join(block["text"])
            if text:
                kind = {"thinking": "thinking_delta", "tool_use": "input_json_delta"}.get(block["block"], "text_delta")
                entries.append({"kind": kind, "index": index, "text": text, "name": block["name"]})
        return entries

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            if not pending or self._off:
                return
            reset = not self._started
            if reset:
                pending.insert(0, {"kind": "call_start", "purpose": self.purpose})
            try:
                with self.r.pipeline(transaction=False) as pipe:
                    common = {"turn": self.turn, "call": self.call}
                    live.stage_entries(pipe, self.keys, [{**common, **e} for e in pending], reset=reset)
                    pipe.execute()
            except RedisError as exc:
                self._disable(exc)
                return
            self._started = True
            self._last_write = time.monotonic()

    def _disable(self, exc: Exception) -> None:
        log.debug("run %s: live output off for this call: %s", self.keys.run_id, exc)
        self._off = True


class _Flusher:
    """One thread per process writes the deltas a burst left waiting, every ``INTERVAL``."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._waiting: set[LiveOutput] = set()
        self._event = threading.Event()
        self._thread: threading.Thread | None = None

    def wake(self, output: LiveOutput) -> None:
        with self._lock:
            self._waiting.add(output)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="agentpool-live", daemon=True)
                self._thread.start()
        self._event.set()

    def forget(self, output: LiveOutput) -> None:
        with self._lock:
            self._waiting.discard(output)

    def _run(self) -> None:
        while True:
            self._event.wait()
            time.sleep(INTERVAL)
            with self._lock:
                due, self._waiting = self._waiting, set()
                self._event.clear()
            for output in due:
                output.flush()


_flusher = _Flusher()
