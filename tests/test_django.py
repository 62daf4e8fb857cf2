"""The lease composed with the app's task class; a real Django project with a real worker.

Composition (no Django): ``LockedTask`` takes the app's ``task_cls`` under a
function's task where that is safe, hooks chain through ``super()``, and a
task that misses the app's class is named at worker start.

The project (tests/djangoproject/, Celery's Django guide layout, SQLite) runs in
this process (to publish inside ``transaction.atomic`` and read the ORM) and in
one prefork worker shared by the module: ``delay_on_commit`` claims at commit,
a rollback leaves no claim and no message, the ORM write is fenced through
Django's cursor, settings come from ``CELERY_LOCKGUARD_*``, and the CLI runs
from ``manage.py``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, Task

from celery_lockguard import (
    ConfigurationError,
    EmptyField,
    LockedTask,
    LockGuard,
    StaleFence,
    bump_fence,
    validate_tasks,
)
from celery_lockguard._keys import claim_name, lock_name
from celery_lockguard._taskclass import adoptable_task_class
from celery_lockguard.testing import Worker, delete_prefix

# make compat's venvs carry neither Django nor (on Celery 5.3) celery.contrib.django
pytest.importorskip("django")
pytest.importorskip("celery.contrib.django.task")

from .conftest import REQUIRE
from .harness import wait_for

# The module's tests share the migrated project and its worker (module fixtures): under pytest-xdist they
# run in one worker, which sets them up once (make unit runs --dist loadgroup).
pytestmark = pytest.mark.xdist_group("test_django")

PROJECT = Path(__file__).resolve().parent / "djangoproject"


# -- composition --------------------------------------------------------------------------------


class ProjectTask(Task):
    """A project's own ``task_cls``: wraps every call and counts its binds."""

    calls: list[tuple[str, bool]] = []
    bound: list[str] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ProjectTask.calls.append((self.name, getattr(self, "lock", None) is not None))
        return super().__call__(*args, **kwargs)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        ProjectTask.bound.append(cls.__name__)

    def tenant(self) -> str:
        return "alpha"


def _app(redis_url: str, prefix: str, task_cls: Any) -> Celery:
    app = Celery("compose", broker="memory://", task_cls=task_cls, set_as_current=False)
    app.conf.update(lockguard_redis_url=redis_url, lockguard_key_prefix=prefix, task_store_eager_result=True)
    return app


def _task_cls_warnings(caplog: pytest.LogCaptureFixture, names: Iterable[str]) -> list[dict[str, Any]]:
    """The ``lock.task_cls_missing`` events (``record.lockguard``) of the tasks ``names``, in order.

    Only this test's tasks: every app that finalizes gets each ``@shared_task``
    defined anywhere in the process (the Django project's, other modules'), and
    ``validate_tasks`` warns about those too.
    """
    wanted = set(names)
    events = [getattr(r, "lockguard", None) for r in caplog.records]
    return [e for e in events if e and e["event"] == "lock.task_cls_missing" and e["task_name"] in wanted]


