"""One lease across a workflow: a chain whose members hold one entity from the first to the last.

``workflow(chain(fetch.s(t), transform.s(), load.s()), lock_key="tenant:{tenant_id}:pipeline",
tenant_id=t).apply_async()`` publishes the chain with a header on every member (:class:`Spec`: the
entity key, a workflow id, the TTLs and policies). No lease is taken at publish; the members carry
it out between them, one Lua script per step (``_scripts.WORKFLOW_*``):

* the **first** member *starts* the workflow: WORKFLOW_ENTER takes the free lease (a fresh token and
  fence, the holder named after the workflow, ``workflow`` = its id). Contention is the usual rules
  (``_decision.decide_member``): an identical workflow running is skipped whole, different work is
  waited for, ``raise`` raises;
* a member that ends hands the lease **on** (WORKFLOW_PASS): state ``gap``, ``next`` = the *slot* of
  the member that runs next (``#<index>`` in the chain: the next step's, or its own for a retry), for
  the *gap TTL*, or, handed to a delayed copy of itself (a retry, a wait for its own lock), for that
  copy's countdown plus the publish grace if longer (DESIGN: a hand-over covers its countdown). No
  process renews during the queue gap; the next member's renewer takes over when it enters. Slots,
  not task ids, so the hand-over works the same in eager mode (``task_always_eager``, where members
  get no frozen ids) and a stale copy of an earlier member is told apart;
* a later member *enters* (WORKFLOW_ENTER finds ``gap`` and ``next`` = its slot): same token, same
  fence, so ``self.lock`` is the workflow lease in every member and ``advance_fence`` accepts its
  writes in each. Finding the lease gone or held by someone else means the gap outlived its TTL:
  the member fails with ``LockLost`` and the chain stops (running on would interleave);
* the **last** member (its slot is the chain's last) releases (RELEASE by token, waking a parked
  waiter); a member that fails, gives up or is ignored releases at once (``workflow.released_on_error``);
* a chord's header members share one slot and run in parallel: the first to enter takes the lease
  over, the others join it (``active`` counts them); each leaves with WORKFLOW_LEAVE, and the last
  one out hands the lease to the slot for the longest gap any of them asked for, where the chord's
  callback (admitted *after* its header: Celery runs it only once every header result is in) enters.
  A page that fails leaves too: its siblings keep the entity, and once every page of the slot has
  left (``width`` in the header) the last one out ends the workflow, failed;
* a member about to wait for its own lock on another entity records it (``waits_on``) and fails with
  ``WorkflowDeadlock`` if the holder of that entity is a workflow waiting, directly or around a
  cycle, for this workflow's entity (:func:`check_lock_order`);
* the worker's main process ends the lease of a member revoked while queued (freed at once) or
  terminated while running (cut to the shorten grace): WORKFLOW_ABORT, by workflow id and task id.

Several entities (``lock_key`` as a sequence, :attr:`Spec.keys`, sorted): every WORKFLOW_* script takes
the N lease hashes and writes the same workflow state (plus ``siblings``) to each, token-checked on all;
the first member takes every entity or none (never a partial hold while it waits); one token, one
fence per entity (the member's lease is a :class:`MultiLease`: ``.fences``); the end frees them all
with RELEASE_MULTI, waking each entity's oldest waiter. The ended ids live on the anchor (the first
key). One slot only: on Redis Cluster such a workflow is refused at build (:func:`workflow`).

The token and fence are read from the lease hash by workflow id and member task id, not carried in
the messages: a member that dies is taken over by its redelivery with a *fresh* token and a new
fence (a paused earlier delivery then can neither renew nor write past the fence), and later
members still find their workflow.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from celery import Signature, current_app, group, states
from celery.canvas import _chain, _chord, chain, chord
from celery.exceptions import Ignore, Reject, Retry

from . import _calls as calls
from . import _claims as claims
from . import _cluster as cluster
from . import _connection as connection
from . import _errors as errors
from . import _handoff as handoff
from . import _headers as headers
from . import _keys as keys
from . import _lease as lease_ops
from . import _multi as multi
from . import _republish as republish
from . import _request as request_state
from . import _scripts as scripts
from . import _taskclass as taskclass
from ._config import Settings, TaskOptions, settings
from ._decision import HolderFacts, Member, MemberAction, MemberDecision, OnLocked, OnUnavailable, decide_member
from ._entities import EntityKeys, is_sequence
from ._events import emit
from ._lease import Lease, MultiLease
from ._metrics import observe_hold
from ._renewer import renewer
from .exceptions import (
    BackendUnavailable,
    ConfigurationError,
    LockContended,
    LockLost,
    WorkflowDeadlock,
    WorkflowEnded,
)

#: Default seconds a handed-on lease waits for the next member (the longest queue gap it survives).
DEFAULT_GAP_TTL = 60.0
#: Seconds an ended workflow's id is remembered (``WORKFLOW_END``): a redelivered copy of one of its members
#: within this window is dropped rather than starting the workflow again (Redis broker: ``visibility_timeout``,
#: 1 h by default, bounds how late such a copy comes).
ENDED_WINDOW = 6 * 3600.0
#: Request attribute holding the workflow lease of the running member (beside ``self.lock``).
WORKFLOW_LEASE = "_lockguard_workflow_lease"

_POLICIES = ("skip", "retry", "raise")
_OUTAGE = ("fail_closed", "fail_open")


@dataclass(frozen=True)
class Spec:
    """What every member's header says about its workflow (JSON in the message)."""

    #: The workflow id (a uuid): the lease hash's ``workflow`` field.
    id: str
    #: The rendered entity key K (no prefix).
    key: str
    #: The holder's ``task_name`` in the lease (``lockguard locks`` shows it) and, with ``digest``, the
    #: identity an identical workflow is recognised by.
    name: str
    digest: str
    ttl_ms: int
    gap_ms: int
    on_locked: OnLocked
    on_unavailable: OnUnavailable
    max_waits: int
    max_hold: float
    #: This member's place in the chain (0 = the first, which may start the workflow) and the chain's length.
    index: int = 0
    count: int = 1
    #: A chord's header member: it runs beside the others of its slot, sharing the lease (WORKFLOW_LEAVE).
    parallel: bool = False
    #: A chord's callback: the slot of its header, which admits it too (-1: none).
    after: int = -1
    #: A chord's header member: how many members its slot has (0: not known), so the last of them to end knows
    #: the slot is done (WORKFLOW_LEAVE: after a failed page the workflow ends then, not before).
    width: int = 0
    #: An earlier member ran without the lease (``fail_open``): this one runs unlocked too, rather than be
    #: dropped or fail with ``LockLost`` on a lease the workflow no longer keeps.
    unlocked: bool = False
    #: Several entities (``lock_key`` as a sequence): every entity key, sorted and distinct; ``key`` is the
    #: first (the anchor, where the ended ids live). Empty for one entity.
    keys: tuple[str, ...] = ()

    @property
    def entities(self) -> tuple[str, ...]:
        """Every entity the workflow holds: ``keys``, or ``(key,)``."""
        return self.keys or (self.key,)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index >= self.count - 1

    @property
    def slot(self) -> str:
        """This member's slot, the ``next`` a hand-over to it writes (its retries and redeliveries share it)."""
        return slot(self.index)

    def header(
        self, index: int | None = None, parallel: bool = False, after: int = -1, width: int = 0
    ) -> dict[str, Any]:
        several = {"keys": list(self.keys)} if self.keys else {}  # one entity: the header is as before
        return {
            **several,
            "id": self.id,
            "key": self.key,
            "name": self.name,
            "digest": self.digest,
            "ttl_ms": self.ttl_ms,
            "gap_ms": self.gap_ms,
            "index": self.index if index is None else index,
            "count": self.count,
            "parallel": parallel or self.parallel,
            "after": after if after >= 0 else self.after,
            "width": width or self.width,
            "on_locked": self.on_locked,
            "on_unavailable": self.on_unavailable,
            "max_waits": self.max_waits,
            "max_hold": self.max_hold,
            "unlocked": self.unlocked,
        }

    @classmethod
    def from_header(cls, value: Any, task_name: str) -> Spec:
        """Parse a member's header; a header no ``workflow()`` wrote is a ``ConfigurationError`` (never unlocked)."""
        try:
            spec = cls(
                id=str(value["id"]),
                key=str(value["key"]),
                name=str(value["name"]),
                digest=str(value["digest"]),
                ttl_ms=int(value["ttl_ms"]),
                gap_ms=int(value["gap_ms"]),
                index=int(value["index"]),
                count=int(value["count"]),
                parallel=bool(value.get("parallel", False)),
                after=int(value.get("after", -1)),
                width=int(value.get("width", 0)),
                on_locked=value["on_locked"],
                on_unavailable=value["on_unavailable"],
                max_waits=int(value["max_waits"]),
                max_hold=float(value["max_hold"]),
                unlocked=bool(value.get("unlocked", False)),
                keys=tuple(str(k) for k in value.get("keys") or ()),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"task {task_name!r}: header {headers.WORKFLOW}={value!r} is not a workflow header ({exc!r})"
            ) from None
        valid = spec.ttl_ms > 0 and spec.gap_ms > 0 and 0 <= spec.index < spec.count
        valid = valid and (not spec.keys or (len(spec.keys) > 1 and spec.keys[0] == spec.key))
        if spec.on_locked not in _POLICIES or spec.on_unavailable not in _OUTAGE or not valid:
            raise ConfigurationError(f"task {task_name!r}: header {headers.WORKFLOW}={value!r} is not valid")
        return spec


