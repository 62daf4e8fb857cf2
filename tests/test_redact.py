"""Credentials never reach a message: URLs and DSNs as configured, and errors that quote them."""

from __future__ import annotations

import logging
from typing import Any

import pytest


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
        ("rediss://user:s3cret@h/0", "rediss://user:***@h/0"),
        ("redis://h:6379/0?password=s3cret", "redis://h:6379/0?password=***"),
        ("redis://h/0?db=1&PASSWORD=s3cret&x=1", "redis://h/0?db=1&PASSWORD=***&x=1"),
        ("unix:///run/redis.sock?password=s3cret&db=2", "unix:///run/redis.sock?password=***&db=2"),
        ("postgressql://app:s3cret@db/billing", "postgressql://app:***@db/billing"),
        ("postgresql://app:s3%ZZcret@db:notaport/billing", "postgresql://app:***@db:notaport/billing"),
        ("host=db password=s3cret dbname=x", "host=db password=*** dbname=x"),
        ("host=db password='s3 cret' dbname=x", "host=db password=*** dbname=x"),
        ("redis://:p@ss@h/0", "redis://:***@h/0"),
        ("redis://h:6379/0", "redis://h:6379/0"),
    ],
)
def test_redact_masks_every_form_of_password(url: str, shown: str) -> None:
    from celery_lockguard._redact import redact

    assert redact(url) == shown


def test_redact_text_removes_a_password_libpq_quotes() -> None:
    from celery_lockguard._redact import redact_text

    dsn = "postgresql://app:s3%ZZcret@127.0.0.1/billing"
    message = 'invalid percent-encoded token: "s3%ZZcret"'
    assert redact_text(message, dsn) == 'invalid percent-encoded token: "***"'


@pytest.mark.parametrize(
    ("dsn", "secret"),
    [
        # libpq: invalid percent-encoded token: "s3%ZZcret"
        ("postgresql://app:s3%ZZcret@127.0.0.1/test", "s3%ZZcret"),
        # the password quoted back as the value of another option
        ("postgresql://app:s3cret@127.0.0.1:1/test?sslmode=s3cret", "s3cret"),
    ],
)
def test_a_completion_store_that_cannot_connect_never_logs_its_password(
    dsn: str, secret: str, redis_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    from celery import Celery

    from celery_lockguard import LockedTask
    from celery_lockguard._completion import forget_stores, postgres_store

    with pytest.raises(Exception) as err:
        postgres_store(dsn, "lgt_redact", namespace=prefix).lookup("x")
    chain: list[BaseException] = []
    exc: BaseException | None = err.value
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    assert not [e for e in chain if secret in str(e)], chain
    forget_stores()

    app = Celery("redact", broker=redis_url, set_as_current=False)
    app.conf.lockguard_key_prefix = prefix
    app.conf.lockguard_completion_backend = dsn
    app.conf.lockguard_on_unavailable = "fail_open"

    @app.task(base=LockedTask, bind=True, shared=False, name="redact.t", lock_key="r:{n}")
    def t(self: Any, n: int) -> int:
        return n

    with caplog.at_level(logging.DEBUG, logger="celery_lockguard"):
        t.apply(args=(1,))
    forget_stores()
    assert caplog.records, "the store's failure is logged"
    for record in caplog.records:
        assert secret not in record.getMessage(), record.getMessage()
        assert secret not in repr(getattr(record, "lockguard", {}))
