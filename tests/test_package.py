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


def _run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)  # type: ignore[call-overload]
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    src = tmp_path_factory.mktemp("src") / "celery-lockguard"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*_NOT_SOURCES))
    _run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out), str(src)])
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


@pytest.fixture(scope="module")
def clean_venv(dist: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with only the wheel and what it declares: no editable checkout, no test extras."""
    venv = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", str(venv)])
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(dist["wheel"])])
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
