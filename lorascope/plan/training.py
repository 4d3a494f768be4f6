"""How the job trains: precision, ZeRO, parallelism, batch shape and the implementation
choices (checkpointing, attention, loss) that move the activation peak."""

from __future__ import annotations

from dataclasses import dataclass, field

from lorascope.errors import UsageError

PRECISIONS = ("bf16", "fp16", "fp32", "4bit")
CHECKPOINTING = ("none", "reentrant", "non-reentrant")
ATTENTION = ("eager", "sdpa", "flash")
LOSSES = ("fp32-upcast", "native", "chunked")

#: bitsandbytes NF4 with double quantization (the QLoRA recipe): 4 bits per weight, an 8-bit
#: absmax per 64-weight block, and an fp32 absmax per 256 such blocks.
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)


@dataclass(frozen=True)
class ZeroSetup:
    """DeepSpeed ZeRO settings; defaults are DeepSpeed's own (DeepSpeedZeroConfig, 0.19)."""

    stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    reduce_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    sub_group_size: int = 1_000_000_000
    contiguous_gradients: bool = True
    #: None: DeepSpeed's default (on for stage 3 only).
    overlap_comm: bool | None = None
    #: "fp32" or None (accumulate gradients in the model's 16-bit dtype: DeepSpeed's default).
    grad_accum_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise UsageError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.stage}")
        if self.offload_params and self.stage != 3:
            raise UsageError("parameter offload needs ZeRO stage 3")
        if self.offload_optimizer and self.stage == 0:
            raise UsageError("optimizer offload needs ZeRO stage 1, 2 or 3")

    @property
    def overlapping(self) -> bool:
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm


@dataclass(frozen=True)
class TrainingSetup:
    precision: str = "bf16"
    #: Adapters stored and computed in fp32 over a 16-bit base (PEFT's autocast_adapter_dtype,
    #: or torch autocast): no separate master copy, and each LoRA input is cast to fp32.
    fp32_adapters: bool = False
    zero: ZeroSetup = field(default_factory=ZeroSetup)
    gpus_per_node: int = 1
    nodes: int = 1
    seq: int = 2048
    micro_batch: int = 1
    checkpointing: str = "none"
    attention: str = "sdpa"
    loss: str = "fp32-upcast"

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("precision", self.precision, PRECISIONS),
            ("checkpointing", self.checkpointing, CHECKPOINTING),
            ("attention", self.attention, ATTENTION),
            ("loss", self.loss, LOSSES),
        ):
            if value not in allowed:
                raise UsageError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        for name, number in (
            ("gpus per node", self.gpus_per_node),
            ("nodes", self.nodes),
            ("sequence length", self.seq),
            ("micro-batch", self.micro_batch),
        ):
            if number < 1:
                raise UsageError(f"{name} must be at least 1, got {number}")

    @property
    def world(self) -> int:
        """Data-parallel ranks: ZeRO partitions over all of them."""
        return self.gpus_per_node * self.nodes

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch on one GPU (B x T)."""
        return self.micro_batch * self.seq

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of activations (bitsandbytes computes 4-bit layers in bf16)."""
        return 4 if self.precision == "fp32" else 2

    @property
    def adapter_bytes(self) -> int:
        return 4 if self.fp32_adapters or self.precision == "fp32" else 2

    @property
    def mixed_precision(self) -> bool:
        """16-bit trainable weights with an fp32 master copy held by the optimizer."""
        return self.adapter_bytes == 2

    @property
    def grad_bytes(self) -> int:
        """Bytes of the gradient DeepSpeed keeps per trainable parameter."""
        return 4 if self.zero.grad_accum_dtype == "fp32" else self.adapter_bytes
