"""Deliver a message through Celery's real (non-eager) tracer, in this process, as a worker child does.

``Task.apply()`` runs the eager path (``request.is_eager``: waits sleep in
process, nothing is published); a worker child runs ``build_tracer(...)``
with ``eager=False``, publishing waits, watches and retries to the broker.
These helpers drive that path and read what it published from the broker's
queue (a Redis list under the test's key prefix).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery, uuid
from celery.app.trace import build_tracer

from celery_lockguard.testing import settle

HOSTNAME = "tracer@lockguard-test"


def make_app(name: str, broker: str, prefix: str, **conf: Any) -> Celery:
    """An app on the real Redis broker, every key (kombu's and results') under ``prefix``."""
    app = Celery(name, broker=broker, backend=broker, set_as_current=False)
    app.conf.update(
        task_default_queue=f"{prefix}-q",
        lockguard_key_prefix=prefix,
        lockguard_socket_timeout=0.5,
        broker_transport_options={"global_keyprefix": f"{prefix}:kombu:"},
        result_backend_transport_options={"global_keyprefix": f"{prefix}:results:"},
        task_publish_retry=False,
    )
    app.conf.update(conf)
    return app


@dataclass
class Traced:
    """One delivery's outcome: Celery's state for it and what the body returned or raised."""

    task_id: str
    state: str
    retval: Any


@dataclass
class Message:
    """A message the runtime published, as a worker would receive it."""

    task_id: str
    task: str
    args: list[Any]
    kwargs: dict[str, Any]
    headers: dict[str, Any] = field(default_factory=dict)
    #: The canvas the message carries (Celery's embed: chain, chord, callbacks, errbacks).
    embed: dict[str, Any] = field(default_factory=dict)

    def custom(self) -> dict[str, Any]:
        return {k: v for k, v in self.headers.items() if k.startswith("lockguard_")}


def deliver(
    task: Any,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    task_id: str | None = None,
    headers: dict[str, Any] | None = None,
    retries: int = 0,
    chain: list[Any] | None = None,
    parent_id: str | None = None,
) -> Traced:
    """Run one delivery through the real tracer (custom headers arrive as request attributes, as on a worker)."""
    task_id = task_id or uuid()
    kwargs = kwargs or {}
    request = {
        "id": task_id,
        "task": task.name,
        "args": list(args),
        "kwargs": kwargs,
        "hostname": HOSTNAME,
        "retries": retries,
        "is_eager": False,
        "root_id": task_id,
        "parent_id": parent_id,
        "delivery_info": {"exchange": "", "routing_key": task.app.conf.task_default_queue, "redelivered": False},
        "chain": chain,
        **(headers or {}),
    }
    tracer = build_tracer(task.name, task, app=task.app, eager=False, propagate=False)
    retval = tracer(task_id, list(args), kwargs, request)[0]
    settle()  # the RELEASE reply a worker reads with its next command: its events are part of this delivery
    return Traced(task_id, task.app.AsyncResult(task_id).state, retval)


def redeliver(task: Any, msg: Message) -> Traced:
    """Deliver a message read from the queue."""
    return deliver(
        task,
        tuple(msg.args),
        msg.kwargs,
        task_id=msg.task_id,
        headers=msg.custom(),
        parent_id=msg.headers.get("parent_id"),
    )


def redeliver_with_canvas(task: Any, msg: Message) -> Traced:
    """Deliver a message read from the queue with the canvas it carries, as a worker reads it (a chord's page
    counts its part and publishes the callback; a chain's member publishes the next)."""
    canvas = {k: msg.embed.get(k) for k in ("chord", "callbacks", "errbacks")}
    group = {k: msg.headers.get(k) for k in ("group", "group_index", "root_id")}
    return deliver(
        task,
        tuple(msg.args),
        msg.kwargs,
        task_id=msg.task_id,
        headers={**msg.custom(), **canvas, **group},
        chain=msg.embed.get("chain"),
        parent_id=msg.headers.get("parent_id"),
    )


def published(r: redis.Redis, app: Celery) -> list[Message]:
    """Every message in the app's default queue, oldest first (the queue is left as it is)."""
    prefix = app.conf.broker_transport_options["global_keyprefix"]
    out = []
    for raw in reversed(r.lrange(f"{prefix}{app.conf.task_default_queue}", 0, -1)):
        payload = json.loads(raw)
        body = json.loads(base64.b64decode(payload["body"]))
        h = payload["headers"]
        out.append(Message(h["id"], h["task"], body[0], body[1], h, body[2] or {}))
    return out
