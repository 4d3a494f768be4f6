"""probes/train_lora.py's job with one more planting: a save on rank 0 alone that enters
ZeRO-3's parameter state (the held-out crash of a ZeRO-3 saving script).

At ``--fault-step`` rank 0 alone gathers the LoRA adapters to save them
(``deepspeed.zero.GatheredParameters`` inside ``if rank == 0:``). The adapters are
persistent (ZeRO-3 keeps parameters under ``stage3_param_persistence_threshold`` whole on
every rank: all of this tiny model's), so entering issues no collective; but leaving
re-partitions them on rank 0 only, and the next forward's ``all_gather`` has different
sizes on the ranks (gloo aborts the peer). Nothing else differs from train_lora.py::

    torchrun --nproc_per_node 2 probes/zero3_save.py --steps 6 --fault-step 3

(A file of its own: recorded dumps point into train_lora.py by line.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_lora


def save_adapters(model: torch.nn.Module, d: train_lora.Dist, path: str | None) -> None:
    """The bug: the save gathers the adapters on rank 0 only."""
    import deepspeed

    adapters = [p for name, p in model.named_parameters() if "lora_" in name]
    if d.rank == 0:
        with deepspeed.zero.GatheredParameters(adapters):
            state = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}
        if path:
            torch.save(state, path)


class SavingFaults(train_lora.Faults):
    def before_step(self, step: int, model: torch.nn.Module) -> None:
        if step == self.args.fault_step:
            save_adapters(model, self.d, None)


def main(argv: list[str] | None = None) -> None:
    """train_lora.py's main (its options), with this file's planting."""
    train_lora.Faults = SavingFaults  # type: ignore[misc]
    train_lora.main(argv)


if __name__ == "__main__":
    train_lora.lone_process_defaults()
    main()
