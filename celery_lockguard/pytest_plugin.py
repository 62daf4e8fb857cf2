"""pytest plugin for celery-lockguard (registered through the ``pytest11`` entry point).

Placeholder: the fixtures land with issue 14's plugin work.
"""
