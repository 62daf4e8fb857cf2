"""Every ``lockguard`` command, and the exporter, against hostile values planted under the prefix.

Anyone with write access to the lock Redis (or to the broker, whose task ids
and names the leases carry) can put there what no worker writes. Planted
here: every field of every key kind -- lease hashes, fences, claims, watch
markers, waiter queues and entries, completion records, checkpoints, metrics
totals and minutes -- with
escape sequences, forged newlines, format characters, bytes that are not
UTF-8, numbers that are not (``"²"``, ``1.5e12``, ``nan``, ``inf``, ``1e400``),
keys of the wrong type and JSON that is a list, a scalar or 100 000 nested
brackets. Every command must finish with its documented exit code and no
traceback, print nothing a terminal would interpret, and print the good rows
beside the bad ones.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_lockguard import _connection as connection
from celery_lockguard import _lease as L
from celery_lockguard import _metrics as metrics
from celery_lockguard._config import reset
from celery_lockguard._keys import (
    checkpoint_name,
    claim_name,
    done_name,
    fence_name,
    lock_name,
    wait_name,
    waiters_name,
    watch_name,
)
from celery_lockguard.testing import RedisServer, free_port

from .conftest import make_cfg
from .harness import ROOT, wait_for
from .test_cli import cli, cli_env

pytestmark = pytest.mark.integration

ESC = "\x1b[2J\x1b[31m"
FORGED = "t-1\ninvoice:9  running  billing.charge  forged-id"
HOSTILE_TEXT = [ESC + "red", FORGED, "rtl\u202eexe.txt", "bell\x07", "nul\x00byte", "cr\roverwrite", "x" * 100_000]
NOT_UTF8 = b"bad\xff\xfe"


@pytest.fixture
def raw(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


def plant(r: redis.Redis, raw: redis.Redis, prefix: str) -> dict[str, Any]:
    """Plant hostile values of every kind under ``prefix``; return what a test needs to name them."""
    # A good lease, which every listing must still show.
    good = L.acquire(
        r, prefix, "inv:good", ttl_ms=60_000, task_id="t-good", task_name="billing.charge", digest="d", worker="w@h",
        fence_ttl_ms=60_000,
    )  # fmt: skip
    assert isinstance(good, L.Lease)
    # Lease hashes whose every field is hostile, one row per field kind.
    for i, value in enumerate(HOSTILE_TEXT):
        r.hset(
            lock_name(prefix, f"text:{i}"),
            mapping={
                "token": value, "task_id": value, "task_name": value, "digest": value, "host": value,
                "worker": value, "state": value, "pid": value, "fence": value, "acquired_at": value,
                "renewed_at": value, "ttl": value,
            },
        )  # fmt: skip
        r.pexpire(lock_name(prefix, f"text:{i}"), 60_000)
    numbers = {"fence": "²", "acquired_at": "1.5e12", "renewed_at": "nan", "pid": "-1", "ttl": "inf", "state": "held"}
    r.hset(lock_name(prefix, "numbers"), mapping={"task_id": "t-n", "task_name": "n", **numbers})
    r.hset(lock_name(prefix, "no-ttl"), mapping={"task_id": "t-forever", "fence": "7"})  # never expires
    r.set(lock_name(prefix, "wrongtype"), "a string where a lease hash belongs")
    raw.hset(lock_name(prefix, "").encode()[:-6] + NOT_UTF8 + b"}:lock", mapping={b"task_id": NOT_UTF8, b"fence": b"1"})
    raw.hset(lock_name(prefix, "fields").encode(), mapping={NOT_UTF8: NOT_UTF8, b"task_name": NOT_UTF8})
    # Fences, claims and watch markers.
    r.hset(lock_name(prefix, "corrupt-fence"), mapping={"task_id": "t-cf", "fence": "3"})
    r.set(fence_name(prefix, "corrupt-fence"), "²")
    r.hset(claim_name(prefix, "text:0"), mapping={"task_id": ESC, "token": FORGED, "state": "\x00"})
    r.set(watch_name(prefix, "text:0"), ESC)
    r.rpush(wait_name(prefix, "text:0"), ESC, FORGED, "x" * 100_000)  # park and wake's waiter queue
    r.hset(waiters_name(prefix, "text:0"), mapping={ESC: FORGED, "t": "[" * 10_000})
    r.set(wait_name(prefix, "inv:good"), "a string where a list belongs")
    r.set(waiters_name(prefix, "inv:good"), "a string where a hash belongs")
    raw.set(fence_name(prefix, "").encode()[:-7] + b"other" + NOT_UTF8 + b"}:fence", NOT_UTF8)
    # Completion records and checkpoints.
    scopes = {
        "list": "[1, 2, 3]",
        "scalar": "42",
        "string": '"just text"',
        "deep": "[" * 100_000 + "]" * 100_000,
        "notjson": "{not json" + ESC,
        "fields": json.dumps({"task_id": FORGED, "result": ESC, "task": ESC, "digest": 5}),
        "huge": json.dumps({"task_id": "x" * 100_000, "result": ["y" * 100_000]}),
    }
    for scope, value in scopes.items():
        r.set(done_name(prefix, scope), value, px=60_000)
        r.hset(checkpoint_name(prefix, scope), mapping={"step": value, ESC: value, "ok": '{"value": 1}'})
    raw.set(done_name(prefix, "bytes").encode(), NOT_UTF8)
    raw.hset(checkpoint_name(prefix, "bytes").encode(), NOT_UTF8, NOT_UTF8)
    r.hset(done_name(prefix, "wrongtype"), "a", "hash where a string belongs")
    r.set(checkpoint_name(prefix, "wrongtype"), "a string where a hash belongs")
    # Metrics: counts no flush writes, names with escapes, flush times that are not times.
    total = metrics.total_key(prefix)
    r.hset(
        total,
        mapping={
            "good.task|lock.acquired": "3", "good.task|lock.released": "3",
            "nan.task|lock.acquired": "nan", "inf.task|lock.acquired": "inf", "big.task|lock.acquired": "1e400",
            "float.task|lock.acquired": "1.5", "text.task|lock.acquired": "many", "sup.task|lock.acquired": "²",
            f"{ESC}|lock.acquired": "2", f"{FORGED}|lock.contended": "1", "no-bar-field": "x",
            "@first_flush_at": "yesterday", "@last_flush_at": "nan",
        },
    )  # fmt: skip
    raw.hset(total.encode(), NOT_UTF8 + b"|lock.acquired", NOT_UTF8)
    raw.hset(total.encode(), b"t" + NOT_UTF8 + b"|lock.acquired", b"1")
    import time

    r.hset(metrics.minute_key(prefix, int(time.time() // 60)), mapping={"good.task|lock.acquired": "inf", "x|y": "1"})
    # Process gauges (held now): counts no process holds -- inf, a 400-digit int, a bool -- beside a good one.
    now = time.time()
    bad_counts = {"inf": "1e400", "huge": "1" + "0" * 400, "bool": "true", "float": "1.5", "neg": "-3"}
    for name, count in {**bad_counts, "good": "2"}.items():
        row = f'{{"task":"{name}.task","worker":"w@h","held":{count},"oldest_acquired_at":{now - 5:.3f}}}'
        r.set(metrics.proc_key(prefix, f"p-{name}"), f'{{"at":{now:.3f},"ttl":600,"held":[{row}]}}', ex=600)
        r.zadd(metrics.procs_key(prefix), {f"p-{name}": now})
    return {"scopes": [*scopes, "bytes", "wrongtype"]}


def strict_json(text: str) -> Any:
    """JSON as the spec has it: ``NaN`` and ``Infinity`` (which ``json.dumps`` writes for nan/inf) refused."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def assert_terminal_safe(text: str, where: str) -> None:
    """Nothing a terminal interprets: every character printable, or a plain newline ending a line."""
    bad = sorted({repr(c) for c in text if not (c.isprintable() or c == "\n")})
    assert not bad, f"{where}: raw {', '.join(bad)} in the output:\n{text[:2000]}"


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    a = Celery("hostile", broker=redis_url, set_as_current=False)
    a.conf.lockguard_key_prefix = prefix
    a.conf.broker_transport_options = {"global_keyprefix": f"{prefix}:kombu:"}
    yield a
    connection.forget_clients()


