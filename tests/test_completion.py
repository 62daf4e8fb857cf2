"""Completion records and checkpoints: the same suite on the Redis and the PostgreSQL backend."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery
from structlog.testing import capture_logs

from celery_lockguard import LockedTask
from celery_lockguard._completion import PostgresStore, postgres_store
from celery_lockguard.exceptions import ConfigurationError
from celery_lockguard.testing import free_port


@pytest.fixture(params=["redis", "postgres"])
def backend(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """(completion backend setting, table)."""
    if request.param == "redis":
        yield "redis", "lockguard_completions"
        return
    dsn = request.getfixturevalue("postgres_url")
    table = f"lgt_{uuid.uuid4().hex[:8]}_completions"
    yield dsn, table
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}")


@pytest.fixture
def app(redis_url: str, prefix: str, backend: tuple[str, str]) -> Celery:
    a = Celery("completiontest", broker=redis_url, set_as_current=False)
    a.conf.lockguard_key_prefix = prefix
    a.conf.lockguard_completion_backend, a.conf.lockguard_completion_table = backend
    return a


def task(app: Celery, **opts: Any) -> Any:
    def deco(fn: Any) -> Any:
        return app.task(base=LockedTask, bind=True, shared=False, name=f"c.{uuid.uuid4().hex[:6]}", **opts)(fn)

    return deco


def test_same_id_is_skipped_with_the_recorded_result(app: Celery) -> None:
    runs: list[int] = []

    @task(app, lock_key="k:{a}")
    def t(self: Any, a: int) -> dict[str, int]:
        runs.append(a)
        return {"n": len(runs)}

    assert t.apply(args=(1,), task_id="same").get() == {"n": 1}
    with capture_logs() as logs:
        assert t.apply(args=(1,), task_id="same").get() == {"n": 1}
    assert runs == [1]
    assert [e["completed_by"] for e in logs if e["event"] == "completion.skipped"] == ["same"]


def test_two_ids_one_idempotency_key_run_once_across_task_types_that_share_a_namespace(app: Celery) -> None:
    """Tasks that mean to share records say so (``idempotency_namespace``); the sharing was implicit before."""
    runs: list[str] = []

    @task(app, idempotency_key="invoice:{invoice_id}:charge", idempotency_namespace="billing")
    def charge(self: Any, invoice_id: int) -> str:
        runs.append("charge")
        return "charged"

    @task(app, idempotency_key="invoice:{invoice_id}:charge", idempotency_namespace="billing")
    def charge_v2(self: Any, invoice_id: int, note: str = "") -> str:
        runs.append("v2")
        return "charged-v2"

    assert charge.apply(args=(9,), task_id="a").get() == "charged"
    assert charge.apply(args=(9,), task_id="b").get() == "charged"
    assert charge_v2.apply(args=(9,), task_id="c").get() == "charged"
    assert runs == ["charge"]


def test_one_rendered_key_of_two_task_types_is_two_records_without_a_namespace(app: Celery) -> None:
    """Issue 29 item 7: keys are injective within one template only. ``ref("payment:42")`` wrote the record
    ``pay(42)`` was then answered from: pay's body never ran and its caller got ref's result."""
    runs: list[str] = []

    @task(app, idempotency_key="{ref}")
    def ref(self: Any, ref: str) -> str:
        self.checkpoint("provider", runs.append, f"ref {ref}")
        return "ref's result"

    @task(app, idempotency_key="payment:{invoice}")
    def pay(self: Any, invoice: int) -> str:
        assert self.completion_scope == "payment:42"  # what a provider sees is unchanged
        self.checkpoint("provider", runs.append, f"pay {invoice}")  # ref's checkpoint does not answer it
        return "paid"

    assert ref.apply(args=("payment:42",)).get() == "ref's result"
    assert pay.apply(args=(42,)).get() == "paid"
    assert pay.apply(args=(42,)).get() == "paid"  # its own record still answers it
    assert runs == ["ref payment:42", "pay 42"]


def test_a_retried_task_is_not_skipped(app: Celery) -> None:
    runs: list[int] = []

    @task(app, lock_key="k:{a}", max_retries=3, default_retry_delay=0)
    def t(self: Any, a: int) -> int:
        runs.append(self.request.retries)
        if self.request.retries < 2:
            raise self.retry()
        return len(runs)

    assert t.apply(args=(1,)).get() == 3
    assert runs == [0, 1, 2]


def test_checkpoint_replays_after_a_failure(app: Celery) -> None:
    effects: list[int] = []

    def provider(x: int) -> dict[str, Any]:
        effects.append(x)
        return {"receipt": f"r-{x}", "amount": (x, 2)}

    @task(app, idempotency_key="inv:{a}")
    def t(self: Any, a: int, fail: bool) -> Any:
        got = self.checkpoint("charge", provider, a)
        if fail:
            raise RuntimeError("crash after the side effect")
        return got

    with pytest.raises(RuntimeError):
        t.apply(args=(5, True), throw=True)
    assert t.apply(args=(5, False), throw=True).get() == {"receipt": "r-5", "amount": [5, 2]}
    assert effects == [5]


def test_completion_off_records_nothing(app: Celery) -> None:
    runs: list[int] = []

    @task(app, lock_key="k:{a}", completion=False)
    def t(self: Any, a: int) -> int:
        runs.append(a)
        return a

    t.apply(args=(1,), task_id="x")
    t.apply(args=(1,), task_id="x")
    assert runs == [1, 1]


def test_record_completion_needs_the_postgres_backend(redis_url: str, prefix: str) -> None:
    app = Celery("redisonly", broker=redis_url, set_as_current=False)
    app.conf.lockguard_key_prefix = prefix

    @task(app, lock_key="k:{a}")
    def t(self: Any, a: int) -> Any:
        return self.record_completion(None)

    with pytest.raises(ConfigurationError, match="record_completion needs"):
        t.apply(args=(1,), throw=True)


# -- PostgreSQL only ---------------------------------------------------------------


@pytest.fixture
def pg_app(redis_url: str, prefix: str, postgres_url: str) -> Iterator[tuple[Celery, str, str]]:
    table = f"lgt_{uuid.uuid4().hex[:8]}"
    a = Celery("pgcompletion", broker=redis_url, set_as_current=False)
    a.conf.lockguard_key_prefix = prefix
    a.conf.lockguard_completion_backend = postgres_url
    a.conf.lockguard_completion_table = f"{table}_completions"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table}_effects (scope TEXT PRIMARY KEY)")
    yield a, postgres_url, table
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}_effects, {table}_completions")


def test_body_write_and_completion_row_commit_in_one_transaction(pg_app: tuple[Celery, str, str]) -> None:
    app, dsn, table = pg_app

    @task(app, idempotency_key="order:{order_id}")
    def ship(self: Any, order_id: int, crash: bool) -> str:
        with psycopg.connect(dsn) as conn, conn.transaction():
            conn.execute(f"INSERT INTO {table}_effects VALUES (%s)", (self.completion_scope,))
            assert self.record_completion(conn, "shipped")
            if crash:
                raise RuntimeError("crash inside the transaction")
        return "shipped"

    with pytest.raises(RuntimeError):
        ship.apply(args=(1, True), throw=True)
    with psycopg.connect(dsn) as conn:
        assert conn.execute(f"SELECT count(*) FROM {table}_effects").fetchone()[0] == 0
        assert conn.execute(f"SELECT count(*) FROM {table}_completions").fetchone()[0] == 0
    assert ship.apply(args=(1, False), throw=True).get() == "shipped"
    assert ship.apply(args=(1, False), throw=True).get() == "shipped"
    with psycopg.connect(dsn) as conn:
        assert conn.execute(f"SELECT count(*) FROM {table}_effects").fetchone()[0] == 1


def test_fail_open_with_postgres_backend_commits_one_effect(pg_app: tuple[Celery, str, str]) -> None:
    app, _dsn, _table = pg_app
    app.conf.lockguard_redis_url = f"redis://127.0.0.1:{free_port()}/0"  # the lock Redis is down
    app.conf.lockguard_on_unavailable = "fail_open"
    app.conf.lockguard_socket_timeout = 0.3
    effects: list[int] = []

    @task(app, idempotency_key="invoice:{invoice_id}")
    def charge(self: Any, invoice_id: int) -> str:
        assert self.lock is None
        self.checkpoint("provider", effects.append, invoice_id)
        return "charged"

    with capture_logs() as logs:
        assert charge.apply(args=(3,), task_id="one").get() == "charged"
        assert charge.apply(args=(3,), task_id="two").get() == "charged"
    assert effects == [3]
    assert sum(e["event"] == "lock.fail_open" for e in logs) == 2
    assert sum(e["event"] == "completion.skipped" for e in logs) == 1


def test_expired_rows_are_replaced_and_purged(postgres_url: str) -> None:
    store = PostgresStore(postgres_url, f"lgt_{uuid.uuid4().hex[:8]}_c")
    try:
        assert store.record("s", "t1", '{"result":1}', ttl_ms=1)
        with psycopg.connect(postgres_url) as conn:
            conn.execute(f"UPDATE {store.table} SET expires_at = now() - interval '1 second'")
        assert store.lookup("s") is None
        assert store.record("s", "t2", '{"result":2}', ttl_ms=60_000)
        assert not store.record("s", "t3", '{"result":3}', ttl_ms=60_000)
        assert store.lookup("s") == '{"result":2}'
        assert store.forget("s") == 1 and store.lookup("s") is None
        store.record("old", "t", "{}", ttl_ms=1)
        with psycopg.connect(postgres_url) as conn:
            conn.execute(f"UPDATE {store.table} SET expires_at = now() - interval '1 second'")
        assert store.purge_expired() == 1
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {store.table}")
    assert postgres_store(postgres_url) is postgres_store(postgres_url)


# -- namespaces: lockguard_key_prefix isolates every store -------------------------------------


def test_two_apps_sharing_a_store_and_a_template_never_answer_each_others_tasks(
    redis_url: str, backend: tuple[str, str]
) -> None:
    import redis as redis_lib

    from celery_lockguard.testing import delete_prefix

    runs: list[str] = []
    apps = []
    prefixes = [f"lgt:{uuid.uuid4().hex[:10]}", f"lgt:{uuid.uuid4().hex[:10]}"]
    try:
        for p in prefixes:
            a = Celery(f"billing-{p}", broker=redis_url, set_as_current=False)
            a.conf.lockguard_key_prefix = p
            a.conf.lockguard_completion_backend, a.conf.lockguard_completion_table = backend

            @a.task(base=LockedTask, bind=True, shared=False, name="billing.charge", idempotency_key="charge:{n}")
            def charge(self: Any, n: int, _p: str = p) -> str:
                runs.append(_p)
                return f"charged by {_p}"

            apps.append(charge)
        first, second = apps
        assert first.apply(args=(42,)).get() == f"charged by {prefixes[0]}"
        # The second app's charge(42) is its own business: it runs, and is then deduplicated in its own namespace.
        assert second.apply(args=(42,)).get() == f"charged by {prefixes[1]}"
        assert second.apply(args=(42,)).get() == f"charged by {prefixes[1]}"
        assert first.apply(args=(42,)).get() == f"charged by {prefixes[0]}"
        assert runs == prefixes
    finally:
        for p in prefixes:
            delete_prefix(redis_lib.Redis.from_url(redis_url), p)


@pytest.fixture
def pg_table(postgres_url: str) -> Iterator[str]:
    table = f"lgt_{uuid.uuid4().hex[:8]}_c"
    yield table
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}")


def test_every_postgres_read_and_write_is_scoped_by_namespace(postgres_url: str, pg_table: str) -> None:
    a = PostgresStore(postgres_url, pg_table, namespace="app-a")
    b = PostgresStore(postgres_url, pg_table, namespace="app-b")
    assert a.record("charge:42", "t-a", '{"result":"a"}', ttl_ms=60_000)
    a.put_checkpoint("charge:42", "card", '{"value":1}', ttl_ms=60_000)
    assert b.lookup("charge:42") is None and b.get_checkpoint("charge:42", "card") is None
    assert b.entries("charge:42") == [] and b.forget("charge:42") == 0
    assert b.record("charge:42", "t-b", '{"result":"b"}', ttl_ms=60_000)  # its own first writer
    with psycopg.connect(postgres_url) as conn, conn.transaction():
        assert not b.record_in(conn, "charge:42", "t-b2", '{"result":"b2"}', 60_000)
        assert PostgresStore(postgres_url, pg_table, "app-c").record_in(conn, "charge:42", "t-c", "{}", 60_000)
    assert a.lookup("charge:42") == '{"result":"a"}' and b.lookup("charge:42") == '{"result":"b"}'
    assert [name for name, _, _ in a.entries("charge:42")] == ["", "cp:card"]
    assert a.forget("charge:42") == 2 and b.lookup("charge:42") == '{"result":"b"}'
    with psycopg.connect(postgres_url) as conn:
        scopes = sorted(r[0] for r in conn.execute(f"SELECT scope FROM {pg_table}").fetchall())
    assert (
        scopes
        == ["app-b:v1:{charge:42}", "app-c:v1:{charge:42}"]
        == sorted(
            [b.stored_scope("charge:42"), PostgresStore(postgres_url, pg_table, "app-c").stored_scope("charge:42")]
        )
    )
    assert PostgresStore(postgres_url, pg_table).namespace == "lockguard"
    for bad in ("", "a{b", "a b"):
        with pytest.raises(ValueError, match="namespace"):
            PostgresStore(postgres_url, pg_table, namespace=bad)
    one = postgres_store(postgres_url, pg_table, namespace="app-a")
    assert one is postgres_store(postgres_url, pg_table, namespace="app-a")
    assert one is not postgres_store(postgres_url, pg_table, namespace="app-b")


def test_rows_written_without_a_namespace_are_not_seen(postgres_url: str, pg_table: str) -> None:
    store = PostgresStore(postgres_url, pg_table)
    store.create_table()
    with psycopg.connect(postgres_url) as conn:  # a 0.1.0 row: the bare scope
        conn.execute(
            f"INSERT INTO {pg_table} (scope, name, value, expires_at) "
            "VALUES ('charge:42', '', '{}', now() + interval '1 hour')"
        )
    assert store.lookup("charge:42") is None


def test_concurrent_first_use_of_a_fresh_table_creates_it_once(postgres_url: str) -> None:
    import threading

    for _ in range(5):
        table = f"lgt_{uuid.uuid4().hex[:8]}_race"
        stores = [PostgresStore(postgres_url, table, namespace=f"n{i}") for i in range(8)]
        barrier = threading.Barrier(len(stores))
        errors: list[BaseException] = []

        def first_use(store: PostgresStore, barrier: threading.Barrier, errors: list[BaseException]) -> None:
            try:
                barrier.wait(10)
                assert store.lookup("s") is None
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=first_use, args=(s, barrier, errors)) for s in stores]
        try:
            for th in threads:
                th.start()
            for th in threads:
                th.join(30)
            assert errors == []  # without the DDL lock: UniqueViolation on pg_type_typname_nsp_index
            assert stores[0].record("s", "t", "{}", ttl_ms=60_000)
        finally:
            with psycopg.connect(postgres_url, autocommit=True) as conn:
                conn.execute(f"DROP TABLE IF EXISTS {table}")


# -- records answer the task that wrote them (issue 29 item 7), through the real tracer ----------------


@pytest.mark.parametrize("shared", [False, True])
def test_a_record_answers_only_its_task_unless_they_share_a_namespace(
    redis_url: str, prefix: str, backend: tuple[str, str], shared: bool
) -> None:
    """Two task types whose templates render one S (``"{ref}"`` with ``"payment:42"``, ``"payment:{invoice}"``
    with 42), delivered by Celery's real tracer on a real Redis (and PostgreSQL): without a namespace each
    body runs and each record answers only its own task; with ``idempotency_namespace="payments"`` on both,
    the second is answered from the first's record, which lives under the namespace."""
    import redis as redis_lib

    from celery_lockguard._keys import done_name

    from .tracer import deliver, make_app

    app = make_app("records", redis_url, prefix)
    app.conf.lockguard_completion_backend, app.conf.lockguard_completion_table = backend
    runs: list[str] = []
    opts: dict[str, Any] = {"idempotency_namespace": "payments"} if shared else {}

    @app.task(base=LockedTask, bind=True, shared=False, name="refunds.by_ref", idempotency_key="{ref}", **opts)
    def by_ref(self: Any, ref: str) -> str:
        runs.append(f"by_ref {ref}")
        return "refunded"

    @app.task(
        base=LockedTask, bind=True, shared=False, name="payments.pay", idempotency_key="payment:{invoice}", **opts
    )
    def pay(self: Any, invoice: int) -> str:
        runs.append(f"pay {invoice}")
        return "paid"

    first = deliver(by_ref, ("payment:42",))
    second = deliver(pay, (42,))
    assert (first.state, first.retval) == ("SUCCESS", "refunded")
    if shared:
        assert runs == ["by_ref payment:42"]  # declared shared: one effect, answered from the record
        assert (second.state, second.retval) == ("SUCCESS", "refunded")
        owners = ["ns:payments:payment:42"]
    else:
        assert runs == ["by_ref payment:42", "pay 42"]  # pay's body ran: ref's record never answers it
        assert (second.state, second.retval) == ("SUCCESS", "paid")
        assert deliver(pay, (42,)).retval == "paid" and deliver(by_ref, ("payment:42",)).retval == "refunded"
        assert len(runs) == 2  # and each task's own record still answers its duplicates
        owners = ["by:payments.pay:payment:42", "by:refunds.by_ref:payment:42"]
    if backend[0] == "redis":
        r = redis_lib.Redis.from_url(redis_url, decode_responses=True)
        assert sorted(k for k in r.scan_iter(match=f"{prefix}:v1:*:done")) == [done_name(prefix, o) for o in owners]
        assert done_name(prefix, owners[0]).startswith(f"{prefix}:v1:{{payment:42}}:")  # the lease's slot
    else:
        from celery_lockguard._keys import record_key

        with psycopg.connect(backend[0]) as conn:
            rows = conn.execute(f"SELECT scope FROM {backend[1]} WHERE name = '' ORDER BY scope").fetchall()
        assert [row[0] for row in rows] == [record_key(prefix, o) for o in owners]


