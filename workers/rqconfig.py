"""RQ's own CLI on agentpool's ``REDIS_URL``, Sentinel included: ``rq info -c agentpool.rqconfig``.

RQ reads the UPPERCASE names of a settings module given with ``-c`` (``rq.cli.helpers.read_config_file``,
RQ 3.0): ``REDIS_URL`` for a plain URL, or a ``SENTINEL`` dict (``INSTANCES``, ``MASTER_NAME``, ``DB``,
``USERNAME``, ``PASSWORD``, ``SSL``, ``SOCKET_TIMEOUT``, ``SENTINEL_KWARGS``), which it turns into
``Sentinel(...).master_for(...)``. Without ``-c``, RQ would hand a ``redis+sentinel://`` URL to
``Redis.from_url``, which does not know the scheme.
"""

from __future__ import annotations

import os

from agentpool.runtime import connections, sentinel
from agentpool.runtime.settings import DEFAULT_REDIS_URL, check_redis_url

_url = check_redis_url(os.environ.get("REDIS_URL", DEFAULT_REDIS_URL), subject="REDIS_URL")
if sentinel.is_sentinel(_url):
    # A socket timeout, so that `rq info` gives up on a primary gone silent (agentpool.runtime.connections).
    SENTINEL = sentinel.rq_settings(_url, socket_timeout=connections.socket_timeout())
else:
    REDIS_URL = _url
