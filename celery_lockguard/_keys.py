"""Entity keys: bind a call's arguments to the task's signature and render a key.

The rendered key K names a business object (``invoice:48291``). Three rules make
it safe to use as a lock name:

* Injective: a value is rendered as text, then every separator (a
  non-alphanumeric character of the template's literal text, and ``% { } ~``,
  whitespace, control characters) is percent-encoded, and a template whose two
  fields are not parted by a separator is refused. The separators then mark
  where each value ends, so parsing a key back is unambiguous. So
  ``"{a}:{b}"`` with ``("x:y", "z")`` and ``("x", "y:z")`` render
  differently, and no value can forge the hash tag's closing brace.
* Bounded: a value whose escaped text is longer than :data:`MAX_PART` keeps a
  readable prefix, a marker and a SHA-256 digest of the *raw* text (so a huge
  argument is hashed once and only its kept prefix is escaped); a whole key
  longer than :data:`MAX_KEY` keeps a prefix, the marker and a digest of the
  key. The marker is a run of ``~`` one longer than any run in the template's
  literal text (``~`` when it has none, the v1 shape). A value never renders a
  ``~`` (it is escaped) and a field never renders empty, so no key of plain
  values contains the marker: a hashed key cannot be imitated by plain values
  around a literal ``~``, and the two digests are domain-separated, so a
  hashed part cannot imitate a bounded key either.
* Hash-tag safe: a field that renders empty is refused (:class:`EmptyField`);
  ``lock_key="{tenant}"`` with ``""`` would name ``...:{}:lock``, an empty hash
  tag, and put the lease, fence and claim of one entity in different Cluster
  slots.
* One entity per key: a field whose value is ``None`` is refused like an empty
  one (:class:`EmptyField`). ``str(None)`` is ``"None"``, the key of the string
  ``"None"``: every call missing its value would share one lease and one
  completion record. ``None`` inside a dict or list renders as JSON ``null``
  there, part of a container's text, and stays allowed.

How a value becomes text (:func:`text`, the documented rule): a ``str`` is
itself; ``dict``, ``list``, ``tuple``, ``set`` and ``frozenset`` render as
compact JSON with dict keys sorted and sets sorted (so a set names the same
entity in every process, whatever its hash seed); anything else is ``str()``.
An object whose ``str()`` shows a memory address (``<Foo object at 0x...>``)
names a different entity in every process, so a key refuses it with
``ConfigurationError``. Text is normalised to Unicode NFC (every ``str`` leaf, and what a key
callable returns): ``"café"`` typed as one code point or as ``e`` and a combining accent names one
entity. Look-alikes of other scripts (a Cyrillic U+0430) stay distinct; the operator's views show a
non-ASCII key beside its escaped spelling (``_terminal.entity``). Lone surrogates (possible in JSON input) are
percent-encoded like separators, so every key encodes as strict UTF-8.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import string
import unicodedata
from collections.abc import Callable, Mapping
from typing import Any

from .exceptions import ConfigurationError, EmptyField, UnstableText

MAX_PART = 64
MAX_KEY = 200
#: Longest holder metadata (task id, task name, worker, host) written into a lease hash.
MAX_META = 256
_DIGEST_CHARS = 32
_ALWAYS_ESCAPED = "%{}~"
#: Domain of the per-value digest: a brace, which no rendered key contains, so a value's
#: digest can never equal the digest of a whole key (``bound``).
_PART_DOMAIN = b"{part}"
_MAX_DEPTH = 64
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")

KeySource = str | Callable[..., str]


def text(value: Any, strict: bool = True) -> str:
    """Render one argument as text: ``42`` and ``"42"`` name the same entity.

    ``strict`` refuses objects whose ``str()`` carries a memory address
    (:class:`UnstableText`); the arguments digest passes ``False``, since such
    a value there only means "never a duplicate", which is safe.
    """
    if isinstance(value, str):
        return _nfc(value)
    if isinstance(value, (dict, list, tuple, set, frozenset)):
        return _json(value, strict, 0)
    out = _nfc(str(value))
    if strict and _ADDRESS.search(out):
        raise UnstableText(
            f"argument of type {type(value).__qualname__} renders as {out[:80]!r}, which differs in every "
            "process; give it a __str__ or pass its id"
        )
    return out


def _nfc(value: str) -> str:
    """``value`` in Unicode NFC: one spelling per text, whichever way the caller's input composed it."""
    return value if value.isascii() else unicodedata.normalize("NFC", value)


