"""The one place the version lives (pyproject reads it; so does ``celery_lockguard.__version__``)."""

__version__ = "0.2.0"
