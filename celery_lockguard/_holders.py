"""Reading who holds what: the lease hashes and queue claims under a prefix, parsed one row at a time.

The ACQUIRE and CLAIM scripts (``_scripts.py``) write each lease (and each queue claim ``{K}:claim``) as a hash:
``token``, ``task_id``, ``task_name``, ``digest``, ``host``, ``pid``,
``worker``, ``state`` (:data:`STATES`), ``acquired_at`` and
``renewed_at`` (server ms), ``ttl`` (ms) and ``fence``. This module is the one
reader of that shape for the operator's tools (``lockguard locks``, the
exporter): :meth:`HeldLease.from_hash` turns one hash into one row.

Whatever a hash holds, it is *one* row. Anyone with write access to the lock
Redis can plant a value no script writes (a fence ``"²"``, which
``str.isdigit`` accepts and ``int`` refuses; a float ``acquired_at``; a
string where a hash belongs; bytes that are not UTF-8): the field is shown as
unknown and named in the row's ``malformed``, and every other row is read as
usual. Numbers are ASCII digits only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ._keys import (
    MAX_KEY,
    claim_name,
    lock_name,
    parse_claim_name,
    parse_lock_name,
    parse_rate_name,
    parse_slot_lock_name,
    rate_name,
    rows_glob,
    slot_fence_name,
    slot_lock_name,
    wait_name,
)
from ._terminal import MAX_SHOWN, entity, plural

#: A counter or a timestamp as the scripts write it: ASCII digits (at most 18, an int64's worth).
_NUMBER = re.compile(r"[0-9]{1,18}\Z")
#: Lease hashes read per pipeline round trip.
BATCH = 200
#: Lease states the scripts write (docs/reference.md, "Redis keys"): an until_done claim being
#: published or queued, a running holder, a release's reservation for a woken waiter, a workflow's lease
#: handed on and waiting for its next member (``gap``). A state not
#: listed here is shown as stored and named in ``malformed``: add it here when a script writes a new one.
STATES = ("publishing", "queued", "running", "handed", "gap")
#: The states of a queue claim: an ``until_done`` claim in ``{K}:lock`` (a ``{K}:claim`` row is one whatever
#: its state). ``publishing``: written before the publish, until its CONFIRM_CLAIM after it.
CLAIM_STATES = ("publishing", "queued")


#: Siblings a row keeps at most (a planted array of 100 000 keys is one row, not a page of them); the count is kept.
MAX_SIBLINGS = 32
#: Longest ``siblings`` field parsed: past it the field is malformed, not parsed (planted megabytes cost no CPU).
MAX_SIBLINGS_FIELD = 64 * 1024
#: Slots :func:`read_entity` reads at most (a planted ``limit`` of a billion is not a billion reads).
MAX_SLOTS_READ = 1000
#: Siblings the text views name in a row before "and N more".
SHOWN_SIBLINGS = 3


def parse_siblings(raw: object) -> tuple[tuple[str, ...], int] | None:
    """The ``siblings`` field of a multi-entity holder's lease hash: (the first :data:`MAX_SIBLINGS` keys, count).

    A holder of several entities (``lock_key`` as a sequence) writes, on each entity's ``{K}:lock``, a JSON
    array of the other rendered entity keys of the same acquisition. Missing or empty: ``((), 0)``, a single
    entity. Anything else that is not a JSON array of non-empty UTF-8 strings (bad JSON, another type, a
    number in the array, bytes that are not UTF-8, a field too long): None, and the row names ``siblings``
    in ``malformed``.
    """
    if raw is None or raw == "":
        return (), 0
    if not isinstance(raw, str) or len(raw) > MAX_SIBLINGS_FIELD:
        return None
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) and v and _utf8(v) for v in value):
        return None
    return tuple(value[:MAX_SIBLINGS]), len(value)


def _utf8(text: str) -> bool:
    """Whether ``text`` is strict UTF-8 (a rendered key is; a planted byte read as a surrogate is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def sibling_names(siblings: tuple[str, ...], count: int) -> str:
    """``acct:2, acct:3 and 4 more``: the other entities of a multi-entity holder as text ("" for none)."""
    if not count:
        return ""
    named = ", ".join(_sibling(k) for k in siblings[:SHOWN_SIBLINGS])
    more = count - min(len(siblings), SHOWN_SIBLINGS)
    return f"{named} and {more} more" if more and named else f"{more} more" if more else named


#: Text in a sibling's key that could forge the list it is shown in (``a, b) (with c``, ``x and 4 more``).
_FORGES_LIST = re.compile(r'[,()"]| and |\bmore\b|^\s|\s$')


def _sibling(key: str) -> str:
    """One sibling as :func:`sibling_names` lists it: quoted (``"`` and ``\\`` escaped) where its text
    could pass for list syntax, so a planted key reads as one entity, never as several (issue 30)."""
    shown = entity(key, MAX_KEY)
    if not _FORGES_LIST.search(shown):
        return shown
    return '"' + shown.replace("\\", "\\\\").replace('"', '\\"') + '"'


#: Longest text field of a ``--json`` / ``data.json`` row (the table's cut, :data:`~._terminal.MAX_SHOWN`).
MAX_FIELD = MAX_SHOWN


def cut_field(text: str | None) -> str | None:
    """``text`` cut to :data:`MAX_FIELD` characters, ``...[N more]`` saying how many were cut (None stays).

    Every text field of a ``--json`` row (``locks``, ``stats``) goes through it: a field planted in Redis
    may be megabytes long, and one answer stays bounded whatever Redis holds.
    """
    if text is None or len(text) <= MAX_FIELD:
        return text
    return f"{text[:MAX_FIELD]}...[{len(text) - MAX_FIELD} more]"


def number(value: object) -> int | None:
    """``value`` as the scripts write numbers (ASCII digits), else None: ``"²"``, ``"1.5"``, ``"-1"`` are not."""
    return int(value) if isinstance(value, str) and _NUMBER.match(value) else None


@dataclass(frozen=True)
class HeldLease:
    """One lease (or queue claim) as ``lockguard locks`` shows it; an unknown field is None, named in ``malformed``."""

    key: str
    redis_key: str
    state: str
    task_name: str | None
    task_id: str | None
    worker: str | None
    host: str | None
    pid: int | None
    fence: int | None
    held_for_ms: int | None
    since_renewal_ms: int | None
    ttl_left_ms: int | None
    lease_ttl_ms: int | None
    malformed: tuple[str, ...] = field(default=())
    #: The slot of a ``lock_limit`` lease (``{K}:lock:<i>``; 0 for K's plain lease hash).
    slot: int = 0
    #: ``lock_limit`` / ``lock_rate`` the holder was admitted under (ACQUIRE_SLOTS writes them), else None.
    limit: int | None = None
    rate: int | None = None
    window_ms: int | None = None
    #: A workflow's lease (``celery_lockguard.workflow``): its id, and the member's task name
    #: (``task_name`` is then the workflow's name, ``task_id`` the member's; in state ``gap``,
    #: the member that handed it on).
    workflow_id: str | None = None
    member: str | None = None
    #: A multi-entity holder (``lock_key`` as a sequence): the other entities of its acquisition (at most
    #: :data:`MAX_SIBLINGS`) and how many there are; ``()`` and 0 for a single entity.
    siblings: tuple[str, ...] = ()
    sibling_count: int = 0

    @classmethod
    def from_hash(cls, prefix: str, redis_key: str, fields: dict[str, str], pttl: Any, now_ms: int) -> HeldLease:
        """Parse one lease hash (``fields``, from HGETALL) with its PTTL, as of the server time ``now_ms``."""
        bad: list[str] = []

        def num(name: str, optional: bool = True) -> int | None:
            raw = fields.get(name)
            if raw is None or (raw == "" and optional):
                return None
            value = number(raw)
            if value is None:
                bad.append(name)
            return value

        acquired, renewed = num("acquired_at"), num("renewed_at")
        pid, fence, ttl = num("pid"), num("fence"), num("ttl")
        state = fields.get("state") or "running"
        if state not in STATES:
            bad.append("state")
        siblings = parse_siblings(fields.get("siblings"))
        if siblings is None:
            bad.append("siblings")
        left = pttl if isinstance(pttl, int) and not isinstance(pttl, bool) and pttl >= 0 else None
        return cls(
            key=row_entity(prefix, redis_key),
            redis_key=redis_key,
            state=state,
            task_name=fields.get("task_name"),
            task_id=fields.get("task_id"),
            worker=fields.get("worker") or None,
            host=fields.get("host"),
            pid=pid,
            fence=fence,
            held_for_ms=now_ms - acquired if acquired else None,
            since_renewal_ms=now_ms - renewed if renewed else None,
            ttl_left_ms=left,
            lease_ttl_ms=ttl,
            malformed=tuple(bad),
            slot=_slot(prefix, redis_key),
            limit=num("limit"),
            rate=num("rate") or None,
            window_ms=num("window") or None,
            workflow_id=fields.get("workflow") or None,
            member=(fields.get("member") or None) if fields.get("workflow") else None,
            siblings=siblings[0] if siblings else (),
            sibling_count=siblings[1] if siblings else 0,
        )

    @classmethod
    def unreadable(cls, prefix: str, redis_key: str, why: str) -> HeldLease:
        """A lease key that is not a hash (WRONGTYPE), or whose read failed: a row that says so."""
        return cls(
            key=row_entity(prefix, redis_key),
            redis_key=redis_key,
            state="unreadable",
            task_name=None,
            task_id=None,
            worker=None,
            host=None,
            pid=None,
            fence=None,
            held_for_ms=None,
            since_renewal_ms=None,
            ttl_left_ms=None,
            lease_ttl_ms=None,
            malformed=(why,),
            slot=_slot(prefix, redis_key),
        )

    def as_dict(self) -> dict[str, Any]:
        """The row of ``lockguard locks --json`` and the page's ``data.json`` (``workflow_id`` and ``member`` only
        for a workflow's lease).

        Every text field is cut to :data:`MAX_FIELD` characters as the table cuts it (``...[N more]``): a
        field planted with megabytes is one bounded row, not megabytes per answer (issue 30).
        """
        row: dict[str, Any] = {
            "key": cut_field(self.key),
            "redis_key": cut_field(self.redis_key),
            "state": cut_field(self.state),
            "task_name": cut_field(self.task_name),
            "task_id": cut_field(self.task_id),
            "worker": cut_field(self.worker),
            "host": cut_field(self.host),
            "pid": self.pid,
            "fence": self.fence,
            "held_for_ms": self.held_for_ms,
            "since_renewal_ms": self.since_renewal_ms,
            "ttl_left_ms": self.ttl_left_ms,
            "lease_ttl_ms": self.lease_ttl_ms,
            "malformed": list(self.malformed),
            # lock_limit / lock_rate leases only: a single lease's row stays as it always was.
            **(
                {"slot": self.slot, "limit": self.limit, "rate": self.rate, "window_ms": self.window_ms}
                if self.slot or self.limit is not None or self.rate is not None
                else {}
            ),
        }
        if self.workflow_id is not None:  # a workflow's lease: its id and the member at it
            row.update(workflow_id=cut_field(self.workflow_id), member=cut_field(self.member))
        if self.sibling_count:  # a multi-entity holder: the other entities of its acquisition
            row.update(siblings=[cut_field(k) for k in self.siblings], sibling_count=self.sibling_count)
        return row

    @property
    def is_claim(self) -> bool:
        """A queue claim (``{K}:claim``, or an ``until_done`` claim in ``{K}:lock``), not a lease a body holds."""
        return self.redis_key.endswith("}:claim") or self.state in CLAIM_STATES

    @property
    def label(self) -> str:
        """The entity key as the operator reads it (:func:`~celery_lockguard._terminal.entity`: a non-ASCII key
        beside its ASCII spelling): K, or ``K (slot i)`` for a ``lock_limit`` slot i > 0."""
        return entity(self.key) + (f" (slot {self.slot})" if self.slot else "")

    @property
    def shown(self) -> str:
        """:attr:`label` and, for a multi-entity holder, the entities it holds beside this one."""
        names = sibling_names(self.siblings, self.sibling_count)
        return f"{self.label} (with {names})" if names else self.label


def row_entity(prefix: str, redis_key: str) -> str:
    """The entity key K a row is listed under: its lease's (slots included) or its queue claim's, else the name."""
    return parse_lock_name(prefix, redis_key) or parse_claim_name(prefix, redis_key) or redis_key


def _is_row(prefix: str, name: str) -> bool:
    """Whether ``name`` is a lease (``{K}:lock``, ``{K}:lock:<i>``) or a queue claim (``{K}:claim``)."""
    return parse_slot_lock_name(prefix, name) is not None or parse_claim_name(prefix, name) is not None


def _slot(prefix: str, redis_key: str) -> int:
    parsed = parse_slot_lock_name(prefix, redis_key)
    return parsed[1] if parsed is not None else 0


def server_ms(client: Any) -> int:
    """The server's clock in ms (leases are stamped with it, not with this host's)."""
    sec, usec = client.time()
    return int(sec) * 1000 + int(usec) // 1000


def read_leases(client: Any, prefix: str, match: str = "*") -> list[HeldLease]:
    """Every lease and queue claim under ``prefix`` whose entity key matches the glob ``match``, sorted by key.

    One SCAN (:func:`._keys.rows_glob`: leases, slot leases ``{K}:lock:<i>`` and queue claims ``{K}:claim``, a
    claim's row keyed K), then HGETALL + PTTL per key in pipelines of :data:`BATCH`. A
    pipeline reads every reply (``raise_on_error=False``), so one key of the
    wrong type is one unreadable row, not a failed command. A key released
    between SCAN and HGETALL is left out.
    """
    found = client.scan_iter(match=rows_glob(prefix, match), count=1000)
    names = sorted(n for n in found if _is_row(prefix, n))
    return _read_named(client, prefix, names)


@dataclass(frozen=True)
class EntityUse:
    """A ``lock_limit`` / ``lock_rate`` entity as ``lockguard locks`` sums it up: slots held, window used."""

    key: str
    held: int
    limit: int | None
    rate: int | None
    window_ms: int | None
    starts: int | None

    def text(self) -> str:
        parts = [f"{self.held}/{self.limit if self.limit else '?'} slots held"]
        if self.rate and self.window_ms:
            parts.append(
                f"{self.starts if self.starts is not None else '?'}/{self.rate} starts in the last "
                f"{self.window_ms / 1000:g}s"
            )
        elif self.starts is not None:
            parts.append(f"{plural(self.starts, 'start')} recorded (no task of this app names its lock_rate)")
        return f"{entity(self.key)}: " + ", ".join(parts)

    def as_dict(self, prefix: str) -> dict[str, Any]:
        """The row of ``lockguard locks --json`` for a start window no slot holder carries (``state: "window"``)."""
        return {
            "key": cut_field(self.key),
            "redis_key": cut_field(rate_name(prefix, self.key)),
            "state": "window",
            "held": self.held,
            "limit": self.limit,
            "rate": self.rate,
            "window_ms": self.window_ms,
            "starts": self.starts,
        }


#: A ``lock_rate`` task as :func:`idle_windows` knows it: its key template's pattern, lock_limit, starts, window ms.
RateTask = tuple["re.Pattern[str]", int, int, int]


def idle_windows(
    client: Any, prefix: str, match: str, skip: set[str], rated: list[RateTask], keys: list[str] | None = None
) -> list[EntityUse]:
    """``lock_rate`` windows holding starts while no slot of the entity is held (throttled between bodies).

    A slot holder's row carries its rate and window; with none, the entity's key is matched against the
    app's ``lock_rate`` tasks (``rated``): one match (or several that agree) gives the window, counted with
    ``ZCOUNT`` by the server's clock; otherwise ``ZCARD`` says how many starts the window still records.
    One SCAN (none when ``keys``, the entity keys of the windows to read, are given), then one pipeline.
    """
    if keys is None:
        found = client.scan_iter(match=rate_name(prefix, match), count=1000)
        keys = [k for k in (parse_rate_name(prefix, n) for n in found) if k is not None]
    entities = sorted({k for k in keys if k not in skip})
    if not entities:
        return []
    specs = {}
    for key in entities:
        # No worker renders a key past MAX_KEY; a planted longer one is not matched (backtracking grows with length).
        fits = len(key) <= MAX_KEY
        known = {(limit, n, window) for pattern, limit, n, window in rated if fits and pattern.fullmatch(key)}
        specs[key] = known.pop() if len(known) == 1 else None
    now_ms = server_ms(client)
    out: list[EntityUse] = []
    for i in range(0, len(entities), BATCH):
        chunk = entities[i : i + BATCH]
        pipe = client.pipeline(transaction=False)
        for key in chunk:
            spec = specs[key]
            if spec is None:
                pipe.zcard(rate_name(prefix, key))
            else:
                pipe.zcount(rate_name(prefix, key), f"({now_ms - spec[2]}", "+inf")
        for key, count in zip(chunk, pipe.execute(raise_on_error=False), strict=True):
            if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
                continue  # empty by now, or a key of the wrong type (planted): nothing to show
            spec = specs[key]
            limit, rate, window = spec if spec is not None else (None, None, None)
            out.append(EntityUse(key=key, held=0, limit=limit, rate=rate, window_ms=window, starts=count))
    return out


def entity_use(client: Any, prefix: str, leases: list[HeldLease]) -> list[EntityUse]:
    """Per entity whose leases carry a limit or a rate: slots held of N, and starts in its window now.

    One pipeline of ``ZCOUNT`` (the window's starts newer than now - window, by the server's clock).
    """
    groups: dict[str, list[HeldLease]] = {}
    for lease in leases:
        if lease.limit is not None or lease.rate is not None:
            groups.setdefault(lease.key, []).append(lease)
    if not groups:
        return []
    now_ms = server_ms(client)
    keys = sorted(groups)
    pipe = client.pipeline(transaction=False)
    for key in keys:
        first = groups[key][0]
        pipe.zcount(rate_name(prefix, key), f"({now_ms - (first.window_ms or 0)}", "+inf")
    counts = pipe.execute(raise_on_error=False)
    out = []
    for key, count in zip(keys, counts, strict=True):
        rows = groups[key]
        first = rows[0]
        out.append(
            EntityUse(
                key=key,
                held=len(rows),
                limit=max((r.limit or 0) for r in rows) or None,
                rate=first.rate,
                window_ms=first.window_ms,
                starts=count if isinstance(count, int) and first.rate else None,
            )
        )
    return out


def read_waiting(client: Any, prefix: str, keys: list[str]) -> dict[str, int]:
    """Deliveries parked behind each entity in ``keys``: the length of its waiter queue (``_handoff``).

    One pipeline of LLEN, every reply read (``raise_on_error=False``): a
    waiter key of the wrong type (planted) is left out, not a failed read.
    Entities nobody waits on are left out too.
    """
    out: dict[str, int] = {}
    for i in range(0, len(keys), BATCH):
        chunk = keys[i : i + BATCH]
        pipe = client.pipeline(transaction=False)
        for key in chunk:
            pipe.llen(wait_name(prefix, key))
        for key, n in zip(chunk, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                out[key] = n
    return out


# -- the first rows, without reading every lease ----------------------------------------------------

#: Lease hashes the operator's default view reads at most before it stops and reports a sample. Below it every
#: lease is seen and the count is exact; above it, the rows are the oldest (and most waited-on) of the leases
#: seen, and the total is an estimate (the share of lease keys among the keys scanned, times DBSIZE).
SAMPLE_LEASES = 20_000
#: Keys one step of the scan looks at (server side: a step holds Redis for ~1 ms per 1000 keys, never more).
SCAN_STEP = 1000
#: Keys the scan looks at in all, whatever it finds: a lock Redis shared with millions of other keys is
#: sampled too, not walked end to end.
SCAN_KEYS = 2_000_000

#: One step of :func:`top_leases`, server side: SCAN one cursor step, keep only this prefix's keys, and send
#: back the row count, the ``limit`` oldest rows (acquired_at, name), the ``limit`` longest waiter queues,
#: the names of start windows and debounce records (at most ``limit`` each), and how many rows are queue
#: claims. A row is a lease (``}:lock``, ``}:lock:<n>``) or a queue claim (``}:claim``, or a ``}:lock`` in
#: state ``publishing`` / ``queued``, :attr:`HeldLease.is_claim`): one HMGET each. Nothing is written.
#: Reading acquired_at and LLEN here is what lets the client see the oldest rows without fetching every one.
#: KEYS: none. ARGV[1] cursor, ARGV[2] MATCH pattern, ARGV[3] COUNT, ARGV[4] limit.
#: Returns {next cursor, keys the step matched, rows seen, {name, acquired_at, ...}, {wait name, length, ...},
#: {start window names}, {debounce record names}, queue claims seen}.
_STEP = """
local res = redis.call('SCAN', ARGV[1], 'MATCH', ARGV[2], 'COUNT', ARGV[3])
local limit = tonumber(ARGV[4])
local n, claims, ages, waits, rates, debounces = 0, 0, {}, {}, {}, {}
for _, k in ipairs(res[2]) do
  local claim = string.sub(k, -7) == '}:claim'
  if claim or string.sub(k, -6) == '}:lock' or string.find(k, '}:lock:%d+$') then
    n = n + 1
    local ok, h = pcall(redis.call, 'HMGET', k, 'acquired_at', 'state')
    local a = ok and tonumber(h[1]) or 0
    if claim or (ok and (h[2] == 'queued' or h[2] == 'publishing')) then claims = claims + 1 end
    ages[#ages + 1] = {a, k}
  elseif string.sub(k, -6) == '}:wait' then
    local ok, l = pcall(redis.call, 'LLEN', k)
    if ok and l > 0 then waits[#waits + 1] = {l, k} end
  elseif string.sub(k, -6) == '}:rate' then
    if #rates < limit then rates[#rates + 1] = k end
  elseif string.find(k, '}:debounce:', 1, true) and not string.find(k, '}:debounce:.*:run:') then
    if #debounces < limit then debounces[#debounces + 1] = k end
  end
end
table.sort(ages, function(x, y) return x[1] < y[1] end)
table.sort(waits, function(x, y) return x[1] > y[1] end)
local out = {res[1], #res[2], n, {}, {}, rates, debounces, claims}
for i = 1, math.min(limit, #ages) do
  table.insert(out[4], ages[i][2]); table.insert(out[4], ages[i][1])
end
for i = 1, math.min(limit, #waits) do
  table.insert(out[5], waits[i][2]); table.insert(out[5], waits[i][1])
end
return out
"""


@dataclass(frozen=True)
class LeaseSample:
    """The first rows of ``lockguard locks`` (most waiters, then longest held) and what the scan behind them saw.

    Rows are leases and queue claims (``{K}:claim``); the counts below count both.
    """

    leases: list[HeldLease]
    #: Waiter queue lengths of the rows' entities (entities nobody waits on are left out).
    waiting: dict[str, int]
    #: Row keys (leases and queue claims) the scan saw; every one when ``complete``.
    seen: int
    #: The total: exact when ``complete``, else an estimate.
    total: int
    complete: bool
    #: Start windows and debounce records the scan found (entity keys / Redis names), at most the row limit each.
    rate_keys: list[str]
    debounce_names: list[str]
    #: The queue claims among ``total`` (:attr:`HeldLease.is_claim`): exact when ``complete``, else an estimate.
    claims: int = 0

    def summary(self, shown: int) -> str:
        """``showing N of M rows: L leases, C queue claims ...``: the line under the rows (says when the counts
        are estimates). A row is a lease or a queue claim, so the line names both."""
        order = "most waiters, then longest held, first"
        counts = f"{plural(self.total - self.claims, 'lease')}, {plural(self.claims, 'queue claim')}"
        if self.complete:
            return f"showing {shown} of {plural(self.total, 'row')}: {counts} ({order}; --all lists every one)"
        return (
            f"showing {shown} of about {plural(self.total, 'row')} (about {counts}): the {order} of a sample of "
            f"{plural(self.seen, 'row')} (the scan stops there; --all lists every one)"
        )


def display_order(lease: HeldLease, waiting: dict[str, int]) -> tuple[int, int, str]:
    """The operator's order: most deliveries waiting first, then longest held (unknown age first), then key."""
    held = lease.held_for_ms if lease.held_for_ms is not None else 2**62
    return (-waiting.get(lease.key, 0), -held, lease.redis_key)


def _is_cluster(client: Any) -> bool:
    return callable(getattr(client, "get_nodes", None))


def top_leases(client: Any, prefix: str, match: str = "*", limit: int = 50, budget: int | None = None) -> LeaseSample:
    """The ``limit`` rows an operator needs first, reading at most ``budget`` row keys' ages, not every row.

    A row is a lease or a queue claim ``{K}:claim`` (keyed K, as :func:`read_leases` lists it).

    The scan runs in the server (:data:`_STEP`, one SCAN step per round trip) and sends back only the oldest
    rows of each step; the winners are then read whole (HGETALL + PTTL) with their waiter counts. It stops
    at ``budget`` (default :data:`SAMPLE_LEASES`) leases seen or :data:`SCAN_KEYS` keys looked at: the rows
    are then the oldest of a sample and the total an estimate. Tasks pay nothing for this (no index is
    kept on their path). On Redis Cluster a script's SCAN sees one node only, so every lease is read
    instead (:func:`read_leases`).
    """
    limit = max(1, limit)
    budget = SAMPLE_LEASES if budget is None else budget
    if _is_cluster(client):
        every = read_leases(client, prefix, match)
        rows, waiting = _first_rows(client, prefix, every, limit)
        return LeaseSample(
            leases=rows,
            waiting=waiting,
            seen=len(every),
            total=len(every),
            complete=True,
            rate_keys=[],
            debounce_names=[],
            claims=sum(lease.is_claim for lease in every),
        )
    pattern = f"{prefix}:v1:{{{match}}}:*"
    cursor, looked, seen, claims = "0", 0, 0, 0
    ages: list[tuple[int, str]] = []
    waits: list[tuple[int, str]] = []
    rates: list[str] = []
    debounces: list[str] = []
    step = client.register_script(_STEP)  # EVALSHA (SCRIPT LOAD on NOSCRIPT): what a worker's grant has
    while True:
        reply = step(keys=[], args=[cursor, pattern, SCAN_STEP, limit])
        # With MATCH, a step reports only the keys that match: it looked at about SCAN_STEP keys.
        cursor, looked, seen = str(reply[0]), looked + SCAN_STEP, seen + int(reply[2])
        claims += int(reply[7])
        pairs = reply[3]
        ages = sorted([*ages, *((int(a), str(k)) for k, a in zip(pairs[0::2], pairs[1::2], strict=True))])[:limit]
        pairs = reply[4]
        found = ((-int(n), str(k)) for k, n in zip(pairs[0::2], pairs[1::2], strict=True))
        waits = sorted([*waits, *found])[:limit]
        rates += [str(k) for k in reply[5]][: max(0, limit - len(rates))]
        debounces += [str(k) for k in reply[6]][: max(0, limit - len(debounces))]
        if cursor == "0" or seen >= budget or looked >= SCAN_KEYS:
            break
    complete = cursor == "0"
    if complete:
        total = seen
    else:
        total = max(seen, round(seen * max(int(client.dbsize()), looked) / looked))
    claims_total = claims if complete or not seen else round(claims * total / seen)
    # Candidates: the oldest leases and the entities with the longest waiter queues (their slot-0 lease).
    names = [name for _, name in ages]
    for _, wait_key in waits:
        entity = wait_key[len(f"{prefix}:v1:{{") : -len("}:wait")]
        if lock_name(prefix, entity) not in names:
            names.append(lock_name(prefix, entity))
    rows, waiting = _first_rows(client, prefix, _read_named(client, prefix, names), limit)
    return LeaseSample(
        leases=rows,
        waiting=waiting,
        seen=seen,
        total=total,
        complete=complete,
        rate_keys=sorted({k for k in (parse_rate_name(prefix, n) for n in rates) if k is not None}),
        debounce_names=sorted(debounces),
        claims=claims_total,
    )


def _first_rows(
    client: Any, prefix: str, leases: list[HeldLease], limit: int
) -> tuple[list[HeldLease], dict[str, int]]:
    """The ``limit`` rows ``locks`` shows first (:func:`display_order`), with the waiter counts of those rows."""
    waiting = read_waiting(client, prefix, sorted({lease.key for lease in leases}))
    rows = sorted(leases, key=lambda lease: display_order(lease, waiting))[:limit]
    shown = {lease.key for lease in rows}
    return rows, {k: n for k, n in waiting.items() if k in shown}


def _read_named(client: Any, prefix: str, names: list[str]) -> list[HeldLease]:
    """The lease hashes ``names`` (HGETALL + PTTL in pipelines); a key released meanwhile is left out."""
    now_ms = server_ms(client)
    out: list[HeldLease] = []
    for i in range(0, len(names), BATCH):
        chunk = names[i : i + BATCH]
        pipe = client.pipeline(transaction=False)
        for name in chunk:
            pipe.hgetall(name)
            pipe.pttl(name)
        replies = pipe.execute(raise_on_error=False)
        for name, fields, pttl in zip(chunk, replies[0::2], replies[1::2], strict=True):
            if isinstance(fields, Exception):
                reason = str(fields).split(" ", 1)[0] or fields.__class__.__name__
                out.append(HeldLease.unreadable(prefix, name, reason))
            elif fields:
                out.append(HeldLease.from_hash(prefix, name, fields, pttl, now_ms))
    return out


def read_entity(client: Any, prefix: str, key: str, slots: int = 1) -> list[HeldLease]:
    """Entity ``key``'s lease and its ``lock_limit`` slot leases (``describe KEY``), by slot; ``[]`` when free.

    Read by name (no SCAN: one entity costs a few round trips whatever the keyspace, and a key holding ``*``
    or ``[`` names only itself): ``slots`` slots (the app's largest ``lock_limit``), then every slot past them
    that the slot fence counters ``{K}:fence:<i>`` show was taken (:func:`taken_slots`, as ACQUIRE_SLOTS reads
    them for its duplicate rule), or that a lease read records in ``limit``, at most :data:`MAX_SLOTS_READ`.
    So a holder of a slot above a ``lock_limit`` a deploy lowered (a body of the old code) is found, however
    far below it the slots are free.
    Then the queue claim ``{K}:claim`` (``until_started``, or ``until_done`` queued behind different work): while
    it stands identical work is not enqueued, so the entity is not free; its row is keyed K, named by its Redis key
    (as ``locks`` lists it).
    """
    claim = claim_name(prefix, key)
    first = min(max(slots, 1), MAX_SLOTS_READ)
    upto = taken_slots(client, prefix, key, first)
    names = [slot_lock_name(prefix, key, i) for i in range(upto)]
    found = _read_named(client, prefix, [*names, claim])
    rows = [lease for lease in found if lease.redis_key != claim]
    recorded = max((lease.limit or 0 for lease in rows), default=0)
    if recorded > upto:
        more = range(upto, min(recorded, MAX_SLOTS_READ))
        rows += _read_named(client, prefix, [slot_lock_name(prefix, key, i) for i in more])
    return rows + [lease for lease in found if lease.redis_key == claim]


#: Slot fence counters :func:`taken_slots` asks about per round trip.
_FENCE_STEP = 32


def taken_slots(client: Any, prefix: str, key: str, start: int) -> int:
    """How many of entity ``key``'s slots to read: ``start``, or more while the fence counters of the slots from
    ``start`` on exist (``EXISTS {K}:fence:<i>``), at most :data:`MAX_SLOTS_READ`.

    Slot i is taken only while every slot below it is held, and each take refreshes its fence counter (kept
    ``lockguard_fence_ttl``, far beyond a lease), so the first absent counter ends the slots ever taken: the
    rule ACQUIRE_SLOTS follows past its N. One round trip when ``lock_limit`` was never above ``start``.
    """
    end = max(start, 1)
    while end < MAX_SLOTS_READ:
        step = range(end, min(end + _FENCE_STEP, MAX_SLOTS_READ))
        pipe = client.pipeline(transaction=False)
        for i in step:
            pipe.exists(slot_fence_name(prefix, key, i))
        for i, there in zip(step, pipe.execute(raise_on_error=False), strict=True):
            if there != 1:
                return max(start, i)
        end = step.stop
    return max(start, end)


def iter_leases(client: Any, prefix: str, match: str = "*") -> Iterator[list[HeldLease]]:
    """Every lease and queue claim under ``prefix`` matching ``match`` (as :func:`read_leases` finds them),
    :data:`BATCH` at a time in scan order (``locks --all``).

    Memory stays one batch whatever the count: the rows are printed as they come, not sorted.
    """
    chunk: list[str] = []
    for name in client.scan_iter(match=rows_glob(prefix, match), count=1000):
        if _is_row(prefix, name):
            chunk.append(name)
        if len(chunk) >= BATCH:
            yield _read_named(client, prefix, chunk)
            chunk = []
    if chunk:
        yield _read_named(client, prefix, chunk)