def invoke(app: Celery, *args: str, input: str = "") -> Result:
    from celery_lockguard._cli import lockguard

    reset(app)
    obj = CLIContext(app=app, no_color=True, workdir=None, quiet=True)
    result = CliRunner().invoke(lockguard, list(args), obj=obj, input=input)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        tb = "".join(traceback.format_exception(result.exception))
        raise AssertionError(f"lockguard {' '.join(args)} crashed:\n{tb}")
    for stream, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        assert "Traceback" not in text, f"lockguard {' '.join(args)} {stream}:\n{text}"
        assert_terminal_safe(text, f"lockguard {' '.join(args)} {stream}")
    return result


def test_locks_lists_every_planted_lease_as_one_row_and_the_good_one_as_usual(
    app: Celery, r: redis.Redis, raw: redis.Redis, prefix: str
) -> None:
    plant(r, raw, prefix)
    out = invoke(app, "locks")
    assert out.exit_code == 0
    good = next(line for line in out.stdout.splitlines() if line.startswith("inv:good"))
    assert "billing.charge" in good and "t-good" in good and "w@h" in good
    # A forged newline stays inside its row: one line per lease, plus the header.
    rows = strict_json(invoke(app, "locks", "--json").stdout)
    assert len(out.stdout.splitlines()) == 1 + len(rows)
    assert not [line for line in out.stdout.splitlines() if line.startswith("invoice:9")]
    by_key = {row["key"]: row for row in rows}
    assert by_key["inv:good"]["fence"] == good_fence(r, prefix) and by_key["inv:good"]["malformed"] == []
    numbers = by_key["numbers"]
    assert {"fence", "acquired_at", "renewed_at", "pid", "ttl", "state"} <= set(numbers["malformed"])
    assert numbers["fence"] is None and numbers["held_for_ms"] is None
    assert by_key["wrongtype"]["state"] == "unreadable" and by_key["wrongtype"]["malformed"] == ["WRONGTYPE"]
    assert "bad\udcff\udcfe" in by_key  # the non-UTF-8 key: read, and named by its bytes
    assert by_key["no-ttl"]["ttl_left_ms"] is None and by_key["no-ttl"]["fence"] == 7
    assert "\\x1b[2J" in out.stdout and "bad\\xff\\xfe" in out.stdout  # shown escaped, not interpreted
    assert "with values no worker writes" in out.stderr
    assert invoke(app, "locks", "--match", "text:*").exit_code == 0