def slot(index: int) -> str:
    """The slot of the member at ``index``: what a hand-over to it writes as ``next``."""
    return f"#{index}"


def claims_own_entity(options: dict[str, Any], key: str) -> bool:
    """Whether a publish with ``options`` is a workflow member whose own entity is one of the workflow's."""
    value = (options.get("headers") or {}).get(headers.WORKFLOW)
    return isinstance(value, dict) and (value.get("key") == key or key in (value.get("keys") or ()))


def own_entities(spec: Spec, own: str | tuple[str, ...] | None) -> bool:
    """Whether a member's own ``lock_key`` (rendered: a key or a tuple) names only entities the workflow holds.

    Such a member runs under the workflow lease; acquiring its own would wait on its own workflow.
    """
    if own is None:
        return False
    return set((own,) if isinstance(own, str) else own) <= set(spec.entities)


def refuse_caps_on_own_entity(task_name: str, opts: TaskOptions, spec: Spec) -> None:
    """Refuse a member on the workflow's own entity whose ``lock_rate`` or ``lock_limit`` the lease cannot keep.

    Such a member runs under the workflow lease (:func:`own_entities`), which takes no start from the
    entity's window, so ``lock_rate`` would go uncounted; and a chord's pages all run under it at once, so a
    ``lock_limit`` below the number of pages would be exceeded. Either would be broken silently: the member
    fails with ``ConfigurationError`` instead (the workflow ends, as on any failure). A chain member with a
    ``lock_limit`` runs alone under the lease, within any limit, and is let through.
    """
    where = f"task {task_name!r}: on the workflow's own entity {spec.key!r}"
    if opts.rate is not None:
        raise ConfigurationError(
            f"{where}, option lock_rate={opts.rate.text!r} cannot be kept: a member there runs under the "
            "workflow lease, which counts no start in the entity's window. Rate-limit another entity (the "
            "member then nests its own lease there), or run the task outside the workflow"
        )
    if opts.limit > 1 and spec.parallel and not 0 < spec.width <= opts.limit:
        pages = f"{spec.width} pages" if spec.width else "its pages"
        raise ConfigurationError(
            f"{where}, option lock_limit={opts.limit} cannot be kept: the chord runs {pages} at once under "
            "the workflow lease. Give the chord at most lock_limit pages, limit another entity, or run the "
            "pages outside the workflow"
        )


def member_of(request: Any, task_name: str) -> Spec | None:
    """The workflow the delivered message is a member of, or ``None``."""
    value = headers.read(request, headers.WORKFLOW)
    return None if value is None else Spec.from_header(value, task_name)


# -- publishing ---------------------------------------------------------------------------


