"""Django: the lease composed with Celery's ``DjangoTask``, and ``manage.py lockguard``.

Celery 5.4+ gives a Django project ``DjangoTask`` (``delay_on_commit``,
``apply_async_on_commit``) as the app's task class. ``base=LockedTask`` keeps
it where it can (see :class:`celery_lockguard.LockedTask`); this module names
the composition outright, for a project that wants it spelt out or builds task
classes by hand::

    from celery import shared_task
    from celery_lockguard.django import LockedDjangoTask

    @shared_task(base=LockedDjangoTask, bind=True, lock_key="invoice:{invoice_id}", lock_mode="until_done")
    def charge_invoice(self, invoice_id): ...

``charge_invoice.delay_on_commit(42)`` publishes -- and so claims, in the
queue-time modes -- when the transaction commits: a rollback leaves neither a
message nor a claim. See docs/django.md.
"""

from __future__ import annotations

import argparse
from typing import Any

try:
    from celery.contrib.django.task import DjangoTask
except ImportError as exc:  # Celery < 5.4 (no contrib.django), or Django itself missing
    raise ImportError(
        "celery_lockguard.django needs Celery 5.4+ (celery.contrib.django.task.DjangoTask) and Django; "
        "on older Celery compose the lease with your own task class: class MyTask(LockGuard, MyBase)"
    ) from exc

import click
from celery import current_app
from django.core.management.base import BaseCommand, CommandError
from kombu.utils.imports import symbol_by_name

from ._task import LockGuard

__all__ = ["LockGuardCommand", "LockedDjangoTask"]


class LockedDjangoTask(LockGuard, DjangoTask):
    """``LockGuard`` over ``DjangoTask``: the lease, plus ``delay_on_commit`` and ``apply_async_on_commit``.

    ``LockGuard`` comes first, so the lease wraps the body and the queue-time
    claim is taken inside ``apply_async`` -- which ``DjangoTask`` defers to
    ``transaction.on_commit``: the claim is taken at commit, never for a
    transaction that rolls back.
    """


class LockGuardCommand(BaseCommand):
    """``python manage.py lockguard ...``: the ``celery lockguard`` CLI with the project's Celery app.

    Django discovers commands only inside an installed app's
    ``management/commands`` package, so a project adds one line there
    (``yourapp/management/commands/lockguard.py``)::

        from celery_lockguard.django import LockGuardCommand as Command

    The arguments are the CLI's (``locks``, ``release KEY``, ``describe``,
    ``doctor``, ...). The app is :attr:`celery_app` if a subclass sets it,
    else Celery's current app -- the project's, once its ``__init__`` imported
    it as Celery's Django guide does.
    """

    help = "celery lockguard ... with this project's Celery app: locks, release KEY, stats, describe, doctor"
    #: The Celery app, or its import path (``"proj.celery:app"``); ``None``: Celery's current app.
    celery_app: Any = None

    def run_from_argv(self, argv: list[str]) -> None:
        """Hand everything after ``manage.py lockguard`` to the click group: its options, help and exit codes.

        Django's own options (``--settings``, ``--pythonpath``, ``-v``, ...) are
        taken out first, wherever they stand: ``manage.py`` has already applied
        ``--settings`` and ``--pythonpath`` before loading the command, and the
        click group would refuse them as unknown. The database connections the
        CLI's app may have opened are closed afterwards, as Django's
        ``run_from_argv`` does.
        """
        from django.db import connections

        prog = f"{argv[0].rsplit('/', 1)[-1]} {argv[1]}" if len(argv) > 1 else "lockguard"
        args, no_color = strip_django_options(argv[2:])
        try:
            self._cli(args, prog, standalone=True, no_color=no_color)
        finally:
            connections.close_all()

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("cli_args", nargs=argparse.REMAINDER, help="the `celery lockguard` arguments")

    def handle(self, *args: Any, **options: Any) -> None:
        """``call_command("lockguard", "describe", "--json")``: a CLI failure becomes a ``CommandError``.

        The CLI writes with ``click.echo`` to ``sys.stdout``, not to ``call_command(stdout=...)``.
        """
        try:
            self._cli(list(options.get("cli_args") or ()), "lockguard", standalone=False)
        except click.ClickException as exc:
            raise CommandError(exc.format_message(), returncode=exc.exit_code) from exc

    def _cli(self, args: list[str], prog: str, *, standalone: bool, no_color: bool = False) -> None:
        from celery.bin.base import CLIContext

        from ._cli import lockguard

        app = symbol_by_name(self.celery_app) if self.celery_app is not None else current_app._get_current_object()
        obj = CLIContext(app=app, no_color=no_color, workdir=None)
        lockguard.main(args=args, prog_name=prog, obj=obj, standalone_mode=standalone)


#: Django's options of every command that take a value (``--settings X`` or ``--settings=X``).
_DJANGO_VALUED = frozenset({"--settings", "--pythonpath", "--verbosity", "-v"})
#: Django's flag options of every command.
_DJANGO_FLAGS = frozenset({"--traceback", "--no-color", "--force-color", "--skip-checks"})


def strip_django_options(args: list[str]) -> tuple[list[str], bool]:
    """``args`` without Django's default options, and whether ``--no-color`` was among them.

    Recognised anywhere before a ``--`` (after it everything is the CLI's):
    ``--settings``, ``--pythonpath``, ``-v``/``--verbosity`` with their value
    as the next word or after ``=`` (``-v2`` too), and the flags
    ``--traceback``, ``--no-color``, ``--force-color``, ``--skip-checks``;
    ``-h`` becomes the CLI's ``--help``.
    """
    out: list[str] = []
    no_color = False
    words = iter(args)
    for word in words:
        if word == "--":
            out.append(word)
            out.extend(words)
            break
        name = word.split("=", 1)[0]
        if word in _DJANGO_FLAGS:
            no_color = no_color or word == "--no-color"
        elif word in _DJANGO_VALUED:
            next(words, None)
        elif name in _DJANGO_VALUED or (word.startswith("-v") and word[2:].isdigit()):
            pass
        elif word == "-h":  # Django's short help; the CLI spells it --help
            out.append("--help")
        else:
            out.append(word)
    return out, no_color
