"""The plugin's fixtures keep a test's tasks away from a development worker, and say why a wait timed out.

A user tested their own task with the plugin while a development worker ran on the same broker: the
test app sent to the app's real queue, the development worker took the task, and the test failed with a
bare ``WaitTimeout ... to be held``.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_lockguard.pytest_plugin import CapturedEvents, LockguardHelper
from celery_lockguard.testing import WaitTimeout, Worker

pytest_plugins = ["pytester"]
pytest.importorskip("pytest_celery")

ROOT = Path(__file__).resolve().parent.parent

DEV_APP = """
import os
from celery import Celery

P = os.environ["ISO_PREFIX"]
app = Celery("dev", broker=os.environ["ISO_REDIS"], backend=os.environ["ISO_REDIS"])
app.conf.update(
    broker_transport_options={"global_keyprefix": f"{P}:kombu:"},
    result_backend_transport_options={"global_keyprefix": f"{P}:results:"},
)


@app.task(name="iso.whoami")
def whoami():
    return "dev"
"""

CONFTEST = """
import os
import pytest


@pytest.fixture(scope="session")
def celery_config():
    P, url = os.environ["ISO_PREFIX"], os.environ["ISO_REDIS"]
    return {
        "broker_url": url,
        "result_backend": url,
        "broker_transport_options": {"global_keyprefix": f"{P}:kombu:"},
        "result_backend_transport_options": {"global_keyprefix": f"{P}:results:"},
    }
"""

INNER = """
from celery import shared_task


@shared_task(name="iso.whoami")
def whoami():
    return "test"


def test_every_task_reaches_the_test_worker(lockguard_worker, lockguard_app):
    calls = [whoami.delay() for _ in range(8)]
    assert [c.get(timeout=30) for c in calls] == ["test"] * 8
    assert lockguard_app.conf.task_default_queue.startswith("lockguard-test-")  # lockguard_queue
"""


@pytest.mark.integration
def test_a_development_worker_on_the_apps_queue_never_takes_the_tests_task(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    (tmp_path / "devapp.py").write_text(textwrap.dedent(DEV_APP))
    env = {"ISO_PREFIX": prefix, "ISO_REDIS": redis_url}
    dev = Worker(
        "devapp:app",
        concurrency=2,
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(tmp_path)},
        log_path=tmp_path / "dev.log",
    )  # consumes the app's real queue, "celery", like `celery -A proj worker` on a laptop
    with dev:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("PYTHONPATH", str(ROOT))  # this tree's plugin, not whichever one is installed
        pytester.makeconftest(CONFTEST)
        pytester.makepyfile(test_iso=INNER)
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", "-W", "ignore::DeprecationWarning")
        assert "iso.whoami[" not in dev.output(), dev.output()[-3000:]  # "Task iso.whoami[<id>] received"
    result.assert_outcomes(passed=1)


def _helper(app: Celery, redis_url: str, prefix: str, tmp_path: Path) -> LockguardHelper:
    return LockguardHelper(redis_url, prefix, lambda: app, CapturedEvents(), tmp_path)


def test_wait_held_names_what_it_waited_for_and_the_likely_cause(redis_url: str, prefix: str, tmp_path: Path) -> None:
    app = Celery("iso", broker="redis://127.0.0.1:6379/5", set_as_current=False)
    app.conf.task_default_queue = "billing"
    helper = _helper(app, redis_url, prefix, tmp_path)
    with pytest.raises(WaitTimeout) as err:
        helper.wait_held("invoice:1", timeout=0.2)
    message = str(err.value)
    assert f"{prefix}:v1:{{invoice:1}}:lock to be held" in message or "invoice:1" in message, message
    assert "no worker consumes queue 'billing' on redis://127.0.0.1:6379/5" in message, message
    assert "development worker" in message and "failed before its body" in message, message


def test_wait_free_shows_the_holder_and_its_ttl(r: Any, redis_url: str, prefix: str, tmp_path: Path) -> None:
    helper = _helper(Celery("iso", set_as_current=False), redis_url, prefix, tmp_path)
    name = helper.lock_name("invoice:2")
    r.hset(name, mapping={"task_name": "billing.charge", "pid": "4242"})
    r.pexpire(name, 60_000)
    with pytest.raises(WaitTimeout) as err:
        helper.wait_free("invoice:2", timeout=0.2)
    message = str(err.value)
    assert "billing.charge" in message and "ms of TTL left" in message and "lockguard.expire" in message, message
