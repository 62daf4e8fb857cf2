"""Every ```python block in README.md and docs/*.md runs, each in a fresh interpreter.

A fresh interpreter per block, because samples define tasks with the same
names on different apps (Celery shares ``@app.task`` functions between the
apps of one process). Each block gets a private server as ``REDIS_URL``
(:class:`celery_lockguard.testing.RedisServer`) and, when a block mentions
``DATABASE_URL``, the test PostgreSQL with ``search_path`` set to a schema of
its own -- so samples can create tables and leave day-long completion records
behind without meeting another block or another run of the suite.

A block that must not run is fenced as another language (```text,
```console) or preceded by the line ``<!-- docs-test: skip -->``; the second
form is counted and kept rare.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest

from celery_lockguard.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_MARKER = "<!-- docs-test: skip -->"
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    code: str
    skipped: bool

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def python_blocks() -> list[Block]:
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group("lang") != "python":
                continue
            before = text[: m.start()].rstrip().splitlines()
            skipped = bool(before) and before[-1].strip() == SKIP_MARKER
            line = text.count("\n", 0, m.start()) + 1
            blocks.append(Block(page, line, textwrap.dedent(m.group("body")), skipped))
    return blocks


BLOCKS = python_blocks()


def test_the_samples_are_found_and_exceptions_are_rare() -> None:
    pages = {b.page.name for b in BLOCKS}
    assert "README.md" in pages and "index.md" in pages
    assert len(BLOCKS) >= 20, [b.id for b in BLOCKS]
    assert sum(b.skipped for b in BLOCKS) <= 2, [b.id for b in BLOCKS if b.skipped]


def test_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if p.name not in nav]
    assert not missing, f"pages not in mkdocs.yml nav: {missing}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if not b.skipped], ids=lambda b: b.id)
def test_sample_runs(block: Block, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCKGUARD_", "DATABASE_URL", "REDIS_URL"))}
    env["PYTHONPATH"] = str(ROOT)
    if "import django" in block.code or "celery.contrib.django" in block.code:
        pytest.importorskip("django")  # make compat's venvs carry no Django
        pytest.importorskip("celery.contrib.django.task")  # nor, on Celery 5.3, DjangoTask
    schema = None
    dsn = ""
    if "DATABASE_URL" in block.code:
        dsn = request.getfixturevalue("postgres_url")  # skips (or fails, in CI) without PostgreSQL
        import psycopg

        schema = f"docs_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        env["DATABASE_URL"] = f"{dsn}{'&' if '?' in dsn else '?'}options={quote(f'-csearch_path={schema}')}"
    script = tmp_path / "sample.py"
    script.write_text(block.code)
    try:
        with RedisServer() as server:
            env["REDIS_URL"] = server.url
            proc = subprocess.run(
                [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90
            )
    finally:
        if schema:
            import psycopg

            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    output = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, f"{block.id} failed:\n{block.code}\n{output}"
