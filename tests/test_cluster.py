"""Redis Cluster: a private three-master cluster, the full lifecycle, round trips counted on the servers.

Round trips are read from each master's ``INFO commandstats`` (reset before
the measured call), so "one EVALSHA per node per tick" and "two more round
trips when S and K live in different slots" are measured, not assumed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from structlog.testing import capture_logs

from celery_lockguard import LockContended, LockedTask
from celery_lockguard import _cluster as C
from celery_lockguard import _connection as connection
from celery_lockguard import _handoff as handoff
from celery_lockguard import _lease as L
from celery_lockguard._config import settings
from celery_lockguard._keys import checkpoint_name, claim_name, done_name, fence_name, lock_name, task_scope
from celery_lockguard._renewer import Renewer

from .harness import wait_for
from .topologies import LocalCluster

# The module's tests share one private Cluster (a module fixture): under pytest-xdist they run in one
# worker, which starts it once (make unit runs --dist loadgroup).
pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("test_cluster")]


OLD_REDIS_PY = connection.redis_py_version() < connection.CLUSTER_MIN_REDIS_PY


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    if OLD_REDIS_PY:
        pytest.skip("Cluster support needs redis-py >= 6.1 (see test_old_redis_py_refuses_cluster_clearly)")
    with LocalCluster() as c:
        yield c
    connection.forget_clients()


@pytest.fixture
def cprefix() -> str:
    return f"lgc:{uuid.uuid4().hex[:8]}"


@pytest.fixture
def app(cluster: LocalCluster, cprefix: str) -> Celery:
    a = Celery("clustertest", broker="memory://", set_as_current=False)
    a.conf.lockguard_redis_url = cluster.url
    a.conf.lockguard_redis_cluster = True
    a.conf.lockguard_key_prefix = cprefix
    a.conf.lockguard_socket_timeout = 2.0
    connection.client(settings(a)).ping()  # load the slot map now, outside any measured call
    return a


@pytest.fixture
def rc(cluster: LocalCluster) -> Any:
    return cluster.client()


def entities_on_distinct_slots(rc: Any, prefix: str, per_node: int) -> list[str]:
    """Entity keys, ``per_node`` on every master, each in a slot of its own."""
    chosen: dict[str, list[str]] = {}
    slots: set[int] = set()
    i = 0
    while any(len(chosen.get(n.name, [])) < per_node for n in rc.get_primaries()):
        key = f"e:{i}"
        i += 1
        name = lock_name(prefix, key)
        node, slot = C.node_name(rc, name), C.slot(name)
        if slot in slots or len(chosen.get(node, [])) >= per_node:
            continue
        slots.add(slot)
        chosen.setdefault(node, []).append(key)
    return [k for keys in chosen.values() for k in keys]


def task_id_in_other_slot(prefix: str, key: str) -> str:
    while True:
        tid = str(uuid.uuid4())
        if C.slot(done_name(prefix, task_scope(tid))) != C.slot(lock_name(prefix, key)):
            return tid


def test_every_key_of_an_entity_shares_its_slot_and_every_scope_key_its_own() -> None:
    for k in ("invoice:42", "tenant:alpha:sync", "x%7Dy"):
        assert len({C.slot(f(("lg"), k)) for f in (lock_name, fence_name, claim_name)}) == 1
        assert C.slot(done_name("lg", k)) == C.slot(checkpoint_name("lg", k)) == C.slot(lock_name("lg", k))
    assert C.slot(lock_name("lg", "a")) != C.slot(lock_name("lg", "b"))


def test_full_lifecycle_in_process_with_round_trips_counted(
    app: Celery, cluster: LocalCluster, rc: Any, cprefix: str
) -> None:
    seen: dict[str, Any] = {}
    runs: list[int] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="cl.charge", lock_key="invoice:{invoice_id}")
    def charge(self: Any, invoice_id: int) -> dict[str, Any]:
        runs.append(invoice_id)
        if invoice_id == 0:  # the warm-up run; the measured run sends nothing of the test's own
            seen["token"] = rc.hget(lock_name(cprefix, f"invoice:{invoice_id}"), "token")
        seen["lease"] = self.lock
        return {"paid": invoice_id}

    tid = task_id_in_other_slot(cprefix, "invoice:7")
    assert C.split_done(rc, lock_name(cprefix, "invoice:7"), done_name(cprefix, task_scope(tid)))
    charge.apply(args=(0,))  # warm up: scripts loaded, connections open on every node
    assert seen["token"] == seen["lease"].token and seen["lease"].released
    with capture_logs() as logs:
        result, sent = cluster.top_level_commands(lambda: charge.apply(args=(7,), task_id=tid).get())
    assert result == {"paid": 7}
    # ACQUIRE, then GET of the record (another slot); SET NX PX of the record, then RELEASE.
    verbs = [cmd.split()[0].strip('"').upper() for _, cmd in sent]
    assert verbs == ["EVALSHA", "GET", "SET", "EVALSHA"], sent
    assert seen["lease"].key == "invoice:7" and seen["lease"].released
    assert not rc.exists(lock_name(cprefix, "invoice:7"))
    record = rc.get(done_name(cprefix, task_scope(tid)))
    assert record is not None and '"paid":7' in record
    assert 0 < rc.pttl(done_name(cprefix, task_scope(tid))) <= 3600_000
    assert [e["event"] for e in logs if e["event"].startswith("lock.")] == ["lock.acquired", "lock.released"]

    # A redelivery of the same id finds the record under its fresh lease and gives the lease back.
    assert charge.apply(args=(7,), task_id=tid).get() == {"paid": 7}
    assert runs == [0, 7]
    assert not rc.exists(lock_name(cprefix, "invoice:7"))


def test_scope_in_the_entity_slot_costs_no_extra_round_trip(app: Celery, cluster: LocalCluster, rc: Any) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="cl.sync", idempotency_key="tenant:{tenant}:sync")
    def sync(self: Any, tenant: str) -> str:
        return tenant

    sync.apply(args=("warm-up",))
    result, sent = cluster.top_level_commands(lambda: sync.apply(args=("alpha",)).get())
    assert result == "alpha"
    assert [cmd.split()[0].strip('"').upper() for _, cmd in sent] == ["EVALSHA", "EVALSHA"], sent
    result, sent = cluster.top_level_commands(lambda: sync.apply(args=("alpha",)).get())
    assert result == "alpha" and len(sent) == 1  # recorded: answered inside ACQUIRE


def test_contended_holder_and_a_recorded_scope_while_held(app: Celery, rc: Any, cprefix: str) -> None:
    ran: list[str] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="cl.raise", lock_key="acct:{a}", on_locked="raise")
    def t(self: Any, a: str) -> str:
        ran.append(a)
        return a

    holder = L.acquire(
        rc,
        cprefix,
        "acct:1",
        ttl_ms=10_000,
        task_id="other",
        task_name="x",
        digest="d",
        worker="w",
        fence_ttl_ms=60_000,
    )
    assert isinstance(holder, L.Lease)
    with pytest.raises(LockContended):
        t.apply(args=("1",), task_id=task_id_in_other_slot(cprefix, "acct:1")).get()
    # The scope of this id already completed: the record wins even while someone else holds the entity.
    tid = task_id_in_other_slot(cprefix, "acct:1")
    rc.set(done_name(cprefix, task_scope(tid)), '{"task_id":"earlier","result":"from-record"}')
    assert t.apply(args=("1",), task_id=tid).get() == "from-record"
    assert ran == []
    assert rc.hget(lock_name(cprefix, "acct:1"), "token") == holder.token


def test_record_is_written_before_the_lease_is_freed(rc: Any, cprefix: str) -> None:
    got = L.acquire(
        rc, cprefix, "inv:1", ttl_ms=10_000, task_id="t", task_name="n", digest="d", worker="w", fence_ttl_ms=60_000
    )
    assert isinstance(got, L.Lease)
    scope = "scope-elsewhere"
    assert C.split_done(rc, got.redis_key, done_name(cprefix, scope))
    assert L.release(rc, got, cprefix, scope, '{"result":1}', 10_000) == (1, 1)
    again = L.acquire(
        rc,
        cprefix,
        "inv:1",
        ttl_ms=10_000,
        task_id="t2",
        task_name="n",
        digest="d",
        worker="w",
        fence_ttl_ms=60_000,
        scope=scope,
    )
    assert isinstance(again, L.Done) and again.record == '{"result":1}'
    assert not rc.exists(lock_name(cprefix, "inv:1"))  # the fresh lease was given back
    # first record wins across the split too
    late = L.Lease("inv:1", cprefix, "gone", 1, 1000, time.monotonic(), "t3", "n")
    assert L.release(rc, late, cprefix, scope, '{"result":2}', 10_000) == (0, 0)
    assert rc.get(done_name(cprefix, scope)) == '{"result":1}'


def test_renew_is_one_evalsha_per_node_whatever_the_slots(cluster: LocalCluster, rc: Any, cprefix: str) -> None:
    keys = entities_on_distinct_slots(rc, cprefix, per_node=3)
    leases = []
    for k in keys:
        got = L.acquire(
            rc, cprefix, k, ttl_ms=5_000, task_id="t", task_name="n", digest="d", worker="w", fence_ttl_ms=60_000
        )
        assert isinstance(got, L.Lease)
        leases.append(got)
    assert L.renew(rc, leases) == [1] * len(leases)  # first call: NOSCRIPT and SCRIPT LOAD on each node
    rc.hset(leases[4].redis_key, "token", "stolen")
    cluster.reset_stats()
    results = L.renew(rc, leases)
    assert results == [0 if i == 4 else 1 for i in range(len(leases))]
    assert cluster.per_node("evalsha") == [1, 1, 1]
    assert all(4_000 < rc.pttl(x.redis_key) <= 5_000 for i, x in enumerate(leases) if i != 4)


def test_renewer_thread_ticks_once_per_node(app: Celery, cluster: LocalCluster, rc: Any, cprefix: str) -> None:
    client = connection.client(settings(app))
    keys = entities_on_distinct_slots(rc, cprefix, per_node=2)
    leases = []
    for k in keys:
        got = L.acquire(
            client, cprefix, k, ttl_ms=600, task_id="t", task_name="n", digest="d", worker="w", fence_ttl_ms=60_000
        )
        assert isinstance(got, L.Lease)
        leases.append(got)
    assert L.renew(client, leases) == [1] * len(leases)  # scripts loaded before counting
    r = Renewer()
    cluster.reset_stats()
    for lease in leases:
        r.track(lease, client, max_hold=60)
    wait_for(lambda: r.ticks >= 4, 10, what="four renewal ticks")
    for lease in leases:
        r.untrack(lease)
    # Every tick sent exactly one EVALSHA to each master, and kept every lease alive past its 600 ms TTL.
    wait_for(lambda: cluster.per_node("evalsha") == [r.ticks] * 3, 5, what=f"one EVALSHA per node per tick ({r.ticks})")
    assert all(lease.held for lease in leases)
    assert all(rc.exists(lease.redis_key) for lease in leases)


def test_renew_falls_back_to_one_call_per_slot_after_a_slot_moved(cluster: LocalCluster, rc: Any, cprefix: str) -> None:
    keys = entities_on_distinct_slots(rc, cprefix, per_node=2)[:2]  # two slots of one node
    leases = []
    for k in keys:
        got = L.acquire(
            rc, cprefix, k, ttl_ms=5_000, task_id="t", task_name="n", digest="d", worker="w", fence_ttl_ms=60_000
        )
        assert isinstance(got, L.Lease)
        leases.append(got)
    assert L.renew(rc, leases) == [1, 1]  # scripts loaded; rc's slot map is about to go stale
    moving = leases[1].redis_key
    slot = C.slot(moving)
    source = rc.get_node_from_key(moving)
    dest = next(n for n in rc.get_primaries() if n.name != source.name)
    src_c, dst_c = rc.get_redis_connection(source), rc.get_redis_connection(dest)
    src_id, dst_id = src_c.execute_command("CLUSTER", "MYID"), dst_c.execute_command("CLUSTER", "MYID")
    # Move the slot the way redis-cli --cluster reshard does.
    dst_c.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src_c.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    src_c.execute_command("MIGRATE", "127.0.0.1", dest.port, "", 0, 5000, "KEYS", moving)
    for c in cluster.node_clients():
        c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    assert dst_c.exists(moving)
    rc.hset(leases[0].redis_key, "renewed_at", 0)
    src_c.config_resetstat()
    # rc still groups both leases on the source node: the node-wide script is refused there,
    # and renewal goes on slot by slot (the moved one following MOVED to its new node).
    assert L.renew(rc, leases) == [1, 1]
    assert int(rc.hget(leases[0].redis_key, "renewed_at")) > 0
    assert 4_000 < dst_c.pttl(moving) <= 5_000
    assert C.node_name(rc, moving) == dest.name  # the map was refreshed on the way
    refused = src_c.info("commandstats")["cmdstat_evalsha"]
    assert int(refused["failed_calls"]) >= 1  # the node-wide try really was refused


def test_scripts_reload_on_every_node_after_script_flush(app: Celery, cluster: LocalCluster) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="cl.flush", lock_key="f:{a}")
    def t(self: Any, a: int) -> int:
        return a

    for c in cluster.node_clients():
        c.script_flush()
    assert [t.apply(args=(i,)).get() for i in range(12)] == list(range(12))


def test_lock_replicas_on_cluster_counts_zero_replicas(app: Celery, cprefix: str) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="cl.repl", lock_key="r:{a}", lock_replicas=1, lock_ttl=2)
    def t(self: Any, a: int) -> int | None:
        return self.lock.replicas

    with capture_logs() as logs:
        assert t.apply(args=(1,)).get() == 0
    under = [e for e in logs if e["event"] == "lock.under_replicated"]
    assert len(under) == 1 and under[0]["replicas"] == 0 and under[0]["wanted"] == 1


# -- the CLI and a real worker on the cluster -----------------------------------------------------


@pytest.mark.integration
def test_cli_locks_stats_doctor_and_release_cover_every_master(
    cluster: LocalCluster, rc: Any, prefix: str, redis_url: str
) -> None:
    from .conftest import make_cfg
    from .test_cli import cli, cli_json

    cfg = make_cfg(prefix, redis_url, lock_url=cluster.url, lock_cluster=True)
    keys = entities_on_distinct_slots(rc, prefix, per_node=2)
    for k in keys:
        got = L.acquire(
            rc,
            prefix,
            k,
            ttl_ms=60_000,
            task_id=f"id-{k}",
            task_name="n",
            digest="d",
            worker="w",
            fence_ttl_ms=60_000,
        )
        assert isinstance(got, L.Lease)
    rows = cli_json(cfg, "locks")
    assert sorted(r["key"] for r in rows) == sorted(keys)
    assert len({C.node_name(rc, r["redis_key"]) for r in rows}) == 3

    from celery_lockguard import _metrics as metrics

    metrics.count("cl.task", "lock.acquired", 7)
    metrics.flush(rc, prefix)
    summary = cli_json(cfg, "stats")
    assert summary["tasks"]["cl.task"]["windows"]["total"]["acquisitions"] == 7

    evicting = cluster.node_clients()[2]
    evicting.config_set("maxmemory-policy", "allkeys-lru")
    try:
        report = cli_json(cfg, "doctor", code=1)
    finally:
        evicting.config_set("maxmemory-policy", "noeviction")
    policy = [f for f in report["findings"] if f["code"] == "maxmemory_policy"]
    assert len(policy) == 1 and "1 of 3 masters" in policy[0]["message"], report

    victim = keys[3]
    out = cli(cfg, "release", victim, "--yes")
    assert out.returncode == 0, out.stderr
    assert sorted(r["key"] for r in cli_json(cfg, "locks")) == sorted(k for k in keys if k != victim)
    bad = cli(cfg, "release", "x}y", "--yes")
    assert bad.returncode == 64 and "not an entity key" in bad.stderr


@pytest.mark.integration
def test_real_worker_on_the_cluster_runs_duplicates_one_at_a_time(
    fleet: Any, cluster: LocalCluster, rc: Any, prefix: str, redis_url: str
) -> None:
    import redis as redis_py

    from .conftest import make_cfg
    from .test_workers import intervals, overlapping, records

    cfg = make_cfg(prefix, redis_url, lock_url=cluster.url, lock_cluster=True)
    fleet.worker(cfg)
    app = fleet.app(cfg)
    hot = f"hot-{uuid.uuid4().hex[:6]}"
    results = [app.tasks["hold_wait"].delay(hot, 0.2, f"d{i}") for i in range(4)]
    results += [app.tasks["short_ttl"].delay(f"long-{hot}", 2.5, "long")]
    outs = [res.get(timeout=90) for res in results]
    assert all(o["held"] for o in outs), outs
    spans = intervals(records(redis_py.Redis.from_url(redis_url, decode_responses=True), prefix, hot))
    assert len(spans) == 4 and overlapping(spans) == []
    fences = [o["fence"] for o in outs[:4]]
    assert len(set(fences)) == 4
    # The 1 s lease of the long body was renewed on its node through 2.5 s, then released.
    assert not outs[4]["lost"]
    assert not rc.exists(lock_name(prefix, f"res:long-{hot}"))
    for res in results:  # every completion record landed in its own slot
        assert rc.get(done_name(prefix, task_scope(res.id))) is not None


def test_checkpoints_and_metrics_flush_are_one_slot_transactions(app: Celery, rc: Any, cprefix: str) -> None:
    from celery_lockguard import _metrics as metrics
    from celery_lockguard import _stats as stats

    calls: list[int] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="cl.cp", lock_key="cp:{a}")
    def t(self: Any, a: int) -> Any:
        return self.checkpoint("step", lambda: calls.append(a) or [a, "x"])

    assert t.apply(args=(1,), task_id="cp-1").get() == [1, "x"]
    assert rc.hget(checkpoint_name(cprefix, task_scope("cp-1")), "step") == '{"value":[1,"x"]}'
    metrics.count("cl.cp", "test.marker", 2)
    held = L.Lease("cp:9", cprefix, "tok", 1, 30_000, time.monotonic(), "cp-9", "cl.cp")
    metrics.lease_held(held, "w1@h")  # the held-now gauge goes in the same transaction
    assert metrics.flush(rc, cprefix) > 0  # MULTI/EXEC on the {fleet} slot
    raw = stats.read(rc, cprefix)  # its ZRANGE and MGET stay on the {fleet} slot too
    assert raw["total"]["cl.cp|test.marker"] == "2"
    assert [(g["task"], g["worker"], g["held"]) for g in raw["gauges"]] == [("cl.cp", "w1@h", 1)]
    metrics.lease_ended(held)
    metrics.flush(rc, cprefix)
    assert stats.read(rc, cprefix)["gauges"] == []
    assert calls == [1]


@pytest.mark.skipif(not OLD_REDIS_PY, reason="this redis-py supports Cluster transactions")
def test_old_redis_py_refuses_cluster_clearly() -> None:
    from celery_lockguard import ConfigurationError

    a = Celery("old", broker="memory://", set_as_current=False)
    a.conf.lockguard_redis_url = "redis://127.0.0.1:1/0"
    a.conf.lockguard_redis_cluster = True
    with pytest.raises(ConfigurationError, match=r"redis-py >= 6\.1"):
        connection.client(settings(a))


def test_slot_leases_fences_and_the_start_window_share_the_entity_slot() -> None:
    from celery_lockguard._keys import rate_name, slot_fence_name, slot_lock_name

    for k in ("tenant:acme:export", "x%7Dy"):
        names = [slot_lock_name("lg", k, i) for i in range(4)] + [slot_fence_name("lg", k, i) for i in range(4)]
        assert len({C.slot(n) for n in (*names, rate_name("lg", k), lock_name("lg", k))}) == 1


def test_lock_limit_and_lock_rate_on_cluster_run_in_one_script_per_acquire(app: Celery, rc: Any, cprefix: str) -> None:
    """ACQUIRE_SLOTS touches N slots and the window of one entity: one node, one call, no CROSSSLOT."""
    from celery_lockguard._keys import rate_name

    def take(i: int) -> Any:
        return L.acquire(
            rc, cprefix, "tenant:c", ttl_ms=5000, task_id=f"t{i}", task_name="n", digest=f"d{i}", worker="w",
            fence_ttl_ms=60_000, limit=2, rate=(3, 60_000),
        )  # fmt: skip

    held = [take(i) for i in range(4)]
    assert [type(x).__name__ for x in held] == ["Lease", "Lease", "Holder", "Holder"]
    assert L.renew(rc, [held[0], held[1]]) == [1, 1]
    for lease in held[:2]:
        assert L.release(rc, lease, cprefix)[0] == 1
    third = take(9)
    assert isinstance(third, L.Lease) and rc.zcard(rate_name(cprefix, "tenant:c")) == 3
    L.release(rc, third, cprefix)
    assert isinstance(take(10), L.Throttled)


def test_a_recorded_redelivery_under_lock_rate_spends_no_start_on_cluster(app: Celery, rc: Any, cprefix: str) -> None:
    """The task-id record lives in another slot than the entity, so it is read after ACQUIRE_SLOTS: a record
    found then gives the start back, and a full window does not refuse work that already ran (review, issue 16)."""
    from celery_lockguard import LockThrottled
    from celery_lockguard._keys import rate_name

    runs: list[str] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="cl.push", lock_key="partner:{acct}", lock_rate="2/m",
              on_locked="raise")  # fmt: skip
    def push(self: Any, acct: str, payload: str) -> str:
        runs.append(payload)
        return payload

    tid = task_id_in_other_slot(cprefix, "partner:a")
    assert push.apply(args=("a", "p1"), task_id=tid).get() == "p1"
    assert push.apply(args=("a", "p1"), task_id=tid).get() == "p1"  # answered from its record
    assert rc.zcard(rate_name(cprefix, "partner:a")) == 1  # its fresh lease's start was taken back
    assert push.apply(args=("a", "p2")).get() == "p2"  # the window's second start, for new work
    assert push.apply(args=("a", "p1"), task_id=tid).get() == "p1"  # full window: still answered, not throttled
    with pytest.raises(LockThrottled):
        push.apply(args=("a", "p3")).get()
    assert runs == ["p1", "p2"]


def test_debounce_keys_share_the_entity_slot_and_its_scripts_run_on_cluster(app: Celery, rc: Any) -> None:
    from celery_lockguard import _debounce as debounce
    from celery_lockguard._keys import debounce_name, debounce_run_name

    for k in ("invoice:42", "doc:7", "x%7Dy"):
        names = (debounce_name("lg", k, "t"), debounce_run_name("lg", k, "t", "burst"), lock_name("lg", k))
        assert len({C.slot(n) for n in names}) == 1

    @app.task(base=LockedTask, shared=False, name="c.reindex", lock_key="doc:{d}", lock_debounce=0.05)
    def reindex(d: int, v: int) -> int:
        return v

    first, last = reindex.delay(1, 0), reindex.delay(1, 1)  # the memory broker: nothing is delivered
    s, opts = settings(app), reindex.lockguard_options
    client = connection.client(s)
    assert debounce.take(client, s, opts, "doc:1", "c.reindex", first.id, first.id) == ("superseded", last.id)

    def due() -> tuple[str, str] | None:
        answer = debounce.take(client, s, opts, "doc:1", "c.reindex", last.id, first.id)
        return None if answer[0] == "early" else answer

    assert wait_for(due, 10, what="the burst to fall due") == ("take", "")
    assert debounce.take(client, s, opts, "doc:1", "c.reindex", first.id, first.id) == ("superseded", last.id)
    assert rc.get(debounce_run_name(s.key_prefix, "doc:1", "c.reindex", first.id)) == last.id
    # DEBOUNCE_START (record and run key, one slot): the taken run starts, marked started.
    from celery_lockguard import _keys as keys
    from celery_lockguard import _scripts as scripts

    record, run = (
        debounce_name(s.key_prefix, "doc:1", "c.reindex"),
        debounce_run_name(s.key_prefix, "doc:1", "c.reindex", first.id),
    )
    assert scripts.debounce_start(client, [record, run], [keys.meta(last.id), 15_000]) in (
        [b"run", b""],
        ["run", ""],
    )
    assert rc.hget(record, "started") == last.id


def test_a_slot_past_a_lowered_lock_limit_is_read_on_cluster(rc: Any, cprefix: str) -> None:
    """The names of slots past N are built inside ACQUIRE_SLOTS: they keep {K}, so the node runs it."""

    def take(limit: int, task_id: str, **kw: Any) -> Any:
        return L.acquire(
            rc, cprefix, "tenant:d", ttl_ms=5000, task_id=task_id, task_name="n", digest=task_id, worker="w",
            fence_ttl_ms=60_000, limit=limit, **kw,
        )  # fmt: skip

    first = [take(3, f"o{i}") for i in range(2)]
    held = take(3, "t1")
    assert held.slot == 2
    for lease in first:
        L.release(rc, lease, cprefix)
    again = take(2, "t1")
    assert isinstance(again, L.Holder) and again.slot == 2 and again.token == held.token


def test_the_single_lease_and_the_slots_exclude_each_other_on_cluster(rc: Any, cprefix: str) -> None:
    """ACQUIRE, PARK and RELEASE build slot names from K's keys: they keep {K}, so one node runs each script."""

    def take(limit: int, task_id: str) -> Any:
        return L.acquire(
            rc, cprefix, "tenant:x", ttl_ms=5000, task_id=task_id, task_name="n", digest=task_id, worker="w",
            fence_ttl_ms=60_000, limit=limit,
        )  # fmt: skip

    s0, s1 = take(2, "e0"), take(2, "e1")
    L.release(rc, s0, cprefix)
    met = take(1, "d")
    assert isinstance(met, L.Holder) and (met.task_id, met.slot) == ("e1", 1)

    parked = handoff.park(rc, cprefix, "tenant:x", "p1", "{}", task_id="d", task_name="n", digest="d", countdown=5)
    assert parked.kind == "parked"
    released, _, woken = L.release_and_wake(rc, s1, cprefix, reserve_ms=3000)
    assert released == 1 and woken is not None and woken.park_token == "p1"
    assert isinstance(take(2, "e2"), L.Holder), "the waiter's reservation excludes the slots"


