"""Key rendering: injective, bounded, hash-tag safe, bound to the signature."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_lockguard import _keys as keys
from celery_lockguard._keys import MAX_KEY, EmptyField, KeyRenderer, bind, digest, lock_name
from celery_lockguard.exceptions import ConfigurationError


def sig(fn: Any) -> inspect.Signature:
    return inspect.signature(fn)


def two(a: Any, b: Any = "dflt") -> None: ...


def render(template: Any, *args: Any, **kwargs: Any) -> str:
    k = KeyRenderer(template, sig(two), "t.two", "lock_key")
    return k.render(bind(sig(two), args, kwargs), args, kwargs)


def test_separator_inside_values_cannot_collide() -> None:
    assert render("{a}:{b}", "x:y", "z") != render("{a}:{b}", "x", "y:z")
    assert render("{a}-{b}", "x-y", "z") != render("{a}-{b}", "x", "y-z")


def test_values_render_as_text_positional_keyword_and_defaults_alike() -> None:
    assert render("inv:{a}", 42) == render("inv:{a}", "42") == render("inv:{a}", a=42) == "inv:42"
    assert render("{a}:{b}", 1) == "1:dflt"


def test_braces_in_values_cannot_close_the_hash_tag() -> None:
    key = render("t:{a}", "x}y{z")
    assert "{" not in key and "}" not in key
    assert lock_name("lg", key).count("}") == 1


def test_long_values_are_hashed_with_a_readable_prefix_and_stay_distinct() -> None:
    long1, long2 = "a" * 10_000, "a" * 9_999 + "b"
    k1, k2 = render("big:{a}", long1), render("big:{a}", long2)
    assert k1 != k2
    assert k1.startswith("big:aaaa") and len(k1) <= MAX_KEY
    assert "~" in k1
    assert "~" not in render("x:{a}", "~") or render("x:{a}", "~") == "x:%7E"


def test_callable_key_is_escaped_and_bounded() -> None:
    k = KeyRenderer(lambda a, b="x": f"c:{a}:{{{b}}}" + "z" * 500, sig(two), "t.two", "lock_key")
    key = k.render({}, (1,), {})
    assert "{" not in key and "}" not in key and len(key) <= MAX_KEY


@pytest.mark.parametrize(
    ("template", "needle"),
    [
        ("inv:{nope}", "unknown field {nope}"),
        ("inv:{a}{b}", "adjacent fields"),
        ("inv:{a}x{b}", "adjacent fields"),
        ("inv:{a!r}", "bare parameter name"),
        ("inv:{a.b}", "bare parameter name"),
        ("inv:{{a}}", "literal braces"),
        ("inv:{a", "not a valid template"),
        ("", "non-empty"),
        (42, "non-empty str template or a callable"),
    ],
)
def test_bad_templates_name_task_option_and_value(template: Any, needle: str) -> None:
    with pytest.raises(ConfigurationError) as err:
        KeyRenderer(template, sig(two), "billing.charge", "lock_key")
    msg = str(err.value)
    assert "billing.charge" in msg and "lock_key" in msg and repr(template) in msg and needle in msg


def test_callable_returning_non_string_is_an_error() -> None:
    k = KeyRenderer(lambda a, b="x": 42, sig(two), "t.two", "lock_key")
    with pytest.raises(ConfigurationError, match="callable returned 42"):
        k.render({}, (1,), {})


def test_digest_same_for_same_text_and_differs_otherwise() -> None:
    assert digest({"a": 42, "b": 100}) == digest({"a": "42", "b": "100"})
    assert digest({"a": 42, "b": 100}) != digest({"a": 42, "b": 250})


def test_letters_in_literals_are_not_escaped_and_alnum_affixes_stay_injective() -> None:
    assert render("tenant:{a}:sync", "alpha") == "tenant:alpha:sync"
    assert render("{a}x:{b}", "1x", "b") != render("{a}x:{b}", "1", "xb")


# -- empty fields, bounded forms, huge arguments ------------------------------------------


@pytest.mark.parametrize("option", ["lock_key", "idempotency_key"])
def test_a_field_that_renders_empty_is_refused_naming_task_option_and_field(option: str) -> None:
    k = KeyRenderer("{a}", sig(two), "billing.sync", option)
    with pytest.raises(EmptyField) as err:
        k.render(bind(sig(two), ("",), {}), ("",), {})
    assert isinstance(err.value, ConfigurationError)
    msg = str(err.value)
    assert "billing.sync" in msg and option in msg and "{a}" in msg and "empty" in msg
    with pytest.raises(EmptyField, match=r"field \{b\}"):
        render("inv:{a}:{b}", 1, "")
    assert render("inv:{a}", 0) == "inv:0" and render("inv:{a}", False) == "inv:False"  # falsy, not empty


@pytest.mark.parametrize("option", ["lock_key", "idempotency_key"])
def test_a_none_field_is_refused_like_an_empty_one(option: str) -> None:
    """Issue 29 item 6: ``None`` rendered ``inv:None``, the key of the string ``"None"``, for every such call."""
    k = KeyRenderer("inv:{a}:{b}", sig(two), "billing.sync", option)
    with pytest.raises(EmptyField) as err:
        k.render(bind(sig(two), (None, "x"), {}), (None, "x"), {})
    msg = str(err.value)
    assert "billing.sync" in msg and option in msg and "{a}" in msg and "None" in msg
    with pytest.raises(EmptyField, match=r"field \{b\} is None"):
        render("inv:{a}:{b}", 1, None)  # a default of None counts too: render("inv:{a}:{b}", 1, b=None)
    assert render("inv:{a}", "None") == "inv:None"  # the string is a value like any other
    assert render("inv:{a}", {"k": None}) == 'inv:%7B"k"%3Anull%7D'  # inside a container: JSON null


def test_a_callable_key_returning_none_or_empty_is_an_empty_field() -> None:
    """A callable returning ``None`` names no entity: refused like a None field, never "run unlocked"."""
    for returned in (None, ""):
        k = KeyRenderer(lambda a, b="x", r=returned: r, sig(two), "t.two", "lock_key")
        with pytest.raises(EmptyField, match=f"callable returned {returned!r}"):
            k.render({}, (1,), {})


#: Keys of values that fit are a stored format (format v1): they must never change.
V1_KEYS = [
    ("inv:{a}", ("42",), "inv:42"),
    ("inv:{a}", ("x:y z",), "inv:x%3Ay%20z"),
    ("{a}:{b}", ("a~b", "%{}"), "a%7Eb:%25%7B%7D"),
    ("t~{a}~{b}", ("p~q", "r"), "t~p%7Eq~r"),
    ("inv:{a}", ({"k": [1, 2]},), 'inv:%7B"k"%3A[1,2]%7D'),
    ("inv:{a}", ("é\u00a0\ud800",), "inv:é%C2%A0%ED%A0%80"),
    ("inv:{a}", ("z" * 64,), "inv:" + "z" * 64),
    ("{a}:{b}:{c}", ("x" * 64, "y" * 64, "z" * 64), None),  # 194 characters: unbounded
]


def three(a: Any, b: Any, c: Any) -> None: ...


@pytest.mark.parametrize(("template", "args", "expected"), V1_KEYS)
def test_keys_of_values_that_fit_are_byte_identical_to_format_v1(
    template: str, args: tuple[Any, ...], expected: str | None
) -> None:
    k = KeyRenderer(template, sig(three), "t.three", "lock_key")
    padded = (*args, "c", "c")[:3]
    key = k.render(bind(sig(three), padded, {}), padded, {})
    assert key == (expected if expected is not None else ":".join(args))


def test_a_huge_argument_is_hashed_once_not_escaped_whole() -> None:
    import time
    import tracemalloc

    huge = "ab:c " * 2_000_000  # 10 MB, a separator every few characters
    k = KeyRenderer("inv:{a}", sig(two), "t.two", "lock_key")
    tracemalloc.start()
    started = time.perf_counter()
    key = k.render(bind(sig(two), (huge,), {}), (huge,), {})
    elapsed = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert elapsed < 1.0, f"rendering a 10 MB argument took {elapsed:.2f}s"
    assert peak < 64 * 2**20, f"rendering a 10 MB argument allocated {peak / 2**20:.0f} MiB"
    head, digest_part = key[len("inv:") :].split("~")
    assert head == "ab%3Ac%20ab%3Ac%20ab%3Ac%20ab%3" and len(head) == 31  # the v1 readable prefix
    assert len(digest_part) == 32 and int(digest_part, 16) >= 0 and len(key) == len("inv:") + 64
    assert key == k.render({"a": huge}, (huge,), {})
    assert key != k.render({"a": huge + "x"}, (huge + "x",), {})


def test_hashed_forms_use_a_marker_longer_than_any_tilde_run_of_the_template() -> None:
    long = "v" * 100
    plain = render("inv:{a}", long)
    assert plain.count("~") == 1 and len(plain) == len("inv:") + 64
    tilde = render("inv~{a}", long)
    assert "~~" in tilde and "~~~" not in tilde and tilde.startswith("inv~" + "v" * 30)
    double = render("{a}~~{b}", long, "x")
    assert "~~~" in double and double.endswith("~~x")


def test_a_task_whose_key_field_is_empty_fails_before_touching_redis(redis_url: str, prefix: str) -> None:
    import redis
    from celery import Celery

    from celery_lockguard import LockedTask

    app = Celery("emptykey", broker=redis_url, set_as_current=False)
    app.conf.lockguard_key_prefix = prefix
    ran: list[str] = []

    @app.task(base=LockedTask, shared=False, name="tenants.sync", lock_key="{tenant}")
    def sync(tenant: str) -> None:
        ran.append(tenant)

    @app.task(base=LockedTask, shared=False, name="tenants.bill", idempotency_key="bill:{tenant}")
    def bill(tenant: str) -> None:
        ran.append(tenant)

    with pytest.raises(EmptyField, match=r"'tenants.sync': option lock_key='\{tenant\}': field \{tenant\}"):
        sync.apply(args=("",), throw=True)
    with pytest.raises(EmptyField, match=r"'tenants.bill': option idempotency_key='bill:\{tenant\}'"):
        bill.apply(args=("",), throw=True)
    assert ran == []
    assert not list(redis.Redis.from_url(redis_url).scan_iter(match=f"{prefix}:*"))  # no `{}` hash tag written
    sync.apply(args=("acme",), throw=True)
    assert ran == ["acme"]


def test_pattern_matches_every_key_its_template_renders_and_no_other_shape() -> None:
    """``lockguard locks`` names a lone start window's task by it (re-review: the first pattern backtracked
    for minutes over one planted 40 KB key)."""

    def f(account: str, region: str, api: str) -> None: ...

    renderer = KeyRenderer("partner:{account}:region:{region}:api:{api}:budget", inspect.signature(f), "t", "lock_key")
    pattern = renderer.pattern()
    assert pattern is not None
    for values in (
        {"account": "a:b", "region": "eu", "api": "x"},
        {"account": "x" * 500, "region": "é{}%", "api": ":"},
    ):
        assert pattern.fullmatch(renderer.render(values, (), {}))
    assert not pattern.fullmatch("partner:a:region:eu:api:x")  # another shape
    assert not pattern.fullmatch("partner:" + ":region::api:" * 3200 + "!")  # linear: no field spans a separator
    assert KeyRenderer(lambda account, region, api: account, inspect.signature(f), "t", "lock_key").pattern() is None


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)


@given(st.dictionaries(st.text(min_size=1, max_size=8), _values, max_size=5))
def test_the_positional_digest_is_the_bound_arguments_digest(arguments: dict[str, Any]) -> None:
    """A delivery's positional call digests through ``digest_in_order`` (key order made once per task): the
    same canonical text as ``digest`` of the bound arguments, or identical work would stop being a duplicate
    across versions and processes."""
    names, values = tuple(arguments), tuple(arguments.values())
    assert keys.digest_in_order(keys.digest_order(names), values) == keys.digest(arguments)


def test_calls_with_a_none_field_share_no_lease_and_no_record(redis_url: str, prefix: str) -> None:
    """Issue 29 item 6 end to end, through the real tracer on a real Redis: ``charge(None, 100)`` then
    ``charge(None, 250)`` rendered one scope ``invoice:None``: the second failed ``IdempotencyKeyReused``
    (or, with ``"warn"``, was answered with the first one's result). Both are refused before Redis."""
    import redis

    from celery_lockguard import IdempotencyKeyReused, LockedTask

    from .tracer import deliver, make_app

    app = make_app("nonekey", redis_url, prefix)
    ran: list[Any] = []

    @app.task(base=LockedTask, shared=False, name="billing.charge", idempotency_key="invoice:{invoice_id}")
    def charge(invoice_id: Any, amount: int) -> int:
        ran.append((invoice_id, amount))
        return amount

    @app.task(base=LockedTask, shared=False, name="billing.sync", lock_key="invoice:{invoice_id}")
    def sync(invoice_id: Any) -> None:
        ran.append(invoice_id)

    first, second = deliver(charge, (None, 100)), deliver(charge, (None, 250))
    assert not isinstance(second.retval.exception, IdempotencyKeyReused)
    for traced in (first, second):
        assert traced.state == "FAILURE" and isinstance(traced.retval.exception, EmptyField), traced
        assert "'billing.charge': option idempotency_key='invoice:{invoice_id}': field {invoice_id} is None" in str(
            traced.retval.exception
        )
    error = deliver(sync, (None,)).retval.exception
    assert isinstance(error, EmptyField) and "'billing.sync': option lock_key=" in str(error)
    with pytest.raises(EmptyField):
        sync.lock_key_for(None)
    assert ran == []
    assert not list(redis.Redis.from_url(redis_url).scan_iter(match=f"{prefix}:v1:*"))  # no lease, no record
    assert deliver(charge, (42, 100)).retval == 100 and ran == [(42, 100)]


def test_record_scopes_of_tasks_and_namespaces_never_meet_and_keep_the_scope_slot() -> None:
    """Issue 29 item 7: one rendered S is one record per task (``by:<task>:S``), or per named namespace
    (``ns:<name>:S``); task-id scopes are their own. The Redis key keeps S as its hash tag."""
    from celery_lockguard._cluster import slot
    from celery_lockguard._keys import checkpoint_name, done_name, record_key, record_scope, task_scope

    s = "payment:42"
    scopes = [
        record_scope(s, "payments.pay"),
        record_scope(s, "refunds.by_ref"),
        record_scope(s, "x", "payments"),
        record_scope(s, "y", "payments"),
        record_scope("42", "payments.pay:payment"),  # a task name with ":" cannot imitate another task's record
        task_scope("payment:42"),
    ]
    assert scopes[2] == scopes[3] == "ns:payments:payment:42"  # the namespace, not the task, owns it
    assert scopes[0] == "by:payments.pay:payment:42" and scopes[4] == "by:payments.pay%3Apayment:42"
    assert len({scopes[0], scopes[1], scopes[2], scopes[4], scopes[5]}) == 5
    names = {done_name("lg", x) for x in scopes}
    assert len(names) == 5 and done_name("lg", scopes[0]) == "lg:v1:{payment:42}:by:payments.pay:done"
    assert checkpoint_name("lg", scopes[2]) == "lg:v1:{payment:42}:ns:payments:cp"
    assert record_key("lg", scopes[1]) == "lg:v1:{payment:42}:by:refunds.by_ref"  # the PostgreSQL scope column
    assert all(slot(done_name("lg", x)) == slot(lock_name("lg", s)) for x in scopes[:3])  # no extra round trip
    assert done_name("lg", "task:t-1") == "lg:v1:{task:t-1}:done"  # task-id scopes: the format is unchanged
    braces = record_scope(s, "we{ird} name")
    assert "{" not in braces and "}" not in braces and " " not in braces


NFC, NFD, CYRILLIC = "caf\u00e9", "cafe\u0301", "c\u0430fe"  # café as one code point, as e + U+0301; a Cyrillic U+0430


def test_a_value_composed_either_way_names_one_entity_in_nfc() -> None:
    """Issue 30 item 7: NFC and NFD ``café`` were two entities (two leases, two records) that looked alike."""
    assert render("inv:{a}", NFD) == render("inv:{a}", NFC) == "inv:caf\u00e9"
    assert render("inv:{a}", {"n": NFD}) == render("inv:{a}", {"n": NFC})  # a string inside a container
    assert render("inv:{a}", {NFD: 1}) == render("inv:{a}", {NFC: 1})  # and a dict key
    assert render(lambda a, b="x": f"inv:{a}", NFD) == render(lambda a, b="x": f"inv:{a}", NFC)  # a callable's key
    assert digest({"a": NFD}) == digest({"a": NFC})  # the same call, so a duplicate is skipped as one
    assert render("inv:{a}", CYRILLIC) != render("inv:{a}", "cafe")  # another script is another entity


def test_an_entity_key_with_non_ascii_text_is_shown_with_its_ascii_spelling() -> None:
    from celery_lockguard._terminal import entity

    assert entity("inv:42") == "inv:42"
    shown = {entity(f"inv:{v}") for v in (NFC, NFD, CYRILLIC, "cafe")}
    assert len(shown) == 4, shown
    assert entity(f"inv:{NFD}") == f"inv:{NFD} [inv:cafe\\u0301]"
    assert entity(f"inv:{CYRILLIC}") == f"inv:{CYRILLIC} [inv:c\\u0430fe]"
    assert entity("bell\x07\u00e9") == "bell\\x07\u00e9 [bell\\x07\\xe9]"  # control characters escaped first
