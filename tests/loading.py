"""A private Redis caught while it loads its dataset: every command but a few is answered ``LOADING``.

``--key-load-delay`` slows the load per key (in µs) and ``--loading-process-events-interval-bytes``
keeps the server answering meanwhile, the way Redis's own test suite holds a server in that state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_lockguard.testing import RedisServer, wait_for


@contextmanager
def loading_server(keys: int = 3000, delay_us: int = 1000) -> Iterator[tuple[RedisServer, Callable[[], None]]]:
    """Yield ``(server, finish)`` once the server answers ``LOADING``; ``finish()`` waits for the load to end.

    The load takes about ``keys * delay_us`` µs from the restart (3 s by default). Without ``finish()``
    the server is killed on exit, still loading: a test that only needs the window waits for nothing.
    """
    server = RedisServer(extra=["--key-load-delay", str(delay_us), "--loading-process-events-interval-bytes", "1024"])
    server.start()
    failed: list[BaseException] = []

    def restart() -> None:
        try:
            server.start(timeout=60)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread, which re-raises it
            failed.append(exc)

    def finish() -> None:
        starting.join(60)
        if failed:
            raise failed[0]
        if starting.is_alive():
            raise AssertionError("the loading server did not finish its load within 60 s")

    try:
        c = server.client()
        c.mset({f"fill:{i}": "x" * 1000 for i in range(keys)})
        c.save()
        server.stop()
        starting = threading.Thread(target=restart, daemon=True)
        starting.start()

        def loading() -> bool:
            if failed:
                raise failed[0]  # the restart itself failed: say why, not "no LOADING reply"
            try:
                server.client(socket_timeout=1, retry=Retry(NoBackoff(), 0)).get("fill:1")
            except redis.exceptions.BusyLoadingError:
                return True
            except redis.exceptions.ConnectionError:
                pass  # not listening yet
            return False

        wait_for(loading, 30, interval=0.01, what="a LOADING reply")
        yield server, finish
    finally:
        server.close()
