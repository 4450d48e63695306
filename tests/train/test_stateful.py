"""A checkpoint's metadata is the union of the registered parts: each writes its keys and reads them
back, in registration order (a restore may keep named parts as they are); two parts may not write
one key."""

from __future__ import annotations

import pytest

from apr.train.stateful import StateRegistry


def test_parts_write_their_keys_and_read_them_back_in_order():
    seen: list[str] = []
    counter = {"n": 3}
    reg = StateRegistry()
    reg.register("a", lambda: {"a": counter["n"]}, lambda meta: seen.append(f"a={meta['a']}"))
    reg.register("recorded", lambda: {"schedule": {"step": 7}})  # written, never read back
    reg.register("b", lambda: {"b1": 1, "b2": 2}, lambda meta: seen.append(f"b={meta['b1'] + meta['b2']}"))
    meta = reg.state_dict()
    assert meta == {"a": 3, "schedule": {"step": 7}, "b1": 1, "b2": 2}
    counter["n"] = 4  # parts are read at save time, not at registration
    assert reg.state_dict()["a"] == 4
    reg.load_state_dict(meta)
    assert seen == ["a=3", "b=3"]


def test_a_part_name_or_key_used_twice_is_refused():
    reg = StateRegistry()
    reg.register("a", lambda: {"x": 1})
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a", lambda: {"y": 1})
    reg.register("b", lambda: {"x": 2})
    with pytest.raises(ValueError, match="'b' writes keys another part wrote: \\['x'\\]"):
        reg.state_dict()


def test_a_load_may_keep_named_parts_as_they_are_and_refuses_a_name_no_part_has():
    seen: list[str] = []
    reg = StateRegistry()
    reg.register("data", lambda: {"cursor": 5}, lambda meta: seen.append(f"cursor={meta['cursor']}"))
    reg.register("mine", lambda: {"mine": 1}, lambda meta: seen.append(f"mine={meta['mine']}"))
    reg.load_state_dict(reg.state_dict(), skip=("data",))
    assert seen == ["mine=1"]
    with pytest.raises(ValueError, match="no stateful part named \\['cursr'\\]"):
        reg.load_state_dict(reg.state_dict(), skip=("cursr", "mine"))
    assert seen == ["mine=1"]  # refused before any part is read
