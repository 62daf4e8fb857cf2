"""Hostile input: property-based tests of key rendering, bounded metadata, no unpickling, a narrow release.

Arguments arrive from message bodies anyone with broker access can write, and
entity keys from operators' shells. Whatever they hold, a key must name one
entity (argument tuples that differ as text never share a key), stay short,
stay inside the prefix and its hash tag, and encode as strict UTF-8.
"""

from __future__ import annotations

import ast
import json
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from click.testing import CliRunner
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from celery_lockguard import ConfigurationError, LockedTask
from celery_lockguard import _connection as connection
from celery_lockguard import _lease as L
from celery_lockguard._keys import (
    MAX_KEY,
    MAX_META,
    EmptyField,
    KeyRenderer,
    bind,
    checkpoint_name,
    done_name,
    fence_name,
    lock_name,
    task_scope,
    text,
)

PACKAGE = Path(__file__).resolve().parent.parent / "celery_lockguard"

#: Every code point, lone surrogates included (JSON can carry them: "\ud800").
ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=300)
JSON_LEAVES = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | ANY_TEXT
JSON_VALUES = st.recursive(
    JSON_LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4), max_leaves=12
)
TEMPLATES = ["{a}:{b}", "inv:{a}", "{a}-{b}", "x{a}.{b}y", "tenant:{a}:sync:{b}", "{a}~{b}", "t~~{a}~{b}~"]


def two(a: Any, b: Any = "dflt") -> None: ...


SIG = __import__("inspect").signature(two)


def render(template: str, a: Any, b: Any) -> str:
    k = KeyRenderer(template, SIG, "h.two", "lock_key")
    return k.render(bind(SIG, (a, b), {}), (a, b), {})


def assert_safe_key(prefix: str, key: str, limit: int = MAX_KEY) -> None:
    """One entity key K inside one Redis key: bounded, one hash tag, strict UTF-8, no whitespace."""
    assert 0 < len(key) <= limit
    assert "{" not in key and "}" not in key
    assert not any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in key)
    key.encode("utf-8")  # strict: redis-py would fail on a lone surrogate
    for name in (lock_name(prefix, key), fence_name(prefix, key), done_name(prefix, key)):
        assert name.count("{") == 1 and name.count("}") == 1
        assert name.startswith(f"{prefix}:v1:{{")


@settings(database=None, max_examples=300, deadline=None)
@given(st.sampled_from(TEMPLATES), JSON_VALUES, JSON_VALUES, JSON_VALUES, JSON_VALUES)
@example("{a}:{b}", "x:y", "z", "x", "y:z")
@example("{a}-{b}", "a" * 100, "b", "a" * 100 + "-b", "")
@example("inv:{a}", "\ud800", 0, "%ED%A0%80", 0)
@example("{a}~{b}", "a" * 100, "b", "a" * 31, "b")
def test_argument_tuples_differing_as_text_never_share_a_key(t: str, a1: Any, b1: Any, a2: Any, b2: Any) -> None:
    used = ["a"] if "{b}" not in t else ["a", "b"]
    texts1 = [text(v) for v, n in zip((a1, b1), "ab", strict=True) if n in used]
    texts2 = [text(v) for v, n in zip((a2, b2), "ab", strict=True) if n in used]
    keys = []
    for a, b, texts in ((a1, b1, texts1), (a2, b2, texts2)):
        values = [v for v, n in zip((a, b), "ab", strict=True) if n in used]
        # An empty field names no entity (and, alone, an empty hash tag); None is refused alike (it would be "None").
        if "" in texts or any(v is None for v in values):
            with pytest.raises(EmptyField):
                render(t, a, b)
            return
        keys.append(render(t, a, b))
    for k in keys:
        assert_safe_key("lg", k)
    assert (keys[0] == keys[1]) == (texts1 == texts2)


@settings(database=None, max_examples=200, deadline=None)
@given(JSON_VALUES)
def test_json_arguments_render_exactly_as_format_v1_did(value: Any) -> None:
    # v1 keys are a contract: the same value must keep naming the same entity after an upgrade -- for text in
    # NFC (nearly all input). Text that is not (U+F900, a decomposed accent) renders as its NFC form: the
    # upgrade note in docs/upgrading.md, "Keys of non-NFC text change".
    if isinstance(value, (dict, list)):
        normal = _nfc(value)
        assume(normal is not None)  # two dict keys that NFC makes one: no v1 value to compare with
        assert text(value) == json.dumps(normal, sort_keys=True, separators=(",", ":"), default=str)
        if normal == value:
            assert text(value) == json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    elif not isinstance(value, str):
        assert text(value) == str(value)