def test_locked_task_runs_inside_the_app_task_class_and_under_the_lease(
    redis_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    ProjectTask.calls.clear()
    ProjectTask.bound.clear()
    app = _app(redis_url, prefix, ProjectTask)

    @app.task(base=LockedTask, bind=True, shared=False, lock_key="k:{n}")
    def work(self: Any, n: int) -> str:
        return f"{self.tenant()}:{self.lock is not None}"

    task = work._get_current_object()
    mro = type(task).__mro__
    assert isinstance(task, ProjectTask) and isinstance(task, LockedTask)
    assert mro.index(LockGuard) < mro.index(ProjectTask)  # the lease wraps the project's __call__
    assert ProjectTask.bound  # on_bound chains to the app's class
    assert work.apply((1,)).get() == "alpha:True"
    assert ProjectTask.calls == [(work.name, True)]  # the project's __call__ ran inside the lease
    assert work(2) == "alpha:False"  # a direct call: through the project's __call__, no lock
    assert ProjectTask.calls[-1] == (work.name, False)
    with caplog.at_level(logging.WARNING, logger="celery_lockguard"):
        validate_tasks(app)
    assert not _task_cls_warnings(caplog, [work.name])


def test_composed_class_options_are_known_typos_still_refused(redis_url: str, prefix: str) -> None:
    class TenantTask(Task):
        on_tenant_missing = "error"  # a project option that starts like one of ours

    app = _app(redis_url, prefix, TenantTask)

    @app.task(base=LockedTask, shared=False, lock_key="k:{n}", on_tenant_missing="skip")
    def fine(n: int) -> None: ...

    @app.task(base=LockedTask, shared=False, lock_key="k:{n}", lock_tll=5)
    def typo(n: int) -> None: ...

    assert fine.lockguard_options.locked
    with pytest.raises(ConfigurationError, match="lock_tll"):
        typo.lockguard_options  # noqa: B018


def test_unsafe_or_hand_written_classes_are_named_at_validation(
    redis_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    class CheckpointingTask(Task):
        def checkpoint(self, name: str) -> None: ...  # LockGuard's name: ours would shadow it

    clashing = _app(redis_url, prefix, CheckpointingTask)

    @clashing.task(base=LockedTask, shared=False, lock_key="k:{n}")
    def kept_apart(n: int) -> None: ...

    assert not isinstance(kept_apart._get_current_object(), CheckpointingTask)

    project = _app(redis_url, prefix, ProjectTask)

    class HandWritten(LockedTask):  # a class task names its own bases: never rewritten
        name = "hand_written"
        lock_key = "k:{n}"

        def run(self, n: int) -> None: ...

    project.register_task(HandWritten())
    with caplog.at_level(logging.WARNING, logger="celery_lockguard"):
        validate_tasks(clashing)
        validate_tasks(project)
        validate_tasks(project)  # once per process is enough
    events = _task_cls_warnings(caplog, [kept_apart.name, "hand_written"])
    warned = {e["task_name"]: e["reason"] for e in events}
    assert len(events) == 2 and events[0]["option"] == "task_cls"
    assert "it defines checkpoint" in warned[kept_apart.name]
    assert "class LockedProjectTask(LockGuard, ProjectTask)" in warned["hand_written"]


def test_a_mixin_composition_chains_every_hook(redis_url: str, prefix: str) -> None:
    ProjectTask.calls.clear()
    ProjectTask.bound.clear()

    class LockedProjectTask(LockGuard, ProjectTask):
        pass

    app = _app(redis_url, prefix, None)

    @app.task(base=LockedProjectTask, bind=True, shared=False, lock_key="k:{n}")
    def work(self: Any, n: int) -> bool:
        return self.lock is not None

    work._get_current_object()  # bound when the app finalizes
    assert ProjectTask.bound == ["work"]  # LockGuard.on_bound chained to the project's
    assert work.apply((1,)).get() is True
    assert ProjectTask.calls == [(work.name, True)]


TENANT: ContextVar[str | None] = ContextVar("tenant", default=None)


class TenantTask(Task):
    """A project base that adds the tenant from a context variable to every publish, and runs bodies inside it."""

    runs: list[tuple[str | None, bool]] = []

    def apply_async(self, args: Any = None, kwargs: Any = None, *rest: Any, **options: Any) -> Any:
        return super().apply_async(args, {**(kwargs or {}), "tenant_id": TENANT.get()}, *rest, **options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mark = TENANT.set(kwargs.get("tenant_id"))
        try:
            return super().__call__(*args, **kwargs)
        finally:
            TENANT.reset(mark)


class ShortCircuitTask(TenantTask):
    """Like ``TenantTask`` but its ``__call__`` runs the body itself instead of ending in ``super().__call__()``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


def _publish_as(task: Any, *tenants: str) -> list[str]:
    ids = []
    for tenant in tenants:
        mark = TENANT.set(tenant)
        try:
            ids.append(task.delay().id)
        finally:
            TENANT.reset(mark)
    return ids


def test_a_task_class_with_its_own_apply_async_is_not_adopted(
    redis_url: str, prefix: str, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Adopted, its ``apply_async`` would run after the claim: two tenants would share ``tenant:None:sync``.

    So ``LockedTask`` leaves it out and the worker start says why and what to
    write instead. ``DjangoTask`` adds methods but no ``apply_async``: adopted.
    """
    from celery.contrib.django.task import DjangoTask

    app = _app(redis_url, prefix, TenantTask)

    @app.task(base=LockedTask, shared=False, name=f"t{prefix}.sync", lock_key="tenant:{tenant_id}:sync")
    def sync(tenant_id: str | None = None) -> None: ...

    assert not isinstance(sync._get_current_object(), TenantTask)
    assert adoptable_task_class(app, LockGuard) is None
    assert adoptable_task_class(_app(redis_url, prefix, DjangoTask), LockGuard) is DjangoTask
    with caplog.at_level(logging.WARNING, logger="celery_lockguard"):
        validate_tasks(app)
    (event,) = _task_cls_warnings(caplog, [sync.name])
    assert event["option"] == "task_cls" and "tests.test_django.TenantTask" in event["reason"]
    assert "its apply_async runs after lockguard computes the claim" in event["reason"]
    assert "class LockedTenantTask(TenantTask, LockGuard)" in event["reason"]


def test_composition_order_decides_what_the_claim_sees(redis_url: str, prefix: str, r: redis.Redis) -> None:
    """``(LockGuard, Project)`` claims on the arguments as given; ``(Project, LockGuard)`` on the final message."""

    class ClaimFirst(LockGuard, TenantTask):
        pass

    class ClaimLast(TenantTask, LockGuard):
        pass

    app = _app(redis_url, prefix, None)
    options: dict[str, Any] = {"shared": False, "lock_key": "tenant:{tenant_id}:sync", "lock_mode": "until_started"}

    @app.task(base=ClaimFirst, name=f"first{prefix}", **options)
    def first(tenant_id: str | None = None) -> None: ...

    @app.task(base=ClaimLast, name=f"last{prefix}", **options)
    def last(tenant_id: str | None = None) -> None: ...

    # Claimed before TenantTask added the tenant: the key's field is still None. It rendered
    # ``tenant:None:sync`` (both publishes "identical work", the second never sent); a None field is
    # now refused at publish (issue 29 item 6), so the wrong order fails loudly instead.
    with pytest.raises(EmptyField, match=r"field \{tenant_id\} is None"):
        _publish_as(first, "acme")
    assert not r.exists(claim_name(prefix, "tenant:None:sync"))
    # Claimed inside TenantTask's apply_async: one claim per tenant, both sent.
    acme, globex = _publish_as(last, "acme", "globex")
    assert acme != globex
    assert r.exists(claim_name(prefix, "tenant:acme:sync"), claim_name(prefix, "tenant:globex:sync")) == 2


def test_a_project_call_before_the_lease_must_end_in_super(redis_url: str, prefix: str) -> None:
    """With the project's class first, its ``__call__`` runs outside ours: skipping ``super()`` skips the lease."""

    class Chained(TenantTask, LockGuard):
        pass

    class Skipping(ShortCircuitTask, LockGuard):
        pass

    app = _app(redis_url, prefix, None)

    @app.task(base=Chained, bind=True, shared=False, name=f"chained{prefix}", lock_key="tenant:{tenant_id}:sync")
    def chained(self: Any, tenant_id: str | None = None) -> tuple[str | None, bool]:
        return TENANT.get(), self.lock is not None

    @app.task(base=Skipping, bind=True, shared=False, name=f"skipping{prefix}", lock_key="tenant:{tenant_id}:sync")
    def skipping(self: Any, tenant_id: str | None = None) -> tuple[str | None, bool]:
        return TENANT.get(), self.lock is not None

    assert tuple(chained.apply(kwargs={"tenant_id": "acme"}).get()) == ("acme", True)
    assert tuple(skipping.apply(kwargs={"tenant_id": "acme"}).get()) == (None, False)  # ran without a lease


def test_app_task_set_directly_is_the_class_locked_task_keeps(
    redis_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``app.Task = MyBase`` (Celery's documented way) leaves ``task_cls`` alone: the class comes from ``app.Task``."""

    class MyBase(Task):
        queue = "hipri"

    app = _app(redis_url, prefix, None)
    app.Task = MyBase

    @app.task(base=LockedTask, shared=False, name=f"adopted{prefix}", lock_key="k:{n}")
    def adopted(n: int) -> None: ...

    class HandWritten(LockedTask):  # names its own bases: warned about, naming MyBase
        name = f"hand{prefix}"
        lock_key = "k:{n}"

        def run(self, n: int) -> None: ...

    app.register_task(HandWritten())
    assert isinstance(adopted._get_current_object(), MyBase) and adopted.queue == "hipri"
    with caplog.at_level(logging.WARNING, logger="celery_lockguard"):
        validate_tasks(app)
    events = _task_cls_warnings(caplog, [adopted.name, HandWritten.name])
    assert [e["task_name"] for e in events] == [HandWritten.name]
    assert "MyBase" in events[0]["reason"]


# -- the Django project -------------------------------------------------------------------------


@dataclass
class Project:
    app: Celery
    prefix: str  # every Redis key of the module lives under it
    lock_prefix: str  # CELERY_LOCKGUARD_KEY_PREFIX
    queue: str
    env: dict[str, str]


@pytest.fixture(scope="module")
def project(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Project]:
    """The project imported and migrated in this process, as ``manage.py`` would.

    ``DJANGO_SETTINGS_MODULE`` is set only while the project is imported: Celery's
    Django fixup reads it when an app is created, and later test modules' apps must
    not become Django apps.
    """
    import django
    from django.conf import settings as django_settings

    if django_settings.configured:
        pytest.skip("Django is already configured in this process")
    prefix = f"lgdj:{uuid.uuid4().hex[:10]}"
    env = {
        "DJANGO_SETTINGS_MODULE": "djangoproject.settings",
        "LOCKGUARD_DJANGO_PREFIX": prefix,
        "LOCKGUARD_DJANGO_DB": str(tmp_path_factory.mktemp("django") / "db.sqlite3"),
        "LOCKGUARD_TEST_REDIS_URL": redis_url,
    }
    if os.environ.get("LOCKGUARD_TEST_POSTGRES_URL"):
        env["LOCKGUARD_DJANGO_PG"] = os.environ["LOCKGUARD_TEST_POSTGRES_URL"]
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    sys.path.insert(0, str(PROJECT))
    try:
        import djangoproject
        from django.core.management import call_command

        django.setup()
        call_command("migrate", verbosity=0)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    app = djangoproject.celery_app
    app.loader.import_default_modules()  # autodiscover_tasks: billing.tasks
    yield Project(app, prefix, f"{prefix}:lg", f"{prefix}-q", env)
    delete_prefix(redis.Redis.from_url(redis_url), prefix)
    sys.path.remove(str(PROJECT))


@pytest.fixture(scope="module")
def worker(project: Project, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """One prefork worker of the project for the module: ``celery -A djangoproject worker``."""
    w = Worker(
        "djangoproject",
        control=project.app,
        concurrency=2,
        queues=[project.queue],
        env={**project.env, "PYTHONPATH": str(PROJECT)},
        cwd=PROJECT,
        log_path=tmp_path_factory.mktemp("django-worker") / "worker.log",
    )
    with w:
        yield w


def _invoice() -> Any:
    from billing.models import Invoice

    return Invoice.objects.create(amount_cents=0)


def _reload(pk: int) -> Any:
    from billing.models import Invoice

    return Invoice.objects.get(pk=pk)


def _stored_fence(key: str, using: str = "default", table: str = "lockguard_fences") -> int | None:
    from django.db import connections

    with connections[using].cursor() as cursor:
        cursor.execute(f"SELECT fence FROM {table} WHERE lock_key = %s", [key])
        row = cursor.fetchone()
    return int(row[0]) if row else None


def test_django_task_classes(project: Project) -> None:
    from billing import tasks
    from celery.contrib.django.task import DjangoTask

    from celery_lockguard.django import LockedDjangoTask

    assert isinstance(tasks.charge._get_current_object(), LockedDjangoTask)
    remind = tasks.remind._get_current_object()  # base=LockedTask under the Django fixup
    assert isinstance(remind, LockedTask) and isinstance(remind, DjangoTask)
    assert hasattr(remind, "apply_async_on_commit")


@pytest.mark.integration
def test_delay_on_commit_claims_at_commit_and_once(project: Project, worker: Worker, r: redis.Redis) -> None:
    from billing.tasks import charge
    from django.db import transaction

    inv = _invoice()
    claim = lock_name(project.lock_prefix, f"invoice:{inv.pk}")  # until_done claims the lease hash
    with transaction.atomic():
        charge.delay_on_commit(inv.pk, 500, hold=0.5)
        charge.delay_on_commit(inv.pk, 500, hold=0.5)  # identical work: answered by the first at commit
        assert not r.exists(claim), "claimed before the transaction committed"
    assert r.exists(claim)  # claimed at commit, held through the (>= 0.5 s) body
    wait_for(lambda: _reload(inv.pk).paid, 30, what="the charge to run")
    wait_for(lambda: not r.exists(claim), 10, what="the claim to be released")
    done = _reload(inv.pk)
    assert (done.charges, done.amount_cents) == (1, 500)
    assert done.fence == _stored_fence(f"invoice:{inv.pk}")


@pytest.mark.integration
def test_apply_async_on_commit_of_a_locked_task(project: Project, worker: Worker, r: redis.Redis) -> None:
    from billing.tasks import remind
    from django.db import transaction

    inv = _invoice()
    claim = claim_name(project.lock_prefix, f"invoice:{inv.pk}:remind")
    with transaction.atomic():
        # A countdown keeps the worker off it, so the claim taken at commit is still there to see: until_started
        # frees it when the body starts, and without the countdown the body could start (and not yet have
        # written) before the check. The claim covers the countdown (a hand-over to a delayed message).
        remind.apply_async_on_commit((inv.pk,), countdown=3)
        assert not r.exists(claim)
    assert r.exists(claim), "not claimed at commit"
    assert _reload(inv.pk).reminders == 0
    wait_for(lambda: _reload(inv.pk).reminders == 1, 30, what="the reminder to run")


class Rollback(Exception):
    pass


@pytest.mark.integration
def test_rollback_leaves_no_claim_and_no_message(project: Project, worker: Worker, r: redis.Redis) -> None:
    from billing.tasks import charge, remind
    from django.db import transaction

    inv = _invoice()
    with pytest.raises(Rollback), transaction.atomic():
        charge.delay_on_commit(inv.pk, 900)
        remind.apply_async_on_commit((inv.pk,))
        raise Rollback
    assert not r.exists(lock_name(project.lock_prefix, f"invoice:{inv.pk}"))
    assert not r.exists(claim_name(project.lock_prefix, f"invoice:{inv.pk}:remind"))
    assert not r.llen(f"{project.prefix}:kombu:{project.queue}")
    # A committed publish after it runs, and is the only run: the rolled-back calls were never sent.
    with transaction.atomic():
        charge.delay_on_commit(inv.pk, 100)
    wait_for(lambda: _reload(inv.pk).paid, 30, what="the committed charge to run")
    done = _reload(inv.pk)
    assert (done.charges, done.amount_cents, done.reminders) == (1, 100, 0)


@pytest.mark.integration
def test_orm_write_is_fenced_on_djangos_connection(project: Project, worker: Worker) -> None:
    from billing.tasks import charge
    from django.db import connection, transaction

    inv = _invoice()
    first = charge.delay(inv.pk, 100).get(timeout=30)
    assert _reload(inv.pk).fence == first["fence"] == _stored_fence(f"invoice:{inv.pk}")
    # A newer holder wrote (or an operator's forced release bumped the fence): this holder's next write is stale.
    with transaction.atomic(), connection.cursor() as cursor:
        bump_fence(cursor, f"invoice:{inv.pk}", 2 * first["fence"])
    stale = charge.delay(inv.pk, 200)
    stale.get(timeout=30, propagate=False)
    assert stale.state == "FAILURE" and type(stale.result).__name__ == StaleFence.__name__
    after = _reload(inv.pk)
    assert (after.amount_cents, after.charges) == (100, 1)  # the ORM update rolled back with the fence


@pytest.mark.parametrize("using", ["default", "pg"])
def test_fence_through_django_cursor_on_each_backend(project: Project, using: str) -> None:
    """SQLite and PostgreSQL alike: ``advance_fence`` takes Django's cursor (``%s`` placeholders on both)."""
    from billing.tasks import fenced_write
    from django.db import connections

    from celery_lockguard import fence_table_sql

    if using not in connections.databases:
        if REQUIRE:
            pytest.fail("LOCKGUARD_REQUIRE_SERVICES=1 but LOCKGUARD_TEST_POSTGRES_URL is not set")
        pytest.skip("LOCKGUARD_TEST_POSTGRES_URL is not set")
    table = f"lgdj_fences_{uuid.uuid4().hex[:8]}"
    key = f"n{uuid.uuid4().hex[:6]}"
    with connections[using].cursor() as cursor:
        cursor.execute(fence_table_sql(table))
    try:
        fence = fenced_write.apply((key,), {"using": using, "table": table}).get()
        assert _stored_fence(f"note:{key}", using, table) == fence
        with connections[using].cursor() as cursor:
            bump_fence(cursor, f"note:{key}", 2 * fence, table)
        stale = fenced_write.apply((key,), {"using": using, "table": table})
        assert isinstance(stale.result, StaleFence)
        assert _stored_fence(f"note:{key}", using, table) == 2 * fence
    finally:
        with connections[using].cursor() as cursor:
            cursor.execute(f"DROP TABLE {table}")


@pytest.mark.integration
def test_settings_come_from_django(project: Project, worker: Worker) -> None:
    from billing.tasks import sync_tenant

    from celery_lockguard import settings

    assert settings(project.app).key_prefix == project.lock_prefix
    got = sync_tenant.delay("alpha").get(timeout=30)
    assert got == {"key": "tenant:alpha:sync", "ttl_ms": 20_000}  # CELERY_LOCKGUARD_KEYS, _DEFAULT_TTL


def test_cli_from_manage_py_and_celery(project: Project) -> None:
    env = {**os.environ, **project.env, "PYTHONPATH": str(PROJECT)}

    def describe(*command: str) -> dict[str, Any]:
        out = subprocess.run(
            [sys.executable, *command, "lockguard", "describe", "--json"],
            cwd=PROJECT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        return {row["task"]: row for row in json.loads(out.stdout)}

    managed = describe("manage.py")
    assert managed == describe("-m", "celery", "-A", "djangoproject")
    assert set(managed) == {"billing.charge", "billing.fenced_write", "billing.remind", "billing.sync_tenant"}
    assert managed["billing.sync_tenant"]["key_template"] == "tenant:{tenant_id}:sync"
    assert managed["billing.charge"]["ttl"] == 20
    # Django's own options, before and after the sub-command's, are Django's: --settings takes effect.
    del env["DJANGO_SETTINGS_MODULE"]
    for argv in (
        ["--settings=djangoproject.short", "-v", "0", "--no-color", "describe", "--json"],
        ["describe", "--json", "--traceback", "--settings", "djangoproject.short", "--pythonpath", "."],
        ["--verbosity=2", "--skip-checks", "describe", "--force-color", "--json", "--settings=djangoproject.short"],
    ):
        out = subprocess.run(
            [sys.executable, "manage.py", "lockguard", *argv],
            cwd=PROJECT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, (argv, out.stderr)
        assert {row["task"]: row["ttl"] for row in json.loads(out.stdout)}["billing.charge"] == 7, argv


def test_django_options_are_taken_out_before_the_cli() -> None:
    from celery_lockguard.django import strip_django_options

    args = ["--settings", "a.b", "-v", "2", "locks", "--match=x*", "-v3", "--pythonpath=.", "--no-color", "--traceback"]
    assert strip_django_options(args) == (["locks", "--match=x*"], True)
    after_separator = ["--force-color", "release", "--", "--settings"]
    assert strip_django_options(after_separator) == (["release", "--", "--settings"], False)
    assert strip_django_options(["describe", "-h"]) == (["describe", "--help"], False)


def test_manage_py_lockguard_closes_the_database_connections(
    project: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    """``run_from_argv`` ends as Django's does: the connections the command's process opened are closed."""
    from django.db import connection

    from celery_lockguard.django import LockGuardCommand

    class Command(LockGuardCommand):
        celery_app = project.app

    _invoice()  # opens the default connection
    assert connection.connection is not None
    with pytest.raises(SystemExit) as exited:
        Command().run_from_argv(["manage.py", "lockguard", "--settings=djangoproject.settings", "describe", "--json"])
    assert exited.value.code == 0
    assert "billing.charge" in {row["task"] for row in json.loads(capsys.readouterr().out)}
    assert connection.connection is None
