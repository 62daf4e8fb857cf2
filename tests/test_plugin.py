"""The pytest plugin, tested the way a user meets it: through the ``pytest11`` entry point.

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

pytest_plugins = ["pytester"]

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
    result.assert_outcomes(passed=5)


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