# -- several entities on Cluster (issue 32): in sorted order, all or nothing, rolled back when one is held --


def test_several_entities_in_different_slots_are_taken_in_order_and_released_with_round_trips_counted(
    app: Celery, cluster: LocalCluster, rc: Any, cprefix: str
) -> None:
    a, b = sorted(entities_on_distinct_slots(rc, cprefix, 1)[:2])
    seen: dict[str, Any] = {}

    @app.task(base=LockedTask, bind=True, shared=False, name="cl.pair", lock_key=("{x}", "{y}"))
    def pair(self: Any, x: str, y: str) -> dict[str, int]:
        seen["siblings"] = {k: rc.hget(lock_name(cprefix, k), "siblings") for k in (a, b)}
        seen["token"] = {rc.hget(lock_name(cprefix, k), "token") for k in (a, b)}
        return self.lock.fences

    pair.apply(args=(b, a))  # warm up: scripts loaded on every node
    tid = task_id_in_other_slot(cprefix, a)
    fences, sent = cluster.top_level_commands(lambda: pair.apply(args=(b, a), task_id=tid).get())
    assert set(fences) == {a, b} and len(seen["token"]) == 1  # one token for the whole acquisition
    assert seen["siblings"] == {a: f'["{b}"]', b: f'["{a}"]'}
    # GET of the record (its own slot), one ACQUIRE_MULTI per entity, GET again under every lease;
    # SET NX PX of the record, one RELEASE_MULTI per entity.
    verbs = [cmd.split()[0].strip('"').upper() for _, cmd in sent]
    verbs = [v for v in verbs if v != "HGET"]  # the body's own reads
    assert verbs == ["GET", "EVALSHA", "EVALSHA", "GET", "SET", "EVALSHA", "EVALSHA"], sent
    assert not rc.exists(lock_name(cprefix, a)) and not rc.exists(lock_name(cprefix, b))


