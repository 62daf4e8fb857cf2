"""tools/provision.sh: what `make test` and .ci/run do about Chromium/chromedriver and promtool.

Where it cannot install them, `make test` must say at its start which tests will be reported as skipped and
why (not let a newcomer find it in the summary at the end), and CI (--strict) must stop. Where apt-get fails,
its output is shown (it is hidden only on success). PATH is narrowed to a directory of the few tools the
script uses, so the binaries and apt-get are "missing" whatever this machine has.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "provision.sh"


def _bin(tmp_path: Path, apt_get: str | None = None) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("bash", "id", "mktemp", "cat", "rm", "env"):
        found = shutil.which(tool)
        assert found, tool
        (bindir / tool).symlink_to(found)
    if apt_get is not None:
        (bindir / "apt-get").write_text(apt_get)
        (bindir / "apt-get").chmod(0o755)
    return bindir


def _run(bindir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": str(bindir), "HOME": os.environ.get("HOME", "/tmp"), "TMPDIR": str(bindir.parent)}
    return subprocess.run(
        [str(bindir / "bash"), str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_when_it_cannot_install_it_says_which_tests_will_skip_and_why(tmp_path: Path) -> None:
    bindir = _bin(tmp_path)
    run = _run(bindir)
    assert run.returncode == 0, run.stderr  # make test goes on: those tests skip, reported as such
    assert "these tests will be reported as skipped" in run.stderr, run.stderr
    assert "tests/test_page.py: chromium, chromedriver" in run.stderr, run.stderr
    assert "tests/test_dashboard.py: promtool" in run.stderr, run.stderr
    why = "no apt-get on this machine" if os.geteuid() == 0 else "not root"
    assert f"why: {why}" in run.stderr, run.stderr
    assert "chromium chromium-driver prometheus" in run.stderr, run.stderr  # the packages to install by hand
    assert _run(bindir, "--strict").returncode == 1  # CI stops instead


def test_a_failing_apt_get_shows_its_output_and_still_says_why(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        return  # not root: apt-get is never tried (the test above holds that branch)
    bindir = _bin(tmp_path, apt_get='#!/bin/sh\necho "E: Unable to locate package $*"\nexit 100\n')
    run = _run(bindir)
    assert run.returncode == 0, run.stderr
    assert "provision: installing chromium chromium-driver prometheus with apt-get" in run.stdout, run.stdout
    assert "E: Unable to locate package" in run.stderr, run.stderr  # apt's output, shown because it failed
    assert "why: apt-get install chromium chromium-driver prometheus failed" in run.stderr, run.stderr


def test_ci_and_make_test_provision_through_the_same_script() -> None:
    assert "tools/provision.sh --strict" in (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "test: provision " in makefile and "\t@tools/provision.sh\n" in makefile
    assert "apt-get" not in (ROOT / ".ci" / "run").read_text()  # one place installs packages