def _nfc(value: Any) -> Any:
    """``value`` with every string in NFC; None when two dict keys become one."""
    import unicodedata

    if isinstance(value, str):
        return unicodedata.normalize("NFC", value)
    if isinstance(value, list):
        items = [_nfc(v) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value, strict=True)) else items
    if isinstance(value, dict):
        out = {_nfc(k): _nfc(v) for k, v in value.items()}
        if len(out) != len(value) or any(out[_nfc(k)] is None and v is not None for k, v in value.items()):
            return None
        return out
    return value


@settings(database=None, max_examples=200, deadline=None)
@given(ANY_TEXT.filter(bool), ANY_TEXT.filter(bool))
def test_callable_keys_and_task_id_scopes_are_injective_bounded_and_tag_safe(s1: str, s2: str) -> None:
    k = KeyRenderer(lambda a, b="x": a, SIG, "h.two", "lock_key")
    r1, r2 = k.render({}, (s1,), {}), k.render({}, (s2,), {})
    assert_safe_key("lg", r1)
    assert (r1 == r2) == (s1 == s2)
    t1, t2 = task_scope(s1), task_scope(s2)
    assert_safe_key("lg", t1, limit=MAX_KEY + len("task:"))
    assert (t1 == t2) == (s1 == s2)


def three(a: Any, b: Any, c: Any) -> None: ...


def four(a: Any, b: Any, c: Any, d: Any) -> None: ...


def render_n(fn: Any, template: str, *values: Any) -> str | None:
    """The key of ``values``, or ``None`` when rendering refuses them (a refused key collides with nothing)."""
    sig = __import__("inspect").signature(fn)
    try:
        return KeyRenderer(template, sig, "h.n", "lock_key").render(bind(sig, values, {}), values, {})
    except ConfigurationError:
        return None


def cuts(form: str, literal: str) -> list[tuple[str, str]]:
    """Every way to read ``form`` as two values around ``literal``: what a forger would pass."""
    out = []
    start = form.find(literal)
    while start >= 0:
        out.append((form[:start], form[start + len(literal) :]))
        start = form.find(literal, start + 1)
    return out


ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
LONG_ALNUM = st.text(ALNUM, min_size=65, max_size=300)


@settings(database=None, max_examples=150, deadline=None)
@given(st.sampled_from(["{a}~{b}~{c}", "k~{a}~{b}~{c}~", "{a}~~{b}~~{c}", "{a}-{b}~{c}"]), LONG_ALNUM, LONG_ALNUM)
@example("{a}~{b}~{c}", "x" * 100, "y" * 100)
def test_a_hashed_value_cannot_be_imitated_by_plain_values_around_a_literal_tilde(t: str, x: str, y: str) -> None:
    # A long value renders as a readable prefix, a marker and a digest. The forger reads the hashed forms
    # of x (field a) and y (field c), cuts each at the template's literal text between two fields and
    # passes the pieces as plain values: (x, pieces of y) against (pieces of x, y). In format v1 the
    # marker was a bare "~", the same character as the literal, and "{a}~{b}~{c}" collided.
    pre_a, rest = t.split("{a}")
    lit_ab, rest = rest.split("{b}")
    lit_bc, post = rest.split("{c}")
    kx, ky = render_n(three, t, x, "m", "n"), render_n(three, t, "m", "n", y)
    assert kx is not None and ky is not None
    form_x = kx[len(pre_a) : len(kx) - len(f"{lit_ab}m{lit_bc}n{post}")]
    form_y = ky[len(f"{pre_a}m{lit_ab}n{lit_bc}") : len(ky) - len(post)]
    assert len(form_x) >= 64 and len(form_y) >= 64  # both hashed
    forged_with_x = {render_n(three, t, x, b, c) for b, c in cuts(form_y, lit_bc)} - {None}
    forged_with_y = {render_n(three, t, a, b, y) for a, b in cuts(form_x, lit_ab)} - {None}
    assert not forged_with_x & forged_with_y, (t, forged_with_x & forged_with_y)
    for key in forged_with_x | forged_with_y:
        assert_safe_key("lg", str(key), limit=MAX_KEY + 2)


