"""The collective ops the probes record (the ``op`` of a call's ``shape`` record), shared by the
probes that wrap them and the analysis that recognises them in stacks."""

from __future__ import annotations

#: op -> (position, keyword) of the argument whose bytes the record reports: the rank's
#: own contribution, so that ranks agree on it (all_gather: the input, not the output).
PAYLOAD_ARG: dict[str, tuple[int, str]] = {
    "all_reduce": (0, "tensor"),
    "broadcast": (0, "tensor"),
    "reduce": (0, "tensor"),
    "send": (0, "tensor"),
    "recv": (0, "tensor"),
    "isend": (0, "tensor"),
    "irecv": (0, "tensor"),
    "gather": (0, "tensor"),
    "scatter": (0, "tensor"),
    "all_gather": (1, "tensor"),
    "all_gather_into_tensor": (1, "input_tensor"),
    "all_gather_single": (1, "input_tensor"),
    "_all_gather_base": (1, "input_tensor"),
    "reduce_scatter_tensor": (1, "input"),
    "reduce_scatter_single": (1, "input"),
    "_reduce_scatter_base": (1, "input"),
    "reduce_scatter": (1, "input_list"),
    "all_to_all_single": (1, "input"),
    "all_to_all": (1, "input_tensor_list"),
    "all_reduce_coalesced": (0, "tensors"),
    "all_gather_coalesced": (1, "input_tensor_list"),
    "batch_isend_irecv": (0, "p2p_op_list"),
    "barrier": (-1, ""),
    "monitored_barrier": (-1, ""),
    "all_gather_object": (-1, ""),
    "gather_object": (-1, ""),
    "broadcast_object_list": (-1, ""),
    "scatter_object_list": (-1, ""),
    "send_object_list": (-1, ""),
    "recv_object_list": (-1, ""),
}

#: The point-to-point ops: a call pairs with its peer's matching one, not with every rank's.
P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list"})

#: The functional collectives (``torch.distributed._functional_collectives``: DTensor's
#: redistributions, a full state dict of FSDP2's sharded parameters) -> (position,
#: keyword) of the payload argument. Recorded as ``funcol.NAME``; they return before the
#: work is done (an ``AsyncCollectiveTensor``), so they are async calls that end when
#: their output is waited for (``wait_tensor``). The aliases (``all_gather_tensor``,
#: ``reduce_scatter_tensor``, ``permute_tensor`` ...) call these.
FUNCTIONAL_PAYLOAD_ARG: dict[str, tuple[int, str]] = {
    "all_reduce": (0, "self"),
    "broadcast": (0, "self"),
    "all_gather_single": (0, "self"),
    "reduce_scatter_single": (0, "self"),
    "all_to_all_single": (0, "self"),
    "all_reduce_coalesced": (0, "self"),
    "all_gather_single_coalesced": (0, "self"),
    "reduce_scatter_single_coalesced": (0, "inputs"),
}
FUNCTIONAL_PREFIX = "funcol."
