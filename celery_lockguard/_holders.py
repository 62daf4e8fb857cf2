"""Reading who holds what: the lease hashes under a prefix, parsed one row at a time.

The ACQUIRE and CLAIM scripts (``_scripts.py``) write each lease as a hash:
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

import re
from dataclasses import dataclass, field
from typing import Any

from ._keys import lock_name, parse_lock_name

#: A counter or a timestamp as the scripts write it: ASCII digits (at most 18, an int64's worth).
_NUMBER = re.compile(r"[0-9]{1,18}\Z")
#: Lease hashes read per pipeline round trip.
BATCH = 200
#: Lease states the scripts write (docs/reference.md, "Redis keys"): an until_done claim being
#: published or queued, a running holder, a release's reservation for a woken waiter. A state not
#: listed here is shown as stored and named in ``malformed``: add it here when a script writes a new one.
STATES = ("publishing", "queued", "running", "handed")


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
        left = pttl if isinstance(pttl, int) and not isinstance(pttl, bool) and pttl >= 0 else None
        return cls(
            key=parse_lock_name(prefix, redis_key) or redis_key,
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
        )

    @classmethod
    def unreadable(cls, prefix: str, redis_key: str, why: str) -> HeldLease:
        """A lease key that is not a hash (WRONGTYPE), or whose read failed: a row that says so."""
        return cls(
            key=parse_lock_name(prefix, redis_key) or redis_key,
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
        )

    def as_dict(self) -> dict[str, Any]:
        """The row of ``lockguard locks --json``."""
        return {
            "key": self.key,
            "redis_key": self.redis_key,
            "state": self.state,
            "task_name": self.task_name,
            "task_id": self.task_id,
            "worker": self.worker,
            "host": self.host,
            "pid": self.pid,
            "fence": self.fence,
            "held_for_ms": self.held_for_ms,
            "since_renewal_ms": self.since_renewal_ms,
            "ttl_left_ms": self.ttl_left_ms,
            "lease_ttl_ms": self.lease_ttl_ms,
            "malformed": list(self.malformed),
        }


def server_ms(client: Any) -> int:
    """The server's clock in ms (leases are stamped with it, not with this host's)."""
    sec, usec = client.time()
    return int(sec) * 1000 + int(usec) // 1000


def read_leases(client: Any, prefix: str, match: str = "*") -> list[HeldLease]:
    """Every lease and queue claim under ``prefix`` whose entity key matches the glob ``match``, sorted by key.

    One SCAN, then HGETALL + PTTL per key in pipelines of :data:`BATCH`. A
    pipeline reads every reply (``raise_on_error=False``), so one key of the
    wrong type is one unreadable row, not a failed command. A key released
    between SCAN and HGETALL is left out.
    """
    names = sorted(client.scan_iter(match=lock_name(prefix, match), count=1000))
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
