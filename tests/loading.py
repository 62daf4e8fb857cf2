"""A private Redis caught while it loads its dataset: every command but a few is answered ``LOADING``.

``--key-load-delay`` slows the load per key (in µs) and ``--loading-process-events-interval-bytes``
keeps the server answering meanwhile, the way Redis's own test suite holds a server in that state.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_lockguard.testing import RedisServer, wait_for


@contextmanager
def loading_server(keys: int = 3000, delay_us: int = 1000) -> Iterator[tuple[RedisServer, threading.Thread]]:
    """Yield ``(server, starting)`` once the server answers ``LOADING``; ``starting.join()`` waits for the load.

    The load takes about ``keys * delay_us`` µs from the restart (3 s by default).
    """
    server = RedisServer(extra=["--key-load-delay", str(delay_us), "--loading-process-events-interval-bytes", "1024"])
    server.start()
    try:
        c = server.client()
        c.mset({f"fill:{i}": "x" * 1000 for i in range(keys)})
        c.save()
        server.stop()
        starting = threading.Thread(target=server.start, kwargs={"timeout": 60}, daemon=True)
        starting.start()

        def loading() -> bool:
            try:
                server.client(socket_timeout=1, retry=Retry(NoBackoff(), 0)).get("fill:1")
            except redis.exceptions.BusyLoadingError:
                return True
            except redis.exceptions.ConnectionError:
                pass  # not listening yet
            return False

        wait_for(loading, 30, interval=0.01, what="a LOADING reply")
        yield server, starting
        starting.join(60)
    finally:
        server.close()