def test_a_held_entity_on_another_slot_rolls_back_what_was_taken(
    app: Celery, cluster: LocalCluster, rc: Any, cprefix: str
) -> None:
    from celery_lockguard import _multi as M

    a, b = sorted(entities_on_distinct_slots(rc, cprefix, 1)[:2])
    blocker = L.acquire(
        rc, cprefix, b, ttl_ms=10_000, task_id="blocker", task_name="x", digest="d", worker="w", fence_ttl_ms=60_000
    )
    assert isinstance(blocker, L.Lease)
    fence_a = int(rc.get(fence_name(cprefix, a)) or 0)
    got, sent = cluster.top_level_commands(
        lambda: M.acquire(
            rc, cprefix, (a, b), ttl_ms=5000, task_id="t", task_name="n", digest="d", worker="w", fence_ttl_ms=60_000
        )
    )
    assert isinstance(got, L.Holder) and got.entity == b and got.task_id == "blocker"
    # a taken, b refused, a given back (token-checked): never a body on part of the set
    assert [cmd.split()[0].strip('"').upper() for _, cmd in sent] == ["EVALSHA", "EVALSHA", "EVALSHA"], sent
    assert not rc.exists(lock_name(cprefix, a))
    assert int(rc.get(fence_name(cprefix, a)) or 0) > fence_a  # a was taken for that moment (a fence was issued)
    L.release(rc, blocker, cprefix)
    lease = M.acquire(
        rc, cprefix, (a, b), ttl_ms=5000, task_id="t", task_name="n", digest="d", worker="w", fence_ttl_ms=60_000
    )
    assert isinstance(lease, L.MultiLease)
    assert L.renew(rc, [lease]) == [1]  # every entity renewed (one EVALSHA per node)
    rc.delete(lock_name(cprefix, b))
    assert L.renew(rc, [lease]) == [0]  # one entity gone: the lease is lost
    assert M.release(rc, lease, cprefix)[0] == 0
    assert not rc.exists(lock_name(cprefix, a))