def _json(value: Any, strict: bool, depth: int) -> str:
    """Compact JSON, dict keys sorted, sets sorted; ``str()`` for other leaves (``json.dumps(default=str)``)."""
    if depth > _MAX_DEPTH:
        raise UnstableText(f"argument nested deeper than {_MAX_DEPTH} levels")
    if isinstance(value, dict):
        try:
            items = sorted(value.items(), key=lambda kv: kv[0])
            pairs = [(_json_key(k, strict), v) for k, v in items]
        except TypeError:  # keys json.dumps(sort_keys=True) cannot order (mixed types)
            pairs = sorted(((_json_key(k, strict), v) for k, v in value.items()), key=lambda kv: kv[0])
        return "{" + ",".join(f"{json.dumps(k)}:{_json(v, strict, depth + 1)}" for k, v in pairs) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_json(v, strict, depth + 1) for v in value) + "]"
    if isinstance(value, (set, frozenset)):
        return "[" + ",".join(sorted(_json(v, strict, depth + 1) for v in value)) + "]"
    if isinstance(value, str):
        return json.dumps(_nfc(value))
    if value is None or isinstance(value, (int, float, bool)):
        return json.dumps(value)
    return json.dumps(text(value, strict))


def _json_key(key: Any, strict: bool) -> str:
    """A dict key as ``json.dumps`` writes it (``True`` → ``true``), else its text."""
    if isinstance(key, str):
        return _nfc(key)
    if key is None or isinstance(key, (bool, int, float)):
        return json.dumps(key)
    return text(key, strict)


def meta(value: str, limit: int = MAX_META) -> str:
    """Holder metadata bounded to ``limit`` characters (a readable prefix and a digest beyond)."""
    return value if len(value) <= limit else _hashed(value, limit)


def _hashed(value: str, limit: int) -> str:
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_CHARS]
    return f"{value[: limit - _DIGEST_CHARS - 1]}~{digest}"


def _value_digest(value: str) -> str:
    """Digest of a raw value (domain-separated from whole-key digests), hashed in one pass."""
    h = hashlib.sha256(_PART_DOMAIN)
    h.update(value.encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:_DIGEST_CHARS]


def _escaper(extra: str, limit: int = MAX_PART, marker: str = "~") -> Callable[[str], str]:
    """Percent-encode separators; past ``limit``, keep an escaped prefix, ``marker`` and a digest of the raw value.

    Only ``value[:limit]`` is ever escaped: escaping never shortens text, so a
    longer value is hashed anyway, and a 10 MB argument costs one SHA-256 pass.
    Values whose escaped text fits render exactly as in format v1.
    """
    chars = "".join(sorted(set(_ALWAYS_ESCAPED + extra)))
    pattern = re.compile(f"[{re.escape(chars)}\\s\\x00-\\x1f\\x7f\\ud800-\\udfff]")
    keep = max(1, limit - _DIGEST_CHARS - len(marker))

    def encode(match: re.Match[str]) -> str:
        return "".join(f"%{b:02X}" for b in match.group().encode("utf-8", "surrogatepass"))

    def escape(value: str) -> str:
        if len(value) <= limit:
            escaped = pattern.sub(encode, value)
            if len(escaped) <= limit:
                return escaped
        head = pattern.sub(encode, value[:keep])[:keep]
        return f"{head}{marker}{_value_digest(value)}"

    return escape


def bound(key: str, marker: str = "~") -> str:
    """Cap a whole key at :data:`MAX_KEY` characters: a prefix, ``marker`` and a digest of the key."""
    if len(key) <= MAX_KEY:
        return key
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_CHARS]
    return f"{key[: max(0, MAX_KEY - _DIGEST_CHARS - len(marker))]}{marker}{digest}"


def _marker(literal: str) -> str:
    """A run of ``~`` longer than any in the template's literal text: plain values can never render it."""
    longest = max((len(run) for run in re.findall("~+", literal)), default=0)
    return "~" * (longest + 1)


