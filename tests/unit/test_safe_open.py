"""Opening untrusted files (rundir/safe_open.py) and the manifest writes that never raise
(rundir/writer.py), in process: the edges the hostile-input suite does not reach."""

from __future__ import annotations

import gzip
import os
import random
from pathlib import Path

import pytest

from lorascope.errors import BadInputError
from lorascope.rundir.format import limits
from lorascope.rundir.format.limits import LimitError
from lorascope.rundir.format.safe_open import (
    _open_beneath,
    json_depth,
    leaves,
    maybe_too_deep,
    open_regular,
    read_capped,
    read_capped_cut,
)
from lorascope.rundir.format.writer import record_launch, record_ranks

MIB = 1 << 20


def _data(kind: str, n: int) -> bytes:
    if kind == "random":
        return random.Random(n).randbytes(n)
    if kind == "zeros":
        return bytes(n)
    return (b"step 1 loss 2.5\n" * (n // 16 + 1))[:n]


@pytest.mark.parametrize("n", [0, 1, MIB - 1, MIB, MIB + 1, 3 * MIB + 17])
@pytest.mark.parametrize("kind", ["random", "zeros", "text"])
def test_read_capped_matches_gzip_on_every_member_and_edge(tmp_path: Path, n: int, kind: str) -> None:
    data = _data(kind, n)
    path = tmp_path / "f.gz"
    path.write_bytes(gzip.compress(data) + gzip.compress(data[:5]) + b"\x00" * 8)  # two members, then padding
    assert bytes(read_capped(path, "json_bytes", "it")) == gzip.decompress(path.read_bytes())
    path.write_bytes(data)
    assert bytes(read_capped(path, "json_bytes", "it")) == data


def test_read_capped_refuses_truncated_and_corrupt_gzip(tmp_path: Path) -> None:
    whole = gzip.compress(_data("text", 100_000))
    path = tmp_path / "f.gz"
    for cut in (3, 10, len(whole) // 2, len(whole) - 1):
        path.write_bytes(whole[:cut])
        with pytest.raises(BadInputError, match="truncated|not a readable gzip"):
            read_capped(path, "json_bytes", "it")
    path.write_bytes(whole + b"garbage after the member")
    with pytest.raises(BadInputError, match="not a readable gzip"):
        read_capped(path, "json_bytes", "it")


def test_read_capped_stops_at_the_limit_naming_the_flag(tmp_path: Path) -> None:
    path = tmp_path / "f.gz"
    path.write_bytes(gzip.compress(bytes(8 * MIB)))
    before = limits.current()
    try:
        limits.configure(json_bytes=4 * MIB)
        with pytest.raises(LimitError, match=r"over the 4 MiB limit \(raise it with `lorascope --max-json-size"):
            read_capped(path, "json_bytes", "the trace")
        limits.configure(json_bytes=8 * MIB)
        assert len(read_capped(path, "json_bytes", "the trace")) == 8 * MIB
    finally:
        limits.configure(json_bytes=before.json_bytes)


def test_configure_changes_what_describe_says() -> None:
    before = limits.current()
    try:
        limits.configure(json_bytes=3 * (1 << 29), log_lines=None)
        assert limits.describe("json_bytes").startswith("the 1.5 GiB limit")
        assert limits.current().log_lines == before.log_lines
        with pytest.raises(ValueError, match="unknown limits"):
            limits.configure(nope=1)
    finally:
        limits.configure(**{k: getattr(before, k) for k in limits.FLAGS})


def test_only_regular_files_open(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(BadInputError, match="a FIFO, not a regular file"):
        open_regular(fifo)  # would block forever without O_NONBLOCK
    with pytest.raises(BadInputError, match="a character device"):
        open_regular("/dev/null")
    with pytest.raises(BadInputError, match="a directory"):
        open_regular(tmp_path)
    (tmp_path / "ok").write_bytes(b"x")
    with open_regular(tmp_path / "ok") as f:
        assert f.read() == b"x"


def test_json_depth_ignores_brackets_in_strings() -> None:
    assert json_depth(b'{"a": [1, {"b": "[[[[{{{{"}]}') == 3
    assert json_depth(b'"\\"[[["') == 0
    assert not maybe_too_deep(b'{"s": "' + b"[" * 500 + b'"}', 64)
    assert maybe_too_deep(b"[" * 65 + b"]" * 65, 64)
    assert not maybe_too_deep(b"[" * 64 + b"]" * 64, 64)


def test_leaves_sees_symlinks_out_and_loops(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    (root / "in").write_text("x")
    (root / "link-in").symlink_to(root / "in")
    (root / "link-out").symlink_to("/etc/hostname")
    (root / "loop").symlink_to(root / "loop")
    assert not leaves(root, root / "link-in")
    assert leaves(root, root / "link-out")
    assert leaves(root, root / "loop")
    assert leaves(root, root / "..")


def test_a_file_in_its_folder_opens_as_resolved(tmp_path: Path) -> None:
    """open_regular(inside=FOLDER) of a file right in FOLDER takes a short way (no
    resolving) for a plain file; a symlink there is still followed only inside."""
    root = tmp_path / "run"
    root.mkdir()
    (root / "in").write_text("x")
    (root / "link-in").symlink_to(root / "in")
    (root / "link-out").symlink_to(tmp_path / "out")
    (tmp_path / "out").write_text("secret")
    for name in ("in", "link-in"):
        with open_regular(root / name, inside=root) as f:
            assert f.read() == b"x"
    with pytest.raises(BadInputError, match="out of the run directory"):
        open_regular(root / "link-out", inside=root)
    with pytest.raises(BadInputError, match="no such file|No such file"):
        open_regular(root / "gone", inside=root)


def test_manifest_writes_never_raise(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the run directory should be")
    assert record_launch(blocker / "run", "h-1", ["job"]) is False
    assert record_ranks(blocker, {"0": {"pid": 1}}) is False
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("lorascope: warning: cannot record the") for line in err)
    assert record_launch(tmp_path / "run", "h-1", ["job"]) is True
    assert not list((tmp_path / "run").glob(".manifest.json.*.tmp"))


def test_read_capped_cut_keeps_what_a_cut_gzip_holds(tmp_path: Path) -> None:
    data = _data("text", 300_000)
    whole = gzip.compress(data)
    path = tmp_path / "f.gz"
    path.write_bytes(whole[: len(whole) // 2])
    held, cut = read_capped_cut(path, "json_bytes", "it")
    assert cut and 0 < len(held) < len(data) and data.startswith(bytes(held))
    path.write_bytes(whole)
    assert read_capped_cut(path, "json_bytes", "it") == (bytearray(data), False)


def test_a_symlink_swapped_in_after_the_check_is_not_followed(tmp_path: Path) -> None:
    """open_regular(inside=) resolves the path, then opens it component by component with
    O_NOFOLLOW: a folder or file replaced by a symlink in between fails, not followed."""
    root, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    (root / "ranks").mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / "f").write_text("secret")
    (root / "ranks" / "f").write_text("ok")
    parts = ["ranks", "f"]  # as resolved before the swap
    os.close(_open_beneath(str(root), parts, os.O_RDONLY))
    (root / "ranks" / "f").unlink()
    (root / "ranks" / "f").symlink_to(elsewhere / "f")
    with pytest.raises(OSError):
        _open_beneath(str(root), parts, os.O_RDONLY)
    (root / "ranks" / "f").unlink()
    (root / "ranks").rmdir()
    (root / "ranks").symlink_to(elsewhere)
    with pytest.raises(OSError):
        _open_beneath(str(root), parts, os.O_RDONLY)