@settings(database=None, max_examples=150, deadline=None)
@given(
    st.integers(1, 64),
    st.integers(1, 64),
    st.integers(1, 64),
    st.text(ALNUM, min_size=1, max_size=64),
    st.sampled_from(["{a}:{b}:{c}~{d}", "{a}:{b}:{c}~~{d}"]),
)
@example(64, 64, 37, "w" * 64, "{a}:{b}:{c}~{d}")
@example(64, 64, 36, "w" * 64, "{a}:{b}:{c}~~{d}")
def test_a_bounded_key_cannot_be_imitated_by_a_short_one(na: int, nb: int, nc: int, d: str, t: str) -> None:
    # A key longer than MAX_KEY keeps a prefix, a marker and a digest of the key. The forger reads a
    # bounded key, cuts it at every "~" and passes what follows as the last value: in format v1,
    # "{a}:{b}:{c}~{d}" with a 167-character head put the marker exactly where the literal "~" is,
    # and the digest itself was a valid plain value.
    a, b, c = "x" * na, "y" * nb, "z" * nc
    key = render_n(four, t, a, b, c, d)
    assert key is not None and len(key) <= MAX_KEY
    lit = t.split("{c}")[1].split("{d}")[0]
    for head, tail in cuts(key, lit):
        parts = head.split(":")
        if len(parts) != 3:
            continue
        forged = render_n(four, t, *parts, tail)
        if (parts[0], parts[1], parts[2], tail) != (a, b, c, d):
            assert forged != key, (head, tail)


def test_non_json_values_follow_the_documented_rule() -> None:
    class Named:
        def __str__(self) -> str:
            return "named-7"

    assert render("inv:{a}", Named(), 0) == "inv:named-7"
    # Sets render sorted, so every process (whatever its hash seed) names the same entity.
    assert render("inv:{a}", {"b", "a", "c"}, 0) == render("inv:{a}", frozenset("cab"), 0) == 'inv:["a","b","c"]'
    # Dicts whose keys JSON cannot sort together, or cannot write at all, still render, sorted.
    assert text({1: "x", "a": "y", None: 0}) == '{"1":"x","a":"y","null":0}'
    assert text({(1, 2): "t"}) == '{"[1,2]":"t"}'
    assert text(b"raw") == "b'raw'"
    # An object whose str() is its memory address would name a new entity in every process.
    with pytest.raises(ConfigurationError, match=r"h\.two.*lock_key.*field \{a\}.*differs in every process"):
        render("inv:{a}", object(), 0)
    deep: Any = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(ConfigurationError, match="nested deeper"):
        render("inv:{a}", deep, 0)


# -- what reaches Redis --------------------------------------------------------------------


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    a = Celery("hostile", broker="memory://", set_as_current=False)
    a.conf.lockguard_redis_url = redis_url
    a.conf.lockguard_key_prefix = prefix
    yield a


def test_holder_metadata_and_records_are_size_bounded(app: Celery, r: redis.Redis, prefix: str) -> None:
    huge_id = "i" * 100_000
    seen: dict[str, Any] = {}

    @app.task(base=LockedTask, bind=True, shared=False, name="h." + "n" * 5000, lock_key="inv:{a}")
    def t(self: Any, a: str) -> str:
        seen["hash"] = r.hgetall(lock_name(prefix, f"inv:{a}"))
        return "ok"

    assert t.apply(args=("1",), task_id=huge_id).get() == "ok"
    assert seen["hash"] and all(len(v) <= MAX_META for v in seen["hash"].values())
    record = r.get(done_name(prefix, task_scope(huge_id)))
    assert record is not None and len(record) < 2 * 1024
    assert len(done_name(prefix, task_scope(huge_id))) <= len(prefix) + MAX_KEY + 16
    # The redelivery of that id still finds its own record (the bounded forms agree).
    assert t.apply(args=("1",), task_id=huge_id).get() == "ok"
    claim = L.claim(
        r, lock_name(prefix, "q"), token="t", ttl_ms=5000, task_id=huge_id, task_name="n" * 9000, digest="d" * 999
    )
    assert claim.kind == "ok"
    assert all(len(v) <= MAX_META for v in r.hgetall(lock_name(prefix, "q")).values())
    assert L.release_claim(r, lock_name(prefix, "q"), huge_id)  # matched through the same bound


