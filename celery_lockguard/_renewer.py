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

Under gevent or eventlet (``threading`` monkey-patched) a ``threading.Thread``
is a greenlet: it runs only when the task's body yields, so a CPU-bound body
starved it (measured: a 3 s pure-Python loop under a 1 s TTL got zero ticks and
lost its lease). There the renewer is *isolated* (:func:`green_runtime`): it
runs on a real OS thread (the interpreter's original ``start_new_thread``),
and everything it shares with the greenlets is unpatched, because a green lock
or socket must not be used from another OS thread (a green socket belongs to
the hub of the thread that created it; an eventlet semaphore contended across
threads never wakes its waiter):

* its state is guarded by original (OS) locks, held only for bookkeeping, never
  across I/O or logging, so a greenlet waiting on one blocks the hub for
  microseconds at most; each tracked lease's guard is swapped for one too;
* it renews through clients of its own, created on that thread (a green
  socket created there uses that thread's own hub);
* its events (``lock.renewed``, ``lock.lost``, ...) are handed to the
  greenlets, because logging handlers and the metrics counters are guarded by
  green locks. The thread wakes the hub thread-safely (gevent: an ``async_``
  watcher; eventlet: a byte on a socket a drainer greenlet reads, as
  ``eventlet.tpool`` does), and a greenlet emits them as soon as the hub runs:
  within milliseconds, on an idle worker too, and never later than the next
  ``track``/``untrack``. A CPU-bound body that never yields holds the hub, so
  its events wait for it to yield or end; the body reads ``lock.lost`` from the
  lease itself, which is never deferred.
* nothing it reports is dropped, whatever the greenlets' delay: ``lock.lost``
  and ``lock.max_hold_reached`` (at most one per lease) are queued one by one;
  the repetitive ones (``lock.renewed`` per tick, ``lock.backend_unavailable``
  per failed tick, ``lock.renewer_error``) are coalesced into one event each,
  counted in full and logged once with ``occurrences=<n>``.

Renewal lag -- how late each renewal was sent against when it was due (a
lease renewed early, with a batch, is 0 late; a failed tick's retries keep
counting from the original due time) -- is tallied per task under the
renewer's own mutex, in buckets, so it stays bounded however long nobody
flushes; the metrics flush takes the tally (:func:`_collect_lags`). The
renewer thread never touches the metrics lock, which under gevent is green.

Wherever it runs, the loop reports an event the way the task that tracked the
lease would have: through the ``lockguard_log_backend`` read at ``track()``
(the thread has no current app to read it from) and onto that task's span
(captured at ``track()``; an event after the span ended goes on none), never
onto whichever span is current where it is emitted.
"""

from __future__ import annotations

import _thread
import logging
import math
import os
import random
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from . import _cluster as cluster
from . import _connection as connection
from . import _errors as errors
from . import _events as events
from . import _lease as lease_ops
from . import _metrics as metrics
from . import _otel_metrics as otel
from . import _tracing as tracing
from . import _wire
from ._connection import follow_failover
from ._lease import Lease
from ._process import PerProcess

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
    backend: str  # lockguard_log_backend where the lease was tracked
    span: Any  # the tracking task's recording span, or None
    expected: float = 0.0  # when the next renewal was due after the last success: lag counts from here


@dataclass
class _Event:
    """An event of the loop, emitted as the task that tracked the lease would have (see the module docstring)."""

    name: str
    task_name: str | None
    fields: dict[str, Any]
    backend: str
    span: Any = None
    n: int = 1  # occurrences coalesced into this one


#: Events an isolated loop may make once per tick: kept as one each (the newest fields), counted in full.
COALESCED = frozenset({"lock.renewed", "lock.backend_unavailable", "lock.renewer_error"})


def green_runtime() -> str | None:
    """``"gevent"`` or ``"eventlet"`` when this process's ``threading`` is monkey-patched, else ``None``.

    Read from ``sys.modules`` only: a process that never imported gevent or
    eventlet is not patched, and importing either here would cost start-up time.
    """
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("threading"):
        return "gevent"
    patcher = sys.modules.get("eventlet.patcher")
    if patcher is not None and patcher.is_monkey_patched("thread"):
        return "eventlet"
    return None


def _native_thread_api(runtime: str | None) -> tuple[Callable[[], Any], Callable[..., Any]]:
    """The interpreter's own ``allocate_lock`` and ``start_new_thread``, as they were before any patching."""
    if runtime == "gevent":
        from gevent import monkey

        return monkey.get_original("_thread", "allocate_lock"), monkey.get_original("_thread", "start_new_thread")
    if runtime == "eventlet":
        from eventlet import patcher

        original = patcher.original("_thread")
        return original.allocate_lock, original.start_new_thread
    return _thread.allocate_lock, _thread.start_new_thread


class _OSThread:
    """A thread started with the original ``start_new_thread``: an OS thread even when ``threading`` is patched."""

    def __init__(self, target: Callable[[], None], start_new_thread: Callable[..., Any]) -> None:
        self._alive = True
        self.name = "lockguard-renewer"

        def run() -> None:
            try:
                target()
            finally:
                self._alive = False

        start_new_thread(run, ())

    def is_alive(self) -> bool:
        return self._alive


def _own_client(client: Any) -> Any:
    """A client like ``client`` whose connections are made (and only ever used) on the calling thread.

    The library's clients are made by ``_connection`` from settings; the same
    settings make an independent one (Sentinel and Cluster included). Another
    plain client is copied from its pool's arguments. Anything else (a Sentinel
    or Cluster client made elsewhere) raises ``TypeError``, a failed tick:
    sharing it would let two OS threads use one green socket, which hangs or
    corrupts replies instead of failing.
    """
    copy = connection.independent_copy(client)
    if copy is not None:
        return copy
    pool = getattr(client, "connection_pool", None)
    if type(pool) in (redis.ConnectionPool, redis.BlockingConnectionPool):
        assert pool is not None
        return redis.Redis(connection_pool=type(pool)(connection_class=pool.connection_class, **pool.connection_kwargs))
    raise TypeError(
        f"cannot renew through a {type(client).__name__} with a {type(pool).__name__} from an OS thread: "
        "use a client made from lockguard settings"
    )


def _close_quietly(client: Any) -> None:
    """Close ``client`` and its pool's connections (``close()`` spares a pool it was handed)."""
    try:
        client.close()
        pool = getattr(client, "connection_pool", None)
        if pool is not None:
            pool.disconnect()
    except Exception:  # noqa: BLE001 - a dead connection needs no orderly close
        pass


class _GeventDrain:
    """Wakes the gevent hub from any thread; the hub then spawns a greenlet that emits the queued events."""

    def __init__(self, flush: Callable[[], None]) -> None:
        import gevent

        self._spawn = gevent.spawn
        self._flush = flush
        # Not ref'd: a pending wake-up must not keep gevent.wait() or the hub alive.
        self._watcher = gevent.get_hub().loop.async_(ref=False)
        self._watcher.start(self._woken)

    def _woken(self) -> None:
        self._spawn(self._flush)  # the hub itself must not block, and logging takes green locks

    def wake(self) -> None:
        self._watcher.send()  # thread-safe (libev ev_async_send / uv_async_send)


class _EventletDrain:
    """Wakes a drainer greenlet through a socket pair, as ``eventlet.tpool`` does: one byte per wake-up.

    eventlet's hub has no thread-safe call; a green socket read blocks the
    greenlet in the hub's poll, so an idle worker spends no CPU on it.
    """

    def __init__(self, flush: Callable[[], None]) -> None:
        import eventlet
        from eventlet import greenio, patcher

        reader, self._writer = patcher.original("socket").socketpair()
        self._writer.setblocking(False)
        self._reader = greenio.GreenSocket(reader)
        self._flush = flush
        eventlet.spawn_n(self._drain)
        # A forked child inherits the pair and this greenlet: its copy would read the parent's wake-ups
        # (the parent's events then wait for the next track/untrack). The child closes its copies, which
        # ends its drainer; its own Renewer makes a new drain. (gevent's async watcher is per loop.)
        ref = weakref.ref(self)

        def in_child() -> None:
            drain = ref()
            if drain is not None:
                drain.close()

        os.register_at_fork(after_in_child=in_child)

    def close(self) -> None:
        for sock in (self._reader, self._writer):
            try:
                sock.close()
            except OSError:
                pass

    def _drain(self) -> None:
        while True:
            try:
                if not self._reader.recv(4096):
                    return
            except OSError:
                return
            self._flush()

    def wake(self) -> None:
        try:
            self._writer.send(b"x")
        except OSError:  # buffer full: wake-ups are already pending
            pass


class Renewer:
    """Renews the leases of one process until they are released, lost or cut off.

    ``isolated`` (default: whether :func:`green_runtime` finds a patched
    process) runs the loop on an OS thread with its own clients, OS locks and
    queued events (see the module docstring); tests force it in a normal process.
    """

    def __init__(self, isolated: bool | None = None) -> None:
        runtime = green_runtime()
        self.isolated = runtime is not None if isolated is None else isolated
        #: What the loop runs on: "thread", or "os-thread" when isolated (reported by ``lockguard doctor``).
        self.thread_kind = "os-thread" if self.isolated else "thread"
        # Not isolated: the primitives threading has (green ones in a patched process, as before 0.2).
        native = _native_thread_api(runtime if self.isolated else None)
        allocate_lock = native[0] if self.isolated else threading.Lock
        self._start_new_thread = native[1]
        self._allocate_lock = allocate_lock
        self._entries: dict[int, _Entry] = {}
        self._mutex = allocate_lock()  # guards _entries, _wake_at, _events; never held across I/O or logging
        self._wakeup = allocate_lock()  # held while nobody asked the loop to look again; released to wake it
        self._wakeup.acquire()
        self._thread: threading.Thread | _OSThread | None = None
        self._wake_at = math.inf  # when the thread will next look at its leases (0: it is ticking now)
        # Seconds an idle thread sleeps before it looks again (inf: until woken): the shortest 0.85 interval
        # of the leases tracked since it last went idle (see _pass).
        self._idle_for = math.inf
        self._idling = False  # in that bounded idle sleep: a lease tracked meanwhile wakes it if due before it
        self._runtime = runtime
        # Isolated: events for the greenlets. Each lease adds at most one to _events (its lost or
        # max-hold), the rest coalesce in _coalesced, so neither needs a bound that would drop one.
        self._events: deque[_Event] = deque()
        self._coalesced: dict[str, _Event] = {}
        self._signalled = False  # events are pending and the drain was woken for them
        self._drain: _GeventDrain | _EventletDrain | None = None
        self._backend = "auto"  # for the loop's own errors: the backend of the last lease tracked
        self._own_clients: dict[int, tuple[Any, Any]] = {}  # id(client) -> (client, own client); loop thread only
        self._drains: dict[int, Any] = {}  # channels with deferred replies to read (_wire.drain_soon)
        self._drain_at = math.inf  # when the loop reads them, if their owners have not by then
        self.ticks = 0
        #: Renewal lag per task since the last flush took it: [count, sum_ms, buckets...] (guarded by _mutex).
        self._lags: dict[str, list[float]] = {}

    def take_lags(self) -> dict[str, list[float]]:
        """The renewal-lag tally since the last call, per task; the renewer starts a new one."""
        with self._mutex:
            lags, self._lags = self._lags, {}
        return lags

    def track(self, lease: Lease, client: Any, max_hold: float) -> None:
        """Start renewing ``lease`` every ttl/3 until ``max_hold`` seconds after acquisition."""
        interval = lease.ttl_ms / 3000
        # Read here, in the task's context: the loop's thread has neither the app nor the span.
        backend = events.backend_choice()
        self._backend = backend
        entry = _Entry(
            lease,
            client,
            interval,
            lease.acquired_at + max_hold,
            lease.acquired_at + _jitter(interval),
            backend,
            tracing.current_span(),
        )
        entry.expected = entry.due
        if self.isolated:
            # Lease methods the loop calls take this guard; a green lock must not be shared with an OS thread.
            lease._guard = self._allocate_lock()
            if self._drain is None and self._runtime is not None:
                self._drain = _make_drain(self._runtime, self.flush_events)
        with self._mutex:
            self._entries[id(lease)] = entry
            self._idle_for = min(self._idle_for, interval * _JITTER_LOW)
            if self._thread is None or not self._thread.is_alive():
                self._thread = self._start()
            elif entry.deadline < self._wake_at or entry.due < self._wake_at - (0 if self._idling else 0.2 * interval):
                # Wake the thread only if it would otherwise renew this lease late by more than a fifth of
                # its interval (a wake-up per task costs more CPU than the whole tracking otherwise does);
                # never late for lock_max_hold, nor at all while idle (its wake-up only bounds the sleep).
                self._notify()
        self.flush_events()

    def drain_soon(self, channel: Any) -> None:
        """Read ``channel``'s deferred replies within :data:`~celery_lockguard._wire.DRAIN_DELAY` (see ``_wire``).

        One wake-up per delay at most, however many releases go out meanwhile: a drain already due
        takes every channel handed in before it runs.
        """
        at = time.monotonic() + _wire.DRAIN_DELAY
        with self._mutex:
            self._drains[id(channel)] = channel
            if at >= self._drain_at:
                return
            self._drain_at = at
            if self._thread is None or not self._thread.is_alive():
                self._thread = self._start()
            elif self._drain_at < self._wake_at:
                self._notify()

    def untrack(self, lease: Lease) -> None:
        """Stop renewing ``lease``; any reply still in flight for it is ignored."""
        with self._mutex:
            self._entries.pop(id(lease), None)
        self.flush_events()

    def tracked(self) -> int:
        with self._mutex:
            return len(self._entries)

    def flush_events(self) -> None:
        """Emit the events an isolated loop handed over (called by the greenlets, which may log).

        Each caller takes the whole batch under the mutex, so two greenlets
        flushing at once emit every event exactly once.
        """
        if not self._signalled:  # unlocked read: a stale answer only defers to the drain's own flush
            return
        with self._mutex:
            batch = [*self._coalesced.values(), *self._events]
            self._coalesced.clear()
            self._events.clear()
            self._signalled = False
        for event in batch:
            self._emit(event)

    @staticmethod
    def _emit(event: _Event) -> None:
        fields = event.fields if event.n == 1 else {**event.fields, "occurrences": event.n}
        try:
            if event.name == "lock.renewer_error":  # logged, not counted
                events.log(logging.ERROR, event.name, None, fields, backend=event.backend)
            else:
                events.emit_for(event.name, event.task_name, fields, backend=event.backend, span=event.span, n=event.n)
        except Exception:  # noqa: BLE001 - a failing log call must not fail the task that flushed it
            pass

    def _start(self) -> threading.Thread | _OSThread:
        if self.isolated:
            return _OSThread(self._run, self._start_new_thread)
        thread = threading.Thread(target=self._run, name="lockguard-renewer", daemon=True)
        thread.start()
        return thread

    def _report(self, event: _Event) -> None:
        """Emit now, or (isolated) hand it to the greenlets and wake them; never called with the mutex held."""
        if not self.isolated:
            self._emit(event)
            return
        with self._mutex:
            if event.name in COALESCED:
                earlier = self._coalesced.get(event.name)
                if earlier is not None:
                    event.n += earlier.n
                self._coalesced[event.name] = event
            else:
                self._events.append(event)
            wake = not self._signalled
            self._signalled = True
        if wake and self._drain is not None:
            self._drain.wake()

    def _notify(self) -> None:
        """Make the loop look at its leases now (with the mutex held)."""
        try:
            self._wakeup.release()
        except RuntimeError:  # already woken, not yet seen
            pass

    def _wait(self, timeout: float | None) -> None:
        """Sleep until notified or ``timeout`` seconds passed; entered and left with the mutex held."""
        self._mutex.release()
        try:
            if timeout is None:
                self._wakeup.acquire()
            else:
                self._wakeup.acquire(True, min(max(timeout, 0.0), _thread.TIMEOUT_MAX))
        finally:
            self._mutex.acquire()

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
                    if self.isolated:  # logged later, outside this except: the traceback travels as text
                        trace = "".join(traceback.format_exception(exc)).rstrip()
                        reason = f"{exc.__class__.__name__}: {exc}\n{trace}"
                        self._report(_Event("lock.renewer_error", None, {"reason": reason}, self._backend))
                    else:
                        events.log(
                            logging.ERROR,
                            "lock.renewer_error",
                            None,
                            {"reason": f"{exc.__class__.__name__}: {exc}"},
                            exc_info=True,
                            backend=self._backend,
                        )
                except Exception:  # noqa: BLE001 - logging itself failed; keep renewing regardless
                    pass
                with self._mutex:
                    self._wake_at = time.monotonic() + delay
                    self._wait(delay)

    def _pass(self) -> None:
        """Wait until a lease or a drain is due, then renew every tracked lease (one call per client and node)."""
        drains: list[Any] = []
        groups: dict[tuple[int, str], list[_Entry]] = {}
        cut: list[tuple[_Entry, str]] = []
        with self._mutex:
            while not self._entries and not self._drains:
                idle, self._idle_for = self._idle_for, math.inf
                if idle < math.inf:
                    # Leases were tracked since the thread last looked: more will follow. Sleep no longer
                    # than the earliest renewal any of them could be due after its track (0.85 of its
                    # interval), so a lease tracked meanwhile is due after this wake-up and track() need
                    # not wake the thread for it (a wake-up per task cost more CPU than the tracking).
                    self._wake_at = time.monotonic() + idle
                    self._idling = True
                    try:
                        self._wait(idle)
                    finally:
                        self._idling = False
                else:
                    self._wake_at = math.inf
                    self._wait(None)
            now = time.monotonic()
            renew_at = min(
                (min(e.due, e.deadline, e.lease.valid_until) for e in self._entries.values()), default=math.inf
            )
            due = min(renew_at, self._drain_at)
            if due > now:
                self._wake_at = due
                self._wait(due - now)
                return
            self._wake_at = 0.0
            if self._drain_at <= now:
                drains = list(self._drains.values())
                self._drains.clear()
                self._drain_at = math.inf
            if renew_at <= now:
                cut = self._cut_off(now)
                for e in self._entries.values():
                    node = cluster.node_name(e.client, e.lease.redis_key)
                    groups.setdefault((id(e.client), node), []).append(e)
        if renew_at <= now:
            for e, reason in cut:
                self._report_cut(e, reason)
            for entries in groups.values():
                self._tick(entries)
            self.ticks += 1
            if len(self._own_clients) > len({key[0] for key in groups}):
                self._prune_own_clients({key[0] for key in groups})
        # After the renewals: a drain writes held commands and waits for their replies, a round trip (up to
        # a socket timeout on a stalled server) that must not make a due renewal late.
        for channel in drains:
            channel.drain(block=False)  # a channel its owner is using is read by the owner's next command

    def _prune_own_clients(self, in_use: set[int]) -> None:
        """Close this thread's copies of clients nobody can hand it again (forgotten, e.g. ``forget_clients``)."""
        known = connection.cached_ids()
        for key, (_original, own) in list(self._own_clients.items()):
            if key not in in_use and key not in known:
                del self._own_clients[key]
                _close_quietly(own)

    def _cut_off(self, now: float) -> list[tuple[_Entry, str]]:
        """Untrack leases past their max-hold, and leases already lost (validity passed); the caller reports them."""
        cut: list[tuple[_Entry, str]] = []
        for key, e in list(self._entries.items()):
            if now >= e.deadline:
                del self._entries[key]
                cut.append((e, "max_hold"))
            elif e.lease.lost:
                del self._entries[key]
                cut.append((e, "expired"))
        return cut

    def _report_cut(self, e: _Entry, reason: str) -> None:
        lease = e.lease
        if reason != "max_hold":
            self._report_lost(e, reason)
        elif lease.mark_lost("max_hold"):
            fields = {"lock_key": lease.key, "task_id": lease.task_id, "fence": lease.fence_field}
            fields["hold_ms"] = round(lease.hold_ms())
            self._report(_Event("lock.max_hold_reached", lease.task_name, fields, e.backend, e.span))

    def _client_for(self, client: Any) -> Any:
        """The client to renew through: ``client``, or (isolated) this thread's own copy of it."""
        if not self.isolated:
            return client
        known = self._own_clients.get(id(client))
        if known is None or known[0] is not client:
            if known is not None:  # a new client at a dead one's address
                _close_quietly(known[1])
            known = (client, _own_client(client))
            self._own_clients[id(client)] = known
        return known[1]

    def _tick(self, entries: list[_Entry]) -> None:
        """One RENEW round trip for ``entries``; any error makes it a failed tick, retried soon."""
        leases = [e.lease for e in entries]
        sent_at = time.monotonic()
        results: list[int] | None = None
        try:
            client = self._client_for(entries[0].client)
            follow_failover(client)  # Sentinel: renew on the current master, not a demoted one
            sent_at = time.monotonic()
            results = lease_ops.renew(client, leases)
            if len(results) != len(leases):
                raise RuntimeError(f"RENEW answered {len(results)} results for {len(leases)} leases")
        except Exception as exc:  # noqa: BLE001 - BUSY, NOREPLICAS, NOPERM...: classified, never fatal
            results = None
            kind = errors.classify(exc) or "unexpected"
            fields: dict[str, Any] = {
                "reason": f"renew ({kind}): {exc.__class__.__name__}: {errors.reply_text(exc)}",
                "lock_keys": [x.key for x in leases[:20]],
            }
            self._report(_Event("lock.backend_unavailable", None, fields, entries[0].backend))
        lost: list[tuple[_Entry, str]] = []
        with self._mutex:
            now = time.monotonic()
            for i, e in enumerate(entries):
                if self._entries.get(id(e.lease)) is not e:
                    continue  # released (or cut off) while the reply was in flight
                if results is not None:
                    if results[i] == 1 and e.lease.renewed(sent_at):
                        self._tally_lag(e.lease.task_name, max(0.0, sent_at - e.expected) * 1000)
                        e.due = e.expected = now + _jitter(e.interval)
                        continue
                    # token gone; or renewed too late: the validity had passed, and lost is final
                    reason = "token_gone" if results[i] != 1 else "expired"
                elif e.lease.lost:
                    reason = "expired"
                else:
                    e.due = now + _retry_delay(e.interval)
                    continue
                del self._entries[id(e.lease)]
                lost.append((e, reason))
        if results is not None:
            fields = {"leases": len(leases), "lock_keys": [x.key for x in leases[:20]]}
            self._report(_Event("lock.renewed", None, fields, entries[0].backend))
        for e, reason in lost:
            self._report_lost(e, reason)

    def _tally_lag(self, task_name: str, lag_ms: float) -> None:
        """Count one renewal's lag (with the mutex held: a few additions, no I/O, no other lock)."""
        row = self._lags.get(task_name)
        if row is None:
            row = self._lags[task_name] = metrics.new_row("renew_lag")
        metrics.add_to_row(row, metrics.RENEW_LAG_BUCKETS_MS, lag_ms)

    def _report_lost(self, e: _Entry, reason: str) -> None:
        lease = e.lease
        if lease.mark_lost(reason):
            fields = {"lock_key": lease.key, "task_id": lease.task_id, "fence": lease.fence_field}
            fields.update(hold_ms=round(lease.hold_ms()), reason=reason)
            self._report(_Event("lock.lost", lease.task_name, fields, e.backend, e.span))


def _make_drain(runtime: str, flush: Callable[[], None]) -> _GeventDrain | _EventletDrain | None:
    """The hub's wake-up for ``runtime``, made on the calling (hub) thread; ``None`` if it cannot be made.

    Without one, events still go out with the next ``track``/``untrack``.
    """
    try:
        return _GeventDrain(flush) if runtime == "gevent" else _EventletDrain(flush)
    except Exception:  # noqa: BLE001 - an unexpected gevent/eventlet: fall back to flushing on track/untrack
        return None


def _retry_delay(interval: float) -> float:
    """When to try again after a failed tick: soon, so a blip shorter than the TTL loses nothing."""
    return max(MIN_RETRY, _jitter(interval) * RETRY_FRACTION)


#: The earliest a renewal is due, as a fraction of its interval after the track or the last renewal.
_JITTER_LOW = 0.85


def _jitter(interval: float) -> float:
    return interval * random.uniform(_JITTER_LOW, 1.0)


_renewer: PerProcess[Renewer] = PerProcess(Renewer)


def renewer() -> Renewer:
    """This process's renewer (a new one after fork: threads do not survive it)."""
    return _renewer.get()


def _collect_lags() -> None:
    """At a metrics flush: hand this process's renewal-lag tally over (nothing when no renewer was made here)."""
    current = _renewer.peek()
    if current is not None:
        for task_name, row in current.take_lags().items():
            metrics.merge(task_name, "renew_lag", row)
            otel.record_row(task_name, "renew_lag", row)


metrics.add_collector(_collect_lags)
