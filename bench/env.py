"""What the numbers were measured on: machine, load, versions."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from typing import Any

PACKAGES = (
    "celery-lockguard",
    "celery",
    "kombu",
    "billiard",
    "redis",
    "structlog",
    "celery-once",
    "celery-singleton",
    "python-redis-lock",
    "hiredis",
    "matplotlib",
)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def describe(server_client: Any, server_binary: str) -> dict[str, Any]:
    """Machine, load and versions, with the private server's own version."""
    uname = subprocess.run(["uname", "-a"], capture_output=True, text=True, check=False).stdout.strip()
    info = server_client.info("server")
    return {
        "uname": uname,
        "cores": os.cpu_count(),
        "cpu": _cpu_model(),
        "python": platform.python_version(),
        "packages": {p: _version(p) for p in PACKAGES},
        "server": f"{info.get('redis_version', '?')} ({server_binary})",
        "loadavg": os.getloadavg(),
    }
