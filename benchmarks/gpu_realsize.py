"""A LoRA job of real size for the GPU check (``benchmarks/gpu_check.sh``): a Llama-shaped
model built from a config with random weights (Llama-3.2-1B's shape, ~1.2B parameters,
no download), bf16, PEFT LoRA r=16 on every linear layer, sequence 2,048, micro-batch 1,
non-reentrant gradient checkpointing, AdamW on the adapters; one process, no launcher.

    python benchmarks/gpu_realsize.py --steps 30                   # bare
    lorascope run --out R -- python benchmarks/gpu_realsize.py ... # probed
    python benchmarks/gpu_realsize.py --compile ...                # the adapted layers compiled
    python benchmarks/gpu_realsize.py --shape tiny --device cpu    # the same code, seconds on CPU

Prints one line a step (``gpu_realsize: step N s=SECONDS``) and a last line
``gpu_realsize: done steps=N mean_step_s=M steady_step_s=S peak_alloc=B peak_reserved=B``
(steady: the median from step ``WARM`` on; peaks from torch.cuda on CUDA, else 0), and
writes the model's ``config.json`` to ``--config-out`` for ``lorascope plan --model``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

#: Llama-3.2-1B's shape (``lorascope plan --preset llama-3.2-1b``), and a tiny one for CPU.
SHAPES: dict[str, dict[str, Any]] = {
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "tie_word_embeddings": True,
    },
}
#: Steps left out of the steady-state figure (allocator warm-up, compilation, the probes'
#: first steps of allocator history under ``--memory-history auto``).
WARM = 5
DONE = re.compile(
    r"gpu_realsize: done steps=(\d+) mean_step_s=([0-9.]+) steady_step_s=([0-9.]+) "
    r"peak_alloc=(\d+) peak_reserved=(\d+)"
)


def parse_done(stdout: str) -> dict[str, float] | None:
    """The job's last line as numbers (None when the job did not get there)."""
    m = DONE.search(stdout)
    if m is None:
        return None
    steps, mean, steady, alloc, reserved = m.groups()
    return {
        "steps": int(steps),
        "mean_step_s": float(mean),
        "steady_step_s": float(steady),
        "peak_alloc": int(alloc),
        "peak_reserved": int(reserved),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--compile", action="store_true", help="torch.compile every LoRA-adapted layer")
    p.add_argument("--config-out", type=Path, help="write the model's config.json here")
    args = p.parse_args(argv)

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = torch.bfloat16
    config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=max(args.seq, 2048), use_cache=False)
    if args.config_out is not None:
        args.config_out.write_text(json.dumps(config.to_dict(), indent=1) + "\n")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with device:
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(previous)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, target_modules="all-linear")
    model = get_peft_model(model, lora)
    if args.compile:
        for module in model.modules():
            if hasattr(module, "lora_A") and hasattr(module, "base_layer"):
                module.compile()
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
    shape = (args.micro_batch, args.seq)
    cuda = device.type == "cuda"
    times: list[float] = []
    for step in range(args.steps):
        ids = torch.randint(0, config.vocab_size, shape, device=device)
        began = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
        print(f"gpu_realsize: step {step} s={times[-1]:.4f} loss={loss.item():.4f}", flush=True)
    steady = times[WARM:] or times
    alloc = torch.cuda.max_memory_allocated() if cuda else 0
    reserved = torch.cuda.max_memory_reserved() if cuda else 0
    print(
        f"gpu_realsize: done steps={len(times)} mean_step_s={statistics.mean(times):.5f} "
        f"steady_step_s={statistics.median(steady):.5f} peak_alloc={alloc} peak_reserved={reserved}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
