"""``lockguard doctor``: settings that fight each other (issue 18, item 4).

Each check gets an app built with the conflicting settings (the code must
appear) and one where they do not fight (the code must be absent). The lock
Redis is a private server per test (``own_redis``, or a ``RedisServer`` started
with an evicting policy): the shared 6379 is never reconfigured, and its other
tenants' keys would make ``cache_traffic`` findings. The broker is never
contacted by doctor, so a RabbitMQ URL needs no connection.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from celery.schedules import crontab
from click.testing import CliRunner, Result
from kombu import Queue

from celery_lockguard import LockedTask, acl
from celery_lockguard import _connection as connection
from celery_lockguard import _doctor as doctor
from celery_lockguard import _metrics as metrics
from celery_lockguard._config import reset
from celery_lockguard._doctor_beat import delay_of, period_of
from celery_lockguard.testing import RedisServer

from .harness import ROOT

pytestmark = pytest.mark.integration

AMQP = "amqp://guest:guest@127.0.0.1:5672//"


@pytest.fixture(autouse=True)
def _forget_clients() -> Iterator[None]:
    yield
    connection.forget_clients()


def make_app(lock_url: str, prefix: str, broker: str | None = None, **conf: Any) -> Celery:
    """An app whose locks live on ``lock_url``; the broker is the same Redis unless given."""
    app = Celery("conflicts", broker=broker or lock_url, set_as_current=False)
    app.conf.update(lockguard_redis_url=lock_url, lockguard_key_prefix=prefix, **conf)
    # Shared tasks other test modules registered (example_app's, @shared_task) join every new app at
    # finalize: drop them, so a finding's task list is this test's alone whatever ran before it.
    app.finalize()
    for name in [n for n in app.tasks if not n.startswith("celery.")]:
        del app.tasks[name]
    return app


def locked(app: Celery, name: str, **options: Any) -> Any:
    """A ``LockedTask`` named ``name`` on ``app`` with ``options``."""

    @app.task(base=LockedTask, bind=True, shared=False, name=name, lock_key="k:{n}", **options)
    def task(self: Any, n: int = 0) -> None: ...

    return task


def found(app: Celery, consumer_timeout: float | None = None) -> dict[str, doctor.Finding]:
    """The findings by code; a per-task code's findings merged into one (their tasks, their messages)."""
    reset(app)
    merged: dict[str, doctor.Finding] = {}
    for f in doctor.run(app, consumer_timeout=consumer_timeout):
        if f.code in merged:
            merged[f.code].tasks += f.tasks
            merged[f.code].message += "\n" + f.message
        else:
            merged[f.code] = doctor.Finding(f.code, f.message, list(f.tasks))
    return merged


def codes_of(stdout: str) -> dict[str, dict[str, Any]]:
    """``doctor --json`` findings by code, a per-task code's tasks merged."""
    merged: dict[str, dict[str, Any]] = {}
    for f in json.loads(stdout)["findings"]:
        entry = merged.setdefault(f["code"], {"message": "", "tasks": []})
        entry["message"] += f["message"] + "\n"
        entry["tasks"] += f["tasks"]
    return merged


def invoke(app: Celery, *args: str) -> Result:
    from celery_lockguard._cli import lockguard

    reset(app)
    return CliRunner().invoke(lockguard, list(args), obj=CLIContext(app=app, no_color=True, workdir=None, quiet=True))


# -- a run longer than visibility_timeout ---------------------------------------------------------


