"""Quantities and messages as text (lorascope/units.py)."""

from __future__ import annotations

from lorascope.units import short_error


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
