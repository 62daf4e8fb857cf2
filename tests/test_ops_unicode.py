"""Entity keys that look alike and differ (issue 30 item 7): ``locks`` and the page tell them apart.

NFC ``café``, NFD ``café`` (``e`` and U+0301: what a key rendered before NFC rendering, or planted, holds) and a
``cafe`` with a Cyrillic U+0430 are three leases on a real Redis. Every view showed them as the same text.
"""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_lockguard import _lease as L

from .conftest import make_cfg
from .test_cli_hostile import app, invoke, strict_json  # noqa: F401 - app: the CLI's fixture
from .test_page import PageServer, pages, start_page  # noqa: F401 - pages: stops the page servers

ALIKE = ["inv:caf\u00e9", "inv:cafe\u0301", "inv:c\u0430fe", "inv:cafe"]


@pytest.fixture
def planted(r: redis.Redis, prefix: str) -> list[str]:
    for i, key in enumerate(ALIKE):
        got = L.acquire(
            r, prefix, key, ttl_ms=60_000, task_id=f"t-{i}", task_name="billing.charge", digest="d", worker="w@h",
            fence_ttl_ms=60_000,
        )  # fmt: skip
        assert isinstance(got, L.Lease)
    return ALIKE


def key_cells(lines: list[str]) -> list[str]:
    """The KEY column of ``locks``' rows: everything before the state (``running``)."""
    return [line.split("  running  ")[0].rstrip() for line in lines if "  running  " in line]


def test_locks_shows_look_alike_keys_apart_and_json_keeps_them_exact(app: Celery, planted: list[str]) -> None:  # noqa: F811
    out = invoke(app, "locks")
    assert out.exit_code == 0, out.output
    cells = key_cells(out.stdout.splitlines())
    assert len(cells) == 4 and len(set(cells)) == 4, cells  # four rows that read apart
    assert "inv:caf\u00e9 [inv:caf\\xe9]" in cells and "inv:c\u0430fe [inv:c\\u0430fe]" in cells, cells
    assert "inv:cafe" in cells  # an ASCII key as it always was
    rows = strict_json(invoke(app, "locks", "--json").stdout)
    assert sorted(row["key"] for row in rows) == sorted(planted)


@pytest.mark.integration  # a real exporter process, as tests/test_page.py (the compat cells leave them out)
def test_the_page_shows_look_alike_keys_apart(
    redis_url: str,
    prefix: str,
    planted: list[str],
    pages: list[PageServer],  # noqa: F811
) -> None:
    page = start_page(make_cfg(prefix, redis_url))
    pages.append(page)
    code, _, body = page.get("/page")
    html = body.decode()
    assert code == 200
    for spelling in ("inv:caf\\xe9", "inv:cafe\\u0301", "inv:c\\u0430fe"):
        assert f"[{spelling}]" in html, spelling
