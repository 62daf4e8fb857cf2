"""Credentials never reach a message: URLs and DSNs as configured, and errors that quote them."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from celery_lockguard._redact import UNPARSED


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
        ("rediss://user:s3cret@h/0", "rediss://user:***@h/0"),
        ("redis://h:6379/0?password=s3cret", "redis://h:6379/0?password=***"),
        ("redis://h/0?db=1&PASSWORD=s3cret&x=1", "redis://h/0?db=1&PASSWORD=***&x=1"),
        ("unix:///run/redis.sock?password=s3cret&db=2", "unix:///run/redis.sock?password=***&db=2"),
        ("postgressql://app:s3cret@db/billing", "postgressql://app:***@db/billing"),
        ("postgresql://app:s3%ZZcret@db:notaport/billing", UNPARSED),  # libpq refuses it: not shown at all
        ("host=db password=s3cret dbname=x", "dbname=x host=db password=***"),  # as libpq reads it
        ("host=db password='s3 cret' dbname=x", "dbname=x host=db password=***"),
        ("host=db password=s3 cret dbname=x", UNPARSED),  # where would a regex end the password?
        ("host=db sslpassword=s3cret", "host=db sslpassword=***"),
        ("rediss://h/0?ssl_password=s3cret", "rediss://h/0?ssl_password=***"),
        ("redis://h/0?pass%77ord=s3cret", "redis://h/0?password=***"),  # redis-py decodes the key
        ("postgresql://db/x?pass%77ord=s3cret", "postgresql://db/x?password=***"),
        ("redis://h:notaport/0", UNPARSED),
        ("redis://:p@ss@h/0", "redis://:***@h/0"),
        ("redis://h:6379/0", "redis://h:6379/0"),
    ],
)
def test_redact_masks_every_form_of_password(url: str, shown: str) -> None:
    from celery_lockguard._redact import redact

    assert redact(url) == shown


def test_redact_text_withholds_a_message_about_a_dsn_that_does_not_parse() -> None:
    from celery_lockguard._redact import WITHHELD, redact_text

    dsn = "postgresql://app:s3%ZZcret@127.0.0.1/billing"
    assert redact_text('invalid percent-encoded token: "s3%ZZcret"', dsn) == WITHHELD
    assert redact_text('missing "=" after "cret"', "host=db password=s3 cret") == WITHHELD


def test_redact_text_masks_secrets_of_a_dsn_and_in_free_text() -> None:
    from celery_lockguard._redact import redact_text

    dsn = "postgresql://app:s3cret@127.0.0.1:1/test?sslmode=s3cret"
    assert redact_text('invalid sslmode value: "s3cret"', dsn) == 'invalid sslmode value: "***"'
    text = "bad x='redis://:pw1@h/0' and ssl_password=pw2 and p%61ssword=pw3 at postgresql://u:pw4@h/db."
    out = redact_text(text)
    assert not [s for s in ("pw1", "pw2", "pw3", "pw4") if s in out], out
    assert out.endswith("postgresql://u:***@h/db.")


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
