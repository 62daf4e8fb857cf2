"""A Django project laid out as Celery's Django guide says, for tests/test_django.py.

Importing the package creates the Celery app, so ``@shared_task`` tasks bind
to it and ``celery -A djangoproject worker`` finds it.
"""

from .celery import app as celery_app

__all__ = ("celery_app",)