class KeyRenderer:
    """A validated ``lock_key`` / ``idempotency_key``: a template or a callable.

    Built once per task; :meth:`render` runs on every call, so the template is
    parsed and checked here, not there.
    """

    def __init__(self, source: KeySource, signature: inspect.Signature, task_name: str, option: str) -> None:
        self.source = source
        self.task_name = task_name
        self.option = option
        self._escape_callable = _escaper("", MAX_KEY)
        if callable(source):
            self._parts: list[tuple[str, str | None]] = []
            return
        if not isinstance(source, str) or not source:
            raise ConfigurationError(
                f"task {task_name!r}: option {option}={source!r} must be a non-empty str template or a callable"
            )
        params = set(signature.parameters)
        parts: list[tuple[str, str | None]] = []
        literal_chars = ""
        previous_field = False
        try:
            parsed = list(string.Formatter().parse(source))
        except ValueError as exc:
            raise ConfigurationError(
                f"task {task_name!r}: option {option}={source!r} is not a valid template: {exc}"
            ) from exc
        for literal, field, spec, conversion in parsed:
            if "{" in literal or "}" in literal:
                raise ConfigurationError(
                    f"task {task_name!r}: option {option}={source!r}: literal braces would break the hash tag"
                )
            separators = "".join(c for c in literal if not c.isalnum())
            if separators:
                previous_field = False
            literal_chars += separators
            if field is None:
                parts.append((literal, None))
                continue
            if not field.isidentifier() or spec or conversion:
                raise ConfigurationError(
                    f"task {task_name!r}: option {option}={source!r}: field {{{field}}} must be a bare parameter name"
                )
            if field not in params:
                raise ConfigurationError(
                    f"task {task_name!r}: option {option}={source!r}: unknown field {{{field}}}; "
                    f"parameters are {sorted(params)}"
                )
            if previous_field:
                raise ConfigurationError(
                    f"task {task_name!r}: option {option}={source!r}: adjacent fields need a separator "
                    "(a non-alphanumeric character between them) or two calls could render the same key"
                )
            parts.append((literal, field))
            previous_field = True
        self._parts = parts
        self._separators = literal_chars
        self._marker = _marker("".join(literal for literal, _ in parts))
        self._escape = _escaper(literal_chars, MAX_PART, self._marker)

    def pattern(self) -> re.Pattern[str] | None:
        """A regex every key this template renders fully matches (the reader beside the format); None for a callable.

        A field matches text without the template's separators (rendering escapes them in values), so
        matching is linear, and a key of another template with the same shape matches too: an
        operator's view (``lockguard locks``) uses it to name an entity's task, never a lease decision.
        """
        if callable(self.source):
            return None
        value = f"[^{re.escape(self._separators)}]+" if self._separators else ".+"
        return re.compile(
            "".join(re.escape(literal) + ("" if name is None else value) for literal, name in self._parts)
        )

    @property
    def template(self) -> str:
        """The template text, or the callable's qualified name (for describe)."""
        if callable(self.source):
            return f"<callable {getattr(self.source, '__qualname__', repr(self.source))}>"
        return self.source

    def checked(self, value: Any) -> str:
        """A callable's returned key, checked and escaped (a str naming one entity)."""
        if value is None or value == "":
            # Like a template's empty or None field: it names no entity. Not "no lock": a task that
            # may run unlocked has no lock_key, and a lock silently dropped per call would be a hole.
            raise EmptyField(
                f"task {self.task_name!r}: option {self.option} callable returned {value!r}, "
                "expected a non-empty str: it names no entity; pass a value or guard the call"
            )
        if not isinstance(value, str):
            raise ConfigurationError(
                f"task {self.task_name!r}: option {self.option} callable returned {value!r}, expected a non-empty str"
            )
        return self._escape_callable(_nfc(value))

    def render(self, arguments: Mapping[str, Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """Render the key for one call: ``arguments`` is the bound signature."""
        if callable(self.source):
            return self.checked(self.source(*args, **kwargs))
        out = []
        for literal, field in self._parts:
            out.append(literal)
            if field is not None:
                raw = arguments[field]
                if raw is None:
                    # str(None) is "None", the key of the string "None": every call with a missing value
                    # would share one lease and one completion record.
                    raise EmptyField(
                        f"task {self.task_name!r}: option {self.option}={self.source!r}: field {{{field}}} "
                        "is None; None names no entity (it would render 'None', the key of the string "
                        "'None', shared by every such call): pass a value or guard the call"
                    )
                try:
                    value = text(raw)
                except UnstableText as exc:
                    raise UnstableText(
                        f"task {self.task_name!r}: option {self.option}: field {{{field}}}: {exc}"
                    ) from None
                if not value:
                    raise EmptyField(
                        f"task {self.task_name!r}: option {self.option}={self.source!r}: field {{{field}}} "
                        "rendered empty; an empty value names no entity (and an empty hash tag splits "
                        "the lease, fence and claim across Cluster slots): pass a value or guard the call"
                    )
                out.append(self._escape(value))
        return bound("".join(out), self._marker)


def bind(signature: inspect.Signature, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Bind a call to the task's signature with defaults applied."""
    ba = signature.bind(*args, **kwargs)
    ba.apply_defaults()
    return dict(ba.arguments)


#: ``json.dumps(..., sort_keys=True, separators=(",", ":"))``, the encoder made once (encoders keep no state).
_DIGEST_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"))
_json_str = json.encoder.encode_basestring_ascii


def digest(arguments: Mapping[str, Any]) -> str:
    """A short digest of the call's arguments: same task + same digest = duplicate work."""
    texts = {k: text(v, strict=False) for k, v in arguments.items()}
    if all(type(k) is str for k in texts):
        # What json.dumps(texts, sort_keys=True, separators=(",", ":")) writes, without building an encoder:
        # every key and value is a str, written by encode_basestring_ascii, in key order.
        canonical = "{" + ",".join(f"{_json_str(k)}:{_json_str(v)}" for k, v in sorted(texts.items())) + "}"
    else:
        canonical = _DIGEST_JSON.encode(texts)
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def digest_order(names: tuple[str, ...]) -> tuple[tuple[int, str], ...]:
    """(position, JSON-quoted name) of each parameter, sorted by name: :func:`digest`'s key order."""
    return tuple((i, _json_str(name)) for i, name in sorted(enumerate(names), key=lambda item: item[1]))


def digest_in_order(order: tuple[tuple[int, str], ...], values: tuple[Any, ...]) -> str:
    """:func:`digest` of the arguments ``dict(zip(names, values))``, with the key order made once
    (:func:`digest_order`): the same canonical text, so the same digest."""
    canonical = "{" + ",".join(f"{name}:{_json_str(text(values[i], strict=False))}" for i, name in order) + "}"
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def task_scope(task_id: str) -> str:
    """The completion scope of a task without ``idempotency_key``: its id."""
    return f"task:{_TASK_ID_ESCAPE(task_id)}"


_TASK_ID_ESCAPE = _escaper("", MAX_KEY)
#: A task name in a record scope: ``:`` is escaped too, so the first ``:`` after it ends it.
_TASK_NAME_ESCAPE = _escaper(":", MAX_KEY)
#: An ``idempotency_namespace``: a short plain name (it is written into record keys as it is).
NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")


def record_prefix(task_name: str, namespace: str | None = None) -> str:
    """What precedes an ``idempotency_key`` scope S in its record scope (:func:`record_scope`).

    Keys are injective within one template only: ``"{ref}"`` with ``"payment:42"`` renders the S of
    ``"payment:{invoice}"`` with 42. So a record answers only the task that wrote it
    (``by:<task name>:``), unless tasks declare they share records (``ns:<namespace>:``). Made
    once per task (``TaskOptions.record_prefix``): it is on every delivery's path.
    """
    if namespace is not None:
        return f"ns:{namespace}:"
    return f"by:{_TASK_NAME_ESCAPE(task_name)}:"


def record_scope(scope: str, task_name: str, namespace: str | None = None) -> str:
    """The scope a completion record and its checkpoints are stored under (``done_name``, ``checkpoint_name``,
    the PostgreSQL ``scope`` column) for the ``idempotency_key`` scope S of task ``task_name``.

    ``task:<id>``, ``by:<task>:<S>`` and ``ns:<namespace>:<S>`` never meet: each starts with its own
    word, and neither an escaped task name nor a namespace holds a ``:``. A task-id scope is its own
    record scope (a task id names one task already).
    """
    return record_prefix(task_name, namespace) + scope


def lock_name(prefix: str, key: str) -> str:
    """Redis key of entity K's lease hash; ``{K}`` is the hash tag."""
    return f"{prefix}:v1:{{{key}}}:lock"


def parse_lock_name(prefix: str, name: str) -> str | None:
    """The entity key K of a lease key, slot leases included (the inverse of :func:`slot_lock_name`), else None."""
    parsed = parse_slot_lock_name(prefix, name)
    return parsed[0] if parsed is not None else None


def slot_lock_name(prefix: str, key: str, slot: int) -> str:
    """Redis key of slot ``slot`` of entity K's leases (``lock_limit``): slot 0 is :func:`lock_name` itself.

    Every slot keeps the ``{K}`` hash tag, so all N slots, their fences and the start window live in
    one Cluster slot and one script touches them all. K is escaped (``{``, ``}`` never occur in it),
    so ``}:lock:<i>`` ends the name unambiguously.
    """
    return lock_name(prefix, key) if slot == 0 else f"{prefix}:v1:{{{key}}}:lock:{slot}"


def parse_slot_lock_name(prefix: str, name: str) -> tuple[str, int] | None:
    """``(K, slot)`` of ``{prefix}:v1:{K}:lock`` (slot 0) or ``{prefix}:v1:{K}:lock:<i>``, else None."""
    head = f"{prefix}:v1:{{"
    if not name.startswith(head):
        return None
    body = name[len(head) :]
    if body.endswith("}:lock") and len(body) > len("}:lock"):
        return body[: -len("}:lock")], 0
    entity, sep, slot = body.rpartition("}:lock:")
    if sep and entity and slot.isdigit() and slot == str(int(slot)) and int(slot) > 0:
        return entity, int(slot)
    return None


def slot_fence_name(prefix: str, key: str, slot: int) -> str:
    """Redis key of slot ``slot``'s fence counter: slot 0 is :func:`fence_name`; each slot fences on its own."""
    return fence_name(prefix, key) if slot == 0 else f"{prefix}:v1:{{{key}}}:fence:{slot}"


def fence_row(key: str, slot: int | None) -> str:
    """The row ``advance_fence`` keeps for a lease: K for the single lease and slot 0, ``K#<i>`` for slot i."""
    return key if not slot else f"{key}#{slot}"


def rate_name(prefix: str, key: str) -> str:
    """Redis key of entity K's start window (``lock_rate``): a ZSET token -> start ms, PX = the window."""
    return f"{prefix}:v1:{{{key}}}:rate"


def parse_rate_name(prefix: str, name: str) -> str | None:
    """The entity key K of a start window's key (the inverse of :func:`rate_name`), else None."""
    head, tail = f"{prefix}:v1:{{", "}:rate"
    if name.startswith(head) and name.endswith(tail) and len(name) > len(head) + len(tail):
        return name[len(head) : -len(tail)]
    return None


def workflows_ended_name(prefix: str, key: str) -> str:
    """Redis key of entity K's ended workflows (a sorted set: workflow id -> end time, same slot as its lease).

    A redelivered copy of a member whose workflow already ended (released by its last member, a
    failure, or a revoke) finds its id here and is dropped, instead of starting the workflow again.
    """
    return f"{prefix}:v1:{{{key}}}:wfended"


def fence_name(prefix: str, key: str) -> str:
    """Redis key of entity K's fence counter (same slot as its lease)."""
    return f"{prefix}:v1:{{{key}}}:fence"


def claim_name(prefix: str, key: str) -> str:
    """Redis key of entity K's queue claim (same slot as its lease): an until_started message, or an
    until_done one queued behind different work."""
    return f"{prefix}:v1:{{{key}}}:claim"


def parse_claim_name(prefix: str, name: str) -> str | None:
    """The entity key K of a queue claim's key (the inverse of :func:`claim_name`), else None."""
    head, tail = f"{prefix}:v1:{{", "}:claim"
    if name.startswith(head) and name.endswith(tail) and len(name) > len(head) + len(tail):
        return name[len(head) : -len(tail)]
    return None


def rows_glob(prefix: str, match: str) -> str:
    """The SCAN pattern of the rows ``locks`` lists for entities matching the glob ``match``: ``{K}:lock*`` (leases,
    slot leases) and ``{K}:claim`` in one walk.

    A glob has no alternation; ``[cl][lo][ac]*`` matches ``lock...`` and ``claim`` and no other key kind of an
    entity (fence, wait, waiters, watch, rate, debounce, done, cp, wfended), so SCAN sends back little else; the
    reader drops what :func:`parse_slot_lock_name` and :func:`parse_claim_name` do not parse.
    """
    return f"{prefix}:v1:{{{match}}}:[cl][lo][ac]*"


def watch_name(prefix: str, key: str) -> str:
    """Redis key of entity K's pending-watch marker (same slot as its lease)."""
    return f"{prefix}:v1:{{{key}}}:watch"


def wait_name(prefix: str, key: str) -> str:
    """Redis key of entity K's waiter queue: park tokens, oldest first (same slot as its lease)."""
    return f"{prefix}:v1:{{{key}}}:wait"


def waiters_name(prefix: str, key: str) -> str:
    """Redis key of entity K's waiter entries: message, state and deadline per park token (same slot)."""
    return f"{prefix}:v1:{{{key}}}:waiters"


def _record_parts(record: str) -> tuple[str, str]:
    """``(S, owner)`` of a record scope: ``by:<task>:<S>`` -> ``(S, ":by:<task>")``, the same for ``ns:``;
    any other scope (``task:<id>``) is its own S with no owner."""
    for word in ("by:", "ns:"):
        if record.startswith(word):
            owner, sep, scope = record[len(word) :].partition(":")
            if sep and owner and scope:
                return scope, f":{word}{owner}"
    return record, ""


def record_key(prefix: str, record: str) -> str:
    """``{prefix}:v1:{S}`` and the record's owner (``{prefix}:v1:{S}:by:<task>``): the stem of its Redis keys
    and the PostgreSQL ``scope`` column.

    The owner stays outside the hash tag: a record keeps S's slot, which is the lease's own for a task
    that locks on S (no ``lock_key``), so on Cluster its record is still read and written inside
    ACQUIRE and RELEASE. S has no braces and an owner no ``:``, so the stem parses back unambiguously.
    """
    scope, owner = _record_parts(record)
    return f"{prefix}:v1:{{{scope}}}{owner}"


def done_name(prefix: str, scope: str) -> str:
    """Redis key of the completion record of record scope ``scope`` (:func:`record_scope`, or ``task:<id>``)."""
    return f"{record_key(prefix, scope)}:done"


def checkpoint_name(prefix: str, scope: str) -> str:
    """Redis key of record scope ``scope``'s checkpoint hash (same slot as its record)."""
    return f"{record_key(prefix, scope)}:cp"


#: What follows the hash tag in a debounce record's name (``{prefix}:v1:{K}:debounce:<task name>``).
_DEBOUNCE = "}:debounce:"
#: What follows the task name in the name of a burst's run key.
_DEBOUNCE_RUN = ":run:"


def debounce_name(prefix: str, key: str, task_name: str) -> str:
    """Redis key of task ``task_name``'s debounce record on entity K (same slot as its lease).

    Per task, not per entity: two task types sharing K (``reindex`` and ``notify``) debounce apart,
    and neither can supersede the other's pending run.
    """
    return f"{prefix}:v1:{{{key}}}:debounce:{meta(task_name)}"


def debounce_run_name(prefix: str, key: str, task_name: str, burst: str) -> str:
    """Redis key naming the run a debounce burst ended in (same slot): read by the burst's late messages."""
    return f"{debounce_name(prefix, key, task_name)}{_DEBOUNCE_RUN}{meta(burst)}"


def parse_debounce_name(prefix: str, name: str) -> tuple[str, str] | None:
    """``(K, task name)`` of a debounce record's name (the inverse of :func:`debounce_name`), else None.

    A burst's run key (``...:run:<burst>``) is not a record and parses as None.
    """
    head = f"{prefix}:v1:{{"
    if not name.startswith(head) or _DEBOUNCE not in name:
        return None
    key, _, task_name = name[len(head) :].partition(_DEBOUNCE)
    if not key or not task_name or _DEBOUNCE_RUN in task_name:
        return None
    return key, task_name
