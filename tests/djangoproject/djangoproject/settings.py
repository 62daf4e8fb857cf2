"""Settings of the test project; every name a test isolates by comes from the environment.

``LOCKGUARD_DJANGO_PREFIX`` prefixes every Redis key (lockguard's, the broker's,
the results'), so a run never touches another's keys on the shared server.
``LOCKGUARD_DJANGO_DB`` is the SQLite file the test process and the worker share;
``LOCKGUARD_DJANGO_PG`` (a ``postgresql://`` URL) adds a ``pg`` database alias.
"""

import os
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

PREFIX = os.environ.get("LOCKGUARD_DJANGO_PREFIX", "lgdj")
REDIS_URL = os.environ.get("LOCKGUARD_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

SECRET_KEY = "lockguard-tests-only"
DEBUG = False
USE_TZ = True
INSTALLED_APPS = ["billing"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("LOCKGUARD_DJANGO_DB", str(Path(tempfile.gettempdir()) / "lockguard-django.sqlite3")),
        # The test process and the worker's children write the same file: wait for the lock, do not fail.
        "OPTIONS": {"timeout": 20},
    }
}
if os.environ.get("LOCKGUARD_DJANGO_PG"):
    _pg = urlsplit(os.environ["LOCKGUARD_DJANGO_PG"])
    DATABASES["pg"] = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _pg.path.lstrip("/"),
        "USER": _pg.username or "",
        "PASSWORD": _pg.password or "",
        "HOST": _pg.hostname or "",
        "PORT": str(_pg.port or ""),
    }

CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = REDIS_URL
CELERY_BROKER_TRANSPORT_OPTIONS = {"global_keyprefix": f"{PREFIX}:kombu:"}
CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS = {"global_keyprefix": f"{PREFIX}:results:"}
CELERY_TASK_DEFAULT_QUEUE = f"{PREFIX}-q"
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# lockguard's settings, Django style: CELERY_ + the upper-cased lockguard_* name.
CELERY_LOCKGUARD_KEY_PREFIX = f"{PREFIX}:lg"
CELERY_LOCKGUARD_DEFAULT_TTL = 20
CELERY_LOCKGUARD_KEYS = {"billing.sync_tenant": "tenant:{tenant_id}:sync"}