def test_a_woken_copy_keeps_what_it_took_before_the_blocker_on_another_slot(
    cluster: LocalCluster, rc: Any, cprefix: str
) -> None:
    from celery_lockguard import _multi as M

    a, b, c = sorted(entities_on_distinct_slots(rc, cprefix, 1)[:3])
    blocker = L.acquire(
        rc, cprefix, b, ttl_ms=10_000, task_id="blocker", task_name="x", digest="d", worker="w", fence_ttl_ms=60_000
    )
    assert isinstance(blocker, L.Lease)
    rc.hset(lock_name(cprefix, c), mapping={"token": "p-old", "state": "handed", "ttl": 5000})  # woken on c
    rc.pexpire(lock_name(cprefix, c), 5000)
    got = M.acquire(
        rc, cprefix, (a, b, c), ttl_ms=5000, task_id="t", task_name="n", digest="d", worker="w",
        fence_ttl_ms=60_000, replace_token="p-old", reserved="p-old", reserve_ms=2000,
    )  # fmt: skip
    assert isinstance(got, L.Holder) and got.entity == b
    # a (before the blocker) stays reserved for the woken copy instead of being rolled back
    assert rc.hget(lock_name(cprefix, a), "token") == "p-old" and rc.hget(lock_name(cprefix, a), "state") == "handed"
    # the delivery then keeps a for its wait and gives back c (after b): one KEEP_BEFORE per slot
    kept, woken = M.keep_before(rc, cprefix, (a, b, c), "p-old", "p-new", b, 40_000, 2000)
    assert (kept, woken) == ([a], None)
    assert rc.hget(lock_name(cprefix, a), "token") == "p-new" and rc.pttl(lock_name(cprefix, a)) > 30_000
    assert not rc.exists(lock_name(cprefix, c))
    L.release(rc, blocker, cprefix)
    lease = M.acquire(
        rc, cprefix, (a, b, c), ttl_ms=5000, task_id="t", task_name="n", digest="d", worker="w",
        fence_ttl_ms=60_000, replace_token="p-new",
    )  # fmt: skip
    assert isinstance(lease, L.MultiLease)  # the kept reservation is adopted
    assert M.release(rc, lease, cprefix)[0] == 1


