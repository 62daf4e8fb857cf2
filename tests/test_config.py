"""Options and settings: validated before any body runs, with names in every error."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_lockguard import ConfigurationError, LockedTask
from celery_lockguard._config import settings


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
        ("lock_debounce", 0, "lock_debounce=0"),
        ("lock_debounce", -5, "lock_debounce=-5"),
        ("lock_debounce", "soon", "lock_debounce='soon'"),
        ("lock_debounce", float("inf"), "lock_debounce=inf"),
        ("lock_limit", 0, "lock_limit=0"),
        ("lock_limit", 2.5, "lock_limit=2.5"),
        ("lock_limit", True, "lock_limit=True"),
        ("lock_limit", 100_000, "lock_limit=100000"),
        ("lock_rate", "100/min", "lock_rate='100/min'"),
        ("lock_rate", "0/s", "lock_rate='0/s'"),
        ("lock_rate", "5", "lock_rate='5'"),
        ("lock_rate", "/m", "lock_rate='/m'"),
        ("lock_rate", "5/0s", "lock_rate='5/0s'"),
        ("lock_rate", 5, "lock_rate=5"),
        ("lock_rate", "-1/s", "lock_rate='-1/s'"),
        # a window Redis cannot take (PEXPIRE of ~1e26 ms): every start failed, with a negative countdown
        ("lock_rate", "1/99999999999999999999h", "lock_rate='1/99999999999999999999h'"),
        ("lock_rate", "1/8785h", "lock_rate='1/8785h'"),  # one hour over 366 days
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


# -- durations below one millisecond ----------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("lock_ttl", 0.0005),
        ("queue_lock_ttl", 0.0009),
        ("lock_max_hold", 0.0001),
        ("completion_ttl", 0.0004),
        ("completion_ttl", 0),  # was taken for "unset" and silently became the default
        ("lock_ttl", float("inf")),
        ("completion_ttl", float("nan")),
    ],
)
def test_a_duration_below_one_millisecond_is_refused(
    redis_url: str, prefix: str, r: Any, option: str, value: float
) -> None:
    app = make(redis_url, lockguard_key_prefix=prefix)
    ran = []
    opts = {"lock_key": "inv:{invoice_id}", "lock_mode": "until_done", option: value}

    @app.task(base=LockedTask, bind=True, shared=False, name="billing.charge", **opts)
    def charge(self: Any, invoice_id: int) -> None:
        ran.append(invoice_id)

    with pytest.raises(ConfigurationError) as err:
        charge.apply_async(args=(1,))  # the queue claim would carry PX 0
    with pytest.raises(ConfigurationError):
        charge.apply(args=(1,), throw=True)
    msg = str(err.value)
    assert "billing.charge" in msg and f"{option}={value!r}" in msg and ">= 0.001" in msg
    assert ran == [] and not list(r.scan_iter(match=f"{prefix}:*"))


@pytest.mark.parametrize("name", ["default_ttl", "completion_ttl", "shorten_grace", "fence_ttl", "socket_timeout"])
def test_a_duration_setting_below_one_millisecond_is_refused(name: str) -> None:
    with pytest.raises(ConfigurationError, match=rf"lockguard_{name}=0\.0005 must be .*>= 0\.001"):
        settings(make(**{f"lockguard_{name}": 0.0005}))
    assert settings(make(**{f"lockguard_{name}": 0.001})) is not None


# -- misspelled options -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "nearest"),
    [
        ("lock_tll", 5, "lock_ttl"),
        ("on_lockd", "raise", "on_locked"),
        ("lockkey", "customer:{customer_id}", "lock_key"),
        ("Lock_Key", "customer:{customer_id}", "lock_key"),
        ("idempotency", "charge:{customer_id}", "idempotency_key"),
        ("completon_ttl", 60, "completion_ttl"),
        ("queue_lock_tl", 60, "queue_lock_ttl"),
        ("lock_timeout", 60, "lock_ttl"),
        ("on_unavailible", "fail_open", "on_unavailable"),
        ("lok_mode", "until_done", "lock_mode"),
    ],
)
def test_a_misspelled_option_is_refused_with_the_nearest_known_one(
    redis_url: str, prefix: str, r: Any, option: str, value: Any, nearest: str
) -> None:
    app = make(redis_url, lockguard_key_prefix=prefix)
    ran = []

    @app.task(base=LockedTask, bind=True, shared=False, name="payments.charge", **{option: value})
    def charge(self: Any, customer_id: int) -> None:
        ran.append(customer_id)

    with pytest.raises(ConfigurationError) as err:
        charge.apply(args=(42,), throw=True)
    msg = str(err.value)
    assert "payments.charge" in msg and f"unknown option {option}=" in msg and f"did you mean {nearest}?" in msg
    assert ran == [] and not list(r.scan_iter(match=f"{prefix}:*"))


def test_celery_options_hooks_and_a_subclass_own_methods_are_not_flagged(redis_url: str, prefix: str) -> None:
    app = make(redis_url, lockguard_key_prefix=prefix)

    def hook(*args: Any, **kwargs: Any) -> None: ...

    class BillingTask(LockedTask):
        tenant_header = "x-tenant"  # the user's own data attribute: nothing like ours

        def on_lock_lost(self) -> None:  # a method of the user's own subclass
            ...

        def lock_helper(self) -> str:
            return "h"

        @property
        def locked_resource(self) -> str:
            return "r"

    @app.task(
        base=BillingTask,
        bind=True,
        shared=False,
        name="billing.ok",
        lock_key="inv:{a}",
        lock_ttl=5,
        on_failure=hook,
        on_success=hook,
        on_retry=hook,
        after_return=hook,
        acks_late=True,
        autoretry_for=(ValueError,),
        retry_kwargs={"max_retries": 1},
        retry_backoff=True,
        my_custom_flag=True,
        rate_limit="10/s",
    )
    def ok(self: Any, a: int) -> str:
        return "ran"

    assert ok.lockguard_options.ttl == 5
    assert ok.apply(args=(1,), throw=True).get() == "ran"

    class BadBase(LockedTask):
        lock_tll = 5  # a data attribute of a subclass is an option, misspelled or not

    @app.task(base=BadBase, bind=True, shared=False, name="billing.bad_base", lock_key="inv:{a}")
    def bad(self: Any, a: int) -> None: ...

    with pytest.raises(ConfigurationError, match="unknown option lock_tll=5; did you mean lock_ttl"):
        bad.apply(args=(1,), throw=True)


# -- validated at start --------------------------------------------------------------------------


def test_validate_tasks_raises_the_first_bad_task_and_caches_nothing(redis_url: str, prefix: str) -> None:
    from celery_lockguard._config import validate_tasks

    app = make(redis_url, lockguard_key_prefix=prefix)

    @app.task(base=LockedTask, shared=False, name="a.good", lock_key="k:{a}")
    def good(a: int) -> None: ...

    validate_tasks(app)
    assert "_lockguard_settings" not in app.__dict__  # settings stay read at first use
    app.conf.lockguard_default_ttl = 7
    assert good.lockguard_options.ttl == 7

    @app.task(base=LockedTask, shared=False, name="b.bad", lock_key="k:{a}", lock_tll=5)
    def bad(a: int) -> None: ...

    with pytest.raises(ConfigurationError, match=r"'b\.bad': unknown option lock_tll"):
        validate_tasks(app)


def test_the_shared_worker_app_and_the_example_app_validate(redis_url: str, prefix: str) -> None:
    from celery_lockguard._config import validate_tasks
    from example_app.celery_app import app as example

    from .conftest import make_cfg
    from .workerapp import create_app

    validate_tasks(create_app(make_cfg(prefix, redis_url)))
    __import__("example_app.tasks")
    validate_tasks(example)


def test_finalize_logs_a_bad_task_and_a_task_defined_later_fails_at_first_use(redis_url: str, prefix: str) -> None:
    from structlog.testing import capture_logs

    from celery_lockguard import _signals as signals

    app = make(redis_url, lockguard_key_prefix=prefix)
    signals.install(app)  # what LockedTask.on_bound does with its app

    @app.task(base=LockedTask, shared=False, name="c.bad", lock_key="k:{a}", on_lockd="raise")
    def bad(a: int) -> None: ...

    with capture_logs() as logs:
        app.finalize()  # never raises: finalizing happens wherever the app is first touched
    errors = [e for e in logs if e["event"] == "lock.configuration_error"]
    assert errors and "'c.bad': unknown option on_lockd" in errors[0]["reason"]
    assert errors[0]["log_level"] == "error"

    @app.task(base=LockedTask, shared=False, name="c.later", lock_key="k:{a}", lock_ttl=0.0001)
    def later(a: int) -> None: ...

    with pytest.raises(ConfigurationError, match=r"'c\.later': option lock_ttl=0\.0001"):
        later.apply(args=(1,), throw=True)


BAD_APP = """
from celery import Celery

