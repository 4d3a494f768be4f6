"""How the job trains: precision, ZeRO or FSDP, parallelism, batch shape and the
implementation choices (checkpointing, attention, loss) that move the activation peak."""

from __future__ import annotations

from dataclasses import dataclass, field

from lorascope.errors import UsageError

PRECISIONS = ("bf16", "fp16", "fp32", "4bit")
CHECKPOINTING = ("none", "reentrant", "non-reentrant")
ATTENTION = ("eager", "sdpa", "flash")
LOSSES = ("fp32-upcast", "native", "chunked")
#: FSDP1's ShardingStrategy names; FSDP2's fully_shard is FULL_SHARD with
#: reshard_after_forward=True, SHARD_GRAD_OP with False, HYBRID_SHARD on a 2-D mesh.
FSDP_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")

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
class FsdpSetup:
    """PyTorch FSDP settings (torch 2.13). Both versions shard each decoder layer as one unit
    and the root (embeddings, final norm, output projection) as another, the usual
    transformer wrap policy; version 1 is ``FullyShardedDataParallel`` with
    ``use_orig_params=True`` (the only way one unit holds a frozen base and trainable
    adapters), version 2 is ``fully_shard``."""

    version: int = 2
    strategy: str = "FULL_SHARD"
    #: MixedPrecision(param_dtype=...) / MixedPrecisionPolicy: the sharded parameters stay
    #: fp32 (the optimizer's copy), the unsharded ones are cast to the setup's precision.
    mixed_precision: bool = False
    #: reduce_dtype float32 under mixed precision (else gradients are reduced in param_dtype).
    reduce_fp32: bool = False
    #: CPUOffload(offload_params=True) / CPUOffloadPolicy: sharded parameters, their
    #: gradients and the optimizer step on the CPU.
    offload_params: bool = False

    def __post_init__(self) -> None:
        if self.version not in (1, 2):
            raise UsageError(f"FSDP version must be 1 or 2, got {self.version}")
        if self.strategy not in FSDP_STRATEGIES:
            raise UsageError(
                f"FSDP sharding strategy must be one of {', '.join(FSDP_STRATEGIES)}, got {self.strategy!r}"
            )
        if self.version == 2 and self.strategy == "NO_SHARD":
            raise UsageError("FSDP2 has no NO_SHARD: replicate the model with DDP (or torch's replicate) instead")
        if self.reduce_fp32 and not self.mixed_precision:
            raise UsageError("an fp32 reduce dtype is a mixed-precision setting: it needs FSDP mixed precision")

    @property
    def reshard_after_forward(self) -> bool:
        """Whether a unit frees its unsharded parameters after its forward (the root never
        does: FSDP1 and FSDP2 both keep it for the backward that follows at once)."""
        return self.strategy in ("FULL_SHARD", "HYBRID_SHARD")

    @property
    def label(self) -> str:
        if self.version == 1:
            return f"FSDP1 {self.strategy}"
        mesh = " on a (replicate, shard) mesh" if self.strategy == "HYBRID_SHARD" else ""
        return f"FSDP2 fully_shard{mesh}, reshard_after_forward={self.reshard_after_forward}"


@dataclass(frozen=True)
class TrainingSetup:
    precision: str = "bf16"
    #: Adapters stored and computed in fp32 over a 16-bit base (PEFT's autocast_adapter_dtype,
    #: or torch autocast): no separate master copy, and each LoRA input is cast to fp32.
    fp32_adapters: bool = False
    zero: ZeroSetup = field(default_factory=ZeroSetup)
    #: PyTorch FSDP instead of DeepSpeed (then ZeRO stays at 0).
    fsdp: FsdpSetup | None = None
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
        if self.fsdp is not None:
            if self.zero.stage:
                raise UsageError("FSDP and DeepSpeed ZeRO are two ways to shard one job: choose one")
            if self.fsdp.mixed_precision and self.precision == "fp32":
                raise UsageError("FSDP mixed precision computes in 16 bits: give --precision bf16 or fp16")

    @property
    def world(self) -> int:
        """Data-parallel ranks: ZeRO partitions over all of them."""
        return self.gpus_per_node * self.nodes

    @property
    def shard_world(self) -> int:
        """The ranks that split the parameters: ZeRO and FSDP's sharded strategies all of
        them, HYBRID_SHARD those of one node (it replicates across nodes), NO_SHARD none."""
        if self.fsdp is not None and self.fsdp.strategy == "HYBRID_SHARD":
            return self.gpus_per_node
        if self.fsdp is not None and self.fsdp.strategy == "NO_SHARD":
            return 1
        return self.world

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
        """Bytes per adapter weight as the adapters compute (FSDP: the unsharded copy)."""
        return 4 if self.fp32_adapters or self.precision == "fp32" else 2

    @property
    def fsdp_master(self) -> bool:
        """FSDP mixed precision: sharded parameters, their gradients and the optimizer in fp32."""
        return self.fsdp is not None and self.fsdp.mixed_precision

    @property
    def mixed_precision(self) -> bool:
        """16-bit trainable weights with an fp32 master copy held by the optimizer (DeepSpeed;
        under FSDP the sharded parameters are the optimizer's own, see ``fsdp_master``)."""
        return self.adapter_bytes == 2

    @property
    def grad_bytes(self) -> int:
        """Bytes of the gradient DeepSpeed keeps per trainable parameter."""
        return 4 if self.zero.grad_accum_dtype == "fp32" else self.adapter_bytes
