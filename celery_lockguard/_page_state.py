"""What the lock page shows, sampled by one thread: leases, busy entities, the four numbers, doctor findings.

The page (:mod:`celery_lockguard._page`) never reads Redis while answering a
request. One sampler thread reads what ``lockguard locks`` and ``lockguard
stats`` read (:func:`~celery_lockguard._holders.top_leases`,
:func:`~celery_lockguard._stats.read` and :func:`~celery_lockguard._stats.summarize`)
and swaps in a new immutable :class:`Snapshot`; every request renders the
latest one. So ten open browser tabs cost Redis what one costs, and a slow
Redis slows the sampler, not the HTTP threads (which the exporter bounds).

**It reads leases only while someone looks.** A page request (any ``/page``
route: the open page polls ``/page/live`` every interval) marks the page
viewed; for :data:`VIEW_SECONDS` after the last one the sampler reads leases
and metrics every ``interval`` seconds. With nobody viewing it reads only the
fleet's metrics (no SCAN: the sparklines keep filling), every
:data:`IDLE_INTERVAL` seconds, and no doctor run. The first request after
start or after an idle spell wakes it and waits for that sample (at most
:data:`FIRST_WAIT` seconds). A sample reads at most
:data:`~celery_lockguard._holders.SAMPLE_LEASES` lease ages and
:data:`MAX_LEASES` rows, whatever the prefix holds (with up to :data:`FULL_READ`
leases, every one is read, as the busy entities need).

What the page adds is memory, not Redis data:

* a **ring of samples** of the fleet's four numbers (the ``1m`` window of
  ``stats``, summed over tasks), one per interval (at most one per 5 s, the
  latest: :data:`RING_POINTS`), for the last hour's sparklines -- a page
  server started a minute ago shows a minute;
* **busy entities**: per entity key seen held, how many holders the
  samples of the last hour saw (a new fence is a new holder: every
  acquisition issues one; kept per 5-minute bucket, :class:`_Seen`), in
  what share of those samples it was held, and the deliveries parked
  behind it now (:func:`~celery_lockguard._holders.read_waiting`). A lower
  bound: holders that came and went between two samples are not seen;
* **doctor findings** (:func:`celery_lockguard._doctor.run`), cached and
  re-run every ``doctor_interval`` seconds, never per request.

A section that cannot be read carries its error and the snapshot its HTTP
status (503: the lock Redis is unreachable; 500: anything else, such as a
metrics key of the wrong type), the exporter's rule for ``/metrics``; the
other sections are still shown.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from . import _connection as connection
from . import _doctor as doctor
from . import _inventory
from . import _stats as stats
from ._config import Settings
from ._connection import UNAVAILABLE_ERRORS
from ._events import logger
from ._holders import (
    EntityUse,
    HeldLease,
    display_order,
    entity_use,
    idle_windows,
    read_leases,
    read_waiting,
    top_leases,
)
from ._redact import redact_text

#: Seconds of history the sparklines and the busy entities cover.
HISTORY_SECONDS = 3600.0
#: Samples the sparklines' ring keeps for that hour at most (one per 5 s). A shorter ``--page-interval``
#: keeps the latest sample of each 5 s slot: the numbers are one-minute windows, and at 0.1 s a ring of
#: one sample per interval (36 001) made every poll of ``/page/live`` megabytes drawn in ~150 ms.
RING_POINTS = 720
#: Lease rows a snapshot keeps (the page says how many more there are).
MAX_LEASES = 500
#: Seconds per bucket of the busy entities' memory (their "last hour" is the last 55 to 60 minutes).
BUCKET_SECONDS = 300.0
#: Busy entities the page lists.
TOP_ENTITIES = 10
#: Entities remembered at most (a prefix with millions of entity keys must not grow the page server without
#: bound): past it, those the page would not list are forgotten first, then those seen longest ago.
MAX_TRACKED = 5000
#: Default seconds between samples, and between doctor runs.
DEFAULT_INTERVAL, DEFAULT_DOCTOR_INTERVAL = 5.0, 300.0
#: Seconds after the last page request during which the page counts as viewed (leases sampled each interval).
VIEW_SECONDS = 60.0
#: Seconds between the metrics-only samples while nobody views the page.
IDLE_INTERVAL = 30.0
#: Seconds the first page request after start (or after an idle spell) waits for a fresh sample (a sample
#: reads a bounded number of leases: well under a second on an idle server, seconds on a starved one).
FIRST_WAIT = 15.0
#: Up to this many leases under the prefix, a sample reads every one (the busy entities see each entity
#: change hands); past it, only the rows shown (the oldest and most waited-on of a bounded scan).
FULL_READ = 5000


@dataclass(frozen=True)
class Sample:
    """The fleet's four numbers at one moment (``stats``' ``1m`` window summed over tasks; None: no data)."""

    at: float
    acquisition_rate: float | None
    contention: float | None
    avg_hold_ms: float | None
    expired_rate: float | None


def fleet_sample(summary: dict[str, Any], at: float, window: str = "1m") -> Sample:
    """Sum one window of every task in a :func:`~celery_lockguard._stats.summarize` result into four numbers.

    Rates add up; the ratios are recomputed from their parts (contended over
    attempts, hold time over holds, expired over ended), so a busy task
    weighs more than an idle one, as it does in the fleet.
    """
    rate: float | None = None
    contended = attempts = holds = expired = ended = 0
    hold_ms = 0.0
    for entry in summary.get("tasks", {}).values():
        w = entry["windows"][window]
        if w["acquisition_rate_per_min"] is not None:
            rate = (rate or 0.0) + w["acquisition_rate_per_min"]
        contended += w["contended"]
        attempts += w["attempts"]
        if w["avg_hold_ms"] is not None:
            hold_ms += w["avg_hold_ms"] * w["hold_count"]
            holds += w["hold_count"]
        expired += w["expired"]
        events = w["events"]
        ended += events.get("lock.released", 0) + events.get("lock.expired_before_release", 0)
    return Sample(
        at=at,
        acquisition_rate=rate,
        contention=contended / attempts if attempts else None,
        avg_hold_ms=hold_ms / holds if holds else None,
        expired_rate=expired / ended if ended else None,
    )


@dataclass
class _Seen:
    """One entity's last hour as the samples saw it, kept per bucket of :data:`BUCKET_SECONDS`.

    Each bucket is ``[bucket, new holders, samples, carried]``: the holders
    first seen in it, the samples that saw the entity held, and 1 if its first
    sample saw the holder the sample before it saw (a holder first seen in an
    older bucket). Buckets past the hour are dropped, so an entity that
    changed hands often two hours ago and has had one holder since is not
    "busy in the last hour", in memory bounded per entity.
    """

    fence: int
    last_at: float
    buckets: deque[list[int]] = field(default_factory=deque)

    def see(self, fence: int, now: float) -> None:
        """One sample saw the entity held under ``fence`` (another fence than the last seen: a new holder)."""
        new = not self.buckets or fence != self.fence
        bucket = int(now // BUCKET_SECONDS)
        if not self.buckets or self.buckets[-1][0] != bucket:
            self.buckets.append([bucket, 0, 0, 0 if new else 1])
        self.buckets[-1][1] += new
        self.buckets[-1][2] += 1
        self.fence, self.last_at = fence, now

    def forget_before(self, bucket: int) -> None:
        while self.buckets and self.buckets[0][0] < bucket:
            self.buckets.popleft()

    @property
    def holders(self) -> int:
        """Distinct holders seen in the buckets kept (one first seen before them counts once)."""
        return sum(b[1] for b in self.buckets) + (self.buckets[0][3] if self.buckets else 0)

    @property
    def samples(self) -> int:
        return sum(b[2] for b in self.buckets)


@dataclass(frozen=True)
class BusyEntity:
    """One entity key as the sampler saw it over the last hour."""

    key: str
    waiting: int
    #: Distinct holders (fences) the samples saw in the last hour.
    holders: int
    held_share: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "waiting": self.waiting,
            "holders": self.holders,
            "held_share": self.held_share,
        }


@dataclass(frozen=True)
class Doctor:
    """The cached doctor run: its findings, when it ran, or why it could not."""

    findings: tuple[doctor.Finding, ...] | None = None
    at: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class Snapshot:
    """Everything one page render shows, as of ``taken_at`` (immutable: requests share it)."""

    taken_at: float
    prefix: str
    interval: float
    leases: tuple[HeldLease, ...] = ()
    lease_count: int = 0
    #: False when ``lease_count`` is an estimate (a prefix past the sample's budget).
    lease_count_exact: bool = True
    waiting: dict[str, int] = field(default_factory=dict)
    #: ``lock_limit`` / ``lock_rate`` entities among the rows (slots held N/M, starts in the window), and
    #: start windows that count starts while no slot is held: what ``locks`` prints under its table.
    uses: tuple[EntityUse, ...] = ()
    summary: dict[str, Any] | None = None
    samples: tuple[Sample, ...] = ()
    busy: tuple[BusyEntity, ...] = ()
    doctor: Doctor = Doctor()
    errors: dict[str, str] = field(default_factory=dict)
    status: int = 200
    #: Seconds after ``taken_at`` past which the page says its data is stale (the sampler is stuck or slow).
    stale_after: float = 60.0

    def as_dict(self) -> dict[str, Any]:
        """The page's data as ``/page/data.json`` serves it."""
        return {
            "taken_at": self.taken_at,
            "prefix": self.prefix,
            "interval": self.interval,
            "status": self.status,
            "errors": self.errors,
            "lease_count": self.lease_count,
            "lease_count_exact": self.lease_count_exact,
            "leases": [{**lease.as_dict(), "waiting": self.waiting.get(lease.key, 0)} for lease in self.leases],
            "entity_use": [asdict(use) for use in self.uses],
            "busy_entities": [b.as_dict() for b in self.busy],
            "limited_entities": [{**use.as_dict(self.prefix), "text": use.text()} for use in self.uses],
            "samples": [s.__dict__ for s in self.samples],
            "tasks": stats.for_json(self.summary)["tasks"] if self.summary else {},
            "doctor": {
                "at": self.doctor.at,
                "error": self.doctor.error,
                "findings": None if self.doctor.findings is None else [f.as_dict() for f in self.doctor.findings],
            },
        }


