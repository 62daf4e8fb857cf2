"""The Celery app ``bench.ops`` runs ``celery lockguard locks`` and ``exporter`` against: settings from the env.

``LG_OPS_CONFIG`` is JSON: ``url`` (the private lock Redis) and ``prefix``. No task is defined: the
operator commands read only the lock Redis.
"""

from __future__ import annotations

import json
import os

from celery import Celery

_cfg = json.loads(os.environ.get("LG_OPS_CONFIG", '{"url": "redis://127.0.0.1:6379/0", "prefix": "ops"}'))
app = Celery("opsapp", broker=_cfg["url"])
app.conf.update(
    lockguard_redis_url=_cfg["url"],
    lockguard_key_prefix=_cfg["prefix"],
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)
