"""The pytest plugin, tested the way a user meets it: through the ``pytest11`` entry point
(or named in a ``conftest.py``), and ``celery_lockguard.testing.Worker``, which its
``lockguard_worker_process`` hands out.

Each sample in docs/testing.md that starts with a ``# test_*.py`` line is written,
verbatim, into a pytester directory and run by a fresh pytest process -- so the
documented examples are the plugin's acceptance tests (in-process worker: a
skipped duplicate, a lost lease, a Redis outage under both policies; a prefork
subprocess worker whose child is SIGKILLed). One pytest run for all of them keeps
the interpreter and Celery start-up paid once.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from celery import Celery

from celery_lockguard.testing import Worker, child_pids

pytest_plugins = ["pytester"]

pytest.importorskip("pytest_celery")  # the plugin builds on it; make compat's venvs do not carry it

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "testing.md"
SAMPLE = re.compile(r"^```python\n(# (test_\w+\.py)\n.*?)^```$", re.M | re.S)


def doc_samples() -> dict[str, str]:
    """File name -> source of every ``# test_*.py`` sample in docs/testing.md."""
    return {m.group(2): textwrap.dedent(m.group(1)) for m in SAMPLE.finditer(DOC.read_text())}


def test_the_docs_carry_the_three_samples() -> None:
    assert set(doc_samples()) == {"test_sync.py", "test_outage.py", "test_crash.py"}


def test_the_documented_samples_pass_under_the_plugin(pytester: pytest.Pytester) -> None:
    samples = doc_samples()
    pytester.makepyfile(**{name.removesuffix(".py"): code for name, code in samples.items()})
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", "-W", "ignore::DeprecationWarning")
    result.assert_outcomes(passed=6)


def test_the_plugin_is_registered_and_lists_its_fixtures(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--fixtures", "-p", "no:cacheprovider")
    out = result.stdout.str()
    for name in (
        "lockguard_redis",
        "lockguard_prefix",
        "lockguard_app",
        "lockguard_worker",
        "lockguard_worker_process",
    ):
        assert name in out, name


def test_without_pytest_celery_the_plugin_loads_and_says_what_is_missing(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_bare="""
        def test_prefix_alone(lockguard_prefix, lockguard):
            assert lockguard_prefix.startswith("lgtest:")
            assert lockguard.holder("nothing:here") is None

        def test_app_needs_pytest_celery(lockguard_app):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:celery", "-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        ["*lockguard_app builds on pytest-celery's celery_app fixture*pip install pytest-celery*"]
    )


def test_a_user_without_lockguard_fixtures_keeps_pytest_celery_defaults(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_plain="""
        def test_defaults(celery_app):
            assert celery_app.conf.broker_url == "memory://"
            assert "lockguard_redis_url" not in celery_app.conf
        """
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q").assert_outcomes(passed=1)


def test_naming_the_plugin_by_its_module_registers_it_once(pytester: pytest.Pytester) -> None:
    """The entry point is named like the module, so a conftest's ``pytest_plugins`` or ``-p`` finds it registered.

    Under another entry-point name pytest refused both with "Plugin already
    registered under a different name"; naming it is how a suite run from a work
    tree (no entry point) gets the fixtures.
    """
    pytester.makeconftest('pytest_plugins = ["celery_lockguard.pytest_plugin"]')
    pytester.makepyfile(
        test_named="""
        def test_fixture(lockguard_prefix, request):
            assert lockguard_prefix.startswith("lgtest:")
            names = [n for n, p in request.config.pluginmanager.list_name_plugin() if p is not None]
            assert names.count("celery_lockguard.pytest_plugin") == 1
        """
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q").assert_outcomes(passed=1)
    named = pytester.runpytest_subprocess("-p", "celery_lockguard.pytest_plugin", "-p", "no:cacheprovider", "-q")
    named.assert_outcomes(passed=1)
    off = pytester.runpytest_subprocess("-p", "no:celery_lockguard.pytest_plugin", "-p", "no:cacheprovider", "-q")
    off.assert_outcomes(errors=1)
    off.stdout.fnmatch_lines(["*fixture 'lockguard_prefix' not found*"])


# -- testing.Worker -------------------------------------------------------------------------


WORKER_APP = """
import os

from celery import Celery

P = os.environ["LGT_PREFIX"]
app = Celery("lgtworker", broker=os.environ["LGT_REDIS"])
app.conf.update(task_default_queue=f"{P}-q", broker_transport_options={"global_keyprefix": f"{P}:kombu:"})
"""


@pytest.mark.integration
@pytest.mark.parametrize("control_broker", ["other_keyspace", "unreachable"])
def test_a_worker_that_never_becomes_ready_is_stopped(
    control_broker: str, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    """``start()`` (and so ``with Worker(...)``) stops the process when the readiness wait fails.

    Two ways it fails: the ping never answers (the control app talks to another
    keyspace) and the ping raises (its broker refuses connections). The worker
    itself is healthy either way, so only ``start`` could have stopped it:
    ``__exit__`` never runs when ``__enter__`` raises.
    """
    (tmp_path / "lgtworker.py").write_text(WORKER_APP)
    control = Celery("ctl", set_as_current=False)
    if control_broker == "other_keyspace":
        control.conf.update(broker_url=redis_url, broker_transport_options={"global_keyprefix": f"{prefix}:other:"})
        expected = "not ready within"
    else:
        control.conf.update(
            broker_url="redis://127.0.0.1:1/0", broker_connection_max_retries=0, broker_connection_timeout=1
        )
        expected = "did not become ready .OperationalError"
    worker = Worker(
        "lgtworker:app",
        control=control,
        concurrency=1,
        cwd=tmp_path,
        env={"LGT_PREFIX": prefix, "LGT_REDIS": redis_url, "PYTHONPATH": str(tmp_path)},
        log_path=tmp_path / "worker.log",
    )
    try:
        with pytest.raises(RuntimeError, match=expected):
            if control_broker == "other_keyspace":
                worker.start(timeout=3)
            else:
                with worker:  # the ping raises at once: the wait fails well inside start()'s default timeout
                    pytest.fail("the worker cannot be ready")
        assert worker.proc is not None and worker.proc.poll() is not None, "the worker was left running"
        assert child_pids(worker.proc.pid) == []
    finally:
        worker.stop(10)