class Workflow:
    """A canvas that runs under one entity lease; made by :func:`workflow`, published like the canvas.

    ``apply_async`` / ``delay`` return what the chain's own would: the ``AsyncResult`` of its last
    member. Members are ``LockGuard`` tasks (``LockedTask``), with or without a ``lock_key`` of
    their own: one that locks another entity takes that lease inside the workflow's; one on the
    workflow's own entity runs under the workflow lease.
    """

    def __init__(self, sig: Signature, spec_fields: dict[str, Any], app: Any) -> None:
        self.sig = sig
        self.app = app
        self._fields = spec_fields

    @property
    def members(self) -> list[Signature]:
        """Every task signature of the workflow in order (nested chains flattened; a chord's header, then its body)."""
        return [m for step in _steps(self.sig) for m in (*step.tasks, *([step.body] if step.body else []))]

    def spec(self, args: Any = None, kwargs: Any = None) -> Spec:
        """A fresh :class:`Spec` (new workflow id) for one publish with these first-member arguments.

        The arguments a publish passes to the first member are part of the workflow's identity: the same
        workflow published with other arguments is different work (waited for, never skipped).
        """
        count = sum(2 if step.body is not None else 1 for step in _steps(self.sig))
        fields = dict(self._fields)
        if args or kwargs:
            fields["digest"] = keys.digest(
                {"members": fields["digest"], "args": list(args or ()), "kwargs": dict(kwargs or {})}
            )
        return Spec(id=uuid.uuid4().hex, count=count, **fields)

    def _canvas(self, args: Any, kwargs: Any, options: dict[str, Any]) -> Signature:
        """The canvas to publish: every member carrying the workflow header (and the caller's ``headers``).

        Slots: a task takes one; a chord two, its header members sharing the first (they run in
        parallel under the one lease) and its callback the second. ``headers`` passed to the publish
        go on every member beside the workflow's: Celery would otherwise put them over the first
        member's, dropping its workflow header.
        """
        spec = self.spec(args, kwargs)
        theirs = dict(options.pop("headers", None) or {})
        theirs.pop(headers.WORKFLOW, None)

        def marked(sig: Signature, header: dict[str, Any]) -> Signature:
            return _marked(sig, header, theirs)

        canvas_steps: list[Signature] = []
        index = 0
        for step in _steps(self.sig):
            if step.body is None:
                canvas_steps.append(marked(step.tasks[0], spec.header(index=index)))
                index += 1
                continue
            width = len(step.tasks)
            header = [marked(t, spec.header(index=index, parallel=True, width=width)) for t in step.tasks]
            body = marked(step.body, spec.header(index=index + 1, after=index))
            canvas_steps.append(chord(group(header, app=self.app), body, app=self.app))
            index += 2
        extra = {k: v for k, v in self.sig.options.items() if k != "headers"}
        if len(canvas_steps) == 1:
            return canvas_steps[0].set(**extra) if extra else canvas_steps[0]
        return chain(*canvas_steps, app=self.app, **extra)

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        """Publish every member carrying the workflow header; the first one starts the workflow."""
        return self._canvas(args, kwargs, options).apply_async(args, kwargs, **options)

    def apply(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        """Run the workflow eagerly in this process (as ``chain.apply``), under the same lease rules."""
        return self._canvas(args, kwargs, options).apply(args, kwargs, **options)

    def delay(self, *args: Any, **kwargs: Any) -> Any:
        return self.apply_async(args, kwargs)

    def __repr__(self) -> str:
        return f"<Workflow {self._fields['key']!r} {self.sig!r}>"

    def _nested(self, *_: Any) -> Any:
        raise ConfigurationError(_nesting_error(self))

    # chain(a, workflow(...)), a | workflow(...), workflow(...) | b: Celery would raise a bare TypeError
    __or__ = __ror__ = _nested


def _nesting_error(w: Workflow) -> str:
    return (
        f"workflow {w._fields['name']!r} on {w._fields['key']!r}: a workflow(...) cannot be a step of another "
        "chain or workflow (its members would run outside both leases). Put its tasks in the outer chain and "
        "pass the outer workflow() every entity up front, or publish the two workflows one after the other"
    )


def workflow(
    sig: Signature,
    lock_key: str | tuple[str, ...] | list[str],
    *,
    name: str | None = None,
    lock_ttl: float | None = None,
    gap_ttl: float = DEFAULT_GAP_TTL,
    on_locked: str = "skip",
    on_unavailable: str = "fail_closed",
    lock_max_waits: int | None = None,
    lock_max_hold: float = 3600.0,
    app: Any = None,
    **fields: Any,
) -> Workflow:
    """Run the chain ``sig`` under one lease on the entity ``lock_key`` (a template over ``fields``).

    ``lock_key`` as a sequence of templates: the workflow holds every entity they name, all or none, on
    one token (refused on Redis Cluster when they fall in different slots: ``ConfigurationError``).

    ``workflow(chain(fetch.s(t), load.s()), lock_key="tenant:{tenant_id}:pipeline", tenant_id=t)``.
    ``lock_ttl``: the lease TTL while a member runs (renewed every third, as for a task; default
    ``lockguard_default_ttl``); ``gap_ttl``: how long a handed-on lease waits for the next member
    (the longest queue gap the workflow survives, and how long a workflow that died between
    members holds the entity); ``on_locked``/``on_unavailable``: the first member's policies
    (``skip`` skips an identical workflow running, different work is waited for); ``name``: the
    holder name shown by ``lockguard locks`` (default ``workflow:<first member's task>``).
    Bad input raises ``ConfigurationError`` naming the option and the value.
    """
    if isinstance(sig, Workflow):
        raise ConfigurationError(_nesting_error(sig))
    app = app or getattr(sig, "app", None) or current_app
    label = name or f"workflow:{_first_name(sig)}"
    where = f"workflow {label!r}"
    members = _members(sig)
    if not members:
        raise ConfigurationError(f"{where}: the chain has no members")
    for member in members:
        task = app.tasks.get(member.task)
        if not taskclass.is_guarded(task):
            raise ConfigurationError(
                f"{where}: member {member.task!r} must be a LockGuard task (base=LockedTask) to run under "
                "the workflow lease" + ("" if task is not None else " (it is not registered in this app)")
            )
    if on_locked not in _POLICIES:
        raise ConfigurationError(f"{where}: option on_locked={on_locked!r} must be one of {_POLICIES}")
    if on_unavailable not in _OUTAGE:
        raise ConfigurationError(f"{where}: option on_unavailable={on_unavailable!r} must be one of {_OUTAGE}")
    s = settings(app)
    ttl = _seconds(where, "lock_ttl", s.default_ttl if lock_ttl is None else lock_ttl)
    gap = _seconds(where, "gap_ttl", gap_ttl)
    hold = _seconds(where, "lock_max_hold", lock_max_hold)
    waits = s.max_waits if lock_max_waits is None else lock_max_waits
    if not isinstance(waits, int) or isinstance(waits, bool) or waits < 0:
        raise ConfigurationError(f"{where}: option lock_max_waits={waits!r} must be an int >= 0")
    entities = _render_key(where, lock_key, fields)
    key = entities[0]
    if len(entities) > 1:
        _refuse_cluster_slots(where, lock_key, entities, s)
    digest = keys.digest(
        {str(i): [m.task, list(m.args or ()), dict(m.kwargs or {})] for i, m in enumerate(members)}
        | {"key": key if len(entities) == 1 else list(entities)}
    )
    spec_fields = {
        "key": key,
        "keys": entities if len(entities) > 1 else (),
        "name": keys.meta(label),
        "digest": digest,
        "ttl_ms": int(ttl * 1000),
        "gap_ms": int(gap * 1000),
        "on_locked": on_locked,
        "on_unavailable": on_unavailable,
        "max_waits": waits,
        "max_hold": hold,
    }
    return Workflow(sig, spec_fields, app)


@dataclass(frozen=True)
class _Step:
    """One step of the workflow: a task, or a chord (its header's tasks run in parallel, then its body)."""

    tasks: tuple[Signature, ...]
    body: Signature | None = None


def _steps(sig: Signature) -> list[_Step]:
    """The workflow's steps in order: nested chains flattened; a group followed by a task is a chord.

    A group with no callback is refused (no member can tell it is the last to end, so nothing would
    end the lease; the error says to add a callback), and so is a canvas nested inside a chord's
    header or body.
    """
    if isinstance(sig, _chain):
        items, out, i = list(sig.tasks), [], 0
        while i < len(items):
            item = items[i]
            if isinstance(item, group) and i + 1 < len(items) and type(items[i + 1]) is Signature:
                out.append(_Step(tuple(_task(t) for t in item.tasks), items[i + 1]))
                i += 2
                continue
            out.extend(_steps(item))
            i += 1
        return out
    if isinstance(sig, _chord):
        # chain(a, chord(g, b), c) is folded by Celery into chord(g, b | c): the callback is the body's first task
        after = _steps(sig.body)
        if not after or after[0].body is not None:
            raise ConfigurationError(f"workflow: a chord's callback must start with a task ({sig.body!r})")
        return [_Step(tuple(_task(t) for t in sig.tasks), after[0].tasks[0]), *after[1:]]
    if isinstance(sig, group):
        # Not supported rather than released by "the last member out": pages run in parallel and one may
        # leave (WORKFLOW_LEAVE) before a sibling has even entered, so no member can tell it is the last;
        # in a chord the callback, which Celery publishes only after every header result, ends it.
        raise ConfigurationError(
            f"workflow: a group with no callback ({sig!r}) is not supported: none of its members can tell "
            "it is the last to end, so nothing would end the lease. Give the group a LockedTask callback "
            "that ends the workflow: write chord(group(...), done.s()), or chain(..., group(...), done.s()), "
            "with `@app.task(base=LockedTask)` `def done(results): return results` (the workflow's result "
            "is then the list of the group's results)"
        )
    return [_Step((_task(sig),))]


def _task(sig: Any) -> Signature:
    if type(sig) is not Signature:
        kind = getattr(sig, "subtask_type", None) or type(sig).__name__
        raise ConfigurationError(
            f"workflow: a {kind} ({sig!r}) inside a chord is not supported: a chord's header and body are tasks"
        )
    return sig


def _marked(sig: Signature, header: dict[str, Any], extra: dict[str, Any] | None = None) -> Signature:
    clone = sig.clone()
    clone.set(headers={**(extra or {}), **(clone.options.get("headers") or {}), headers.WORKFLOW: header})
    return clone


def _members(sig: Signature) -> list[Signature]:
    return [m for step in _steps(sig) for m in (*step.tasks, *([step.body] if step.body else []))]


def _first_name(sig: Signature) -> str:
    try:
        return str(_members(sig)[0].task)
    except (ConfigurationError, IndexError):
        return "canvas"


def _seconds(where: str, option: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0.001 or value != value:
        raise ConfigurationError(f"{where}: option {option}={value!r} must be a number of seconds >= 0.001")
    return float(value)


def _render_key(where: str, template: Any, fields: dict[str, Any]) -> tuple[str, ...]:
    """``lock_key`` rendered over ``fields`` with the task keys' rules (escaped, bounded, no empty field).

    Several templates: every entity key, sorted and distinct (``src == dst`` is one entity, one key).
    """
    params = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in fields]
    name = where.split(" ", 1)[-1].strip("'")
    try:
        if is_sequence(template):
            rendered = EntityKeys(template, inspect.Signature(params), name).render_keys(fields, (), fields)
            return tuple(sorted(set(rendered)))
        return (keys.KeyRenderer(template, inspect.Signature(params), name, "lock_key").render(fields, (), fields),)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{where}: {exc}") from None


def _refuse_cluster_slots(where: str, template: Any, entities: tuple[str, ...], s: Settings) -> None:
    """Redis Cluster with the entities in different slots: refused (the WORKFLOW_* scripts touch every entity).

    A task over several entities acquires them one by one in sorted order with roll-back
    (``_multi``); a workflow's hand-overs, leaves and aborts would each need that too, with a window in
    which part of the workflow's hold is visible between members. One slot (one Redis, Sentinel) only.
    """
    names = [keys.lock_name(s.key_prefix, k) for k in entities]
    if s.redis_cluster and len({cluster.slot(n) for n in names}) > 1:  # settings only: no connection at build
        raise ConfigurationError(
            f"{where}: option lock_key={template!r} names entities {list(entities)!r} in different Redis "
            "Cluster slots: a workflow over several entities needs them in one slot (one Redis or Sentinel); "
            "on Cluster, hold several entities in one task (lock_key as a sequence on the member), or one "
            "entity per workflow"
        )


# -- the member's delivery ---------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """WORKFLOW_ENTER's answer, parsed."""

    kind: str
    token: str = ""
    fence: int = 0
    held_ms: int = 0
    holder: lease_ops.Holder | None = None
    #: Several entities: entity key -> fence (every entity's own); empty for one entity.
    fences: dict[str, int] | None = None


def enter(client: Any, s: Settings, spec: Spec, request: Any, token: str, take_over: bool) -> Entry:
    """One WORKFLOW_ENTER round trip for this member's delivery."""
    entities = spec.entities
    keys_ = [
        *(keys.lock_name(s.key_prefix, k) for k in entities),
        *(keys.fence_name(s.key_prefix, k) for k in entities),
        keys.workflows_ended_name(s.key_prefix, spec.key),
    ]
    args: list[Any] = [
        spec.id,
        keys.meta(str(request.id)),
        keys.meta(str(request.task or "")),
        token,
        spec.ttl_ms,
        spec.name,
        spec.digest,
        keys.meta(lease_ops.HOST),
        os.getpid(),
        keys.meta(request.hostname or ""),
        int(s.fence_ttl * 1000),
        "1" if spec.first else "",
        "1" if take_over else "",
        spec.slot,
        slot(spec.after) if spec.after >= 0 else "",
        "1" if spec.parallel else "",
    ]
    if spec.keys:
        args += [multi.siblings(spec.keys, i) for i in range(len(spec.keys))]
    try:
        reply = scripts.workflow_enter(client, keys_, args)
    except Exception as exc:
        named = [f for f in keys_[len(entities) : 2 * len(entities)] if f" {f} " in str(exc)]
        corrupt = scripts.corrupt_fence(exc, keys_[1] if len(entities) == 1 else next(iter(named), None))
        if corrupt is not None:
            raise corrupt from exc
        raise
    kind = str(reply[0])
    fences = _fences(spec, reply, 4 if kind in ("started", "entered") else 8)
    if kind in ("started", "entered"):
        return Entry(kind, str(reply[1]), int(reply[2]), int(reply[3]), fences=fences)
    if kind == "self":
        holder = lease_ops.Holder(
            task_id=str(request.id),
            task_name=spec.name,
            digest=spec.digest,
            host=str(reply[4]),
            pid=int(reply[5] or 0),
            state="running",
            pttl_ms=0,
            ms_since_renewal=int(reply[6]),
            token=str(reply[1]),
            ttl_ms=int(reply[7]),
        )
        return Entry(kind, str(reply[1]), int(reply[2] or 0), int(reply[3]), holder, fences)
    if kind == "held":
        holder = lease_ops.held_reply(reply)
        return Entry(kind, holder=holder)
    if kind == "blocked":  # several entities: the one that blocked is named (entity, task, id)
        entity = spec.keys[int(reply[1]) - 1]
        holder = dataclasses.replace(lease_ops.held_reply(reply[2]), entity=entity)
        return Entry("held", holder=holder)
    return Entry(kind)


def _fences(spec: Spec, reply: Any, at: int) -> dict[str, int] | None:
    """Several entities: WORKFLOW_ENTER's trailing fences as entity key -> fence; else ``None``."""
    if not spec.keys or len(reply) <= at:
        return None
    return {k: int(f or 0) for k, f in zip(spec.keys, reply[at], strict=True)}


def new_lease(spec: Spec, s: Settings, entry: Entry, sent_at: float, task_id: str) -> Lease:
    """The workflow lease a member holds: a :class:`MultiLease` (``.fences``) over several entities."""
    if spec.keys:
        fences = entry.fences or {}
        return MultiLease(spec.keys, s.key_prefix, entry.token, fences, spec.ttl_ms, sent_at, task_id, spec.name)
    return Lease(spec.key, s.key_prefix, entry.token, entry.fence, spec.ttl_ms, sent_at, task_id, spec.name)


def facts(spec: Spec, entry: Entry) -> HolderFacts | None:
    """What the member knows of the holder WORKFLOW_ENTER met (``self``: its own running delivery)."""
    h = entry.holder
    if h is None:
        return None
    here = h.host == lease_ops.HOST
    renewed = h.ms_since_renewal < (h.ttl_ms or spec.ttl_ms) * 0.6
    if entry.kind == "self":
        # Alive only while still renewed, also on this host: a process that lived on after its member stopped
        # renewing (a hand-over to its retry that failed) is not running it. A wrong "dead" is safe: the take-over
        # has a fresh token and a new fence, so the earlier delivery can neither renew nor write past it.
        pid_gone = here and not lease_ops.pid_alive(h.pid)
        return HolderFacts(own_id=True, duplicate=True, alive=renewed and not pid_gone, dead_here=pid_gone)
    if h.state in ("queued", "publishing", "gap"):
        alive = True  # its next message is in the broker
    elif here:
        alive = lease_ops.pid_alive(h.pid)
    else:
        alive = renewed
    return HolderFacts(own_id=False, duplicate=h.task_name == spec.name and h.digest == spec.digest, alive=alive)


def deliver(
    task: Any, s: Settings, opts: TaskOptions, spec: Spec, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Carry out one member's delivery: enter the workflow lease, decide, run, hand on or release."""
    req = task.request
    fields = _fields(spec, req.id)
    if spec.unlocked or spec.id in _failed_open:
        emit("lock.fail_open", task.name, **fields, policy="fail_open", reason="an earlier member ran unlocked")
        return _run_unlocked(task, s, opts, spec, args, kwargs)
    if _already_ran(task):
        # A copy of a member that ran to its end (a lost ack, the visibility timeout): a chord's page joins its
        # slot's lease whoever left it, and a first member starts the workflow again once its lease is gone (a
        # forced release, gap_ttl), so the lease cannot tell such a copy from new work: its stored result can.
        emit("workflow.member_dropped", task.name, **fields, reason="already_ran")
        _give_back_own_wait(task, args, kwargs)  # a woken copy's reservation: the next waiter's, at once
        raise Ignore()
    client = connection.client(s)
    take_over = False
    # A parked copy (woken or safety) of a member with its own lock: its twin may be inside the workflow for
    # the moment it takes to settle with the waiter entry and hand back; look again until the wake grace ends.
    parked_until = time.monotonic() + handoff.WAKE_GRACE if headers.read_str(req, headers.PARK) else 0.0

    def twin_may_hand_back() -> bool:
        return time.monotonic() < parked_until

    while True:
        token = lease_ops.new_token()
        failure: BaseException | None = None
        sent_at = time.monotonic()
        try:
            entry = enter(client, s, spec, req, token, take_over)
        except Exception as exc:
            kind = errors.classify(exc)
            if kind is None:
                raise
            entry, failure = Entry(kind), exc
        holder = entry.holder
        decision = decide_member(
            Member(
                entry=entry.kind,  # type: ignore[arg-type]
                first=spec.first,
                on_locked=spec.on_locked,
                on_unavailable=spec.on_unavailable,
                holder=facts(spec, entry),
                waits=headers.read_int(req, headers.WAITS),
                max_waits=spec.max_waits,
            )
        )
        action = decision.action
        if action is MemberAction.RUN:
            lease = new_lease(spec, s, entry, sent_at, req.id)
            event = "workflow.started" if entry.kind == "started" else "workflow.entered"
            emit(event, task.name, **fields, fence=lease.fence_field, reason=decision.reason)
            return _run(task, s, opts, spec, client, lease, sent_at - entry.held_ms / 1000, args, kwargs)
        if action is MemberAction.ADOPT:
            emit("workflow.taken_over", task.name, **fields, reason=decision.reason)
            take_over = True
            continue
        if action is MemberAction.DROP and decision.reason == "member_already_running" and twin_may_hand_back():
            time.sleep(0.05)  # the twin is a parked copy of ours about to drop itself and hand the workflow back
            continue
        if action is MemberAction.DROP:
            emit("workflow.member_dropped", task.name, **fields, reason=decision.reason)
            if decision.reason == "workflow_ended":
                _give_back_own_wait(task, args, kwargs)
            if decision.reason == "workflow_ended" and _never_answered(task):
                # not a stale copy of a member that ran: say so in its result rather than leave it PENDING
                raise WorkflowEnded(spec.key, spec.name)
            raise Ignore()
        if action is MemberAction.SKIP_WORKFLOW:
            assert holder is not None
            emit(
                "lock.skipped_duplicate",
                spec.name,  # counted under the workflow (what was skipped), not under its first member's task
                **fields,
                member=task.name,
                holder_task_id=holder.task_id,
                policy="skip",
                reason="identical_workflow_running",
            )
            _skip_rest(task, req)
            return None
        if action is MemberAction.WAIT:
            _wait(task, s, spec, decision, holder, fields)
            continue  # waited in this process (the publish failed)
        if action is MemberAction.LOST:
            emit("workflow.lost", task.name, **fields, reason=decision.reason)
            forfeit(task, s, spec, client, "enter", "")
            _give_back_own_wait(task, args, kwargs)
            raise LockLost(spec.key)
        if action is MemberAction.FAIL_OPEN:
            emit("lock.fail_open", task.name, **fields, policy="fail_open", reason=_describe(failure))
            return _run_unlocked(task, s, opts, spec, args, kwargs, ending=True)
        if action is MemberAction.MISCONFIGURED:
            assert failure is not None
            raise errors.configuration_error(failure, task.name, "WORKFLOW_ENTER") from failure
        if action is MemberAction.GIVE_UP:
            emit("lock.wait_budget_exhausted", task.name, **fields, reason=decision.reason, policy=spec.on_locked)
        _give_back_own_wait(task, args, kwargs)
        raise _contention_error(task, spec, holder, failure)


def _give_back_own_wait(task: Any, args: Any, kwargs: Any) -> None:
    """A member that ends here, never to take its own lock: free what its own entity's waiter queue holds for
    it -- the reservation it was woken into (the next waiter is woken), or its parked entry -- else that lease
    end would wake nobody for ``RESERVATION_TTL``; and its own queue claim (``until_started``/``until_done``),
    else identical work is refused, and other work waits, for ``queue_lock_ttl``. Best effort: both lapse by
    their TTL anyway."""
    from . import _signals as signals

    try:
        signals.free_reservation_from_main(task, task.request, args, kwargs)
    except Exception:  # noqa: BLE001 - the member's own outcome stands; the reservation lapses by its TTL
        pass
    try:
        signals.free_claim_from_main(task, str(task.request.id), args or (), kwargs or {}, "workflow member ended")
    except Exception:  # noqa: BLE001 - the claim lapses by its TTL
        pass


def _already_ran(task: Any) -> bool:
    """Whether this delivery is a copy of a member that ran to its end (its result is stored as ready)."""
    from celery.backends.base import DisabledBackend

    if isinstance(task.backend, DisabledBackend) or task.request.is_eager:
        return False
    try:
        return bool(task.backend.get_state(task.request.id) in states.READY_STATES)
    except Exception:  # noqa: BLE001 - an unreachable backend: enter as before (the lease decides)
        return False


#: How long a copy that met its workflow ended looks for a final result its twin is about to store: the member
#: that ends a workflow marks it ended before its own result is stored (milliseconds apart).
ANSWER_GRACE = 2.0


def _never_answered(task: Any) -> bool:
    """Whether no final result was stored for this member (a redelivered copy of one that ran has one).

    ``RETRY`` is no answer: it is this copy's own retry (or wait) asking to run again, so a copy of a member
    whose workflow ended meanwhile (forfeited while it retried) must answer, or its chain hangs. A duplicate
    copy may meet the end its twin wrote before the twin's result is stored: the state is read again for
    :data:`ANSWER_GRACE`, and a final one arriving meanwhile means this copy is that duplicate.
    """
    from celery.backends.base import DisabledBackend

    if isinstance(task.backend, DisabledBackend) or task.request.is_eager:
        return False
    deadline = time.monotonic() + ANSWER_GRACE
    try:
        while True:
            if task.backend.get_state(task.request.id) not in (states.PENDING, states.RETRY):
                return False
            if time.monotonic() >= deadline:
                return True
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - an unreachable backend: drop as before, the state cannot be stored either
        return False


#: Workflows a member in this process ran unlocked (fail_open), for eager chains, whose later members are
#: run from the signatures as published rather than from the request's chain (bounded, oldest dropped).
_failed_open: dict[str, None] = {}
_FAILED_OPEN_KEPT = 1024


def _run_unlocked(
    task: Any,
    s: Settings,
    opts: TaskOptions,
    spec: Spec,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    ending: bool = False,
) -> Any:
    """``fail_open``: run this member without the workflow lease, and every later member likewise.

    The later members' headers (in ``request.chain`` and ``request.chord``, which Celery publishes
    next) are marked ``unlocked``: they would otherwise find the lease gone or still waiting for this
    member, and be dropped or fail with ``LockLost``, losing the rest of the workflow; so is this
    member's own header, which its ``retry()`` carries on. ``ending`` (the member that met the
    outage, in a chain): once the body ran, the lease, if it still waits for this member, is freed
    and the workflow marked ended (best effort: Redis may still be down; then it frees within the gap
    TTL). A chord's page leaves the lease to its sibling pages, published before it failed open. A
    member on another entity still takes its own lease. An unlocked member has no lease to tell a
    redelivered copy of it by: like any ``fail_open`` run, such a copy runs again.
    """
    req = task.request
    _failed_open[spec.id] = None
    while len(_failed_open) > _FAILED_OPEN_KEPT:
        del _failed_open[next(iter(_failed_open))]
    _mark_unlocked(req.chain, spec.id)
    _mark_unlocked(req.chord, spec.id)
    own = headers.read(req, headers.WORKFLOW)
    if isinstance(own, dict):
        own["unlocked"] = True  # this member's own retry (on_retry copies the header) runs unlocked too
    from . import _delivery as delivery  # the delivery's door (it imports this module: lock order)

    try:
        if opts.locked and not own_entities(spec, task.lock_key_for(*args, **kwargs)):
            return delivery.deliver(task, s, opts, args, kwargs)
        return delivery.run_body(task, args, kwargs)
    finally:
        if ending and not spec.parallel:
            # A chord's other pages were published unmarked: they still join the lease (it waits in the gap for
            # their slot), so a page leaves it to them; a chain member frees what only it could have used.
            _end_unlocked(task, s, spec)


def _mark_unlocked(node: Any, workflow_id: str) -> None:
    """Mark every workflow header of ``workflow_id`` in a request's chain/chord (signature dicts) ``unlocked``."""
    for options in _signature_options(node):
        value = (options.get("headers") or {}).get(headers.WORKFLOW)
        if isinstance(value, dict) and value.get("id") == workflow_id:
            value["unlocked"] = True


def _signature_options(node: Any, depth: int = 0) -> Iterator[dict[str, Any]]:
    """The ``options`` of every signature dict nested in ``node`` (a chain's steps, a chord's header and body)."""
    if depth > 64:
        return
    if isinstance(node, dict):
        if isinstance(node.get("options"), dict):
            yield node["options"]
        for child in node.values():
            if isinstance(child, (dict, list, tuple)):
                yield from _signature_options(child, depth + 1)
    elif isinstance(node, (list, tuple)):
        for child in node:
            yield from _signature_options(child, depth + 1)


def _end_unlocked(task: Any, s: Settings, spec: Spec) -> None:
    req = task.request
    fields = _fields(spec, req.id)
    try:
        if abort(connection.client(s), s, spec, req.id, task.app):
            emit("workflow.released_on_error", task.name, **fields, reason="fail_open")
    except Exception as exc:  # the lease, no longer renewed, frees within the gap TTL
        if errors.classify(exc) is None:
            raise
        emit("lock.backend_unavailable", task.name, **fields, reason=f"end after fail_open: {_describe(exc)}")


def _contention_error(task: Any, spec: Spec, holder: lease_ops.Holder | None, failure: BaseException | None) -> Any:
    if holder is not None:
        return LockContended(holder.entity or spec.key, holder.task_id, holder.pttl_ms)
    return BackendUnavailable(f"task {task.name!r}: lock store unavailable for {spec.key!r}: {_describe(failure)}")


def _wait(
    task: Any,
    s: Settings,
    spec: Spec,
    decision: MemberDecision,
    holder: lease_ops.Holder | None,
    fields: dict[str, Any],
) -> None:
    """Re-deliver this member later with its place in the chain (``Retry``), or wait here if the publish fails."""
    req = task.request
    waits = headers.read_int(req, headers.WAITS)
    holder_ttl = holder.pttl_ms / 1000 if holder is not None else None
    countdown = min(republish.wait_countdown(waits, holder_ttl), republish.max_countdown(s))
    countdown_s = round(countdown, 3)
    emit("lock.retry_scheduled", task.name, **fields, reason=decision.reason, waits=waits, countdown=countdown_s)
    hdrs = {**republish.wait_headers(req, None), headers.WORKFLOW: spec.header()}
    if not req.is_eager:
        try:
            sig = republish.publish(task, req.args or (), req.kwargs or {}, countdown, hdrs)
        except Exception as exc:  # noqa: BLE001 - a failed publish must not lose the member: wait here
            emit("lock.backend_unavailable", task.name, **fields, reason=f"publish failed: {_describe(exc)}")
        else:
            raise Retry(exc=_contention_error(task, spec, holder, None), when=republish.retry_when(sig), sig=sig)
    time.sleep(countdown)
    req.headers = hdrs


def _skip_rest(task: Any, req: Any) -> None:
    """An identical workflow runs: end this one here; every member it would have run answers ``None``.

    The rest of the chain (``request.chain``) and, for a chord's header member, the chord's callback
    and what follows it (``request.chord``) are not published; their results are stored as ``None``.
    """
    rest = list(req.chain or ())
    body = req.chord if isinstance(req.chord, dict) else None
    if body is not None:
        rest += [body, *((body.get("options") or {}).get("chain") or ())]
    req.chain = None
    req.chord = None
    for task_id in _task_ids(rest):  # a chord's callback and header too: the caller may wait on its callback
        try:
            task.backend.store_result(task_id, None, states.SUCCESS)
        except Exception:  # noqa: BLE001 - no result backend (DisabledBackend): nobody waits on the results
            pass


def _task_ids(node: Any) -> list[str]:
    """Every ``task_id`` of the signature dicts nested in ``node``, once each."""
    found = (options.get("task_id") for options in _signature_options(node))
    return list(dict.fromkeys(t for t in found if isinstance(t, str) and t))


def _run(
    task: Any,
    s: Settings,
    opts: TaskOptions,
    spec: Spec,
    client: Any,
    lease: Lease,
    started_at: float,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run the body under the workflow lease; on the way out hand it on, or release it.

    The member's own lock nests: a ``lock_key`` on another entity takes that lease too (the usual
    delivery, inside this one); a ``lock_key`` on the workflow's own entity runs under the workflow
    lease (acquiring it again would wait on ourselves).
    """
    from . import _delivery as delivery  # the delivery's door (it imports this module: lock order)

    req = task.request
    setattr(req, WORKFLOW_LEASE, lease)
    request_state.hold(req, lease)
    renewer().track(lease, client, spec.max_hold)
    nested = opts.locked and not own_entities(spec, task.lock_key_for(*args, **kwargs))
    outcome = "failed"
    try:
        if nested:
            # the workflow's own entities among the member's are held already: lease the others only
            result = delivery.deliver(task, s, opts, args, kwargs, held=spec.entities)
        else:
            if opts.locked:
                refuse_caps_on_own_entity(task.name, opts, spec)
            # checkpoints work in every member (scoped by its own lock_key / idempotency_key, else its task id,
            # which its retries and redeliveries share)
            request_state.enter(req, calls.render(opts, req.id, args, kwargs))
            result = delivery.run_body(task, args, kwargs)
        outcome = "success"
        return result
    except Retry:
        outcome = "retry"
        raise
    except Reject as exc:
        outcome = "retry" if exc.requeue else "failed"
        raise
    except Ignore:
        # A parked copy of a member with its own lock dropped itself: the member's other copy (woken or
        # safety) runs it. Hand the workflow back to this member's slot for that copy, as for a retry;
        # ending the workflow here would drop that copy as a stale one and leave the chain PENDING.
        if nested and headers.read_str(req, headers.PARK):
            outcome = "handed_back"
        raise
    finally:
        renewer().untrack(lease)
        _finish(task, s, spec, client, lease, started_at, outcome)


def _finish(task: Any, s: Settings, spec: Spec, client: Any, lease: Lease, started_at: float, outcome: str) -> None:
    """Every exit of a member: hand the lease on (success with a next step, a retry) or release it."""
    req = task.request
    fields = _fields(spec, req.id)
    handed = getattr(lease, "handed_to", None)
    if outcome in ("retry", "handed_back"):
        if handed is None:
            # handed back: the other copy is already published (no countdown), the hand-over covers its grace
            gap = covering_ms(0.0) if outcome == "handed_back" else 0
            hand_on(task, s, spec, client, lease, spec.index, gap_ms=gap)
        return
    if spec.parallel:
        # a chord's page leaves its slot, failed or not: its siblings keep the entity until the last one leaves
        # (``handed``: it left already for a retry() that ran out of retries, so it is not counted out twice)
        failed = outcome != "success"
        hand_on(
            task,
            s,
            spec,
            client,
            lease,
            spec.index,
            strict=not failed,
            final=True,
            failed=failed,
            left=handed is not None,
        )
        if not getattr(lease, "slot_failed", False):
            return
        outcome = "failed"  # the last page out of a slot where one failed: Celery fails the callback, end here
    elif outcome == "success" and not spec.last:
        hand_on(task, s, spec, client, lease, spec.index + 1, strict=True)
        return
    hold_ms = (time.monotonic() - started_at) * 1000
    try:
        mark_ended(client, s, spec)  # before the release: a stale copy never finds the lease free and W unknown
        # The one path that ends a lease and wakes the entity's oldest waiter (_handoff.release); several
        # entities: RELEASE_MULTI frees every one still ours and wakes each freed entity's oldest waiter.
        if isinstance(lease, MultiLease):
            released, _, woken = multi.release(client, lease, s.key_prefix, reserve_ms=handoff.reserve_ms())
            handoff.wake(task.app, s, woken, task.name, req.id, client)
        else:
            released = handoff.release(task.app, s, client, spec.key, lease.token, task.name, req.id)
    except Exception as exc:  # noqa: BLE001 - the body's outcome stands; the lease expires by its TTL
        lease.released = True
        error, woken = multi.split(exc)  # Cluster: the entities freed before or after the error still wake
        emit("lock.backend_unavailable", task.name, **fields, reason=f"release: {_describe(error)}")
        handoff.wake(task.app, s, woken, task.name, req.id, client)
        return
    lease.released = True
    observe_hold(spec.name, hold_ms)
    if outcome == "success":
        event = "workflow.released" if released == 1 else "lock.expired_before_release"
    else:
        event = "workflow.released_on_error" if released == 1 else "lock.expired_before_release"
    emit(event, task.name, **fields, fence=lease.fence_field, hold_ms=round(hold_ms), reason=outcome)


def abort(client: Any, s: Settings, spec: Spec, task_id: Any, app: Any = None) -> bool:
    """WORKFLOW_ABORT for the member ``task_id`` (a gap waiting for its slot freed, its running lease cut to the
    shorten grace), then WORKFLOW_END if it ended the lease: True if it did."""
    args = [spec.id, keys.meta(str(task_id)), int(s.shorten_grace * 1000), spec.slot]
    names = [keys.lock_name(s.key_prefix, k) for k in spec.entities]
    ended = bool(scripts.workflow_abort(client, names, args))
    if ended:
        mark_ended(client, s, spec)
        # Freed (a gap) or cut to the grace (a running member): either way its end wakes each entity's oldest waiter.
        if app is not None:
            for key in spec.entities:
                handoff.wake_if_free(app, s, key, spec.name, str(task_id))
                handoff.wake_later(app, s, key, s.shorten_grace + 0.05, spec.name, str(task_id))
    return ended


def mark_ended(client: Any, s: Settings, spec: Spec) -> None:
    """WORKFLOW_END: remember that workflow ``spec.id`` ended, so a stale copy of a member is dropped, not re-run."""
    scripts.workflow_end(
        client, [keys.workflows_ended_name(s.key_prefix, spec.key)], [spec.id, int(ENDED_WINDOW * 1000)]
    )


def hand_on(
    task: Any,
    s: Settings,
    spec: Spec,
    client: Any,
    lease: Lease,
    index: int,
    strict: bool = False,
    gap_ms: int = 0,
    waits_on: str = "",
    final: bool = False,
    failed: bool = False,
    left: bool = False,
) -> bool:
    """WORKFLOW_PASS: the lease waits ``gap_ttl`` for the member at ``index``; False (and said) if no longer ours.

    ``gap_ms``: a longer gap the next copy needs (a delayed copy's countdown plus the publish grace,
    :func:`covering_ms`). ``waits_on``: the entity this member waits for with its own lock (a wait copy),
    recorded for :func:`check_lock_order`. A chord's page leaves its slot instead (WORKFLOW_LEAVE;
    ``final``: it ended for good, ``failed``: it failed, ``left``: it left already, for a retry whose
    retries ran out); the last page out of a slot where one failed
    sets ``lease.slot_failed`` and leaves the lease to the caller to end.

    ``strict``: the caller is about to publish the member at ``index`` (the chain's next step, or a
    retry). If Redis could not be reached, that member would find the lease still ``running`` at
    this one and be dropped as a stale copy, leaving the chain hanging with no result: raise
    ``BackendUnavailable`` instead, so this member fails and the chain stops visibly (the lease, no
    longer renewed, frees within its TTL).
    """
    req = task.request
    fields = _fields(spec, req.id)
    renewer().untrack(lease)
    name = [keys.lock_name(s.key_prefix, k) for k in spec.entities]
    gap = gap_ms_for(spec.gap_ms, gap_ms)
    try:
        if spec.parallel:  # one of a chord's header: leave the slot; the last one out hands it on
            flags = ["1" if final else "", "1" if failed else "", spec.width, "1" if left else ""]
            running = int(scripts.workflow_leave(client, name, [lease.token, spec.slot, gap, *flags]))
            if running == -2:
                lease.slot_failed = True  # type: ignore[attr-defined]
                return True
            handed = running >= 0
            index = spec.index
        else:
            handed = bool(scripts.workflow_pass(client, name, [lease.token, slot(index), gap, waits_on]))
    except Exception as exc:  # the lease is no longer renewed: it frees within its TTL
        emit("lock.backend_unavailable", task.name, **fields, reason=f"hand on: {_describe(exc)}")
        lease.released = True
        lease.handed_to = index  # type: ignore[attr-defined]
        if strict:
            raise BackendUnavailable(
                f"task {task.name!r}: lock store unavailable handing {spec.key!r} on to member {index} of "
                f"workflow {spec.name!r}: {_describe(exc)}"
            ) from exc
        return False
    lease.released = True
    lease.handed_to = index  # type: ignore[attr-defined]
    if handed:
        emit("workflow.handed_over", task.name, **fields, fence=lease.fence_field, next_member=index)
    else:
        emit("workflow.lost", task.name, **fields, reason="lease_gone_at_hand_over")
        # Under this delivery's own token only (a take-over's fresh token is not ours), and a page counted
        # out already (``left``) is not counted out again.
        forfeit(task, s, spec, client, "leave" if spec.parallel else "pass", lease.token, left)
    return handed


def forfeit(task: Any, s: Settings, spec: Spec, client: Any, who: str, token: str, left: bool = False) -> None:
    """The workflow lost one of its entities (a forced release, an expiry): end it, and free the others.

    Its scripts are all or none, so with one entity gone they write nothing, and the entities still its own
    would stay held (gap or running) until ``gap_ttl`` or ``lock_ttl``, their waiters with them. WORKFLOW_FORFEIT
    names those nothing of it runs under any more (``who``: ``enter``, ``pass``, ``leave``; ``token``: the
    caller's lease token, ``""`` for a member entering; ``left``: a chord page already counted out); they are released
    by their token, each waking its oldest waiter, once the workflow is marked ended (so no stale member
    copy starts it again). One entity: nothing to do (its loss is the whole lease). Never raises: what it
    cannot free lapses by its TTL.
    """
    if len(spec.entities) < 2:
        return
    names = [keys.lock_name(s.key_prefix, k) for k in spec.entities]
    req = task.request
    try:
        flat = scripts.workflow_forfeit(client, names, [spec.id, who, token, "1" if left else ""])
        if not flat:
            return
        mark_ended(client, s, spec)
        for i in range(0, len(flat), 2):
            key = spec.entities[int(flat[i]) - 1]
            handoff.release(task.app, s, client, key, str(flat[i + 1]), task.name, str(req.id))
    except Exception as exc:  # noqa: BLE001 - the member's own outcome stands; the entities lapse by their TTL
        fields = _fields(spec, req.id)
        emit("lock.backend_unavailable", task.name, **fields, reason=f"forfeit: {_describe(exc)}")


def gap_ms_for(gap_ttl_ms: int, covering: int) -> int:
    """The gap WORKFLOW_PASS / WORKFLOW_LEAVE give the next copy: the workflow's ``gap_ttl``, or longer to cover
    a delayed copy (``covering``: :func:`covering_ms` of its countdown)."""
    return max(gap_ttl_ms, covering)


def covering_ms(countdown: float | None) -> int:
    """The gap a hand-over to a copy due in ``countdown`` seconds must last: the countdown plus the publish grace.

    DESIGN, "a hand-over covers its countdown": a wait behind another holder's long TTL, or a retry after
    ``default_retry_delay`` (180 s), would otherwise find the lease gone (``LockLost``), or let other work in.
    """
    return 0 if countdown is None else int((max(countdown, 0.0) + claims.PUBLISH_GRACE) * 1000)


def before_self_republish(task: Any, strict: bool = False, countdown: float | None = None) -> None:
    """A member publishing its own next copy (a retry, a wait): hand the workflow lease to that copy first.

    Before, not after: the copy may be delivered at once, and it must find ``gap`` with ``next`` = its
    slot, not its own id still running (it would be dropped as a duplicate of a running delivery). The
    gap lasts at least the copy's ``countdown`` plus the publish grace (:func:`covering_ms`).
    """
    lease: Lease | None = getattr(task.request, WORKFLOW_LEASE, None)
    if lease is None or lease.released:
        return
    spec = member_of(task.request, task.name)
    if spec is None:
        return
    s = settings(task.app)
    waits_on = str(getattr(lease, "waits_on", "") or "")  # set by check_lock_order for this wait only
    lease.waits_on = ""  # type: ignore[attr-defined]
    gap = covering_ms(countdown)
    hand_on(task, s, spec, connection.client(s), lease, spec.index, strict=strict, gap_ms=gap, waits_on=waits_on)


#: Most entities :func:`check_lock_order` follows from one wait (a longer cycle is left to its gap TTL).
LOCK_ORDER_HOPS = 8


def check_lock_order(task: Any, key: str) -> None:
    """A member about to wait for its own lock on ``key`` while its workflow holds another entity: refuse a cycle.

    Waiting would deadlock when ``key`` is held by a workflow whose member waits (``waits_on`` in its
    lease, written by WORKFLOW_PASS at that member's wait) for our workflow's entity, directly or through
    other workflows: every one of them sits in ``gap`` with no body running, each wait lengthening the
    others' gaps. The member that finds the cycle fails with :class:`WorkflowDeadlock` naming the entities;
    its workflow ends and releases, so the others go on. Otherwise ``key`` is recorded as what this
    member waits for, for a member of another workflow to find. Best effort: an unreachable Redis skips
    the check (the wait then behaves as before).
    """
    req = task.request
    lease: Lease | None = getattr(req, WORKFLOW_LEASE, None)
    if lease is None or lease.released or key in lease.keys:
        return
    spec = member_of(req, task.name)
    if spec is None or spec.parallel:
        return
    ours = set(spec.entities)
    s = settings(task.app)
    lease.waits_on = key  # type: ignore[attr-defined]
    cycle, at = [spec.key], key
    try:
        client = connection.client(s)
        names = [keys.lock_name(s.key_prefix, k) for k in spec.entities]
        scripts.workflow_waits_on(client, names, [lease.token, key])
        for _ in range(LOCK_ORDER_HOPS):
            holder, waits_on = (
                _text(v) for v in client.hmget(keys.lock_name(s.key_prefix, at), "workflow", "waits_on")
            )
            if not holder or not waits_on or holder == spec.id:
                return
            cycle.append(at)
            if waits_on in ours:  # several entities: a wait for any of ours closes the cycle
                break
            if waits_on in cycle:
                return  # a cycle that does not pass through us: its own members find it
            at = waits_on
        else:
            return
    except Exception as exc:
        if errors.classify(exc) is None:
            raise
        return
    fields = _fields(spec, req.id)
    emit("workflow.deadlock", task.name, **fields, waits_for=key, cycle=">".join(cycle))
    raise WorkflowDeadlock(key, spec.key, cycle)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


def on_retry(task: Any, options: dict[str, Any], delay: float | None = None) -> None:
    """``retry()`` of a member: the retry message keeps the workflow header, and gets the lease first.

    ``delay``: seconds until the retry is due (countdown, eta or ``default_retry_delay``): the lease
    waits for it that long plus the publish grace, not just the gap TTL.
    """
    req = task.request
    try:
        spec = member_of(req, task.name)
    except ConfigurationError:  # not a header workflow() wrote: the delivery itself refused it (or never read it)
        return
    if spec is None:
        return
    options["headers"] = {**(options.get("headers") or {}), headers.WORKFLOW: spec.header()}
    # strict: a retry published after a failed hand-over would find its own id still running and be dropped
    before_self_republish(task, strict=True, countdown=delay)


def abort_from_main(task: Any, request: Any, terminated: bool, reason: str | None = None) -> bool:
    """The worker's main process: a member revoked while queued, or terminated while running, ends its workflow's lease.

    Queued (waiting in the gap for it): freed at once. Running (terminated, or past its hard time
    limit): cut to the shorten grace, since the child may not be dead yet. ``reason`` names the exit
    in the event (default ``terminated`` / ``revoked``). True if it did either.
    """
    found = getattr(request, "request_dict", None) or {}
    value = headers.read(request, headers.WORKFLOW) or found.get(headers.WORKFLOW)
    if value is None:
        return False
    try:
        spec = Spec.from_header(value, getattr(task, "name", "?"))
    except ConfigurationError:
        return False
    s = settings(task.app)
    grace_ms = int(s.shorten_grace * 1000)
    fields = _fields(spec, request.id)
    try:
        ended = abort(connection.client(s), s, spec, request.id, task.app)
    except Exception as exc:
        if errors.classify(exc) is None:
            raise
        emit("lock.backend_unavailable", task.name, **fields, reason=f"abort: {_describe(exc)}")
        return False
    if ended:
        reason = reason or ("terminated" if terminated else "revoked")
        emit("workflow.released_on_error", task.name, **fields, reason=reason, grace_ms=grace_ms if terminated else 0)
    return ended


def _fields(spec: Spec, task_id: Any) -> dict[str, Any]:
    """The fields every workflow event of a member carries: the entity, the member's id and its workflow."""
    return {"lock_key": spec.key, "task_id": task_id, "workflow_id": spec.id, "workflow": spec.name}


def _describe(exc: BaseException | None) -> str:
    return f"{exc.__class__.__name__}: {exc}" if exc is not None else ""
