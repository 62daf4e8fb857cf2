"""The test project's settings with a shorter lease TTL: what ``manage.py lockguard --settings=...`` must read."""

from .settings import *  # noqa: F403 - a settings variant, as Django projects write them

CELERY_LOCKGUARD_DEFAULT_TTL = 7