def test_a_lock_hold_past_the_visibility_timeout_is_flagged(own_redis: RedisServer, prefix: str) -> None:
    app = make_app(own_redis.url, prefix, broker_transport_options={"visibility_timeout": 600})
    locked(app, "vt.long_hold", acks_late=True, lock_max_hold=7200)  # renewed for up to 2 h, no time limit
    locked(app, "vt.no_renew", acks_late=True, lock_renew=False, lock_ttl=900)
    locked(app, "vt.short", acks_late=True, lock_max_hold=300)
    locked(app, "vt.early_ack", lock_max_hold=7200)  # acknowledged at start: never redelivered while it runs
    locked(app, "vt.unbounded", acks_late=True)  # nothing says how long it runs: no bound, no finding
    f = found(app)["visibility_timeout_below_lock_hold"]
    assert f.tasks == ["vt.long_hold", "vt.no_renew"]
    assert "visibility_timeout=600s (10 min)" in f.message and "lock_max_hold=7200s" in f.message


def test_a_lock_hold_within_the_visibility_timeout_is_not_flagged(own_redis: RedisServer, prefix: str) -> None:
    app = make_app(own_redis.url, prefix, broker_transport_options={"visibility_timeout": 10_800})
    locked(app, "vt.long_hold", acks_late=True, lock_max_hold=7200)
    assert "visibility_timeout_below_lock_hold" not in found(app)
    # On RabbitMQ there is no visibility timeout: the same hold is judged against consumer_timeout instead.
    amqp = make_app(own_redis.url, prefix, broker=AMQP, broker_transport_options={"visibility_timeout": 600})
    locked(amqp, "vt.long_hold", acks_late=True, lock_max_hold=7200)
    codes = found(amqp)
    assert "visibility_timeout_below_lock_hold" not in codes and "consumer_timeout_below_time_limit" in codes


def test_a_time_limit_past_the_visibility_timeout_keeps_its_own_code(own_redis: RedisServer, prefix: str) -> None:
    app = make_app(own_redis.url, prefix, broker_transport_options={"visibility_timeout": 600}, task_time_limit=900)
    locked(app, "vt.limited", acks_late=True, lock_max_hold=7200)
    codes = found(app)
    assert codes["visibility_timeout_below_time_limit"].tasks == ["vt.limited"]
    assert "visibility_timeout_below_lock_hold" not in codes  # one finding per cause, not two


# -- countdowns and etas beyond the redelivery timer ---------------------------------------------


def test_a_beat_countdown_past_the_visibility_timeout_is_flagged(own_redis: RedisServer, prefix: str) -> None:
    eta = datetime.now(timezone.utc) + timedelta(hours=2)
    app = make_app(
        own_redis.url,
        prefix,
        broker_transport_options={"visibility_timeout": 600},
        beat_schedule={
            "late": {"task": "cd.report", "schedule": 3600.0, "options": {"countdown": 900}},
            "later": {"task": "cd.plain", "schedule": 86400.0, "options": {"eta": eta}},
            "soon": {"task": "cd.soon", "schedule": 3600.0, "options": {"countdown": 300}},
        },
    )
    locked(app, "cd.report")
    locked(app, "cd.soon")

    @app.task(shared=False, name="cd.plain")  # not a locked task: its duplicates are duplicates all the same
    def plain() -> None: ...

    findings = [f for f in doctor.run(app) if f.code == "countdown_beyond_visibility_timeout"]
    assert sorted(t for f in findings for t in f.tasks) == ["cd.plain", "cd.report"]
    assert any("countdown=900s (15 min)" in f.message and "'late'" in f.message for f in findings)
    assert any("eta " in f.message and "'later'" in f.message for f in findings)


def test_a_beat_countdown_within_the_visibility_timeout_is_not_flagged(own_redis: RedisServer, prefix: str) -> None:
    app = make_app(
        own_redis.url,
        prefix,
        broker_transport_options={"visibility_timeout": 3600},
        beat_schedule={"late": {"task": "cd.report", "schedule": 3600.0, "options": {"countdown": 900}}},
    )
    locked(app, "cd.report")
    codes = found(app)
    assert "countdown_beyond_visibility_timeout" not in codes and "countdown_beyond_consumer_timeout" not in codes


