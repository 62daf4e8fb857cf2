"""Options and settings: validated before any body runs, with names in every error."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_lockguard import ConfigurationError, LockedTask
from celery_lockguard.config import settings


def make(broker: str = "redis://127.0.0.1:6379/0", **conf: Any) -> Celery:
    app = Celery("cfgtest", broker=broker, set_as_current=False)
    app.conf.update(conf)
    return app


@pytest.mark.parametrize(
    ("option", "value", "needle"),
    [
        ("lock_ttl", 0, "lock_ttl=0"),
        ("lock_ttl", -1, "lock_ttl=-1"),
        ("on_locked", "sometimes", "on_locked='sometimes'"),
        ("on_unavailable", "shrug", "on_unavailable='shrug'"),
        ("lock_mode", "forever", "lock_mode='forever'"),
        ("lock_key", "inv:{missing}", "unknown field {missing}"),
        ("lock_max_hold", 0, "lock_max_hold=0"),
        ("lock_max_waits", -2, "lock_max_waits=-2"),
        ("completion_ttl", "soon", "completion_ttl='soon'"),
        ("lock_renew", "yes", "lock_renew='yes'"),
    ],
)
def test_bad_option_raises_before_the_body(option: str, value: Any, needle: str) -> None:
    app = make()
    ran = []
    opts = {"lock_key": "inv:{invoice_id}", option: value}

    @app.task(base=LockedTask, bind=True, shared=False, name="billing.charge", **opts)
    def charge(self: Any, invoice_id: int) -> None:
        ran.append(invoice_id)

    with pytest.raises(ConfigurationError) as err:
        charge.apply(args=(1,), throw=True)
    assert "billing.charge" in str(err.value) and needle in str(err.value) and option in str(err.value)
    assert ran == []


def test_template_from_settings_by_task_name() -> None:
    app = make(lockguard_keys={"billing.sync_tenant": "tenant:{tenant_id}:sync"})

    @app.task(base=LockedTask, shared=False, name="billing.sync_tenant")
    def sync_tenant(tenant_id: str) -> None: ...

    assert sync_tenant.lock_key_for("alpha") == "tenant:alpha:sync"


def test_django_style_namespace() -> None:
    class Conf:
        CELERY_BROKER_URL = "redis://127.0.0.1:6379/3"
        CELERY_LOCKGUARD_KEY_PREFIX = "djangoish"
        CELERY_LOCKGUARD_DEFAULT_TTL = 12

    app = Celery("ns", set_as_current=False)
    app.config_from_object(Conf, namespace="CELERY")
    s = settings(app)
    assert s.key_prefix == "djangoish" and s.default_ttl == 12
    assert s.redis_url == "redis://127.0.0.1:6379/3"


def test_redis_url_defaults_only_to_a_redis_broker() -> None:
    assert settings(make("rediss://h:6380/1")).redis_url == "rediss://h:6380/1"
    app = make("amqp://guest:guest@127.0.0.1:5672//")
    assert settings(app).redis_url is None

    @app.task(base=LockedTask, shared=False, name="t.x", lock_key="k:{a}")
    def x(a: int) -> None: ...

    with pytest.raises(ConfigurationError, match="lockguard_redis_url is required"):
        x.apply(args=(1,), throw=True)


@pytest.mark.parametrize(
    ("name", "value"),
    [("on_locked", "nope"), ("on_unavailable", "nope"), ("default_ttl", 0), ("key_prefix", "a{b"), ("keys", [1])],
)
def test_bad_settings_name_the_setting(name: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=f"lockguard_{name}"):
        settings(make(**{f"lockguard_{name}": value}))


def test_callable_lock_key_receives_the_task_arguments_only() -> None:
    app = make()

    def key_of(tenant_id: str, full: bool = False) -> str:
        return f"tenant:{tenant_id}:{'full' if full else 'delta'}"

    @app.task(base=LockedTask, bind=True, shared=False, name="t.cb", lock_key=key_of)
    def sync(self: Any, tenant_id: str, full: bool = False) -> None: ...

    assert sync.lock_key_for("alpha", full=True) == "tenant:alpha:full"