def test_nothing_is_unpickled_anywhere() -> None:
    banned_modules = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "yaml", "jsonpickle"}
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not {a.name.split(".")[0] for a in node.names} & banned_modules, path
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] not in banned_modules, path
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("eval", "exec", "__import__"), f"{path}:{node.lineno}"


class _Boom:
    def __reduce__(self) -> Any:
        return (Path.touch, (Path("/tmp/lockguard-was-unpickled"),))


def test_a_pickle_planted_in_redis_is_never_loaded(app: Celery, r: redis.Redis, prefix: str) -> None:
    marker = Path("/tmp/lockguard-was-unpickled")
    marker.unlink(missing_ok=True)
    payload = pickle.dumps(_Boom(), protocol=0).decode("ascii")
    r.set(done_name(prefix, "task:planted"), payload)
    r.hset(checkpoint_name(prefix, "task:planted-cp"), "step", payload)

    @app.task(base=LockedTask, bind=True, shared=False, name="h.victim", lock_key="v:{a}")
    def t(self: Any, a: int) -> Any:
        return self.checkpoint("step", lambda: "fresh")

    with pytest.raises(ValueError):  # not JSON: the call fails visibly
        t.apply(args=(1,), task_id="planted").get()
    with pytest.raises(ValueError):
        t.apply(args=(2,), task_id="planted-cp").get()
    assert not marker.exists()


# -- lockguard release ---------------------------------------------------------------------


def _release(app: Celery, key: str) -> Any:
    from celery.bin.base import CLIContext

    from celery_lockguard._cli import lockguard

    obj = CLIContext(app=app, no_color=True, workdir=None, quiet=True)
    return CliRunner().invoke(lockguard, ["release", key, "--yes"], obj=obj)


#: Keys per SCAN step in the release test's snapshots (see there).
SCAN_COUNT = 10_000


@settings(database=None, max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.one_of(
        ANY_TEXT.filter(lambda s: "\x00" not in s),
        st.sampled_from(["*", "inv:*", "?", "[a-z]*", "inv:1*", "inv:1}:lock", "{inv:1}", "inv:1 inv:2"]),
    )
)
@example("inv:1")
@example("inv:*")
def test_release_only_ever_deletes_the_one_key_named(app: Celery, r: redis.Redis, prefix: str, key: str) -> None:
    app.conf.lockguard_key_prefix = prefix
    from celery_lockguard._config import reset

    reset(app)
    others = ["inv:1", "inv:2", "inv:*", "a"]
    for k in others:
        if not r.exists(lock_name(prefix, k)):
            hour = 3_600_000
            L.acquire(r, prefix, k, ttl_ms=hour, task_id="t", task_name="n", digest="d", worker="w", fence_ttl_ms=hour)
    # An hour, not a minute: hypothesis runs many examples over the same keys, and on a loaded machine the
    # whole test outlived a 60 s TTL, so keys expired between the two snapshots and looked deleted.
    r.set(done_name(prefix, "inv:1"), "{}", px=3_600_000)
    # SCAN walks the whole shared database whatever the match: COUNT 10 (the default) made each snapshot
    # thousands of round trips once other tests' keys piled up, and under load the 60 examples outlived
    # pytest-timeout (120 s), which hypothesis then reported as a FlakyFailure of whichever example it hit.
    before = {k: r.type(k) for k in r.scan_iter(match=f"{prefix}:*", count=SCAN_COUNT)}
    head, tail = f"{prefix}:v1:{{", "}:lock"
    entity = key[len(head) : -len(tail)] if key.startswith(head) and key.endswith(tail) else key
    _release(app, key)
    after = set(r.scan_iter(match=f"{prefix}:*", count=SCAN_COUNT))
    gone = set(before) - after
    assert gone <= {lock_name(prefix, entity)}, (key, gone)
    created = {k for k in after - set(before) if not k.startswith(f"{prefix}:v1:metrics:{{fleet}}:")}  # its count
    assert created <= {fence_name(prefix, entity)}, (key, created)
    if gone or entity in others:
        assert entity in others and gone == {lock_name(prefix, entity)}, (key, gone)
    connection.forget_clients()