def test_delays_are_read_from_countdown_and_eta() -> None:
    now = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
    assert delay_of({"countdown": 90}, now) == (90.0, "countdown=90s")
    assert delay_of({"eta": datetime(2026, 1, 1, 13, 0)}, now)[0] == 3600.0  # type: ignore[index]  # naive is UTC
    assert delay_of({"eta": datetime(2026, 1, 1, 11, 0, tzinfo=timezone.utc)}, now) is None  # due already
    assert delay_of({"countdown": True}, now) is None and delay_of(None, now) is None


# -- a beat interval shorter than a run's hold ----------------------------------------------------


def test_period_of_every_schedule_kind() -> None:
    assert period_of(30)[0] == 30.0  # type: ignore[index]
    assert period_of(timedelta(minutes=2))[0] == 120.0  # type: ignore[index]
    assert period_of(crontab(minute="*/15", hour="9-17"))[0] == 900.0  # type: ignore[index]
    assert period_of(crontab(minute="0,5"))[0] == 300.0  # type: ignore[index]  # 5 min, then 55
    assert period_of(crontab(minute=0, hour=3))[0] == 86400.0  # type: ignore[index]  # once a day
    assert period_of(crontab(minute=0, hour="0,23"))[0] == 3600.0  # type: ignore[index]  # 23:00 -> 00:00
    assert period_of("nonsense") is None and period_of(True) is None


def test_a_beat_interval_below_the_lock_ttl_is_flagged_when_there_are_no_metrics(
    own_redis: RedisServer, prefix: str
) -> None:
    app = make_app(
        own_redis.url,
        prefix,
        beat_schedule={
            "often": {"task": "beat.skip", "schedule": timedelta(seconds=10)},
            "cron": {"task": "beat.retry", "schedule": crontab()},  # every minute
            "fine": {"task": "beat.fine", "schedule": 300.0},
        },
    )
    locked(app, "beat.skip", lock_ttl=60)
    locked(app, "beat.retry", lock_ttl=120, on_locked="retry")
    locked(app, "beat.fine", lock_ttl=60)
    findings = [f for f in doctor.run(app) if f.code == "beat_interval_below_hold"]
    by_task = {f.tasks[0]: f.message for f in findings}
    assert sorted(by_task) == ["beat.retry", "beat.skip"]
    assert "lock_ttl=60s, used because no hold-time metrics for it were found" in by_task["beat.skip"]
    assert "skipped as its duplicate" in by_task["beat.skip"]
    assert "pile up without bound" in by_task["beat.retry"] and "at most every 60s" in by_task["beat.retry"]


def test_a_beat_interval_is_judged_by_the_flushed_hold_times_over_the_ttl(own_redis: RedisServer, prefix: str) -> None:
    client = own_redis.client()
    app = make_app(
        own_redis.url,
        prefix,
        beat_schedule={
            "quick": {"task": "beat.quick", "schedule": 30.0},  # ttl 60 > 30, but runs hold 2 s
            "slow": {"task": "beat.slow", "schedule": 30.0},  # ttl 10 < 30, but runs hold 45 s
        },
    )
    locked(app, "beat.quick", lock_ttl=60)
    locked(app, "beat.slow", lock_ttl=10)
    for _ in range(3):
        metrics.observe_hold("beat.quick", 2_000)
        metrics.observe_hold("beat.slow", 45_000)
    metrics.flush(client, prefix)
    findings = [f for f in doctor.run(app) if f.code == "beat_interval_below_hold"]
    assert [f.tasks for f in findings] == [["beat.slow"]]
    assert "45s (the average of 3 holds in the last 60 min, from the flushed hold-time metrics)" in findings[0].message


def test_with_the_lock_redis_down_the_beat_check_says_it_used_the_ttl(prefix: str) -> None:
    from celery_lockguard.testing import free_port

    app = make_app(
        f"redis://127.0.0.1:{free_port()}/0",
        prefix,
        broker=AMQP,
        beat_schedule={"often": {"task": "beat.skip", "schedule": 5.0}},
    )
    locked(app, "beat.skip", lock_ttl=30)
    codes = found(app)
    assert "redis_unreachable" in codes
    assert "lock_ttl=30s, used because the metrics could not be read" in codes["beat_interval_below_hold"].message