# -- a per-entity loop failing part way on Cluster: the waiters of the other entities still wake ----------


def _park(rc: Any, prefix: str, key: str, token: str) -> None:
    parked = handoff.park(rc, prefix, key, token, "{}", task_id=f"w-{key}", task_name="n", digest="d", countdown=5)
    assert parked.kind == "parked"


def _wrong_type(rc: Any, prefix: str, key: str) -> None:
    """``key``'s lease hash turned into a string: its entity's script fails with WRONGTYPE."""
    ttl = max(rc.pttl(lock_name(prefix, key)), 5000)
    rc.delete(lock_name(prefix, key))
    rc.set(lock_name(prefix, key), "planted", px=ttl)


def test_release_failing_at_one_entity_still_frees_and_wakes_the_others(rc: Any, cprefix: str) -> None:
    """RELEASE_MULTI per slot: b's error neither stops c's release nor loses a's and c's woken waiters."""
    from celery_lockguard import _multi as M

    a, b, c = sorted(entities_on_distinct_slots(rc, cprefix, 1)[:3])
    lease = M.acquire(
        rc, cprefix, (a, b, c), ttl_ms=10_000, task_id="t", task_name="n", digest="d", worker="w", fence_ttl_ms=60_000
    )
    assert isinstance(lease, L.MultiLease)
    _park(rc, cprefix, a, "pa")
    _park(rc, cprefix, c, "pc")
    _wrong_type(rc, cprefix, b)
    with pytest.raises(M.Unfinished) as raised:
        M.release(rc, lease, cprefix, reserve_ms=3000)
    error, woken = M.split(raised.value)
    assert "WRONGTYPE" in str(error)
    assert woken is not None and {(w.key, w.park_token) for w in (woken, *woken.also)} == {(a, "pa"), (c, "pc")}
    for key, token in ((a, "pa"), (c, "pc")):  # handed to their waiters, c too although it came after b
        assert rc.hget(lock_name(cprefix, key), "token") == token
        assert rc.hget(lock_name(cprefix, key), "state") == "handed"
    assert rc.get(lock_name(cprefix, b)) == "planted"


