"""How fast, and in how much memory, lorascope analyses a large allocator snapshot,
next to torch's own tool on the same file.

    python benchmarks/snapshot_speed.py                      # ~1 GiB snapshot in a temp dir
    python benchmarks/snapshot_speed.py --size-mb 200 --keep /tmp/snap.pickle

Writes a synthetic snapshot in the format ``torch.cuda.memory._dump_snapshot`` writes
(pickle protocol 4, framed and memoized as ``pickle.dump`` writes it; one device trace of
alloc / free_requested / free_completed / segment_alloc entries ending in an ``oom``, with
``time_us``, ``compile_context``, ``user_metadata``; segments with blocks for the final
state; ``allocator_settings``; stacks of C++ unwind frames then Python frames, the frame
dicts shared between stacks as torch shares them, one stack list per entry). It is
streamed to disk, so the generator's own memory stays small. The one liberty: the trace
is written before the segments (a dict's key order; readers do not care), so the
segments can show the final state without a second pass.

Then runs each tool in its own process and reports wall time, CPU time and peak RSS
(``getrusage`` of the child): ``lorascope analyze FILE`` (text discarded) and
``python -m torch.cuda._memory_viz stats FILE``.
"""

from __future__ import annotations

import argparse
import bisect
import pickle
import random
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import BinaryIO

MiB = 1 << 20
FRAME_TARGET = 64 * 1024
SITE = "/opt/conda/lib/python3.11/site-packages"
SIZES = [512, 4096, 65536, 2 * MiB, 12 * MiB, 48 * MiB, 250 * MiB]