# -- acks_late without completion records under skip ----------------------------------------------


def test_acks_late_with_skip_and_no_completion_record_is_flagged(own_redis: RedisServer, prefix: str) -> None:
    app = make_app(own_redis.url, prefix)
    locked(app, "ack.bare", acks_late=True, completion=False)  # on_locked defaults to skip
    locked(app, "ack.recorded", acks_late=True)  # completion=True is the default
    locked(app, "ack.waits", acks_late=True, completion=False, on_locked="retry")
    locked(app, "ack.early", completion=False)
    f = found(app)["acks_late_skip_without_completion"]
    assert f.tasks == ["ack.bare"]
    assert "no watch copy is left" in f.message and "runs a second time" in f.message


def test_the_setting_acks_late_counts_as_the_option_does(own_redis: RedisServer, prefix: str) -> None:
    app = make_app(own_redis.url, prefix, task_acks_late=True, lockguard_on_locked="skip")
    locked(app, "ack.bare", completion=False)
    assert found(app)["acks_late_skip_without_completion"].tasks == ["ack.bare"]
    app = make_app(own_redis.url, prefix, task_acks_late=True)
    locked(app, "ack.bare")
    assert "acks_late_skip_without_completion" not in found(app)


# -- RabbitMQ's consumer_timeout -------------------------------------------------------------------


def test_a_hard_time_limit_past_rabbitmqs_default_consumer_timeout_is_flagged(
    own_redis: RedisServer, prefix: str
) -> None:
    app = make_app(own_redis.url, prefix, broker=AMQP)
    locked(app, "mq.long", acks_late=True, time_limit=3600)
    locked(app, "mq.short", acks_late=True, time_limit=600)
    f = found(app)["consumer_timeout_below_time_limit"]
    assert f.tasks == ["mq.long"]
    assert "consumer_timeout=1800s (30 min) (RabbitMQ's default" in f.message and "hard time limit 3600s" in f.message


def test_the_consumer_timeout_comes_from_the_command_line_and_the_queue_argument(
    own_redis: RedisServer, prefix: str
) -> None:
    app = make_app(
        own_redis.url,
        prefix,
        broker=AMQP,
        task_queues=[Queue("celery"), Queue("reports", queue_arguments={"x-consumer-timeout": 600_000})],
        task_routes={"mq.report": {"queue": "reports"}},
    )
    locked(app, "mq.long", acks_late=True, time_limit=3600)
    locked(app, "mq.report", acks_late=True, time_limit=900)  # its queue allows 10 min
    out = invoke(app, "doctor", "--json", "--rabbitmq-consumer-timeout", "7200")
    assert out.exit_code == 1, out.output
    report = codes_of(out.stdout)
    f = report["consumer_timeout_below_time_limit"]
    assert f["tasks"] == ["mq.report"]  # the server's 2 h covers mq.long; the queue argument wins for mq.report
    assert "the x-consumer-timeout argument of queue 'reports'" in f["message"]
    out = invoke(app, "doctor", "--json", "--rabbitmq-consumer-timeout", "600")
    report = codes_of(out.stdout)
    assert report["consumer_timeout_below_time_limit"]["tasks"] == ["mq.long", "mq.report"]
    assert invoke(app, "doctor", "--rabbitmq-consumer-timeout", "0").exit_code == 2  # not a duration


