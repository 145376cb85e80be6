"""pytest fixtures for testing your agents on a real local pool. Opt in from a ``conftest.py``::

    pytest_plugins = ["agentpool.testing.pytest_plugin"]

    def test_support_answers(agentpool_pool):
        run = agentpool_pool.run("myapp.agents:support", "Where is order A-17?",
                                 script=[{"text": "It ships today."}])
        assert run.status == "completed" and run.result == "It ships today."

- ``agentpool_pool``: a started :class:`~agentpool.testing.LocalPool` for one test, with one worker
  process (``start_workers`` adds more) importing agents from the current directory;
- ``agentpool_model``: the scripted Messages API, one per session, reset before each test;
- ``agentpool_redis_url``: a throwaway redis-server, one per session, flushed before each test.

Nothing here is loaded unless a conftest asks for it (no entry point): installing agentpool changes
no one's test session.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from redis import Redis

from agentpool.testing.localpool import RedisNotInstalled, RedisServer
from agentpool.testing.pool import LocalPool
from agentpool.testing.scripted_model import ScriptedModel


@pytest.fixture(scope="session")
def agentpool_redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    try:
        server = RedisServer(tmp_path_factory.mktemp("agentpool-redis")).start()
    except RedisNotInstalled as exc:
        pytest.fail(str(exc))
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def agentpool_model() -> Iterator[ScriptedModel]:
    model = ScriptedModel().start()
    yield model
    model.stop()


@pytest.fixture
def agentpool_pool(agentpool_redis_url: str, agentpool_model: ScriptedModel) -> Iterator[LocalPool]:
    client = Redis.from_url(agentpool_redis_url)
    try:
        # A worker SIGKILLed by the previous test may still be blocked in a dequeue for a moment; a job
        # pushed then would go to the dead client.
        deadline = time.monotonic() + 10
        while client.info("clients")["blocked_clients"] and time.monotonic() < deadline:
            time.sleep(0.05)
        client.flushall()
    finally:
        client.close()
    agentpool_model.reset()
    agentpool_model.set_scripts({})
    with LocalPool(redis_url=agentpool_redis_url, model=agentpool_model) as pool:
        yield pool