def test_keep_before_failing_at_one_entity_still_wakes_the_others(rc: Any, cprefix: str) -> None:
    """KEEP_BEFORE per slot, giving every reservation back: b's error does not lose a's and c's waiters."""
    from celery_lockguard import _multi as M

    a, b, c = sorted(entities_on_distinct_slots(rc, cprefix, 1)[:3])
    for key in (a, b, c):  # a woken copy's reservations, token p-old, each with a waiter parked behind it
        rc.hset(lock_name(cprefix, key), mapping={"token": "p-old", "state": "handed", "ttl": 5000})
        rc.pexpire(lock_name(cprefix, key), 5000)
    _park(rc, cprefix, a, "pa")
    _park(rc, cprefix, c, "pc")
    _wrong_type(rc, cprefix, b)
    with pytest.raises(M.Unfinished) as raised:
        M.keep_before(rc, cprefix, (a, b, c), "p-old", "", "", 0, 3000)
    error, woken = M.split(raised.value)
    assert "WRONGTYPE" in str(error)
    assert woken is not None and {(w.key, w.park_token) for w in (woken, *woken.also)} == {(a, "pa"), (c, "pc")}
    assert rc.hget(lock_name(cprefix, c), "token") == "pc"


def test_a_release_failing_at_one_entity_publishes_the_other_waiters_from_the_tracer(
    app: Celery, rc: Any, cprefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the real tracer: the body succeeds, the release reports the error and still wakes a's waiter."""
    a, b = sorted(entities_on_distinct_slots(rc, cprefix, 1)[:2])
    published: list[dict[str, Any]] = []
    monkeypatch.setattr(handoff, "publish", lambda _app, spec: published.append(spec))

    @app.task(base=LockedTask, shared=False, name="cl.part", lock_key=("{x}", "{y}"))
    def part(x: str, y: str) -> str:
        _park(rc, cprefix, a, "pa")  # parks behind this holder
        _wrong_type(rc, cprefix, b)
        return "done"

    with capture_logs() as logs:
        assert part.apply(args=(a, b)).get() == "done"
    assert [e for e in logs if e["event"] == "lock.backend_unavailable" and "WRONGTYPE" in e["reason"]]
    assert len(published) == 1, "a's waiter is woken although b's release failed"
    assert rc.hget(lock_name(cprefix, a), "token") == "pa"