def test_a_safety_copy_countdown_past_the_consumer_timeout_is_flagged(own_redis: RedisServer, prefix: str) -> None:
    app = make_app(own_redis.url, prefix, broker=AMQP)
    locked(app, "mq.long_ttl", lock_ttl=2000)  # a waiter's safety copy comes back after up to ~1800 s
    locked(app, "mq.long_ttl_raises", lock_ttl=2000, on_locked="raise")  # never waits: no safety copy
    locked(app, "mq.default_ttl")
    f = found(app)["countdown_beyond_consumer_timeout"]
    assert f.tasks == ["mq.long_ttl"] and "safety copy" in f.message and "Lower lock_ttl" in f.message
    assert "countdown_beyond_consumer_timeout" not in found(app, consumer_timeout=7200)


def test_a_consumer_timeout_of_a_minute_is_shorter_than_lockguards_own_waits(
    own_redis: RedisServer, prefix: str
) -> None:
    app = make_app(
        own_redis.url,
        prefix,
        broker=AMQP,
        task_queues=[Queue("celery", queue_arguments={"x-consumer-timeout": 60_000})],
    )
    locked(app, "mq.waits")  # a wait's countdown grows to 60 s, a watch copy's to 75 s
    locked(app, "mq.never_waits", on_locked="raise", on_unavailable="fail_open", completion=False)
    f = found(app)["countdown_beyond_consumer_timeout"]
    assert f.tasks == ["mq.waits"] and "up to 75s (a watch copy's countdown" in f.message


def test_a_beat_countdown_past_the_consumer_timeout_is_flagged(own_redis: RedisServer, prefix: str) -> None:
    app = make_app(
        own_redis.url,
        prefix,
        broker=AMQP,
        beat_schedule={"late": {"task": "mq.report", "schedule": 86400.0, "options": {"countdown": 2400}}},
    )
    locked(app, "mq.report")
    f = found(app)["countdown_beyond_consumer_timeout"]
    assert f.tasks == ["mq.report"] and "beat entry 'late'" in f.message
    assert "countdown_beyond_visibility_timeout" not in found(app)  # RabbitMQ has no visibility timeout
    assert "countdown_beyond_consumer_timeout" not in found(app, consumer_timeout=3600)


# -- a lock Redis shared with the broker, under an evicting policy --------------------------------


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl"])
def test_an_evicting_redis_shared_with_the_broker_is_flagged(policy: str, prefix: str) -> None:
    with RedisServer(extra=["--maxmemory-policy", policy]) as server:
        app = make_app(server.url, prefix)  # broker and locks in one database
        locked(app, "ev.task", acks_late=True)
        codes = found(app)
        other_db = make_app(server.url, prefix, broker=server.url.replace("/0", "/5"))
        locked(other_db, "ev.task", acks_late=True)
        other = found(other_db)
    assert set(codes) == {"maxmemory_policy", "broker_shares_evicting_redis"}
    message = codes["broker_shares_evicting_redis"].message
    assert f"maxmemory-policy={policy}" in message and "in the same database" in message
    assert ("evicting exactly the leases" in message) == policy.startswith("volatile")
    assert "the same server (another database" in other["broker_shares_evicting_redis"].message


def test_an_evicting_lock_redis_apart_from_the_broker_or_a_noeviction_one_is_not(
    own_redis: RedisServer, redis_url: str, prefix: str
) -> None:
    with RedisServer(extra=["--maxmemory-policy", "allkeys-lru"]) as server:
        app = make_app(server.url, prefix, broker=redis_url)  # the broker is another server
        locked(app, "ev.task", acks_late=True)
        assert set(found(app)) == {"maxmemory_policy"}
    app = make_app(own_redis.url, prefix)  # shared with the broker, but noeviction
    locked(app, "ev.task", acks_late=True)
    assert found(app) == {}


