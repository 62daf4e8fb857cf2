"""The one adaptation the peers need here, and why.

celery-once (``celery_once.backends.redis.redis``) and celery-singleton
(``celery_singleton.backends._backend``) cache one Redis client per
*process* in a module global at first use, whatever URL a later app
configures. An application with one Redis never notices; the benchmark does,
because each section builds its app against its own private server. So
:func:`forget_clients` drops those caches before an app is built. Their lock
logic is used unchanged.
"""

from __future__ import annotations


def forget_clients() -> None:
    """Drop celery-once's and celery-singleton's process-wide cached clients."""
    import celery_once.backends.redis as once_redis
    import celery_singleton.backends as singleton_backends

    once_redis.redis = None
    singleton_backends._backend = None