def good_fence(r: redis.Redis, prefix: str) -> int:
    return int(r.hget(lock_name(prefix, "inv:good"), "fence") or 0)


def test_release_prompt_and_messages_escape_the_holder_and_refuse_what_is_no_lease(
    app: Celery, r: redis.Redis, raw: redis.Redis, prefix: str
) -> None:
    plant(r, raw, prefix)
    asked = invoke(app, "release", "text:1", input="n\n")  # the forged-newline holder
    assert asked.exit_code == 1 and "Aborted" in asked.stderr
    prompt = asked.stdout.splitlines()
    assert prompt[0].startswith("Force-release 'text:1' held by t-1\\ninvoice:9"), prompt
    for key in ("text:0", "text:6", "numbers", "no-ttl"):
        done = invoke(app, "release", key, "--yes")
        assert done.exit_code == 0, (key, done.stdout, done.stderr)
        assert not r.exists(lock_name(prefix, key))
    wrong = invoke(app, "release", "wrongtype", "--yes")
    assert wrong.exit_code == 1 and "is not a lease" in wrong.stderr and r.exists(lock_name(prefix, "wrongtype"))
    corrupt = invoke(app, "release", "corrupt-fence", "--yes")
    assert corrupt.exit_code == 1 and "nothing was released" in corrupt.stderr
    assert r.exists(lock_name(prefix, "corrupt-fence"))
    # The key that is not UTF-8, named by the bytes the shell passes (surrogate-escaped, as Python reads argv):
    # no task renders such a key, so it is refused, by name, and left for the operator to delete.
    bad = invoke(app, "release", "bad\udcff\udcfe", "--yes")
    assert bad.exit_code == 64 and "bad\\xff\\xfe is not an entity key" in bad.stderr, bad.stderr
    assert raw.exists(lock_name(prefix, "").encode()[:-6] + NOT_UTF8 + b"}:lock")
    assert r.exists(lock_name(prefix, "inv:good"))


