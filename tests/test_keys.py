"""Key rendering: injective, bounded, hash-tag safe, bound to the signature."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from celery_lockguard.exceptions import ConfigurationError
from celery_lockguard.keys import MAX_KEY, KeyRenderer, bind, digest, lock_name


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
    k = KeyRenderer(lambda a, b="x": None, sig(two), "t.two", "lock_key")
    with pytest.raises(ConfigurationError, match="callable returned None"):
        k.render({}, (1,), {})


def test_digest_same_for_same_text_and_differs_otherwise() -> None:
    assert digest({"a": 42, "b": 100}) == digest({"a": "42", "b": "100"})
    assert digest({"a": 42, "b": 100}) != digest({"a": 42, "b": 250})


def test_letters_in_literals_are_not_escaped_and_alnum_affixes_stay_injective() -> None:
    assert render("tenant:{a}:sync", "alpha") == "tenant:alpha:sync"
    assert render("{a}x:{b}", "1x", "b") != render("{a}x:{b}", "1", "xb")
