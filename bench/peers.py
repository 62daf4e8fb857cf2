"""The peers as the benchmark runs them: the one adaptation they need, and the lock users write by hand.

celery-once (``celery_once.backends.redis.redis``) and celery-singleton
(``celery_singleton.backends._backend``) cache one Redis client per
*process* in a module global at first use, whatever URL a later app
configures. An application with one Redis never notices; the benchmark does,
because each section builds its app against its own private server. So
:func:`forget_clients` drops those caches before an app is built. Their lock
logic is used unchanged.

:func:`by_hand` is the lock written before any library: ``SET NX PX`` with a
random token around the body, then ``DEL``. No owner check, fence or record:
the floors of the worker table and the breakdown both run it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def forget_clients() -> None:
    """Drop celery-once's and celery-singleton's process-wide cached clients."""
    import celery_once.backends.redis as once_redis
    import celery_singleton.backends as singleton_backends

    once_redis.redis = None
    singleton_backends._backend = None


@contextmanager
def by_hand(client: Any, key: str) -> Iterator[None]:
    """Hold ``key`` by ``SET NX PX`` (uuid4 token, 30 s) around the block, ``DEL`` it after; held raises."""
    if not client.set(key, uuid.uuid4().hex, nx=True, px=30_000):
        raise RuntimeError(f"{key} is held: the benchmark's keys are distinct")
    try:
        yield
    finally:
        client.delete(key)