def test_stats_skip_values_no_flush_writes_and_read_the_rest(
    app: Celery, r: redis.Redis, raw: redis.Redis, prefix: str
) -> None:
    plant(r, raw, prefix)
    text = invoke(app, "stats")
    assert text.exit_code == 0
    assert "good.task" in text.stdout and "\\x1b[2J" in text.stdout
    assert "with values no worker writes, skipped" in text.stderr
    summary = strict_json(invoke(app, "stats", "--json").stdout)  # strict JSON: no NaN, no Infinity
    assert summary["tasks"]["good.task"]["windows"]["total"]["acquisitions"] == 3
    assert {"nan.task|lock.acquired", "inf.task|lock.acquired", "big.task|lock.acquired", "@first_flush_at"} <= set(
        summary["malformed"]
    )
    assert summary["first_flush_at"] is None and summary["last_flush_at"] is None
    prom = invoke(app, "stats", "--prometheus")
    assert prom.exit_code == 0
    assert 'lockguard_events_total{task="good.task",event="lock.acquired"} 3' in prom.stdout.splitlines()
    # Held-now: only the good process gauge counts; inf, a 400-digit int, bools and floats are skipped.
    held = [line for line in prom.stdout.splitlines() if line.startswith("lockguard_leases_held{")]
    assert held == ['lockguard_leases_held{task="good.task",worker="w@h"} 2'], held
    assert "nan.task" not in prom.stdout and "lockguard_metrics_last_flush_timestamp_seconds" not in prom.stdout


@pytest.mark.parametrize("as_json", [False, True])
def test_completions_show_and_forget_survive_every_planted_record(
    app: Celery, r: redis.Redis, raw: redis.Redis, prefix: str, as_json: bool
) -> None:
    planted = plant(r, raw, prefix)
    for scope in planted["scopes"]:
        out = invoke(app, "completions", "show", scope, *(["--json"] if as_json else []))
        assert out.exit_code == 0, (scope, out.stdout, out.stderr)
        if as_json:
            shown = strict_json(out.stdout)
            assert shown["scope"] == scope
        else:
            assert len(out.stdout) < 20_000, scope  # a 100 kB value is cut in the text output
    text = invoke(app, "completions", "show", "deep").stdout
    assert "not a JSON object" in text and "more]" in text
    assert "completed by t-1\\ninvoice:9" in invoke(app, "completions", "show", "fields").stdout
    assert invoke(app, "completions", "forget", "notjson", "--yes").exit_code == 0
    assert not r.exists(done_name(prefix, "notjson"))


