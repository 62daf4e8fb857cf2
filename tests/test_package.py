"""The package installs like one: a wheel and an sdist that ``twine check`` passes, with
``py.typed``, one version, both entry points, and a clean venv holding only the wheel (and
its declared dependencies) that runs the README sample and ``celery lockguard doctor``.

Built once per session (``python -m build`` in its isolated environment, then a venv):
about a minute on two cores, which is why the module is marked ``package`` and ``make
compat`` leaves it out.
"""

from __future__ import annotations

import ast
import configparser
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import celery_lockguard
from celery_lockguard.testing import RedisServer

# One build per run: each build costs a minute (make unit runs --dist loadgroup). It runs on a copy of the
# tree: `python -m build` writes build/ and *.egg-info beside the sources, where other tests' celery
# subprocesses import the package from.
pytestmark = [pytest.mark.package, pytest.mark.xdist_group("test_package")]

ROOT = Path(__file__).resolve().parent.parent
#: What the build's copy of the tree leaves out: environments, caches and earlier build output.
_NOT_SOURCES = (".git", ".venv", ".bench", ".chaos", "build", "dist", "site", "*.egg-info", "__pycache__", ".*_cache")
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


#: A throwaway venv's installs skip byte-compiling (the packages are imported a few times, then deleted): about
#: half of each install's time on this machine kind, and nothing a test here checks.
PIP_INSTALL = ["-m", "pip", "install", "-q", "--no-compile"]


def _venv(path: Path) -> str:
    """A clean venv at ``path`` (no system site-packages, no editable checkout); its python."""
    _run([sys.executable, "-m", "venv", str(path)])
    return str(path / "bin" / "python")


def _run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)  # type: ignore[call-overload]
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    src = tmp_path_factory.mktemp("src") / "celery-lockguard"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*_NOT_SOURCES))
    # No --sdist/--wheel: build makes the sdist, then the wheel *from the unpacked sdist*, so the wheel every
    # test here installs is the one the sdist builds (test_the_sdist_runs_its_own_docs_and_tests installs it,
    # not a second build of the sdist in pip's isolated environment).
    built = _run([sys.executable, "-m", "build", "--outdir", str(out), str(src)])
    (out / "build.log").write_text(built.stdout + built.stderr)
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist, "log": out / "build.log"}


