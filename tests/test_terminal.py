"""Text for the operator's terminal and the logs: non-printables escaped, ids bounded, counts agreed."""

from __future__ import annotations

import logging

import pytest

from celery_lockguard import _events as events


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("plain id-7", "plain id-7"),
        ("\x1b[2Jred", "\\x1b[2Jred"),
        ("row\nforged", "row\\nforged"),
        ("cr\rtab\t", "cr\\rtab\\t"),
        ("rtl\u202eexe", "rtl\\u202eexe"),
        ("bad\udcff", "bad\\xff"),  # a surrogate-escaped byte (not UTF-8) is shown as that byte
        ("lone\ud800", "lone\\ud800"),
        ("C:\\path", "C:\\path"),
        ("naïve ünïcode", "naïve ünïcode"),
    ],
)
def test_printable_escapes_what_a_terminal_would_interpret(raw: str, shown: str) -> None:
    from celery_lockguard._terminal import printable

    assert printable(raw) == shown


def test_printable_bounds_long_text_and_says_how_much_was_cut() -> None:
    from celery_lockguard._terminal import plural, printable

    assert printable("x" * 300) == "x" * 256 + "...[44 more]"
    assert printable("x" * 300, None) == "x" * 300
    assert (plural(1, "lease"), plural(2, "lease"), plural(1, "body", "bodies"), plural(0, "body", "bodies")) == (
        "1 lease",
        "2 leases",
        "1 body",
        "0 bodies",
    )


def test_log_fields_are_escaped_and_ids_bounded(caplog: pytest.LogCaptureFixture) -> None:
    forged = "t-1\n[2026-12-01 10:00:00: INFO] lock.released forged=yes"
    with caplog.at_level(logging.DEBUG, logger="celery_lockguard"):
        events.emit(
            "lock.contended",
            "\x1b[31mbilling.charge",
            lock_key="inv:1",
            task_id=forged,
            holder_task_id="h" * 100_000,
            reason="r" * 5000,
        )
    (record,) = [r for r in caplog.records if r.getMessage().startswith("lock.contended")]
    message = record.getMessage()
    assert "\n" not in message and "\x1b" not in message
    assert "\\x1b[31mbilling.charge" in message and "\\n[2026-12-01" in message
    fields = record.lockguard  # type: ignore[attr-defined]
    assert fields["task_id"] == "t-1\\n[2026-12-01 10:00:00: INFO] lock.released forged=yes"
    assert len(fields["holder_task_id"]) < 300 and fields["holder_task_id"].endswith("...[99744 more]")
    assert len(fields["reason"]) < 2100
    assert len(message) < 3000


def test_structlog_gets_the_same_escaped_fields() -> None:
    import structlog
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        events.log(logging.WARNING, "lock.lost", "t\x07", {"task_id": "a\nb"}, backend="structlog")
    structlog.reset_defaults()
    assert logs[0]["task_name"] == "t\\x07" and logs[0]["task_id"] == "a\\nb"