def test_doctor_and_describe_run_over_a_database_of_hostile_keys(
    app: Celery, own_redis: RedisServer, prefix: str
) -> None:
    app.conf.lockguard_redis_url = own_redis.url  # a private server: doctor's sample is sure to meet them
    plant(own_redis.client(), redis.Redis.from_url(own_redis.url), prefix)
    raw = redis.Redis.from_url(own_redis.url)
    for i in range(30):  # foreign keys that are not UTF-8: doctor samples (and quotes) them
        raw.set(b"foreign:" + NOT_UTF8 + str(i).encode(), b"x")
    doctor = invoke(app, "doctor")
    assert doctor.exit_code == 1, doctor.stdout
    report = strict_json(invoke(app, "doctor", "--json").stdout)
    assert {f["code"] for f in report["findings"]} == {"cache_traffic"}
    assert "foreign:bad\\xff\\xfe" in doctor.stdout or "foreign:bad\\udcff" in doctor.stdout
    assert invoke(app, "describe").exit_code == 0
    assert invoke(app, "describe", "--json").exit_code == 0


def test_the_real_command_prints_no_escape_sequence(
    r: redis.Redis, raw: redis.Redis, redis_url: str, prefix: str
) -> None:
    plant(r, raw, prefix)
    cfg = make_cfg(prefix, redis_url)
    for args in (("locks",), ("stats",), ("completions", "show", "fields"), ("release", "text:0", "--yes")):
        out = cli(cfg, *args)
        assert out.returncode == 0, (args, out.stderr)
        assert "Traceback" not in out.stderr
        assert_terminal_safe(out.stdout, f"{args} stdout")
        assert_terminal_safe(out.stderr, f"{args} stderr")


