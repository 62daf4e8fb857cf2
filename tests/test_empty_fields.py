"""A ``None`` or empty key field is refused at publish in every mode (issue 29 item 6), not only in the queue-time ones.

The model of crossing features (tests/test_model_crossings.py) found it: ``lock_mode="while_running"`` (the
default) and ``lock_limit`` tasks rendered their keys only at delivery, so ``apply_async((None,))`` was accepted,
queued, and failed later in a worker with ``EmptyField``; the queue-time modes and ``lock_debounce`` refused it
at publish. The real publish path, on the real Redis broker.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis

from celery_lockguard import EmptyField, LockedTask

from .tracer import make_app

OPTIONS = [
    pytest.param({}, id="while_running"),
    pytest.param({"lock_limit": 2}, id="lock_limit"),
    pytest.param({"lock_rate": "5/1s"}, id="lock_rate"),
    pytest.param({"idempotency_key": "pay:{a}", "lock_key": None}, id="idempotency_key"),
    pytest.param({"lock_mode": "until_done"}, id="until_done"),
    pytest.param({"lock_key": ("e:{a}", "f:{a}")}, id="several_entities"),
]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("value", [None, ""])
def test_a_none_or_empty_key_field_is_refused_at_publish_and_nothing_is_sent(
    options: dict[str, Any], value: Any, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    app = make_app("empty-fields", redis_url, prefix, lockguard_redis_url=redis_url)
    conf = {"lock_key": "e:{a}", **options}

    @app.task(base=LockedTask, shared=False, name="ef.task", **conf)
    def task(a: Any) -> Any:
        return a

    with pytest.raises(EmptyField, match=r"task 'ef\.task'.*field \{a\}"):
        task.apply_async((value,))
    assert r.llen(f"{prefix}:kombu:{app.conf.task_default_queue}") == 0, "the refused call was queued anyway"
    assert task.apply_async((1,)).id  # a call with its field set is published as before
