"""Differentiable collectives of sequence parallelism, on ``torch.distributed`` (gloo on the CPU, NCCL on GPUs).

- :func:`all_to_all`: the Ulysses exchange (heads <-> tokens); its backward is the same exchange of the gradients;
- :func:`ring_shift`: send a tensor to the next rank of the ring and receive the previous rank's; its backward
  sends the gradients the other way;
- :func:`gather_sequence`: every rank's shard joined in the original token order; its backward gives each rank the
  sum over ranks of the gradient of its own tokens (the convention of ``torch.distributed.nn.functional.all_gather``).

Gradients: the tokens of a rank flow through its own blocks only, so a parameter's gradient on one rank is that
rank's share. Where every rank computes the same loss from the gathered output, averaging the gradients over the
group (:func:`average_gradients`, or DDP over the same ranks) gives the unsharded model's gradient exactly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checks import check_instance, check_int, check_tensor
from .sharding import SequenceShard

__all__ = ["all_to_all", "average_gradients", "gather_sequence", "group_rank", "group_size", "ring_shift"]


def group_size(group: Any = None) -> int:
    """Number of ranks in ``group`` (None: the default group); RuntimeError without an initialised process group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("sequence parallelism needs torch.distributed initialised (init_process_group) first")
    return dist.get_world_size(group)


def group_rank(group: Any = None) -> int:
    """This process's rank in ``group``."""
    group_size(group)
    return dist.get_rank(group)


def _global_rank(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # equal splits: slot j of rank r goes to slot r of rank j, so the adjoint is the same exchange
        return _AllToAll.apply(grad, ctx.group), None


def all_to_all(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``x`` (P, ...) with slot j sent to rank j: slot i of the result came from rank i. Differentiable.

    Args:
        x: a tensor whose first dimension is the group's size P.
        group: the process group (None: the default one).
    """
    check_tensor(x, "x")
    size = group_size(group)
    if x.ndim == 0 or x.shape[0] != size:
        raise ValueError(f"x must have the group size {size} as its first dimension, got shape {tuple(x.shape)}")
    return _AllToAll.apply(x, group)


class _RingShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, step: int) -> torch.Tensor:
        ctx.group, ctx.step = group, step
        return _shift(x.contiguous(), group, step)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _RingShift.apply(grad, ctx.group, -ctx.step), None, None


def _shift(x: torch.Tensor, group: Any, step: int) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    out = torch.empty_like(x)
    if size == 1:
        return out.copy_(x)
    send, recv = _global_rank(group, (rank + step) % size), _global_rank(group, (rank - step) % size)
    ops = [dist.P2POp(dist.isend, x, send, group), dist.P2POp(dist.irecv, out, recv, group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return out


def ring_shift(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """The ``x`` of the previous rank of the ring (rank r receives from r - 1 and sends to r + 1). Differentiable:
    the gradient goes back from r + 1 to r."""
    check_tensor(x, "x")
    group_size(group)
    return _RingShift.apply(x, group, 1)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.stack(pieces)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # the sum over ranks of the gradient of this rank's slot (a reduce-scatter, as an all-to-all for gloo)
        return _AllToAll.apply(grad, ctx.group).sum(0), None


def gather_sequence(x: torch.Tensor, shard: SequenceShard, group: Any = None, dim: int = 1) -> torch.Tensor:
    """Every rank's shard ``x`` joined along the token dimension ``dim`` in the original order (the inverse of
    :func:`~visionpe.parallel.shard_tensor` across the ranks of ``group``). Differentiable.

    Args:
        x: this rank's tokens, ``shard.local_tokens`` along ``dim``.
        shard: this rank's :class:`~visionpe.parallel.SequenceShard`.
        group: the sequence-parallel process group (None: the default one).
        dim: the token dimension (1 for (B, N, C) activations, -1 for ids).
    """
    check_tensor(x, "x")
    check_instance(shard, "shard", SequenceShard, expected="a visionpe.parallel.SequenceShard")
    _check_shard_group(shard, group)
    if x.ndim == 0:
        raise ValueError("x must have a token dimension, got a 0-d tensor")
    check_int(dim, "dim", min=-x.ndim, max=x.ndim - 1)
    dim %= x.ndim
    if x.shape[dim] != shard.local_tokens:
        raise ValueError(
            f"x must hold the shard's {shard.local_tokens} local tokens along dim={dim}, got shape {tuple(x.shape)}"
        )
    pieces = _Gather.apply(x, group)  # (P, ..., N / P, ...)
    joined = torch.cat(pieces.unbind(0), dim)
    return joined.index_select(dim, torch.argsort(shard.gathered_order).to(x.device))


def _check_shard_group(shard: SequenceShard, group: Any) -> None:
    size, rank = group_size(group), dist.get_rank(group)
    if (shard.world_size, shard.rank) != (size, rank):
        raise ValueError(
            f"shard is rank {shard.rank} of {shard.world_size}, but this process is rank {rank} of {size} in group"
        )


def average_gradients(module: nn.Module, group: Any = None) -> nn.Module:
    """Average the gradient of every parameter of ``module`` over ``group`` (what DDP does over its ranks), in place.

    After a backward from the same loss on every rank (computed from :func:`gather_sequence`'s output), the averaged
    gradients are the unsharded model's. Returns ``module``.
    """
    check_instance(module, "module", nn.Module, expected="a torch.nn.Module")
    size = group_size(group)
    for parameter in module.parameters():
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad, group=group)
            parameter.grad.div_(size)
    return module