def test_carry_over_moves_earlier_format_records_to_the_task_that_wrote_them(
    redis_url: str, prefix: str, backend: tuple[str, str]
) -> None:
    """The upgrade path of issue 29 item 7: records named by S alone are not read any more (a duplicate
    would run once more); ``lockguard completions carry-over`` copies each to its writer's record scope,
    with its checkpoints and TTL, and leaves task-id scopes and other tasks' records alone."""
    import redis as redis_lib
    from celery.bin.base import CLIContext
    from click.testing import CliRunner

    from celery_lockguard._cli import lockguard
    from celery_lockguard._keys import checkpoint_name, done_name

    from .tracer import deliver, make_app

    app = make_app("carry", redis_url, prefix)
    app.conf.lockguard_completion_backend, app.conf.lockguard_completion_table = backend
    runs: list[str] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="payments.pay", idempotency_key="payment:{invoice}")
    def pay(self: Any, invoice: int) -> str:
        self.checkpoint("card", runs.append, f"card {invoice}")
        return "paid now"

    def old_record(task_name: str, result: str) -> str:
        return f'{{"task_id":"old-{task_name}","task":"{task_name}","digest":"","result":"{result}"}}'

    legacy = {  # S -> (writer, result): as the earlier release stored them
        "payment:42": ("payments.pay", "paid before"),
        "payment:43": ("refunds.by_ref", "refunded before"),  # another task's record: never pay's
    }
    if backend[0] == "redis":
        r = redis_lib.Redis.from_url(redis_url, decode_responses=True)
        for scope, (writer, result) in legacy.items():
            r.set(f"{prefix}:v1:{{{scope}}}:done", old_record(writer, result), px=600_000)
        r.hset(f"{prefix}:v1:{{payment:42}}:cp", "card", '{"value":null}')
        r.pexpire(f"{prefix}:v1:{{payment:42}}:cp", 600_000)
        r.set(done_name(prefix, "task:t-1"), old_record("payments.pay", "x"), px=600_000)
        r.hset(f"{prefix}:v1:{{planted}}:done", "a", "a hash where a record belongs")  # skipped, no crash
        r.set(f"{prefix}:v1:{{deep}}:done", "[" * 100_000, px=600_000)
    else:
        PostgresStore(backend[0], backend[1], namespace=prefix).create_table()
        for scope, (writer, result) in legacy.items():
            with psycopg.connect(backend[0], autocommit=True) as conn:
                conn.execute(
                    f"INSERT INTO {backend[1]} (scope, name, value, task_id, expires_at) "
                    "VALUES (%s, %s, %s, %s, now() + interval '10 minutes')",
                    (f"{prefix}:v1:{{{scope}}}", "", old_record(writer, result), f"old-{writer}"),
                )
        with psycopg.connect(backend[0], autocommit=True) as conn:
            conn.execute(
                f"INSERT INTO {backend[1]} (scope, name, value, expires_at) "
                "VALUES (%s, 'cp:card', '{\"value\":null}', now() + interval '10 minutes')",
                (f"{prefix}:v1:{{payment:42}}",),
            )

    obj = CLIContext(app=app, no_color=True, workdir=None, quiet=True)
    out = CliRunner().invoke(lockguard, ["completions", "carry-over", "--yes"], obj=obj)
    assert out.exit_code == 0, out.output
    assert "carried over 1 record(s)" in out.output
    assert deliver(pay, (42,)).retval == "paid before"  # answered from the record it wrote before the upgrade
    assert deliver(pay, (43,)).retval == "paid now"  # refunds.by_ref's record did not become pay's
    assert runs == ["card 43"]
    if backend[0] == "redis":
        assert r.hget(checkpoint_name(prefix, "by:payments.pay:payment:42"), "card") == '{"value":null}'
        assert 0 < r.pttl(done_name(prefix, "by:payments.pay:payment:42")) <= 600_000
    else:
        entries = PostgresStore(backend[0], backend[1], namespace=prefix).entries("by:payments.pay:payment:42")
        assert [name for name, _, _ in entries] == ["", "cp:card"]
    again = CliRunner().invoke(lockguard, ["completions", "carry-over", "--yes"], obj=obj)
    assert "carried over 0 record(s)" in again.output  # an existing new record is never replaced
