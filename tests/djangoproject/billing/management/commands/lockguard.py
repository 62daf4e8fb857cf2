"""``python manage.py lockguard ...``: the ``celery lockguard`` CLI with this project's Celery app."""

from celery_lockguard.django import LockGuardCommand as Command

__all__ = ["Command"]
