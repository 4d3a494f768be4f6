"""The lines of a job log that say what went wrong, as regular expressions.

Each pattern is matched against one line after its rank prefix is removed. Messages are
the ones torch, NCCL, gloo and DeepSpeed print (several versions' wording where it
changed); a line may match several patterns (an OOM line also names other processes).
"""

from __future__ import annotations

import re

#: Rank prefixes launchers add: torchrun ``[rank3]:``, its ``--tee`` role prefix
#: ``[default3]:``, the DeepSpeed/pdsh ``host: [rank3]:``.
RANK_PREFIX = re.compile(r"^(?:[\w.-]+:\s+)?\[(?:rank|default)(\d+)\]:\s?")

#: ``WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600024 ms``
WATCHDOG = re.compile(
    r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+)"
    r"(?:, NumelIn=(?P<numel_in>\d+))?(?:, NumelOut=(?P<numel_out>\d+))?"
    r"(?:, Timeout\(ms\)=(?P<timeout_ms>\d+))?\)(?: ran for (?P<ran_ms>\d+) milliseconds)?"
)
#: The watchdog's progress line (several wordings across torch versions).
NCCL_PROGRESS = re.compile(
    r"(?:work(?: sequence id)?: (?P<at>\d+)[,.]?\s*(?:PG status: )?)?"
    r"last enqueued (?:NCCL )?work: (?P<enqueued>\d+),? last completed (?:NCCL )?work: (?P<completed>\d+)"
)
PG_NAME = re.compile(r"\[PG(?: ID)? (?P<pg>\d+)(?: PG GUID \S+?)?(?:\((?P<desc>[^)]*)\))?")
GLOO_TIMEOUT = re.compile(r"Timed out waiting (?P<timeout_ms>\d+)ms for (?P<what>\w+) operation")
GLOO_SIZE_MISMATCH = re.compile(r"Received data size doesn't match expected size")

SIZE = r"(\d+(?:\.\d+)?) ?([KMGT]i?B|bytes|B)"
OOM = re.compile(r"CUDA out of memory\. Tried to allocate " + SIZE)
OOM_FIELDS: dict[str, re.Pattern[str]] = {
    "total_capacity": re.compile(r"total capacity of " + SIZE + r"|" + SIZE + r" total capacity"),
    "free": re.compile(r"of which " + SIZE + r" is free|" + SIZE + r" free[;)]"),
    "process_in_use": re.compile(r"this process has " + SIZE + r" memory in use"),
    "allocated_by_pytorch": re.compile(SIZE + r" is allocated by PyTorch|" + SIZE + r" already allocated"),
    "reserved_unallocated": re.compile(SIZE + r" is reserved by PyTorch but unallocated"),
    "reserved_total": re.compile(SIZE + r" reserved in total by PyTorch"),
    # torch.cuda.set_per_process_memory_fraction's cap ("... memory in use. 170.00 MiB allowed;")
    "allowed": re.compile(SIZE + r" allowed"),
}
OOM_GPU = re.compile(r"GPU (\d+)")
OTHER_PROCESS = re.compile(r"Process (\d+) has " + SIZE + r" memory in use")

NO_INPUT_GRAD = re.compile(r"None of the inputs have requires_grad=True")
#: What a backward says when reentrant checkpointing left nothing to differentiate
#: (DeepSpeed ZeRO's misleading message, and plain torch's).
NO_GRAD_ERROR = re.compile(r"loss must be a scalar tensor|element 0 of tensors does not require grad")
CACHE_FLUSHES = re.compile(r"(\d+) pytorch allocator cache flushes since last step")
EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?(?P<type>[A-Z]\w*(?:Error|Exception|Interrupt))(?::\s*(?P<msg>.*))?$")

#: Lines that show a text file is a job's log (timestamps, log levels, tracebacks, the
#: trainers' progress lines) even when none of the patterns above occurs in it; source
#: code or a README has none of these at the start of a line.
LOG_MARKERS = re.compile(
    r"^\[?\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}|^[IWEF]\d{4} \d{2}:\d{2}:\d{2}|"
    r"\[(?:INFO|WARNING|WARN|ERROR|DEBUG|CRITICAL)\]|^(?:INFO|WARNING|ERROR|DEBUG|CRITICAL)[: ]|"
    r"^Traceback \(most recent call last\)|\{'loss': |\d(?:it/s|s/it)\]"
)

_UNITS = {
    "B": 1,
    "bytes": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KiB": 1 << 10,
    "MiB": 1 << 20,
    "GiB": 1 << 30,
    "TiB": 1 << 40,
}


def bytes_of(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit])


def size_bytes(match: re.Match[str] | None) -> int | None:
    """Bytes from the first (number, unit) group pair that matched."""
    if match is None:
        return None
    groups = match.groups()
    for i in range(0, len(groups) - 1, 2):
        if groups[i] is not None:
            return bytes_of(groups[i], groups[i + 1])
    return None
