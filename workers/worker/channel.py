"""A worker's command channel (RQ's ``rq:pubsub:<worker>``, for ``rq``'s stop commands), closed without
waiting up to a minute.

RQ 3's ``unsubscribe`` unsubscribes, then stops the channel's thread. With redis-py 8 that stop waits
for the thread (``PubSubWorkerThread.stop`` joins), and the thread, which saw the unsubscribe land
before the stop, is by then waiting up to RQ's ``sleep_time`` (60 s) for a subscription that will
never come (``PubSub.get_message``): a warm shutdown took up to a minute after its last turn, under
load often (seen in the rolling-deploy and honcho tests, a worker's stack dumped while it waited).
Here the thread is told to stop first, then the unsubscribe's reply wakes it and it ends.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("agentpool.worker")


class QuickUnsubscribe:
    """Mixin for RQ worker classes (before the RQ class in the bases)."""

    pubsub: Any
    pubsub_thread: Any
    name: str

    def unsubscribe(self) -> None:
        thread = getattr(self, "pubsub_thread", None)
        if not thread:
            return
        try:
            thread.stop(timeout=0)  # the flag, at once (redis-py 8 would join without a timeout)
        except TypeError:  # redis-py before 8: stop() only clears the flag
            thread.stop()
        try:
            self.pubsub.unsubscribe()  # its reply ends the thread's wait for a message
        except Exception as exc:  # noqa: BLE001 - a lost connection ends the thread as well
            log.debug("worker %s: unsubscribe: %s", self.name, exc)
        thread.join(timeout=1)
        self.pubsub.close()