class PickleWriter:
    """Protocol-4 opcodes, memoized and framed the way the C pickler writes them."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.f.write(b"\x80\x04")
        self.buf = bytearray()
        self.memo = 0
        self.shared: dict[str, int] = {}

    def commit(self) -> None:
        """Between two complete values: write a frame once enough is buffered."""
        if len(self.buf) >= FRAME_TARGET:
            self.flush()

    def flush(self) -> None:
        if self.buf:
            self.f.write(b"\x95" + len(self.buf).to_bytes(8, "little") + self.buf)
            self.buf = bytearray()

    def memoize(self) -> int:
        self.buf += b"\x94"
        self.memo += 1
        return self.memo - 1

    def get(self, idx: int) -> None:
        self.buf += b"h" + bytes([idx]) if idx < 256 else b"j" + idx.to_bytes(4, "little")

    def string(self, s: str) -> int:
        raw = s.encode()
        self.buf += (b"\x8c" + bytes([len(raw)]) if len(raw) < 256 else b"X" + len(raw).to_bytes(4, "little")) + raw
        return self.memoize()

    def shared_string(self, s: str) -> None:
        """A string object torch reuses (dict keys, action names): written once, then referenced."""
        if s in self.shared:
            self.get(self.shared[s])
        else:
            self.shared[s] = self.string(s)

    def integer(self, v: int) -> None:
        if 0 <= v < 256:
            self.buf += b"K" + bytes([v])
        elif 0 <= v < 65536:
            self.buf += b"M" + v.to_bytes(2, "little")
        elif -(1 << 31) <= v < (1 << 31):
            self.buf += b"J" + v.to_bytes(4, "little", signed=True)
        else:
            raw = pickle.encode_long(v)  # type: ignore[attr-defined]
            self.buf += b"\x8a" + bytes([len(raw)]) + raw

    def dict_start(self) -> None:
        self.buf += b"}"
        self.memoize()
        self.buf += b"("


class Stacks:
    """Frames (dicts written inline the first time, referenced after) and stacks of them."""

    def __init__(self, rng: random.Random, n_frames: int = 3000, n_stacks: int = 6000, depth: int = 48) -> None:
        cpp = [
            ("??", 0, n)
            for n in (
                "torch::unwind::unwind()",
                "torch::CapturedTraceback::gather(bool, bool, bool)",
                "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(signed char, unsigned long, "
                "CUstream_st*)",
                "at::native::empty_cuda(...)",
                "at::_ops::empty_strided::call(...)",
                "_PyEval_EvalFrameDefault",
            )
        ]
        pkgs = [
            "torch/nn/modules",
            "transformers/models/llama",
            "peft/tuners/lora",
            "deepspeed/runtime/zero",
            "torch/optim",
            "accelerate",
            "torch/utils",
        ]
        py = [
            (f"{SITE}/{pkgs[i % len(pkgs)]}/module_{i % 211}.py", 10 + i % 900, f"function_{i}")
            for i in range(n_frames)
        ]
        self.frames = cpp + py
        self.memo_of: dict[int, int] = {}
        #: A stack's bytes once all its frames are written (then it is only references).
        self.ready: dict[int, bytes] = {}
        self.stacks = [
            list(range(len(cpp))) + rng.sample(range(len(cpp), len(self.frames)), depth - len(cpp))
            for _ in range(n_stacks)
        ]

    def write(self, w: PickleWriter, s: int) -> None:
        """A new list object per entry, as torch builds one per traceback."""
        w.buf += b"]"
        w.memoize()
        w.buf += b"("
        ready = self.ready.get(s)
        if ready is not None:
            w.buf += ready
            return
        mark = len(w.buf)
        known = all(i in self.memo_of for i in self.stacks[s])
        for i in self.stacks[s]:
            idx = self.memo_of.get(i)
            if idx is not None:
                w.get(idx)
                continue
            filename, line, name = self.frames[i]
            w.buf += b"}"
            self.memo_of[i] = w.memoize()
            w.buf += b"("
            w.shared_string("name")
            w.string(name)
            w.shared_string("filename")
            w.string(filename)
            w.shared_string("line")
            w.integer(line)
            w.buf += b"u"
        w.buf += b"e"
        if known:
            self.ready[s] = bytes(w.buf[mark:])


class Workload:
    """Training-like steps: many short-lived activations, a few that stay, one OOM at the end."""

    def __init__(self, w: PickleWriter, rng: random.Random) -> None:
        self.w, self.rng = w, rng
        self.stacks = Stacks(rng)
        self.free: dict[int, list[int]] = {s: [] for s in SIZES}
        self.live: dict[int, tuple[int, int]] = {}
        self.segments: list[list[int]] = []  # [address, total, used]
        self.next_segment = 0x7F00_0000_0000
        self.now = 1_716_000_000_000_000
        self.entries = 0

    def entry(self, action: str, addr: int, size: int, stack: int | None) -> None:
        w = self.w
        self.now += self.rng.randint(1, 40)
        w.dict_start()
        for key, value in (("action", None), ("addr", addr), ("size", size), ("stream", 0), ("time_us", self.now)):
            w.shared_string(key if not (key == "addr" and action == "oom") else "device_free")
            if value is None:
                w.shared_string(action)
            else:
                w.integer(value)
        w.shared_string("compile_context")
        w.string("N/A")
        w.shared_string("user_metadata")
        w.shared_string("")
        if stack is not None:
            w.shared_string("frames")
            self.stacks.write(w, stack)
        w.buf += b"u"
        self.entries += 1

    def alloc(self, size: int) -> int:
        if self.free[size]:
            addr = self.free[size].pop()
        else:
            seg = self.segments[-1] if self.segments else None
            if seg is None or seg[2] + size > seg[1]:
                total = max(20 * MiB, -(-size // (2 * MiB)) * 2 * MiB)
                seg = [self.next_segment, total, 0]
                self.segments.append(seg)
                self.next_segment += total + 64 * MiB
                self.entry("segment_alloc", seg[0], total, None)
            addr = seg[0] + seg[2]
            seg[2] += size
        stack = self.rng.randrange(len(self.stacks.stacks))
        self.live[addr] = (size, stack)
        self.entry("alloc", addr, size, stack)
        return addr

    def release(self, addr: int) -> None:
        size, stack = self.live.pop(addr)
        self.free[size].append(addr)
        self.entry("free_requested", addr, size, stack)
        self.entry("free_completed", addr, size, stack)

    def run(self, target_bytes: int) -> None:
        w, rng = self.w, self.rng
        w.buf += b"]"
        w.memoize()
        w.buf += b"("  # device_traces: one device
        w.buf += b"]"
        w.memoize()
        batch_start = self.entries
        w.buf += b"("
        while w.f.tell() < target_bytes * 0.95:
            step = [
                self.alloc(rng.choice(SIZES[:5]) if rng.random() < 0.97 else rng.choice(SIZES[5:]))
                for _ in range(rng.randint(150, 250))
            ]
            for addr in step[:-2] if rng.random() < 0.02 else step:
                self.release(addr)
            if self.entries - batch_start >= 1000:
                w.buf += b"e("
                batch_start = self.entries
            w.commit()
        self.entry("oom", 16 * MiB, 250 * MiB, 0)
        w.buf += b"e"  # last batch of entries
        w.buf += b"e"  # the list of devices

    def write_segments(self) -> None:
        w = self.w
        w.buf += b"]"
        w.memoize()
        w.buf += b"("
        by_segment: dict[int, list[int]] = {}
        starts = [s[0] for s in self.segments]
        for addr in sorted(self.live):
            by_segment.setdefault(bisect.bisect_right(starts, addr) - 1, []).append(addr)
        for i, (address, total, _) in enumerate(self.segments):
            w.dict_start()
            for key, value in (("device", 0), ("address", address), ("total_size", total), ("stream", 0)):
                w.shared_string(key)
                w.integer(value)
            w.shared_string("segment_type")
            w.shared_string("large")
            w.shared_string("is_expandable")
            w.buf += b"\x89"
            w.shared_string("blocks")
            w.buf += b"]"
            w.memoize()
            w.buf += b"("
            cursor = address
            for addr in by_segment.get(i, []) + [address + total]:
                if addr > cursor:
                    self._block(cursor, addr - cursor, "inactive", None)
                if addr == address + total:
                    break
                size, stack = self.live[addr]
                self._block(addr, size, "active_allocated", stack)
                cursor = addr + size
            w.buf += b"e"
            w.buf += b"u"
            w.commit()
        w.buf += b"e"

    def _block(self, addr: int, size: int, state: str, stack: int | None) -> None:
        w = self.w
        w.dict_start()
        for key, value in (("address", addr), ("size", size), ("requested_size", size)):
            w.shared_string(key)
            w.integer(value)
        w.shared_string("state")
        w.shared_string(state)
        w.shared_string("frames")
        if stack is None:
            w.buf += b"]"
            w.memoize()
        else:
            self.stacks.write(w, stack)
        w.buf += b"u"


def write_snapshot(path: Path, target_bytes: int, seed: int = 0) -> int:
    """Stream a snapshot of about TARGET_BYTES to PATH; returns its trace entry count."""
    with open(path, "wb") as f:
        w = PickleWriter(f)
        load = Workload(w, random.Random(seed))
        w.dict_start()
        w.shared_string("device_traces")
        load.run(target_bytes)
        w.shared_string("segments")
        load.write_segments()
        w.shared_string("allocator_settings")
        w.dict_start()
        for key, value in (
            ("PYTORCH_CUDA_ALLOC_CONF", ""),
            ("max_split_size", -1),
            ("garbage_collection_threshold", 0.0),
            ("expandable_segments", False),
        ):
            w.shared_string(key)
            if isinstance(value, bool):
                w.buf += b"\x89"
            elif isinstance(value, float):
                w.buf += b"G" + struct.pack(">d", value)
            elif isinstance(value, int):
                w.integer(value)
            else:
                w.shared_string(value)
        w.buf += b"u"
        w.shared_string("external_annotations")
        w.buf += b"]"
        w.memoize()
        w.buf += b"u."
        w.flush()
        return load.entries


#: Runs a command and prints its wall time, CPU time and peak RSS: a fresh parent per
#: measurement, since getrusage(RUSAGE_CHILDREN) keeps the largest child ever waited for.
_MEASURE = """
import resource, subprocess, sys, time
start = time.perf_counter()
proc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
wall = time.perf_counter() - start
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
tail = proc.stderr.strip().splitlines()[-1][:200] if proc.stderr.strip() else ""
print(wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024, proc.returncode, tail, sep="\t")
"""


def measure(cmd: list[str]) -> tuple[float, float, float, int, str]:
    """(wall s, CPU s, peak RSS MiB, exit status, last stderr line) of CMD."""
    out = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], capture_output=True, text=True, check=True)
    wall, cpu, rss, rc, tail = (out.stdout.rstrip("\n").split("\t") + [""])[:5]
    return float(wall), float(cpu), float(rss), int(rc), tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="snapshot size to generate (MiB)")
    parser.add_argument("--keep", type=Path, default=None, help="write the snapshot here and keep it")
    parser.add_argument("--reuse", action="store_true", help="use the file at --keep if it exists")
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    path = args.keep or Path(tmp.name) / "snapshot.pickle"
    if not (args.reuse and path.exists()):
        start = time.perf_counter()
        entries = write_snapshot(path, args.size_mb * MiB)
        print(
            f"generated {path.stat().st_size / MiB:.0f} MiB, {entries:,} trace entries "
            f"in {time.perf_counter() - start:.0f} s"
        )
    print(f"snapshot: {path} ({path.stat().st_size / MiB:.0f} MiB)")
    runs = [
        (
            "python -m torch.cuda._memory_viz stats",
            [sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(path)],
        ),
        ("lorascope analyze", [sys.executable, "-m", "lorascope", "analyze", str(path)]),
    ]
    print(f"{'tool':<42} {'wall s':>8} {'CPU s':>8} {'peak RSS MiB':>13}")
    for name, cmd in runs:
        wall, cpu, rss, rc, tail = measure(cmd)
        status = "" if rc == 0 else f"   exit {rc}: {tail}"
        print(f"{name:<42} {wall:>8.1f} {cpu:>8.1f} {rss:>13.0f}{status}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