@pytest.fixture(scope="module")
def clean_venv(dist: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with only the wheel and what it declares: no editable checkout, no test extras."""
    venv = tmp_path_factory.mktemp("venv")
    _run([_venv(venv), *PIP_INSTALL, str(dist["wheel"])])
    return venv


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    srv = RedisServer().start()
    yield srv
    srv.stop()


def test_twine_check_passes_on_wheel_and_sdist(dist: dict[str, Path]) -> None:
    out = _run([sys.executable, "-m", "twine", "check", "--strict", str(dist["wheel"]), str(dist["sdist"])])
    assert out.stdout.count("PASSED") == 2, out.stdout


def test_wheel_ships_py_typed_one_version_and_both_entry_points(dist: dict[str, Path]) -> None:
    with zipfile.ZipFile(dist["wheel"]) as whl:
        names = whl.namelist()
        assert "celery_lockguard/py.typed" in names
        assert not [n for n in names if n.startswith(("tests/", "bench/", "chaos/", "example_app/"))]
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        version = re.search(r"^Version: (.+)$", whl.read(meta).decode(), re.M)
        assert version and version.group(1) == celery_lockguard.__version__
        entry_points = configparser.ConfigParser()
        entry_points.read_string(whl.read(next(n for n in names if n.endswith("entry_points.txt"))).decode())
    assert entry_points["celery.commands"]["lockguard"] == "celery_lockguard._cli:lockguard"
    # Named like the module: ``pytest_plugins = ["celery_lockguard.pytest_plugin"]`` then finds it registered.
    assert dict(entry_points["pytest11"]) == {"celery_lockguard.pytest_plugin": "celery_lockguard.pytest_plugin"}
    assert f"-{celery_lockguard.__version__}-" in dist["wheel"].name


def test_sdist_builds_the_same_package(dist: dict[str, Path]) -> None:
    with tarfile.open(dist["sdist"]) as sdist:
        names = sdist.getnames()
    assert any(n.endswith("celery_lockguard/py.typed") for n in names)
    assert any(n.endswith("celery_lockguard/_version.py") for n in names)
    assert any(n.endswith("CHANGELOG.md") for n in names) or any(n.endswith("README.md") for n in names)


def test_license_is_an_spdx_expression_and_the_file_ships_in_both(dist: dict[str, Path]) -> None:
    """PEP 639: ``License-Expression: MIT`` and the LICENSE file, no deprecated table form or classifier.

    ``license = { text = "MIT" }`` made setuptools warn on every build and four times per install.
    """
    log = dist["log"].read_text()
    assert "license" not in " ".join(line for line in log.splitlines() if "eprecat" in line).lower(), log
    with zipfile.ZipFile(dist["wheel"]) as whl:
        names = whl.namelist()
        meta = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        licence = next((n for n in names if n.endswith(".dist-info/licenses/LICENSE")), None)
        assert licence, names
        assert "MIT License" in whl.read(licence).decode()
    assert re.search(r"^License-Expression: MIT$", meta, re.M), meta[:2000]
    assert re.search(r"^License-File: LICENSE$", meta, re.M)
    assert not re.search(r"^Classifier: License ::", meta, re.M)
    assert re.search(r"^Classifier: Typing :: Typed$", meta, re.M)
    with tarfile.open(dist["sdist"]) as sdist:
        names = sdist.getnames()
    assert any(n.endswith("/LICENSE") for n in names)


def test_readme_links_work_on_the_package_index() -> None:
    """The README is the package index page's description, where a relative link leads nowhere."""
    readme = (ROOT / "README.md").read_text()
    relative = [t for t in re.findall(r"\]\(([^)]+)\)", readme) if not t.startswith(("https://", "http://", "#"))]
    assert not relative, relative
    assert "`docs/`" in readme  # says where the docs live instead


def test_changelog_has_one_unreleased_section_and_it_is_the_version_built() -> None:
    """The wheel builds as ``__version__``: the changelog's one unreleased section is that version."""
    headings = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    unreleased = [h for h in headings if "unreleased" in h.lower()]
    assert unreleased == [headings[0]], headings
    assert celery_lockguard.__version__ in headings[0], headings[0]
    released = [h.split()[0] for h in headings[1:]]
    assert celery_lockguard.__version__ not in released, headings


def test_sdist_carries_the_docs_and_the_tests_helpers(dist: dict[str, Path]) -> None:
    with tarfile.open(dist["sdist"]) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    for needed in (
        "docs/index.md",
        "docs/testing.md",
        "mkdocs.yml",
        "CHANGELOG.md",
        "README.md",
        "tests/conftest.py",
        "tests/harness.py",
        "tests/workerapp.py",
        "tests/test_docs.py",
    ):
        assert needed in names, needed
    # Every test module it carries imports only what it carries (no bench/chaos/ops/tools in an sdist).
    carried = {n.split("/")[0] for n in names}
    for name in names:
        if name.startswith("tests/test_") and name.endswith(".py"):
            assert not ({"bench", "chaos", "ops", "tools"} - carried) & _top_imports(name), name


def _top_imports(test_module: str) -> set[str]:
    tree = ast.parse((ROOT / test_module).read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
    return names


@pytest.mark.sdist
@pytest.mark.timeout(900)
def test_the_sdist_runs_its_own_docs_and_tests(
    dist: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, redis_url: str, postgres_url: str
) -> None:
    """Unpacked, installed in a clean venv (its runtime extras and pytest, no editable checkout), the sdist
    runs the docs test (its checks and the README's samples) and a test module it carries against the
    installed package (``--import-mode=append``: the unpacked sources come after site-packages). The docs
    test could not run from the sdist before: it carried ``tests/test_*.py`` but neither ``docs/`` nor the
    tests' conftest and helpers."""
    root = tmp_path_factory.mktemp("sdist")
    with tarfile.open(dist["sdist"]) as sdist:
        sdist.extractall(root, filter="data")
    (src,) = root.iterdir()
    venv = root / "venv"
    # The wheel the sdist built (the dist fixture), with the extras the tests need: pip would build the same
    # wheel from the sdist again in an isolated environment, a minute of duplicated work.
    _run([_venv(venv), *PIP_INSTALL, f"{dist['wheel']}[postgres,embedded,pytest,django]", "pytest-timeout"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "VIRTUAL_ENV"))}
    env.update(LOCKGUARD_TEST_REDIS_URL=redis_url, LOCKGUARD_TEST_POSTGRES_URL=postgres_url)
    proc = subprocess.run(
        [
            str(venv / "bin" / "pytest"),  # not ``python -m pytest``: that puts the unpacked sources first
            "-q",
            "-p",
            "no:cacheprovider",
            "--import-mode=append",
            "tests/test_docs.py",
            "tests/test_errors.py",
            # The docs test's own checks (every page found and in the nav: docs/ shipped) and the README's
            # samples against the installed wheel; the suite's own test_docs runs every page's samples
            # against the same code (here they were the same 40-odd interpreters again, ~2 minutes).
            "-k",
            "not test_sample_runs or README",
        ],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary and "failed" not in summary, tail


def test_clean_venv_runs_the_readme_sample(clean_venv: Path, server: RedisServer, tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    sample = re.search(r"```python\n(.*?)```", readme, re.S)
    assert sample, "README has no python sample"
    (tmp_path / "readme_app.py").write_text(sample.group(1))
    env = {"PATH": os.environ["PATH"], "REDIS_URL": server.url, "HOME": str(tmp_path)}
    _run([str(clean_venv / "bin" / "python"), "readme_app.py"], cwd=tmp_path, env=env)
    # the same app, through the installed `celery` console script and our celery.commands entry point
    doctor = subprocess.run(
        [str(clean_venv / "bin" / "celery"), "-A", "readme_app", "lockguard", "doctor"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    # The installed command ran against the app, and what the README sets up is what doctor asks for.
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "Traceback" not in doctor.stderr
    assert "no findings" in doctor.stdout, doctor.stdout


def test_clean_venv_imports_only_what_the_wheel_declares(clean_venv: Path) -> None:
    code = (
        "import celery_lockguard, celery_lockguard.fencing, celery_lockguard.acl, celery_lockguard.testing;"
        "import importlib.metadata as m; print(celery_lockguard.__version__, m.version('celery-lockguard'))"
    )
    out = _run([str(clean_venv / "bin" / "python"), "-c", code], cwd="/")
    installed, declared = out.stdout.split()
    assert installed == declared == celery_lockguard.__version__


def test_every_name_in_all_is_importable() -> None:
    for name in celery_lockguard.__all__:
        assert hasattr(celery_lockguard, name), name


def test_docs_import_only_from_public_modules() -> None:
    """A user copying a sample never reaches into an internal (underscore) module."""
    offenders = []
    for page in DOC_PAGES:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            for node in ast.walk(ast.parse(block)):
                modules = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    modules = [a.name for a in node.names]
                for module in modules:
                    parts = module.split(".")
                    if parts[0] == "celery_lockguard" and any(p.startswith("_") and p != "__version__" for p in parts):
                        offenders.append(f"{page.name}: {module}")
    assert not offenders, offenders


def test_the_public_modules_are_the_same_in_the_docstring_and_the_reference() -> None:
    """The package docstring and docs/reference.md's "What is public" name the same modules, each importable.

    ``celery_lockguard.django`` was missing from both while the Django docs told users to import it.
    """
    import importlib

    docstring = set(re.findall(r"``(celery_lockguard\.[a-z][a-z_]*)``", celery_lockguard.__doc__ or ""))
    reference = (ROOT / "docs" / "reference.md").read_text()
    public = reference[reference.index("**What is public.**") : reference.index("## Task options")]
    documented = set(re.findall(r"`(celery_lockguard\.[a-z][a-z_]*)`", public))
    assert docstring == documented
    assert "celery_lockguard.django" in documented
    for module in documented:
        assert not module.split(".")[1].startswith("_"), module
        importlib.import_module(module)
    assert "_signals.install" not in reference  # signals are connected when a LockGuard task is bound


def test_every_module_of_the_suites_imports() -> None:
    """bench, chaos, example_app and tools run outside pytest (make bench, make chaos, make demo): a broken
    import there shows only when CI reaches that target, so catch it here, in a fresh interpreter."""
    modules = [
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for folder in ("bench", "chaos", "example_app", "tools")
        for path in sorted((ROOT / folder).glob("*.py"))
    ]
    assert len(modules) > 20
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\nprint('ok')"
    out = _run([sys.executable, "-c", code, *modules], cwd=ROOT)
    assert out.stdout.strip() == "ok"


def _make_install(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``make install`` of a copy of the tree into a venv of its own (no extras: a minute, not five)."""
    src = tmp / "src"
    if not src.exists():
        shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*_NOT_SOURCES))
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "VIRTUAL_ENV")}
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(src), "install", f"PYTHON={sys.executable}", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


@pytest.mark.timeout(900)
def test_make_install_is_quiet_and_shows_pip_only_on_failure(tmp_path: Path) -> None:
    """``make demo`` on a fresh clone printed 243 lines of pip before the demo's first: now one line, unless
    pip fails, and then all of pip's output and where its log is."""
    ok = _make_install(tmp_path, f"VENV={tmp_path / 'ok'}", "EXTRAS=", "PIP_ARGS=--no-compile")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.strip().splitlines() == [
        f"Installing celery-lockguard into {tmp_path / 'ok'} (pip's output: {tmp_path / 'ok'}/install.log)..."
    ], ok.stdout + ok.stderr
    assert not ok.stderr.strip(), ok.stderr
    assert "Successfully installed" in (tmp_path / "ok" / "install.log").read_text()

    bad = _make_install(
        tmp_path, f"VENV={tmp_path / 'bad'}", "EXTRAS=", "PIP_ARGS=--no-index --find-links=/nonexistent"
    )
    assert bad.returncode != 0
    assert "ERROR" in bad.stdout, bad.stdout  # pip's own output, printed because it failed
    assert f"its whole output is in {tmp_path / 'bad'}/install.log" in bad.stderr
    assert not (tmp_path / "bad" / ".installed").exists()
