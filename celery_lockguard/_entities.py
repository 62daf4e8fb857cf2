"""``lock_key`` as several entities: a sequence of templates, or a callable that may return several keys.

A task that touches several business objects (a transfer between two accounts) names each one;
the delivery then holds every entity or none (:mod:`celery_lockguard._multi`). Rendering gives
the entity keys deduplicated (``src == dst`` is one lease) and sorted: one global order, so two
calls naming the same entities in opposite orders take them in the same order on Cluster.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from ._keys import EmptyField, KeyRenderer
from .exceptions import ConfigurationError


def is_sequence(source: Any) -> bool:
    """Whether a ``lock_key`` value is a sequence of templates (a list or tuple; never a str)."""
    return isinstance(source, (list, tuple))


class EntityKeys:
    """A validated multi-entity ``lock_key``: a sequence of templates, or a callable.

    A callable may return one key (a str) or several (a list or tuple of str); either way
    :meth:`render_keys` gives the sorted, deduplicated keys of one call. Shaped like
    :class:`~celery_lockguard._keys.KeyRenderer` where operator views read it (``template``,
    ``pattern``).
    """

    def __init__(self, source: Any, signature: inspect.Signature, task_name: str, option: str = "lock_key") -> None:
        self.source = source
        self.task_name = task_name
        self.option = option
        self._callable: Callable[..., Any] | None = None
        self._members: tuple[KeyRenderer, ...] = ()
        if callable(source):
            self._callable = source
            self._one = KeyRenderer(source, signature, task_name, option)
            return
        if not is_sequence(source) or not source:
            raise ConfigurationError(
                f"task {task_name!r}: option {option}={source!r} must be a non-empty str template, "
                "a non-empty list or tuple of str templates (several entities), or a callable"
            )
        for member in source:
            if not isinstance(member, str) or not member:
                raise ConfigurationError(
                    f"task {task_name!r}: option {option}={source!r}: member {member!r} is not a non-empty "
                    "str template (each member names one entity)"
                )
        try:
            self._members = tuple(KeyRenderer(m, signature, task_name, option) for m in source)
        except ConfigurationError as exc:
            raise ConfigurationError(f"task {task_name!r}: option {option}={source!r}: {exc}") from None

    @property
    def callable(self) -> bool:
        """Whether the keys come from a callable (how many is known per call only)."""
        return self._callable is not None

    @property
    def several(self) -> bool:
        """Whether the templates name more than one entity (a callable: maybe; decided per call)."""
        return self._callable is not None or len(set(self.templates)) > 1

    @property
    def templates(self) -> tuple[str, ...]:
        """The member templates (empty for a callable)."""
        return tuple(m.source for m in self._members)  # type: ignore[misc]

    @property
    def template(self) -> str:
        """The templates joined with ``" + "``, or the callable's qualified name (for describe/stats)."""
        if self._callable is not None:
            return f"<callable {getattr(self._callable, '__qualname__', repr(self._callable))}>"
        return " + ".join(self.templates)

    def pattern(self) -> None:
        """No single pattern matches several entities (operator views fall back to the task name)."""
        return None

    def render_keys(
        self, arguments: Mapping[str, Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[str, ...]:
        """The call's entity keys: rendered, deduplicated and sorted (one global order)."""
        if self._callable is None:
            return tuple(sorted({m.render(arguments, args, kwargs) for m in self._members}))
        value = self._callable(*args, **kwargs)
        if not is_sequence(value):
            return (self._one.checked(value),)
        if not value:
            raise EmptyField(
                f"task {self.task_name!r}: option {self.option} callable returned {value!r}: an empty "
                "sequence names no entity; pass a value or guard the call"
            )
        return tuple(sorted({self._one.checked(v) for v in value}))