def test_a_policy_the_acl_hides_is_a_finding_not_a_crash(own_redis: RedisServer, prefix: str) -> None:
    admin = own_redis.client()
    setinfo = "client|setinfo" in admin.acl_cat("connection")  # Redis 7.2+ knows it
    rule = acl.rule(prefix, setinfo=setinfo).split()
    admin.execute_command("ACL", "SETUSER", "ops", *rule, ">s3cret")
    admin.execute_command("ACL", "SETUSER", "worker", *rule, "-info", "-config|get", ">s3cret")  # INFO, CONFIG hidden
    url = f"redis://{{}}:s3cret@127.0.0.1:{own_redis.port}/0"
    app = make_app(url.format("ops"), prefix, broker=url.format("ops"))
    locked(app, "acl.task", acks_late=True)
    assert found(app) == {}  # the operator's rule grants what doctor reads
    app = make_app(url.format("worker"), prefix, broker=url.format("worker"))
    locked(app, "acl.task", acks_late=True)
    out = invoke(app, "doctor", "--json")
    assert out.exit_code == 1, out.output
    report = codes_of(out.stdout)
    assert set(report) == {"maxmemory_policy_unknown", "server_checks_refused"}
    unknown = report["maxmemory_policy_unknown"]["message"]
    assert "INFO refused" in unknown and "CONFIG GET refused" in unknown and "s3cret" not in out.stdout
    assert "evictions (INFO stats)" in report["server_checks_refused"]["message"]


# -- through the real entry point: `celery -A module lockguard doctor` ---------------------------

CONFLICTED = """
import os
from datetime import timedelta

from celery import Celery

from celery_lockguard import LockedTask

app = Celery("conflicted", broker=os.environ["REDIS_URL"])
app.conf.update(
    lockguard_key_prefix=os.environ["PREFIX"],
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    broker_transport_options={"visibility_timeout": 600},
    beat_schedule={
        "sync": {"task": "sync_catalog", "schedule": timedelta(seconds=20)},
        "digest": {"task": "send_digest", "schedule": 86400.0, "options": {"countdown": 900}},
    },
)


@app.task(base=LockedTask, bind=True, name="sync_catalog", lock_key="catalog", lock_ttl=60)
def sync_catalog(self) -> None: ...


@app.task(base=LockedTask, bind=True, name="send_digest", lock_key="digest", completion=False)
def send_digest(self) -> None: ...
"""

SOUND = (
    CONFLICTED.replace('"visibility_timeout": 600', '"visibility_timeout": 3600')
    .replace("timedelta(seconds=20)", "timedelta(minutes=5)")
    .replace(", completion=False", "")
)


def doctor_cli(tmp_path: Path, source: str, redis_url: str, prefix: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conflicted.py").write_text(textwrap.dedent(source))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCKGUARD_", "REDIS_URL"))}
    env.update(REDIS_URL=redis_url, PREFIX=prefix, PYTHONPATH=f"{tmp_path}:{ROOT}")
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "conflicted", "lockguard", "doctor", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_cli_reports_settings_that_fight(tmp_path: Path, prefix: str) -> None:
    with RedisServer(extra=["--maxmemory-policy", "allkeys-lfu"]) as server:
        out = doctor_cli(tmp_path, CONFLICTED, server.url, prefix)
    assert out.returncode == 1, out.stdout + out.stderr
    report = codes_of(out.stdout)
    assert set(report) == {
        "maxmemory_policy",
        "broker_shares_evicting_redis",
        "beat_interval_below_hold",
        "countdown_beyond_visibility_timeout",
        "acks_late_skip_without_completion",
    }
    assert report["beat_interval_below_hold"]["tasks"] == ["sync_catalog"]
    assert report["countdown_beyond_visibility_timeout"]["tasks"] == ["send_digest"]
    assert report["acks_late_skip_without_completion"]["tasks"] == ["send_digest"]


def test_the_cli_passes_the_same_app_once_its_settings_agree(
    own_redis: RedisServer, tmp_path: Path, prefix: str
) -> None:
    out = doctor_cli(tmp_path, SOUND, own_redis.url, prefix)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout) == {"ok": True, "findings": []}


