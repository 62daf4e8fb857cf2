"""``_headers.carried``: the one test that lets a plain first delivery skip reading each header."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from celery.app.task import Context

from celery_lockguard import _headers as headers

EVERY = (*headers.ALL, headers.WORKFLOW)


def test_a_plain_request_carries_none_and_every_read_agrees() -> None:
    ctx = Context(id="t1", args=(1,), kwargs={}, headers={"other": "x"}, retries=0)
    assert headers.carried(ctx) is False
    assert all(headers.read(ctx, name) is None for name in EVERY)


@pytest.mark.parametrize("name", EVERY)
def test_a_header_on_the_request_itself_is_carried(name: str) -> None:
    assert headers.carried(Context(id="t1", **{name: "v"})) is True


@pytest.mark.parametrize("name", EVERY)
def test_a_header_in_request_headers_is_carried(name: str) -> None:
    assert headers.carried(Context(id="t1", headers={name: "v"})) is True


def test_a_request_that_is_not_celerys_context_is_read_header_by_header() -> None:
    assert headers.carried(SimpleNamespace(id="t1", headers=None)) is True
