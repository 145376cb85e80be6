"""Wall-clock milliseconds, the unit of every deadline and lease in Redis."""

import time


def now_ms() -> int:
    return int(time.time() * 1000)
