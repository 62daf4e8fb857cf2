"""One object per process, made on first use and made again after fork.

Threads do not survive ``fork`` and sockets must not be shared across it, so a
prefork child needs its own renewer, its own reply thread and its own token
generator (a copied generator would hand parent and children the same tokens).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class PerProcess(Generic[T]):
    """``get()`` returns this process's ``make()``; the check is one ``getpid`` and a tuple read."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._current: tuple[int, T] | None = None
        self._lock = threading.Lock()

    def get(self) -> T:
        pid = os.getpid()
        current = self._current
        if current is None or current[0] != pid:
            with self._lock:
                current = self._current
                if current is None or current[0] != pid:
                    current = self._current = (pid, self._make())
        return current[1]

    def peek(self) -> T | None:
        """This process's object if one was made here, else ``None`` (makes nothing)."""
        current = self._current
        return current[1] if current is not None and current[0] == os.getpid() else None
