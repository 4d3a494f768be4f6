"""Format validation: what passes, and every way a record or manifest is refused."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from lorascope.rundir.format.schema import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LAUNCH_FIELDS,
    MANIFEST_FILE,
    SchemaError,
    validate_manifest,
    validate_record,
)
from lorascope.rundir.format.writer import record_launch, record_ranks

START = {
    "k": "start",
    "t": 1.0,
    "rank": 0,
    "world_size": 2,
    "local_rank": 0,
    "pid": 10,
    "host": "h",
    "argv": [],
    "versions": {},
    "device": "cpu",
}
SHAPE = {
    "k": "shape",
    "t": 2.0,
    "id": 0,
    "op": "all_reduce",
    "dtype": "float32",
    "async": False,
    "site": None,
    "via": None,
}
LAUNCH = {
    "id": "h-1",
    "host": "h",
    "pid": 1,
    "command": ["torchrun"],
    "cwd": "/",
    "start": 1.0,
    "end": None,
    "exit_status": None,
}

COLL_ERR = {"k": "coll_err", "t": 2.5, "index": 7, "gid": 0, "seq": 8, "err": "RuntimeError('x')"}
CALLS_FILE = {"k": "calls_file", "t": 1.0, "file": "h-1.calls", "how": "mmap", "head": 16, "ring": 64}


def test_valid_records_pass() -> None:
    assert validate_record(START)
    assert validate_record(SHAPE)
    assert validate_record(COLL_ERR)
    assert validate_record(CALLS_FILE)
    assert validate_record({"k": "dropped", "t": 3, "records": 12})
    assert validate_record({"k": "end", "t": 3, "status": "exit", "code": 0})


def test_unknown_kind_is_not_an_error() -> None:
    assert validate_record({"k": "from-the-future", "t": 1.0}) is False


@pytest.mark.parametrize(
    "record, message",
    [
        ([1, 2], "JSON list"),
        ({"t": 1.0}, "lacks its kind"),
        ({"k": "mem", "step": 0, "rss": 1, "src": "x"}, "lacks its time"),
        ({"k": "mem", "t": True, "step": 0, "rss": 1, "src": "x"}, "lacks its time"),
        ({**SHAPE, "id": "1"}, "'id' is str"),
        ({**SHAPE, "dtype": 4.5}, "'dtype' is float"),
        ({**SHAPE, "async": 0}, "'async' is int"),
        ({**START, "rank": True}, "'rank' is a bool"),
        ({k: v for k, v in SHAPE.items() if k != "op"}, "lacks the field 'op'"),
        ({k: v for k, v in SHAPE.items() if k != "via"}, "'shape' record lacks the field 'via'"),
        ({k: v for k, v in COLL_ERR.items() if k != "index"}, "'coll_err' record lacks the field 'index'"),
        ({k: v for k, v in COLL_ERR.items() if k != "err"}, "'coll_err' record lacks the field 'err'"),
        ({**COLL_ERR, "index": None}, "'index' is NoneType"),
        ({**COLL_ERR, "index": True}, "'index' is a bool"),
        ({**COLL_ERR, "err": 3}, "'err' is int"),
        ({**CALLS_FILE, "ring": "64"}, "'ring' is str"),
        ({"k": "dropped", "t": 1.0, "records": "7"}, "'records' is str"),
        ({"k": "dropped", "t": 1.0}, "lacks the field 'records'"),
        ({"k": "end", "t": 1.0, "status": "vanished", "code": None}, "status 'vanished'"),
    ],
)
def test_invalid_records_are_refused(record: object, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        validate_record(record)


def test_valid_manifest_passes_unchanged() -> None:
    manifest = {"format": FORMAT_NAME, "version": 1, "launches": [LAUNCH], "ranks": {"0": {"pid": 10}}}
    kept = copy.deepcopy(manifest)
    assert validate_manifest(manifest) is None  # nothing normalised: readers see the file as written
    assert manifest == kept


def test_the_writers_manifest_passes(tmp_path: Path) -> None:
    """What `lorascope run` writes (record_launch, record_ranks) is what the check accepts."""
    record_launch(tmp_path, "h-1", ["torchrun", "train.py"])
    record_launch(tmp_path, "h-1", ["torchrun", "train.py"], end=2.0, exit_status=0)
    record_ranks(tmp_path, {"0": {"pid": 10, "host": "h"}})
    manifest = json.loads((tmp_path / MANIFEST_FILE).read_text())
    assert manifest["format"] == FORMAT_NAME and manifest["version"] == FORMAT_VERSION
    assert [launch["exit_status"] for launch in manifest["launches"]] == [0]
    validate_manifest(manifest)


@pytest.mark.parametrize("name", sorted(LAUNCH_FIELDS))
def test_every_launch_field_is_required(name: str) -> None:
    """The negative twin of the valid manifest: drop any one field of its launch and it is refused."""
    launch = {k: v for k, v in LAUNCH.items() if k != name}
    with pytest.raises(SchemaError, match=f"launch #0 lacks the field '{name}'"):
        validate_manifest({"format": FORMAT_NAME, "version": 1, "launches": [launch]})


@pytest.mark.parametrize(
    "manifest, message",
    [
        ("text", "not a JSON object"),
        ({"format": "other", "version": 1, "launches": []}, "not a lorascope run manifest"),
        ({"format": FORMAT_NAME, "version": "1", "launches": []}, "integer 'version'"),
        ({"format": FORMAT_NAME, "version": 1}, "'launches' list"),
        ({"format": FORMAT_NAME, "version": 1, "launches": [3]}, "launch #0 is not an object"),
        ({"format": FORMAT_NAME, "version": 1, "launches": [{**LAUNCH, "pid": "1"}]}, "'pid' is str"),
    ],
)
def test_invalid_manifests_are_refused(manifest: object, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        validate_manifest(manifest)
