"""Quantities and messages as text (lorascope/units.py)."""

from __future__ import annotations

from lorascope.units import group_named, short_error


def test_an_error_reads_without_cpp_source_locations_and_is_cut_at_a_word() -> None:
    text = (
        "RuntimeError('[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:1971: Connection reset by peer.\\nThis is typically caused by a remote worker')"
    )
    assert short_error(text, 500) == (
        "RuntimeError('Read error [127.0.0.1]:1971: Connection reset by peer.\\nThis is typically caused by a "
        "remote worker')"
    )
    assert short_error(text, 60) == "RuntimeError('Read error [127.0.0.1]:1971: Connection reset ..."
    assert short_error("a\n  b [x.py:3] c", 20) == "a b [x.py:3] c"  # one line; a Python location stays


def test_a_group_torch_numbered_is_named_a_group() -> None:
    """torch names the groups after the default one "1", "2": a verdict read "all_reduce
    #1 on 2"."""
    assert group_named("2") == "group 2"
    assert group_named("default_pg") == "default_pg"
    assert group_named("tp-2") == "tp-2"