class PageState:
    """The sampler: one thread refreshing the :class:`Snapshot` that every page request renders."""

    def __init__(
        self,
        app: Any,
        s: Settings,
        interval: float = DEFAULT_INTERVAL,
        doctor_interval: float = DEFAULT_DOCTOR_INTERVAL,
    ) -> None:
        if not interval > 0 or not doctor_interval > 0:
            raise ValueError("the page needs an interval > 0 and a doctor interval > 0")
        self.app, self.settings = app, s
        self.interval, self.doctor_interval = float(interval), float(doctor_interval)
        self._slot = max(self.interval, HISTORY_SECONDS / RING_POINTS)
        self._ring: deque[Sample] = deque(maxlen=int(HISTORY_SECONDS / self._slot) + 1)
        self._seen: dict[str, _Seen] = {}
        self._samples_taken: deque[float] = deque(maxlen=int(HISTORY_SECONDS / self.interval) + 1)
        self._doctor = Doctor()
        self._templates = self._key_templates()
        try:
            self._rate_tasks = _inventory.rate_tasks(app)
        except Exception:  # noqa: BLE001 - as the templates: a window is then shown by its start count only
            self._rate_tasks = []
        # A sample is late past three intervals plus the reads' socket timeouts (two reads, each may retry once).
        self.stale_after = 3 * self.interval + 4 * s.socket_timeout
        self._current = Snapshot(
            taken_at=time.time(), prefix=s.key_prefix, interval=self.interval, status=503, stale_after=self.stale_after
        )
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._sampled = threading.Condition()
        self._generation = 0  # lease samples taken (a request waiting for a fresh one watches it)
        self._viewed_at = -float("inf")  # monotonic time of the last page request
        self._thread: threading.Thread | None = None

    def _key_templates(self) -> dict[str, str]:
        try:
            return _inventory.key_templates(self.app)
        except Exception:  # noqa: BLE001 - the templates only label rows; doctor reports a bad set-up
            return {}

    @property
    def snapshot(self) -> Snapshot:
        """The latest snapshot (one attribute read: the sampler swaps it whole)."""
        return self._current

    # -- the thread ------------------------------------------------------------------------

    def start(self) -> PageState:
        """Start the sampler thread; nothing is read until a page is requested (the server answers at once)."""
        self._thread = threading.Thread(target=self._run, name="lockguard-page-sampler", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.settings.socket_timeout * 4 + 5)

    @property
    def viewing(self) -> bool:
        """True while a page request came in the last :data:`VIEW_SECONDS`."""
        return time.monotonic() - self._viewed_at <= VIEW_SECONDS

    def viewed(self, wait: float = FIRST_WAIT) -> None:
        """A page request came in: sample leases from now on; the first after an idle spell waits for one."""
        idle = not self.viewing
        self._viewed_at = time.monotonic()
        if not idle or self._thread is None:
            return
        with self._sampled:
            seen = self._generation
            self._wake.set()
            self._sampled.wait_for(lambda: self._generation > seen or self._stop.is_set(), timeout=wait)

    def _run(self) -> None:
        # The doctor runs once after the first sample (in this thread: the server answers meanwhile), then
        # every doctor_interval while the page is viewed.
        next_doctor, doctor_ran = 0.0, False
        while not self._stop.is_set():
            viewing = self.viewing
            try:
                self.refresh(leases=viewing)
            except Exception as exc:  # noqa: BLE001 - the sampler never dies: the failure is shown, the next read runs
                reason = f"{exc.__class__.__name__}: {self._safe(exc)}"
                logger.warning("page.sample_failed", reason=reason)
                self._current = replace(self._current, errors={**self._current.errors, "page": reason}, status=500)
            if viewing:
                with self._sampled:
                    self._generation += 1
                    self._sampled.notify_all()
            if (viewing or not doctor_ran) and time.monotonic() >= next_doctor:
                self.run_doctor()
                next_doctor, doctor_ran = time.monotonic() + self.doctor_interval, True
            self._wake.wait(self.interval if viewing else max(self.interval, IDLE_INTERVAL))
            self._wake.clear()

    # -- one sample ------------------------------------------------------------------------

    def run_doctor(self) -> None:
        """Run every doctor check once and cache the findings (an error in a check is itself shown)."""
        try:
            findings = tuple(doctor.run(self.app))
            self._doctor = Doctor(findings=findings, at=time.time())
        except Exception as exc:  # noqa: BLE001 - a failing check must not stop the sampler
            logger.warning("page.doctor_failed", reason=f"{exc.__class__.__name__}: {exc}")
            self._doctor = Doctor(at=time.time(), error=f"{exc.__class__.__name__}: {self._safe(exc)}")
        self._current = replace(self._current, doctor=self._doctor)

    def refresh(self, leases: bool = True) -> None:
        """Read leases and metrics once, append a sample, and swap in the new snapshot.

        ``leases=False`` (nobody views the page): the metrics only, for the sparklines; the lease rows
        of the last snapshot stay, with its time (so the page says how old they are).
        """
        if not leases:
            self._refresh_metrics()
            return
        now = time.time()
        s = self.settings
        errors: dict[str, str] = {}
        codes: list[int] = []
        rows: list[HeldLease] = []
        waiting: dict[str, int] = {}
        count, exact = 0, True
        uses: list[EntityUse] = []
        summary: dict[str, Any] | None = None
        try:
            client = connection.operator_client(s)
        except Exception as exc:  # noqa: BLE001 - a bad setting is shown, not raised into the thread
            client, codes = None, [500]
            errors["redis"] = f"{exc.__class__.__name__}: {self._safe(exc)}"
        if client is not None:
            try:
                sample = top_leases(client, s.key_prefix, "*", MAX_LEASES)
                if sample.complete and sample.seen <= FULL_READ:
                    rows = read_leases(client, s.key_prefix)
                    # Every lease's waiters, not only the rows shown: the busiest entities are chosen from all.
                    waiting = read_waiting(client, s.key_prefix, [lease.key for lease in rows])
                    rows.sort(key=lambda lease: display_order(lease, waiting))
                    count = len(rows)
                else:  # past FULL_READ: the rows shown, and a count (exact, or an estimate past the budget)
                    rows, waiting, count, exact = sample.leases, sample.waiting, sample.total, sample.complete
                shown = rows[:MAX_LEASES]
                uses = entity_use(client, s.key_prefix, shown)
                held = {lease.key for lease in shown}
                uses += idle_windows(client, s.key_prefix, "*", held, self._rate_tasks, keys=sample.rate_keys)
            except Exception as exc:  # noqa: BLE001 - one section fails, the others are shown
                codes.append(self._failed("leases", exc, errors))
            try:
                summary = stats.summarize(stats.read(client, s.key_prefix, now=now), self._templates)
                self.remember(fleet_sample(summary, now))
            except Exception as exc:  # noqa: BLE001 - as above
                codes.append(self._failed("metrics", exc, errors))
        busy: tuple[BusyEntity, ...] = ()
        if client is not None and "leases" not in errors:
            try:
                busy = self._observe(rows, waiting, now)
            except Exception as exc:  # noqa: BLE001 - as above
                codes.append(self._failed("entities", exc, errors))
        self._current = Snapshot(
            taken_at=now,
            prefix=s.key_prefix,
            interval=self.interval,
            leases=tuple(rows[:MAX_LEASES]),
            lease_count=count,
            lease_count_exact=exact,
            waiting=waiting,
            uses=tuple(uses),
            summary=summary,
            samples=tuple(self._ring),
            busy=busy,
            doctor=self._doctor,
            errors=errors,
            status=max(codes, default=200),
            stale_after=self.stale_after,
        )

    def _refresh_metrics(self) -> None:
        """The idle sample: the fleet's metrics only (no SCAN), into the ring and the snapshot."""
        now = time.time()
        s = self.settings
        try:
            client = connection.operator_client(s)
            summary = stats.summarize(stats.read(client, s.key_prefix, now=now), self._templates)
        except Exception as exc:  # noqa: BLE001 - shown when the page is next opened (it samples again then)
            logger.warning("page.read_failed", section="metrics", reason=f"{exc.__class__.__name__}: {self._safe(exc)}")
            return
        self.remember(fleet_sample(summary, now))
        self._current = replace(self._current, summary=summary, samples=tuple(self._ring))

    def remember(self, sample: Sample) -> None:
        """Add ``sample`` to the sparklines' ring: it replaces the last one if both fall in one slot."""
        if self._ring and int(self._ring[-1].at // self._slot) == int(sample.at // self._slot):
            self._ring[-1] = sample
        else:
            self._ring.append(sample)

    def _safe(self, exc: BaseException) -> str:
        return redact_text(exc, self.settings.redis_url)

    def _failed(self, section: str, exc: BaseException, errors: dict[str, str]) -> int:
        errors[section] = f"{exc.__class__.__name__}: {self._safe(exc)}"
        if isinstance(exc, UNAVAILABLE_ERRORS):
            return 503
        logger.warning("page.read_failed", section=section, reason=errors[section])
        return 500

    def _observe(self, leases: list[HeldLease], waiting: dict[str, int], now: float) -> tuple[BusyEntity, ...]:
        """Fold this sample's leases into the per-entity memory; the busiest entities of the last hour."""
        self._samples_taken.append(now)
        for lease in leases:
            if lease.fence is None:
                continue
            seen = self._seen.get(lease.key)
            if seen is None:
                seen = self._seen[lease.key] = _Seen(lease.fence, now)
            seen.see(lease.fence, now)
        # The last hour, in whole buckets and the current one: the last 55 to 60 minutes.
        first = int((now - HISTORY_SECONDS) // BUCKET_SECONDS) + 1
        while self._samples_taken and self._samples_taken[0] < first * BUCKET_SECONDS:
            self._samples_taken.popleft()
        for key, seen in list(self._seen.items()):
            seen.forget_before(first)
            if not seen.buckets:
                del self._seen[key]
        if len(self._seen) > MAX_TRACKED:
            # Forget first what the page would not show (one holder, nobody waiting), then what was seen
            # longest ago, then what was seen in fewest samples. Not by insertion order: with more
            # entities held than are tracked, the ones added this sample would push out the ones kept
            # last sample, every sample, and no entity would be tracked long enough to change hands.
            def worth(kv: tuple[str, _Seen]) -> tuple[bool, float, int]:
                key, seen = kv
                return seen.holders > 1 or waiting.get(key, 0) > 0, seen.last_at, seen.samples

            for key, _ in sorted(self._seen.items(), key=worth)[: len(self._seen) - MAX_TRACKED]:
                del self._seen[key]
        taken = max(1, len(self._samples_taken))
        rows = [
            BusyEntity(
                key=key,
                waiting=waiting.get(key, 0),
                holders=seen.holders,
                held_share=min(1.0, seen.samples / taken),
            )
            for key, seen in self._seen.items()
        ]
        rows = [b for b in rows if b.waiting or b.holders > 1]
        rows.sort(key=lambda b: (b.waiting, b.holders, b.held_share), reverse=True)
        return tuple(rows[:TOP_ENTITIES])