def test_the_exporter_answers_every_scrape_over_hostile_metrics(
    r: redis.Redis, raw: redis.Redis, redis_url: str, prefix: str
) -> None:
    plant(r, raw, prefix)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.workerapp:app", "lockguard", "exporter", "--port", str(port)],
        cwd=ROOT,
        env=cli_env(make_cfg(prefix, redis_url)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def scrape() -> tuple[int, str] | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                    return resp.status, resp.read().decode()
            except urllib.error.HTTPError as err:
                return err.code, err.read().decode()
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, "the exporter exited"
                return None

        code, body = wait_for(scrape, 30, interval=0.2, what="the exporter to answer")
        assert code == 200
        assert 'lockguard_events_total{task="good.task",event="lock.acquired"} 3' in body.splitlines()
        assert 'task="\\\\x1b[2J\\\\x1b[31m"' in body  # the escape, as text, in a valid label
        assert_terminal_safe(body, "the exporter's body")
        # A totals key of the wrong type is read as empty (issue 30): 200, and the exporter keeps serving.
        r.delete(metrics.total_key(prefix))
        r.set(metrics.total_key(prefix), "not a hash")
        wrong = scrape()
        assert wrong is not None and wrong[0] == 200 and "lockguard_events_total{" not in wrong[1], wrong
        r.delete(metrics.total_key(prefix))
        r.hset(metrics.total_key(prefix), "good.task|lock.acquired", "4")
        again = scrape()
        assert again is not None and again[0] == 200 and "} 4" in again[1]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "Traceback" not in err


# -- one reproduced defect at a time ----------------------------------------------------------


def _good_lease(r: redis.Redis, prefix: str) -> None:
    L.acquire(
        r, prefix, "inv:good", ttl_ms=60_000, task_id="t-good", task_name="billing.charge", digest="d", worker="w@h",
        fence_ttl_ms=60_000,
    )  # fmt: skip


@pytest.mark.parametrize(
    "field,value", [("fence", "²"), ("acquired_at", "1732900112345.5"), ("pid", "١٢"), ("ttl", "1e3")]
)
def test_one_malformed_lease_field_is_a_placeholder_in_its_row(
    app: Celery, r: redis.Redis, prefix: str, field: str, value: str
) -> None:
    _good_lease(r, prefix)
    r.hset(lock_name(prefix, "odd"), mapping={"task_id": "t-odd", "task_name": "n", "fence": "4", field: value})
    out = invoke(app, "locks")
    assert out.exit_code == 0
    odd = next(line for line in out.stdout.splitlines() if line.startswith("odd "))
    assert "t-odd" in odd and any(line.startswith("inv:good ") for line in out.stdout.splitlines())
    row = next(x for x in strict_json(invoke(app, "locks", "--json").stdout) if x["key"] == "odd")
    assert row["malformed"] == [field]


@pytest.mark.parametrize("kind", ["wrongtype", "not-utf8"])
def test_a_lease_key_of_the_wrong_type_or_not_utf8_is_one_row(
    app: Celery, r: redis.Redis, raw: redis.Redis, prefix: str, kind: str
) -> None:
    _good_lease(r, prefix)
    if kind == "wrongtype":
        r.set(lock_name(prefix, "odd"), "x")
    else:
        raw.hset(lock_name(prefix, "odd").encode().replace(b"odd", b"odd\xff"), b"task_id", b"t\xfe")
    out = invoke(app, "locks")
    assert out.exit_code == 0 and any(line.startswith("inv:good ") for line in out.stdout.splitlines())
    assert any(line.startswith("odd") for line in out.stdout.splitlines())


@pytest.mark.parametrize(
    "where,value",
    [("count", "nan"), ("count", "inf"), ("count", "1e400"), ("count", "lots"), ("flush", "nan"), ("flush", "soon")],
)
def test_one_malformed_metrics_value_is_skipped_by_stats(
    app: Celery, r: redis.Redis, prefix: str, where: str, value: str
) -> None:
    total = metrics.total_key(prefix)
    r.hset(
        total, mapping={"good.task|lock.acquired": "2", "@first_flush_at": "1700000000", "@last_flush_at": "1700000060"}
    )
    r.hset(total, *(("bad.task|lock.acquired", value) if where == "count" else ("@last_flush_at", value)))
    for args in (("stats",), ("stats", "--json"), ("stats", "--prometheus")):
        out = invoke(app, *args)
        assert out.exit_code == 0 and "good.task" in out.stdout, (args, out.stdout, out.stderr)
        assert "nan" not in out.stdout.lower().replace("good.task", "")
    summary = strict_json(invoke(app, "stats", "--json").stdout)
    assert summary["tasks"]["good.task"]["windows"]["total"]["acquisitions"] == 2


@pytest.mark.parametrize("record", ["[1, 2]", "7", "null", '"text"', "[" * 100_000 + "]" * 100_000])
def test_completions_show_reads_a_record_that_is_no_object(
    app: Celery, r: redis.Redis, prefix: str, record: str
) -> None:
    r.set(done_name(prefix, "s"), record, px=60_000)
    r.hset(checkpoint_name(prefix, "s"), mapping={"a": record, "b": '{"value": 1}'})
    for args in (("completions", "show", "s"), ("completions", "show", "s", "--json")):
        out = invoke(app, *args)
        assert out.exit_code == 0, (args, out.stdout, out.stderr)
    assert "checkpoint b: 1" in invoke(app, "completions", "show", "s").stdout


def test_a_forged_row_and_escapes_stay_inside_their_cell(app: Celery, r: redis.Redis, prefix: str) -> None:
    _good_lease(r, prefix)
    L.acquire(
        r, prefix, "inv:evil", ttl_ms=60_000, task_id=FORGED, task_name=ESC + "charge", digest="d", worker="w\x07",
        fence_ttl_ms=60_000,
    )  # fmt: skip
    out = invoke(app, "locks")
    lines = out.stdout.splitlines()
    assert len(lines) == 3 and not any(line.startswith("invoice:9") for line in lines)
    asked = invoke(app, "release", "inv:evil", input="n\n")
    assert not any(line.startswith("invoice:9") for line in asked.stdout.splitlines())  # no forged prompt line
    metrics.count(FORGED, "lock.acquired", 2)
    metrics.flush(r, prefix)
    stats = invoke(app, "stats")
    assert not any(line.startswith("invoice:9") for line in stats.stdout.splitlines())
    r.set(done_name(prefix, "s"), json.dumps({"task_id": FORGED, "result": ESC}), px=60_000)
    assert "\\ninvoice:9" in invoke(app, "completions", "show", "s").stdout
