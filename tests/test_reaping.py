"""Every worker a test starts dies with the test run, however the run ends.

``make test`` interrupted by Ctrl-C or a timeout left ``tests.poolapp`` solo workers polling their queues:
a worker runs in a session of its own (so the test can signal its group), which a terminal's SIGINT and a
timeout's SIGTERM do not reach. Here a real pytest run starts a real worker and waits; the run is then sent
SIGINT, SIGTERM or SIGKILL, and the worker (and its pool children) must be gone within a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from celery_lockguard.testing import wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent

APP = """
import os
from celery import Celery

app = Celery("reapapp", broker=os.environ["REAP_BROKER"])
app.conf.broker_connection_retry_on_startup = True
# Every broker key under the test's prefix (its queue, kombu's bindings), as on a shared server.
app.conf.broker_transport_options = {"global_keyprefix": os.environ["REAP_PREFIX"] + ":kombu:"}
"""

INNER_TEST = """
import json, os, threading
from pathlib import Path
from celery_lockguard.testing import Worker

def test_starts_a_worker_and_waits():
    here = str(Path(__file__).parent)
    w = Worker("reapapp:app", pool=os.environ["REAP_POOL"], concurrency=1, cwd=here,
               env={"PYTHONPATH": here}, queues=[os.environ["REAP_QUEUE"]])
    w.start(90)
    # Written whole, then renamed: the outer test polls for the name and must never read a half-written file.
    pids = Path(os.environ["REAP_PIDS"])
    pids.with_suffix(".tmp").write_text(json.dumps([w.pid, *w.children()]))
    pids.with_suffix(".tmp").rename(pids)
    threading.Event().wait(600)  # until the run is signalled
"""


def _alive(pid: int) -> bool:
    """Running (a zombie no one reaped yet counts as gone: it runs nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("sig", "pool"),
    [(signal.SIGINT, "solo"), (signal.SIGTERM, "solo"), (signal.SIGTERM, "prefork"), (signal.SIGKILL, "prefork")],
    ids=["sigint-solo", "sigterm-solo", "sigterm-prefork", "sigkill-prefork"],
)
def test_workers_die_with_the_test_run(
    sig: signal.Signals, pool: str, tmp_path: Path, redis_url: str, prefix: str
) -> None:
    (tmp_path / "reapapp.py").write_text(textwrap.dedent(APP))
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER_TEST))
    pids_file = tmp_path / "pids.json"
    env = {
        **os.environ,
        "REAP_BROKER": redis_url,
        "REAP_POOL": pool,
        "REAP_QUEUE": f"{prefix}-q",
        "REAP_PREFIX": prefix,
        "REAP_PIDS": str(pids_file),
        "PYTHONPATH": str(ROOT),  # this tree's celery_lockguard, not whichever one the venv has installed
    }
    # Its output goes to a file, never to a pipe nobody reads while we wait (a full pipe would block it).
    output = (tmp_path / "inner.log").open("wb")
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "test_inner.py"],
        cwd=tmp_path,
        env=env,
        stdout=output,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # our own signals stay ours
        # As from a shell: SIGINT at its default, so Python turns it into KeyboardInterrupt. A parent that
        # ignores it (a pytest-xdist worker does) would pass SIG_IGN on across exec, and Ctrl-C would do nothing.
        preexec_fn=_default_sigint,
    )
    pids: list[int] = []
    try:
        wait_for(lambda: pids_file.exists() or run.poll() is not None, 120, what="the inner run's worker to start")
        assert run.poll() is None, (tmp_path / "inner.log").read_text(errors="replace")[-3000:]
        pids = json.loads(pids_file.read_text())
        assert pids and all(_alive(p) for p in pids), pids
        os.kill(run.pid, sig)  # a Ctrl-C reaches pytest, never the worker's own session
        run.wait(120)
        wait_for(
            lambda: not [p for p in pids if _alive(p)],
            20,
            what=f"worker processes {pids} to die after {sig.name} to the test run",
        )
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(10)
        for p in pids:  # leave nothing behind even when the assertion failed
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
        output.close()
