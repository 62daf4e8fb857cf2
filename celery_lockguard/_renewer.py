"""One renewal thread per worker process, started lazily after fork.

Every tick renews *all* leases the process holds in one EVALSHA per client
(one round trip per tick, whatever the number of leases; on Redis Cluster one
per node, so a node that is down only delays its own leases), then sleeps until
the earliest lease is due again (ttl/3 with jitter) or hits its max-hold.
Renewing a long-TTL lease a little early costs nothing; an extra round trip
per lease would.

A lease is untracked under the same lock the tick uses to apply results, so a
reply that arrives after release is ignored: the RENEW script is token-checked,
so it cannot resurrect a released key either.

The thread never dies: any error in a tick (an outage, BUSY, NOREPLICAS, an ACL
denial, a bug) is a failed tick, logged as ``lock.backend_unavailable`` with
its kind, and retried after a fraction of the interval (:data:`RETRY_FRACTION`,
at least :data:`MIN_RETRY`) rather than a whole one, so a short blip costs no
lease. A lease whose validity passes is reported lost (``lock.lost``,
``reason="expired"``) and untracked, whatever the store is doing.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from . import _cluster as cluster
from . import _errors as errors
from . import _lease as lease_ops
from ._connection import follow_failover
from ._events import emit, logger
from ._lease import Lease

#: After a failed tick, the next try comes this fraction of the renewal interval later (ttl/15)...
RETRY_FRACTION = 0.2
#: ...but never sooner than this many seconds, so a refusing server is not hammered.
MIN_RETRY = 0.05
#: Longest pause after an error outside a tick (the loop itself), doubling from MIN_RETRY.
MAX_LOOP_BACKOFF = 1.0


@dataclass
class _Entry:
    lease: Lease
    client: Any
    interval: float
    deadline: float
    due: float


class Renewer:
    """Renews the leases of one process until they are released, lost or cut off."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._wake_at = math.inf  # when the thread will next look at its leases (0: it is ticking now)
        self.ticks = 0

    def track(self, lease: Lease, client: Any, max_hold: float) -> None:
        """Start renewing ``lease`` every ttl/3 until ``max_hold`` seconds after acquisition."""
        interval = lease.ttl_ms / 3000
        entry = _Entry(lease, client, interval, lease.acquired_at + max_hold, lease.acquired_at + _jitter(interval))
        with self._cond:
            self._entries[id(lease)] = entry
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="lockguard-renewer", daemon=True)
                self._thread.start()
            elif min(entry.due, entry.deadline) < self._wake_at - 0.2 * interval:
                # Wake the thread only if it would otherwise renew this lease late by more than a fifth of
                # its interval: a wake-up per task costs more CPU than the whole tracking otherwise does.
                self._cond.notify()

    def untrack(self, lease: Lease) -> None:
        """Stop renewing ``lease``; any reply still in flight for it is ignored."""
        with self._cond:
            self._entries.pop(id(lease), None)

    def tracked(self) -> int:
        with self._cond:
            return len(self._entries)

    def _run(self) -> None:
        """The thread's loop: nothing escapes it, or every lease of the process would silently stop renewing."""
        failures = 0
        while True:
            try:
                self._pass()
                failures = 0
            except Exception as exc:  # noqa: BLE001 - a dead renewer loses every lease of the process
                failures += 1
                delay = min(MAX_LOOP_BACKOFF, MIN_RETRY * 2 ** min(failures - 1, 10))
                try:
                    logger.error("lock.renewer_error", reason=f"{exc.__class__.__name__}: {exc}", exc_info=True)
                except Exception:  # noqa: BLE001 - logging itself failed; keep renewing regardless
                    pass
                with self._cond:
                    self._wake_at = time.monotonic() + delay
                    self._cond.wait(delay)

    def _pass(self) -> None:
        """Wait until a lease is due, then renew every tracked lease (one call per client and node)."""
        with self._cond:
            while not self._entries:
                self._wake_at = math.inf
                self._cond.wait()
            now = time.monotonic()
            due = min(min(e.due, e.deadline, e.lease.valid_until) for e in self._entries.values())
            if due > now:
                self._wake_at = due
                self._cond.wait(due - now)
                return
            self._wake_at = 0.0
            self._cut_off(now)
            groups: dict[tuple[int, str], list[_Entry]] = {}
            for e in self._entries.values():
                node = cluster.node_name(e.client, e.lease.redis_key)
                groups.setdefault((id(e.client), node), []).append(e)
        for entries in groups.values():
            self._tick(entries)
        self.ticks += 1

    def _cut_off(self, now: float) -> None:
        """Untrack leases past their max-hold, and leases already lost (validity passed): report each once."""
        for key, e in list(self._entries.items()):
            if now >= e.deadline:
                del self._entries[key]
                if e.lease.mark_lost("max_hold"):
                    emit(
                        "lock.max_hold_reached",
                        e.lease.task_name,
                        lock_key=e.lease.key,
                        task_id=e.lease.task_id,
                        fence=e.lease.fence,
                        hold_ms=round(e.lease.hold_ms()),
                    )
            elif e.lease.lost:
                del self._entries[key]
                self._report_lost(e.lease, "expired")

    def _tick(self, entries: list[_Entry]) -> None:
        """One RENEW round trip for ``entries``; any error makes it a failed tick, retried soon."""
        leases = [e.lease for e in entries]
        sent_at = time.monotonic()
        results: list[int] | None = None
        try:
            follow_failover(entries[0].client)  # Sentinel: renew on the current master, not a demoted one
            sent_at = time.monotonic()
            results = lease_ops.renew(entries[0].client, leases)
            if len(results) != len(leases):
                raise RuntimeError(f"RENEW answered {len(results)} results for {len(leases)} leases")
        except Exception as exc:  # noqa: BLE001 - BUSY, NOREPLICAS, NOPERM...: classified, never fatal
            results = None
            kind = errors.classify(exc) or "unexpected"
            emit(
                "lock.backend_unavailable",
                None,
                reason=f"renew ({kind}): {exc.__class__.__name__}: {errors.reply_text(exc)}",
                lock_keys=[x.key for x in leases[:20]],
            )
        lost: list[tuple[Lease, str]] = []
        with self._cond:
            now = time.monotonic()
            for i, e in enumerate(entries):
                if self._entries.get(id(e.lease)) is not e:
                    continue  # released (or cut off) while the reply was in flight
                if results is not None:
                    if results[i] == 1 and e.lease.renewed(sent_at):
                        e.due = now + _jitter(e.interval)
                        continue
                    # token gone; or renewed too late: the validity had passed, and lost is final
                    reason = "token_gone" if results[i] != 1 else "expired"
                elif e.lease.lost:
                    reason = "expired"
                else:
                    e.due = now + _retry_delay(e.interval)
                    continue
                del self._entries[id(e.lease)]
                lost.append((e.lease, reason))
        if results is not None:
            emit("lock.renewed", None, leases=len(leases), lock_keys=[x.key for x in leases[:20]])
        for lease, reason in lost:
            self._report_lost(lease, reason)

    @staticmethod
    def _report_lost(lease: Lease, reason: str) -> None:
        if lease.mark_lost(reason):
            emit(
                "lock.lost",
                lease.task_name,
                lock_key=lease.key,
                task_id=lease.task_id,
                fence=lease.fence,
                hold_ms=round(lease.hold_ms()),
                reason=reason,
            )


def _retry_delay(interval: float) -> float:
    """When to try again after a failed tick: soon, so a blip shorter than the TTL loses nothing."""
    return max(MIN_RETRY, _jitter(interval) * RETRY_FRACTION)


def _jitter(interval: float) -> float:
    return interval * random.uniform(0.85, 1.0)


_renewer: tuple[int, Renewer] | None = None
_renewer_lock = threading.Lock()


def renewer() -> Renewer:
    """This process's renewer (a new one after fork: threads do not survive it)."""
    global _renewer
    pid = os.getpid()
    current = _renewer
    if current is None or current[0] != pid:
        with _renewer_lock:
            current = _renewer
            if current is None or current[0] != pid:
                current = (pid, Renewer())
                _renewer = current
    return current[1]