@pytest.mark.parametrize("visibility_timeout", [3600.0, 90.0])
def test_the_longest_countdowns_doctor_assumes_bound_the_real_ones(visibility_timeout: float) -> None:
    # doctor judges lockguard's own delayed messages by these bounds: a real countdown above one would slip past it.
    from celery_lockguard import _handoff as handoff
    from celery_lockguard import _republish as republish
    from celery_lockguard._config import load_settings

    app = Celery("bounds", set_as_current=False)
    app.conf.broker_transport_options = {"visibility_timeout": visibility_timeout}
    s = load_settings(app)
    # (_task.py caps a wait at max_countdown; watch and safety copies cap themselves)
    waits = [min(republish.wait_countdown(w, None), republish.max_countdown(s)) for w in range(20) for _ in range(50)]
    watches = [republish.watch_countdown(w, 30.0, s) for w in range(20) for _ in range(50)]
    safety = [handoff.safety_countdown(2_000_000, s) for _ in range(200)]
    assert max(waits) <= republish.longest_wait_countdown(s)
    assert max(watches) <= republish.longest_watch_countdown(s)
    assert max(safety) <= handoff.longest_safety_countdown(2000.0, s)
    assert max(watches) > 0.9 * republish.longest_watch_countdown(s)  # the bound is reached, not just above


# -- found in review: odd configurations, where the broker is read from, beat routing ---------------


@pytest.mark.parametrize(
    "options", [{"visibility_timeout": None}, {"visibility_timeout": "abc"}, "600", [("visibility_timeout", 600)]]
)
def test_a_visibility_timeout_kombu_cannot_use_is_a_configuration_finding(
    own_redis: RedisServer, prefix: str, options: Any
) -> None:
    # These crashed doctor (and every locked delivery) with a TypeError/ValueError/AttributeError traceback.
    app = make_app(own_redis.url, prefix, broker_transport_options=options)
    locked(app, "vt.task", acks_late=True, time_limit=60)
    out = invoke(app, "doctor", "--json")
    assert out.exit_code == 78, out.output
    (finding,) = json.loads(out.stdout)["findings"]
    assert finding["code"] == "configuration" and "broker_transport_options" in finding["message"]


def test_a_visibility_timeout_of_zero_names_the_setting_not_completion_ttl(own_redis: RedisServer, prefix: str) -> None:
    app = make_app(own_redis.url, prefix, broker_transport_options={"visibility_timeout": 0})
    locked(app, "vt.task")
    (finding,) = found(app).values()
    assert finding.code == "configuration"
    assert "broker_transport_options['visibility_timeout']=0" in finding.message  # was: "completion_ttl=0.0"


def test_a_numeric_string_visibility_timeout_is_still_read(own_redis: RedisServer, prefix: str) -> None:
    app = make_app(own_redis.url, prefix, broker_transport_options={"visibility_timeout": "600"})
    locked(app, "vt.task", acks_late=True, time_limit=900)
    assert found(app)["visibility_timeout_below_time_limit"].tasks == ["vt.task"]


def test_sqs_without_a_visibility_timeout_is_judged_by_kombus_sqs_default(own_redis: RedisServer, prefix: str) -> None:
    # kombu's SQS transport defaults to 1800 s, not the Redis transport's 3600 s: a 45 min limit was passed.
    from celery_lockguard._config import settings

    app = make_app(own_redis.url, prefix, broker="sqs://AKIAEXAMPLE:secret@")
    locked(app, "sqs.long", acks_late=True, time_limit=2700)
    locked(app, "sqs.short", acks_late=True, time_limit=900)
    f = found(app)["visibility_timeout_below_time_limit"]
    assert f.tasks == ["sqs.long"] and "visibility_timeout=1800s" in f.message
    assert settings(app).visibility_timeout == 1800.0
    app.conf.broker_transport_options = {"visibility_timeout": 3600}
    assert "visibility_timeout_below_time_limit" not in found(app)
    redis_app = make_app(own_redis.url, prefix)  # the Redis transport keeps its own default
    assert settings(redis_app).visibility_timeout == 3600.0


