"""The probes/ job (probes/train_lora.py) with two GPU-only settings its own command line
does not have, for benchmarks/gpu_check.sh:

    torchrun --nproc_per_node 2 benchmarks/gpu_job.py --share-gpu -- --engine torch ...
    torchrun --nproc_per_node 1 benchmarks/gpu_job.py --memory-cap-mib 900 -- --fault logits-spike ...

``--share-gpu``: every rank on ``cuda:0`` over gloo with CUDA tensors (NCCL refuses two
ranks on one device; a machine with one GPU can still run a 2-rank job this way).
``--memory-cap-mib``: ``torch.cuda.set_per_process_memory_fraction`` so that the
allocator refuses to reserve more than that: a planted OOM.
``--stall RANK:STEP:SECONDS``: that rank sleeps after that step (on top of any
``--fault``), so the others wait in the next collective: the stall watchdog fires and
``lorascope hang`` has a hung job to ask.

train_lora.py is loaded as it is (its lines stay where the recorded fixtures point):
only its ``setup_distributed`` is replaced, and only with ``--share-gpu``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType

TRAIN = Path(__file__).resolve().parents[1] / "probes" / "train_lora.py"


def load_train_lora() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_lora", TRAIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_lora"] = module
    spec.loader.exec_module(module)
    return module


def share_gpu(train_lora: ModuleType) -> None:
    """Replace the job's device and backend choice: cuda:0 and gloo for every rank."""
    import torch
    import torch.distributed as dist

    def setup_distributed(args: argparse.Namespace) -> object:
        torch.cuda.set_device(0)
        kwargs = {}
        if args.pg_timeout is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=args.pg_timeout)
        dist.init_process_group(backend="gloo", **kwargs)
        # local_rank 0: DDP's device_ids must name the device the rank uses
        return train_lora.Dist(dist.get_rank(), dist.get_world_size(), 0, torch.device("cuda", 0), "gloo")

    train_lora.setup_distributed = setup_distributed


def plant_stall(train_lora: ModuleType, spec: str) -> None:
    rank, step, seconds = spec.split(":")
    original = train_lora.Faults.after_step

    def after_step(self: object, s: int, model: object) -> None:
        original(self, s, model)
        if s == int(step) and self.d.rank == int(rank):  # type: ignore[attr-defined]
            time.sleep(float(seconds))

    train_lora.Faults.after_step = after_step


def cap_memory(mib: int) -> None:
    import torch

    device = int(os.environ.get("LOCAL_RANK", "0"))
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, mib * 2**20 / total), device)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, theirs = _split(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--share-gpu", action="store_true")
    p.add_argument("--memory-cap-mib", type=int)
    p.add_argument("--stall", metavar="RANK:STEP:SECONDS")
    # whatever is not ours is train_lora.py's (a launcher may have dropped the "--")
    args, rest = p.parse_known_args(ours)
    train_lora = load_train_lora()
    if args.share_gpu:
        share_gpu(train_lora)
    if args.stall:
        plant_stall(train_lora, args.stall)
    if args.memory_cap_mib:
        cap_memory(args.memory_cap_mib)
    train_lora.main(rest + theirs)


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """This script's options before ``--``, train_lora.py's after."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


if __name__ == "__main__":
    main()
