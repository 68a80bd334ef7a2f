import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def redis_server():
    """A real ``redis-server`` for one test (skips where none is installed, fails under TIERED_KV_REQUIRE_REDIS)."""
    from tierutil import RedisServer  # imported here: tierutil needs torch, which most tests never load

    server = RedisServer()
    yield server
    server.stop()