def test_the_broker_named_in_the_environment_is_the_one_judged(
    own_redis: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # CELERY_BROKER_URL is how Celery (and so the worker) is often told its broker; doctor read only
    # the setting, saw no broker, and skipped every RabbitMQ check.
    monkeypatch.setenv("CELERY_BROKER_URL", AMQP)
    app = Celery("env", set_as_current=False)
    app.conf.update(lockguard_redis_url=own_redis.url, lockguard_key_prefix=prefix)
    locked(app, "env.long", acks_late=True, time_limit=7200)
    assert found(app)["consumer_timeout_below_time_limit"].tasks == ["env.long"]
    # a Redis broker there is also the locks' default store (it was "lockguard_redis_url is required")
    monkeypatch.setenv("CELERY_BROKER_URL", own_redis.url)
    app = Celery("env", set_as_current=False)
    app.conf.update(lockguard_key_prefix=prefix, task_acks_late=True)
    locked(app, "env.task")
    assert found(app) == {}
    # the broker the workers consume from is the one whose transport redelivers
    monkeypatch.delenv("CELERY_BROKER_URL")
    app = make_app(own_redis.url, prefix, broker_read_url=AMQP)
    locked(app, "env.long", acks_late=True, time_limit=7200)
    assert "consumer_timeout_below_time_limit" in found(app)


def test_a_beat_countdown_on_rabbitmq_is_judged_by_the_entrys_queue_for_any_task(
    own_redis: RedisServer, prefix: str
) -> None:
    app = make_app(
        own_redis.url,
        prefix,
        broker=AMQP,
        task_queues=[Queue("celery"), Queue("slow", queue_arguments={"x-consumer-timeout": 7_200_000})],
        beat_schedule={
            # routed by the entry to a queue allowing 2 h: was judged against the default queue's 30 min
            "routed": {"task": "mq.report", "schedule": 86400.0, "options": {"queue": "slow", "countdown": 3000}},
            # a task this process does not register (beat publishes it by name): was not judged at all
            "elsewhere": {"task": "other.service", "schedule": 86400.0, "options": {"countdown": 3000}},
        },
    )
    locked(app, "mq.report")
    f = found(app)["countdown_beyond_consumer_timeout"]
    assert f.tasks == ["other.service"] and "beat entry 'elsewhere'" in f.message


def test_a_beat_entry_whose_task_declares_the_skip_is_no_finding(own_redis: RedisServer, prefix: str) -> None:
    # The finding's own fix is on_locked='skip' with lock_mode='until_done': a task set so was still flagged.
    app = make_app(
        own_redis.url,
        prefix,
        task_acks_late=True,
        beat_schedule={
            "declared": {"task": "beat.declared", "schedule": 10.0},
            "undeclared": {"task": "beat.undeclared", "schedule": 10.0},
        },
    )
    locked(app, "beat.declared", lock_ttl=60, on_locked="skip", lock_mode="until_done")
    locked(app, "beat.undeclared", lock_ttl=60, on_locked="skip", lock_mode="until_started")
    assert found(app)["beat_interval_below_hold"].tasks == ["beat.undeclared"]


# -- debounce and a dead worker ---------------------------------------------------------------------


def test_debounce_without_acks_late_is_flagged(own_redis: RedisServer, prefix: str) -> None:
    app = make_app(own_redis.url, prefix)
    locked(app, "deb.early_ack", lock_debounce=1.0)
    locked(app, "deb.late_ack", lock_debounce=1.0, acks_late=True)
    locked(app, "deb.plain")
    f = found(app)["debounce_without_acks_late"]
    assert f.tasks == ["deb.early_ack"]
    assert "acks_late=True" in f.message and "burst is lost" in f.message
    app = make_app(own_redis.url, prefix, task_acks_late=True)
    locked(app, "deb.setting", lock_debounce=1.0)
    assert "debounce_without_acks_late" not in found(app)