from celery_lockguard import LockedTask

app = Celery("badapp", broker={broker!r})
app.conf.update(
    lockguard_key_prefix={prefix!r},
    broker_transport_options={{"global_keyprefix": {prefix!r} + ":kombu:"}},
    broker_connection_retry_on_startup=False,
    worker_hijack_root_logger=False,
)


@app.task(base=LockedTask, name="payments.charge", lock_key="customer:{{customer_id}}")
def charge(customer_id):
    return customer_id


@app.task(base=LockedTask, name="payments.refund", lockkey="customer:{{customer_id}}")
def refund(customer_id):
    return customer_id
"""


@pytest.mark.integration
@pytest.mark.parametrize(
    ("typo", "needles"),
    [
        ("option", ("'payments.refund': unknown option lockkey=", "did you mean lock_key?")),
        ("setting", ("setting lockguard_default_tll is not a LockGuard", "did you mean lockguard_default_ttl?")),
    ],
)
def test_a_worker_with_a_misspelled_option_or_setting_refuses_to_start(
    redis_url: str, prefix: str, tmp_path: Any, typo: str, needles: tuple[str, ...]
) -> None:
    """Issue 29 item 8: ``lockguard_default_tll=5`` started the worker silently with the 30 s default."""
    import subprocess
    import sys

    from .harness import ROOT

    app_text = BAD_APP.format(broker=redis_url, prefix=prefix)
    if typo == "setting":
        app_text = app_text.replace('lockkey="customer', 'lock_key="customer').replace(
            "worker_hijack_root_logger=False,", "worker_hijack_root_logger=False,\n    lockguard_default_tll=5,"
        )
    (tmp_path / "badapp.py").write_text(app_text)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "badapp:app",
            "worker",
            "-P",
            "solo",
            "-Q",
            f"{prefix}-q",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ],
        cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 78, out
    assert "refusing to start the worker" in out
    assert all(needle in out for needle in needles), out
    assert "ready." not in out  # never consumed a message


@pytest.mark.parametrize("prefix", ["*", "lg*", "lg?", "lg[ab]", "lg\\x", "a b", "lg\x1b", ""])
def test_a_key_prefix_with_glob_characters_is_refused(prefix: str) -> None:
    # "*" made `lockguard locks` SCAN MATCH "*:v1:{*}:lock": every other prefix's leases, listed as this app's.
    with pytest.raises(ConfigurationError, match="lockguard_key_prefix"):
        settings(make(lockguard_key_prefix=prefix))


@pytest.mark.parametrize("table", ["lockguard_fences\n", "a\n", "s.t\n", "t;drop", "1t"])
def test_a_table_name_with_a_trailing_newline_is_no_identifier(table: str) -> None:
    # `$` matches before a trailing newline: "lockguard_fences\n" passed the check and reached the SQL text.
    from celery_lockguard._completion import PostgresStore
    from celery_lockguard.fencing import fence_table_sql

    with pytest.raises(ConfigurationError, match="lockguard_fence_table"):
        settings(make(lockguard_fence_table=table))
    with pytest.raises(ValueError, match="plain SQL identifier"):
        PostgresStore("postgresql://h/db", table)
    with pytest.raises(ValueError, match="plain SQL identifier"):
        fence_table_sql(table)


def test_a_mistyped_completion_dsn_is_refused_without_its_password() -> None:
    with pytest.raises(ConfigurationError, match="lockguard_completion_backend") as err:
        settings(make(lockguard_completion_backend="postgressql://app:hunter2@db.internal/billing"))
    assert "hunter2" not in str(err.value) and "postgressql://app:***@db.internal/billing" in str(err.value)


@pytest.mark.parametrize(
    ("text", "count", "window_ms"),
    [
        ("100/m", 100, 60_000),
        ("5/s", 5, 1000),
        ("7/h", 7, 3_600_000),
        (" 10 / 30s ", 10, 30_000),
        ("1/2m", 1, 120_000),
        ("1/8784h", 1, 366 * 86_400_000),
    ],
)
def test_lock_rate_parses_n_per_period(text: str, count: int, window_ms: int) -> None:
    from celery_lockguard._config import parse_rate

    rate = parse_rate(text, "x")
    assert rate is not None and (rate.count, rate.window_ms) == (count, window_ms)


def test_lock_limit_and_rate_fall_back_to_their_settings_and_default_to_the_single_lease() -> None:
    app = make(lockguard_lock_limit=4, lockguard_lock_rate="10/s")

    @app.task(base=LockedTask, bind=True, shared=False, name="t.limited", lock_key="k:{x}")
    def limited(self: Any, x: int) -> None: ...

    @app.task(base=LockedTask, bind=True, shared=False, name="t.own", lock_key="k:{x}", lock_limit=2, lock_rate="1/m")
    def own(self: Any, x: int) -> None: ...

    assert (limited.lockguard_options.limit, limited.lockguard_options.rate.window_ms) == (4, 1000)  # type: ignore[union-attr]
    assert (own.lockguard_options.limit, own.lockguard_options.rate.count) == (2, 1)  # type: ignore[union-attr]
    plain = make()

    @plain.task(base=LockedTask, bind=True, shared=False, name="t.plain", lock_key="k:{x}")
    def single(self: Any, x: int) -> None: ...

    opts = single.lockguard_options
    assert opts.limit == 1 and opts.rate is None and not opts.slotted


def test_a_bad_lock_rate_setting_names_the_setting() -> None:
    app = make(lockguard_lock_rate="lots")

    @app.task(base=LockedTask, bind=True, shared=False, name="t.x", lock_key="k:{x}")
    def x(self: Any, x: int) -> None: ...

    with pytest.raises(ConfigurationError) as err:
        _ = x.lockguard_options
    assert "t.x" in str(err.value) and "setting lockguard_lock_rate='lots'" in str(err.value)


@pytest.mark.parametrize("mode", ["until_started", "until_done"])
@pytest.mark.parametrize("extra", [{"lock_limit": 2}, {"lock_rate": "5/s"}])
def test_limits_are_refused_with_queue_time_modes(mode: str, extra: dict[str, Any]) -> None:
    app = make()

    @app.task(base=LockedTask, bind=True, shared=False, name="t.q", lock_key="k:{x}", lock_mode=mode, **extra)
    def q(self: Any, x: int) -> None: ...

    with pytest.raises(ConfigurationError) as err:
        _ = q.lockguard_options
    assert "t.q" in str(err.value) and f"lock_mode={mode!r}" in str(err.value)


def test_debounce_from_the_setting_by_task_name_and_its_bad_values() -> None:
    app = make(lockguard_debounce={"search.reindex": 2.5})

    @app.task(base=LockedTask, shared=False, name="search.reindex", lock_key="doc:{doc_id}")
    def reindex(doc_id: int) -> None:
        pass

    @app.task(base=LockedTask, shared=False, name="search.other", lock_key="doc:{doc_id}")
    def other(doc_id: int) -> None:
        pass

    assert reindex.lockguard_options.debounce == 2.5 and other.lockguard_options.debounce is None
    for value, needle in ((["search.reindex"], "lockguard_debounce=['search.reindex']"),):
        with pytest.raises(ConfigurationError, match="lockguard_debounce") as err:
            settings(make(lockguard_debounce=value))
        assert needle in str(err.value)
    bad = make(lockguard_debounce={"search.reindex": 0})

    @bad.task(base=LockedTask, shared=False, name="search.reindex", lock_key="doc:{doc_id}")
    def reindex_bad(doc_id: int) -> None:
        pass

    with pytest.raises(ConfigurationError) as err2:
        _ = reindex_bad.lockguard_options
    assert "'search.reindex'" in str(err2.value) and "lock_debounce=0" in str(err2.value)


@pytest.mark.parametrize(
    ("opts", "needle"),
    [
        ({"lock_mode": "until_done", "lock_key": "doc:{doc_id}"}, "lock_mode='until_done'"),
        ({"lock_mode": "until_started", "lock_key": "doc:{doc_id}"}, "lock_mode='until_started'"),
        ({}, "needs a lock_key"),
        # An idempotency_key as the entity: the first burst's record would answer every later burst (review).
        ({"idempotency_key": "doc:{doc_id}"}, "needs a lock_key"),
        # A publish during a run is one more run after it: its delivery must wait, not raise (review).
        ({"lock_key": "doc:{doc_id}", "on_locked": "raise"}, "on_locked='raise' does not combine"),
        ({"lock_key": "doc:{doc_id}", "lock_limit": 2}, "does not combine with lock_limit"),
        ({"lock_key": "doc:{doc_id}", "lock_rate": "5/s"}, "does not combine with lock_limit or lock_rate"),
    ],
)
def test_debounce_needs_an_entity_and_the_while_running_mode(opts: dict[str, Any], needle: str) -> None:
    app = make()

    @app.task(base=LockedTask, shared=False, name="search.reindex", lock_debounce=1, **opts)
    def reindex(doc_id: int) -> None:
        pass

    with pytest.raises(ConfigurationError) as err:
        _ = reindex.lockguard_options
    assert "'search.reindex'" in str(err.value) and "lock_debounce=1" in str(err.value) and needle in str(err.value)


@pytest.mark.parametrize(
    ("conf", "needle"),
    [
        (
            {"lockguard_default_tll": 5},
            "lockguard_default_tll is not a LockGuard setting; did you mean lockguard_default_ttl?",
        ),
        (
            {"lockguard_completion_backed": "postgresql://u:s3cret@h/db"},
            "lockguard_completion_backed is not a LockGuard setting; did you mean lockguard_completion_backend?",
        ),
        ({"lockguard_on_lockd": "raise"}, "did you mean lockguard_on_locked?"),
        (
            {"LOCKGUARD_REDIS_URL": "redis://h/0"},
            "LOCKGUARD_REDIS_URL is not a LockGuard setting; did you mean lockguard_redis",
        ),
        ({"lockguard_Default_TTL": 5}, "did you mean lockguard_default_ttl?"),
    ],
)
def test_a_misspelled_setting_is_refused_with_the_nearest_known_one(conf: dict[str, Any], needle: str) -> None:
    """Issue 29 item 8: misspelled options were refused, misspelled settings kept their default silently.

    Refused where the settings are read (first use), by ``validate_tasks`` (worker start, even with no
    locked task) and reported by ``doctor``; the value is never quoted (a DSN carries a password).
    """
    from celery_lockguard import _doctor
    from celery_lockguard._config import validate_tasks

    app = make(**conf)
    with pytest.raises(ConfigurationError) as err:
        settings(app)
    assert needle in str(err.value) and "s3cret" not in str(err.value)
    with pytest.raises(ConfigurationError, match="is not a LockGuard setting"):
        validate_tasks(app)  # no LockGuard task at all: still refused

    @app.task(base=LockedTask, shared=False, name="c.charge", lock_key="k:{a}")
    def charge(a: int) -> None: ...

    with pytest.raises(ConfigurationError, match="is not a LockGuard setting"):
        validate_tasks(app)
    with pytest.raises(ConfigurationError, match="is not a LockGuard setting"):
        charge.apply(args=(1,), throw=True)
    findings = _doctor.run(app)
    assert [f.code for f in findings] == ["configuration"] and "is not a LockGuard setting" in findings[0].message


def test_a_misspelled_django_style_setting_is_refused() -> None:
    """``CELERY_LOCKGUARD_DEFAULT_TLL`` through ``config_from_object(..., namespace="CELERY")``; a project's own
    ``LOCKGUARD_*`` name (a Django settings module brings all of them) is left alone."""

    class DjangoSettings:
        CELERY_BROKER_URL = "redis://127.0.0.1:6379/0"
        CELERY_LOCKGUARD_DEFAULT_TTL = 12
        LOCKGUARD_PROJECT_FLAG = True

    app = Celery("djtypo", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    assert settings(app).default_ttl == 12

    class Typo(DjangoSettings):
        CELERY_LOCKGUARD_DEFAULT_TLL = 5

    app = Celery("djtypo", set_as_current=False)
    app.config_from_object(Typo, namespace="CELERY")
    with pytest.raises(
        ConfigurationError, match="_DEFAULT_TLL is not a LockGuard setting; did you mean CELERY_LOCKGUARD_DEFAULT_TTL"
    ):
        settings(app)


def test_every_setting_the_library_reads_is_a_known_setting() -> None:
    """A setting read but missing from ``KNOWN_SETTINGS`` would be refused as a typo when a user sets it."""
    import re
    from pathlib import Path

    from celery_lockguard._config import KNOWN_SETTINGS

    from .harness import ROOT

    read: set[str] = set()
    for folder in ("celery_lockguard", "bench", "chaos", "example_app", "tests"):
        for path in Path(ROOT, folder).rglob("*.py"):
            if path.name == "test_config.py":  # this file's typos are on purpose
                continue
            text = path.read_text()
            read.update(re.findall(r"\bsetting\([\w.]+,\s*\"(\w+)\"", text))
            read.update(n.lower() for n in re.findall(r"CELERY_LOCKGUARD_([A-Z_]+)\b", text))
            read.update(re.findall(r"\blockguard_(\w+)\s*=[^=]", text))  # conf.update(lockguard_x=...)
            read.update(re.findall(r"[\"']lockguard_(\w+)[\"']\s*:", text))  # {"lockguard_x": ...}
    section = Path(ROOT, "docs/reference.md").read_text().split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `lockguard_(\w+)` \|", section, re.M))
    assert read and documented
    assert documented == KNOWN_SETTINGS
    unknown = {n for n in read if n not in KNOWN_SETTINGS and n != "x" and not n.startswith(("test_", "template_"))}
    assert not unknown, unknown


@pytest.mark.parametrize(
    ("opts", "needle"),
    [
        ({"idempotency_key": "pay:{a}", "idempotency_namespace": ""}, "idempotency_namespace='' must be a name"),
        ({"idempotency_key": "pay:{a}", "idempotency_namespace": "pay:ments"}, "idempotency_namespace='pay:ments'"),
        ({"idempotency_key": "pay:{a}", "idempotency_namespace": "x" * 65}, "must be a name of 1-64"),
        ({"idempotency_key": "pay:{a}", "idempotency_namespace": 7}, "idempotency_namespace=7"),
        ({"lock_key": "k:{a}", "idempotency_namespace": "payments"}, "needs an idempotency_key"),
        ({"idempotency_key": "pay:{a}", "idempotency_namspace": "payments"}, "did you mean idempotency_namespace?"),
    ],
)
def test_a_bad_idempotency_namespace_names_the_task_and_the_value(opts: dict[str, Any], needle: str) -> None:
    app = make()

    @app.task(base=LockedTask, shared=False, name="pay.charge", **opts)
    def charge(a: int) -> None: ...

    with pytest.raises(ConfigurationError, match=r"'pay\.charge'") as err:
        charge.lockguard_options  # noqa: B018 - resolving is the check
    assert needle in str(err.value)


def test_an_idempotency_namespace_is_resolved_once_into_the_record_prefix() -> None:
    app = make()

    @app.task(
        base=LockedTask, shared=False, name="pay.charge", idempotency_key="pay:{a}", idempotency_namespace="p-1.x"
    )
    def charge(a: int) -> None: ...

    @app.task(base=LockedTask, shared=False, name="pay.refund", idempotency_key="pay:{a}")
    def refund(a: int) -> None: ...

    assert charge.lockguard_options.idempotency_namespace == "p-1.x"
    assert charge.lockguard_options.record_prefix == "ns:p-1.x:"
    assert refund.lockguard_options.record_prefix == "by:pay.refund:"


def test_describe_names_the_namespace_a_task_shares_its_records_in() -> None:
    from celery_lockguard import _inventory

    app = make()

    @app.task(base=LockedTask, shared=False, name="pay.charge", idempotency_key="pay:{a}", idempotency_namespace="pay")
    def charge(a: int) -> None: ...

    @app.task(base=LockedTask, shared=False, name="pay.refund", idempotency_key="pay:{a}")
    def refund(a: int) -> None: ...

    rows = {r["task"]: r for r in _inventory.inventory(app)}
    assert rows["pay.charge"]["completion_namespace"] == "pay" and rows["pay.refund"]["completion_namespace"] is None
    text = _inventory.markdown(app, list(rows.values()))
    assert "`pay:{a}` (shared: `pay`)" in text
