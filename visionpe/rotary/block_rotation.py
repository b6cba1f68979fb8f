"""Applying per-token block rotations to q and k: R v for every (head, token, b x b channel block).

Rotations are applied per block as one batched matrix product R @ X whose batch is (head, token, block) and whose
columns are all images of the batch (q and k together): each small matrix is read once for 2 B vectors. In
training attention the rotated vectors are written back into the q/k/v projection's output
(:func:`rotate_qkv_blocks_`), whose backward needs only them (the rotations are orthogonal).

:class:`TokenRotations` is one block's rotations of the rotated tokens, built by token range: the form in which the
Lie-group schemes (LieRE, ComRoPE) hand their rotations to attention.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..checks import check_int, is_int
from .functional import _fused_qk, check_fused_qkv

__all__ = ["TokenRotations", "apply_block_rotation", "rotate_qkv_blocks_"]


class TokenRotations(ABC):
    """One block's (num_heads | 1, n, head_dim // b, b, b) rotations of ``num_tokens`` tokens, by token range."""

    num_tokens: int

    @abstractmethod
    def __call__(self, start: int, stop: int) -> torch.Tensor:
        """fp32 rotations of tokens [start, stop): (num_heads | 1, stop - start, head_dim // b, b, b)."""

    def rotate_qkv_(self, qkv: torch.Tensor, num_heads: int, num_prefix_tokens: int, tokens: int) -> torch.Tensor:
        """:func:`rotate_qkv_blocks_` of ``qkv`` by the rotations of every token; subclasses that can square and
        rotate in one step (keeping less for the backward) override it."""
        return rotate_qkv_blocks_(qkv, self(0, self.num_tokens), num_heads, num_prefix_tokens, tokens)


def apply_block_rotation(x: torch.Tensor, rot: torch.Tensor, num_prefix_tokens: int = 0) -> torch.Tensor:
    """Rotate channel blocks of ``x`` by per-token block rotations; prefix tokens are left as they are.

    Args:
        x: (..., num_heads, num_prefix_tokens + N, head_dim).
        rot: (num_heads | 1, N, head_dim // b, b, b) rotations (fp32; cast to x's dtype); read in place when
            contiguous, copied otherwise.
        num_prefix_tokens: leading tokens of ``x`` that are not rotated.

    Returns:
        Same shape and dtype as ``x``.
    """
    heads, tokens, head_dim = x.shape[-3:]
    nblocks, b = rot.shape[-3], rot.shape[-1]
    if (
        rot.ndim != 5
        or nblocks * b != head_dim
        or rot.shape[1] != tokens - num_prefix_tokens
        or rot.shape[0] not in (1, heads)
    ):
        raise ValueError(
            f"rot (num_heads | 1, N, head_dim // b, b, b) = {tuple(rot.shape)} does not match x {tuple(x.shape)} "
            f"with {num_prefix_tokens} prefix tokens"
        )
    if torch.compiler.is_compiling():  # dynamo cannot trace _BlockRotation's backward
        return _summed_block_rotation(x, rot.to(x.dtype), num_prefix_tokens)
    return _BlockRotation.apply(x, rot.to(x.dtype), num_prefix_tokens)


def _summed_block_rotation(x: torch.Tensor, rot: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """:func:`apply_block_rotation` as plain tensor operations with autograd's own backward, for a compiled graph:
    R v per block as a product summed over the block's columns (one fused kernel, no (G, b, C) copies), the prefix
    tokens put back in front unchanged. The same rotations to float rounding."""
    tokens = x[..., num_prefix_tokens:, :].unflatten(-1, (rot.shape[-3], rot.shape[-1]))  # (..., heads, N, m, b)
    out = (rot * tokens.unsqueeze(-2)).sum(-1).flatten(-2)
    return torch.cat((x[..., :num_prefix_tokens, :], out), -2) if num_prefix_tokens else out


class _BlockRotation(torch.autograd.Function):
    """R v for every (head, token, block), as one batched product R @ X whose columns are all the vectors that
    share a rotation: the images of the batch and q and k (and the heads, when ``rot`` is shared by them).

    X is a view of the rotated tokens of x made contiguous in their own (..., heads, N, head_dim) layout (a cheap
    copy of whole rows): (C, G, b) seen as (G, b, C), column-major matrices that the batched gemm reads in place.
    (G, b, b) @ (G, b, C) is the fast form of a batched product of small matrices on CPU (the row form
    (G, C, b) @ (G, b, b) is about twice as slow), and the result goes back to the token layout in one copy,
    the prefix tokens copied beside it, never multiplied by identities. The backward runs R^T @ dY and dY @ X^T
    on the same views. What is kept for the backward is x itself, not X: in attention x is a view of the qkv
    projection, which stays alive for v anyway, so X is copied again in the backward instead of being held from
    forward to backward (in LieRE's ViT-S training step that was 58 MB fewer bytes held, and many fewer page
    faults with glibc's default allocator).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, rot: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
        mats = rot.reshape(-1, *rot.shape[-2:])  # (G, b, b), G = (heads | 1, N, blocks): a view when contiguous
        tokens = x[..., num_prefix_tokens:, :].contiguous()
        out = _BlockRotation._rotate(x, tokens, mats, num_prefix_tokens)
        # x, not its contiguous copy: x is usually a view of the qkv projection, which attention keeps alive
        # for v anyway, so the backward copies the tokens again rather than holding a second copy per layer
        ctx.save_for_backward(mats, x)
        ctx.num_prefix_tokens, ctx.rot_shape = num_prefix_tokens, rot.shape
        return out

    @staticmethod
    def _rotate(x: torch.Tensor, tokens: torch.Tensor, mats: torch.Tensor, prefix: int) -> torch.Tensor:
        """``x`` with its tokens after ``prefix`` replaced by ``mats`` @ ``tokens`` (contiguous, per block)."""
        # in x's own memory order (dims by decreasing stride): for q and k cut from the qkv projection that is
        # (B, N, 2, heads, head_dim), so attention's output keeps the (B, N, heads, head_dim) order and the
        # reshape after it stays a view, as in timm's Attention (a contiguous (2, B, heads, N, head_dim) made
        # attention write (B, heads, N, head_dim) and the reshape copy and keep it)
        # (empty + permute rather than empty_permuted, which ONNX export cannot translate)
        order = sorted(range(x.ndim), key=lambda dim: -x.stride(dim))
        out = x.new_empty([x.shape[dim] for dim in order]).permute(sorted(range(x.ndim), key=order.__getitem__))
        if prefix:
            out[..., :prefix, :] = x[..., :prefix, :]
        _rotate_into(out[..., prefix:, :], tokens, mats)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        mats, x = ctx.saved_tensors
        prefix = ctx.num_prefix_tokens
        grad = grad_out[..., prefix:, :].contiguous()
        grad_x = grad_rot = None
        if ctx.needs_input_grad[0]:  # x = R^T y per block: the forward's product with the transposed rotations
            grad_x = _BlockRotation._rotate(grad_out, grad, mats.transpose(1, 2), prefix)
        if ctx.needs_input_grad[1]:
            tokens = x[..., prefix:, :].contiguous()
            grad_rot = torch.bmm(_columns(grad, mats), _columns(tokens, mats).transpose(1, 2)).view(ctx.rot_shape)
        return grad_x, grad_rot, None


def _columns(tokens: torch.Tensor, mats: torch.Tensor) -> torch.Tensor:
    """(G, b, C) view of contiguous (*lead, heads, N, head_dim) ``tokens`` for the (G, b, b) ``mats``: the vectors
    that block g rotates, as the columns of a column-major matrix that the batched gemm reads in place."""
    return tokens.view(-1, len(mats), mats.shape[-1]).permute(1, 2, 0)


def _rotate_into(dst: torch.Tensor, tokens: torch.Tensor, mats: torch.Tensor) -> None:
    """``dst`` (a (*lead, heads, N, head_dim) view, any strides) = ``mats`` @ ``tokens`` block by block;
    ``tokens`` is contiguous, of dst's shape (it may hold dst's own values: the product is made before the copy)."""
    b = mats.shape[-1]
    y = torch.bmm(mats, _columns(tokens, mats))  # (G, b, C)
    # y's (G, b, C) back to (..., heads, N, head_dim): G and C unflattened to the dims they came from
    shape = tokens.shape  # (*lead, heads, N, head_dim)
    n = len(shape) - 3
    if len(mats) == shape[-3] * shape[-2] * (shape[-1] // b):  # a rotation per head: C = lead
        y = y.view(*shape[-3:-1], -1, b, *shape[:n]).permute(*range(4, 4 + n), 0, 1, 2, 3)
    else:  # shared by the heads: C = (lead, heads)
        y = y.view(shape[-2], -1, b, *shape[: n + 1]).permute(*range(3, 4 + n), 0, 1, 2)
    dst.unflatten(-1, (-1, b)).copy_(y)


def _qk_view(qkv: torch.Tensor, num_heads: int, tokens: int) -> torch.Tensor:
    """(2, B, heads, tokens, head_dim) view of q and k in a contiguous fused projection output (:func:`_fused_qk`)."""
    return _fused_qk(qkv, num_heads, tokens).permute(2, 0, 3, 1, 4)


def rotate_qkv_blocks_(
    qkv: torch.Tensor, rot: torch.Tensor, num_heads: int, num_prefix_tokens: int = 0, tokens: int | None = None
) -> torch.Tensor:
    """Rotate q and k in a fused q/k/v projection output in place, block by block; v and prefix tokens unchanged.

    The same products as :func:`apply_block_rotation` on q and k cut from ``qkv``, written back into ``qkv``, so
    that attention cuts q, k, v from one buffer as timm's Attention does. Differentiable, with two conditions
    for a correct backward:

    - ``rot`` must be orthogonal (R^T R = I in every block, as exp of a skew-symmetric generator is). The unrotated
      q and k X are not kept: the backward computes dL/dR = dY X^T as (dY Y^T) R from the rotated vectors
      Y = R X, which equals it only when R^T R = I, so a non-orthogonal ``rot`` gets a wrong dL/drot, without
      any error (dL/dqkv = R^T dY stays right).
    - The incoming gradient buffer is reused: the backward writes the gradient of the unrotated q and k over the
      incoming gradient of ``qkv``, in place. That is right when the only use of the returned tensor is to be
      cut into q, k and v (as in :class:`~visionpe.PosAttention`); a caller that keeps that gradient for another
      use (or a second backward through it, e.g. ``gradcheck`` with the rotation as the last op, which reports
      "Backward is not reentrant") sees it overwritten.

    Args:
        qkv: contiguous (*lead, num_prefix_tokens + N, 3 * num_heads * head_dim), q, k and v of each token side
            by side; or flat, (B * (num_prefix_tokens + N), 3 * num_heads * head_dim) with ``tokens`` given. Pass
            the projection's own output (``F.linear`` of flattened tokens), not a view of it: autograd then
            records the change on the tensor itself instead of copying the gradient of the tensor it views.
        rot: (num_heads | 1, N, head_dim // b, b, b) rotations (cast to qkv's dtype).
        num_heads: heads of the projection.
        num_prefix_tokens: leading tokens of each image that are not rotated.
        tokens: tokens per image, num_prefix_tokens + N (default: ``qkv.shape[-2]``).

    Returns:
        ``qkv`` itself.
    """
    tokens = _check_qkv_rotation(qkv, rot.shape, num_heads, num_prefix_tokens, tokens)
    return _QKVBlockRotation.apply(qkv, rot.to(qkv.dtype), num_heads, num_prefix_tokens, tokens)


def _check_qkv_rotation(
    qkv: torch.Tensor, rot_shape: tuple[int, ...], num_heads: int, num_prefix_tokens: int, tokens: int | None
) -> int:
    """Tokens per image; ValueError unless rotations of shape ``rot_shape`` fit the q and k of ``qkv``."""
    head_dim = check_fused_qkv(qkv, num_heads)
    check_int(num_prefix_tokens, "num_prefix_tokens", min=0)
    if tokens is None:
        tokens = qkv.shape[-2]
    if not is_int(tokens) or tokens <= 0 or qkv.numel() % (tokens * qkv.shape[-1]):
        raise ValueError(f"tokens must be a positive int that divides qkv's rows {qkv.shape[:-1]}, got {tokens!r}")
    if (
        len(rot_shape) != 5
        or rot_shape[2] * rot_shape[4] != head_dim
        or rot_shape[3] != rot_shape[4]
        or rot_shape[1] != tokens - num_prefix_tokens
        or rot_shape[0] not in (1, num_heads)
    ):
        raise ValueError(
            f"rot (num_heads | 1, N, head_dim // b, b, b) = {tuple(rot_shape)} does not match qkv "
            f"{tuple(qkv.shape)} with num_heads={num_heads} and {num_prefix_tokens} of {tokens} tokens as prefix"
        )
    return tokens


class _QKVBlockRotation(torch.autograd.Function):
    """:func:`rotate_qkv_blocks_`: q and k rotated in place in the fused projection output.

    Attention's q, k and v are then views of one buffer, which its backward keeps anyway (as in timm), instead
    of that buffer (v) plus a rotated copy of q and k: in LieRE's ViT-S training step 4.8 MB fewer per block
    live from forward to backward, which with glibc's default allocator also means fewer fresh pages per step.
    The unrotated q and k are not needed for the backward: R is orthogonal, so with Y = R X the rotated
    vectors, dL/dR = sum_c dY X^T = (sum_c dY Y^T) R, and Y is what the buffer holds.
    """

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, rot: torch.Tensor, num_heads: int, prefix: int, tokens: int) -> torch.Tensor:
        mats = rot.reshape(-1, *rot.shape[-2:])  # (G, b, b): a view when contiguous
        _rotate_qkv(qkv, mats, num_heads, prefix, tokens)
        ctx.mark_dirty(qkv)
        ctx.save_for_backward(mats, qkv)
        ctx.layout, ctx.rot_shape = (num_heads, prefix, tokens), rot.shape
        return qkv

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mats, qkv = ctx.saved_tensors
        grad_qkv, grad_rot = _rotate_qkv_backward(grad, qkv, mats, *ctx.layout, *ctx.needs_input_grad[:2])
        return grad_qkv, None if grad_rot is None else grad_rot.view(ctx.rot_shape), None, None, None


def _rotate_qkv(qkv: torch.Tensor, mats: torch.Tensor, num_heads: int, prefix: int, tokens: int) -> None:
    """q and k of the tokens after ``prefix`` in ``qkv`` rotated in place by the (G, b, b) ``mats``."""
    rotated = _qk_view(qkv, num_heads, tokens)[..., prefix:, :]
    _rotate_into(rotated, rotated.contiguous(), mats)


def _rotate_qkv_backward(
    grad: torch.Tensor,
    qkv: torch.Tensor,
    mats: torch.Tensor,
    num_heads: int,
    prefix: int,
    tokens: int,
    need_x: bool,
    need_rot: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dL/dqkv before the rotation, dL/dmats) of :func:`_rotate_qkv` from dL/dqkv after it; ``qkv`` holds the
    rotated vectors. dL/dqkv is written over ``grad`` (its q and k tokens; v and prefix pass through)."""
    grad = grad.contiguous()  # the incoming buffer itself when it is dense
    grad_tokens = _qk_view(grad, num_heads, tokens)[..., prefix:, :]
    grad_cols = grad_tokens.contiguous()
    grad_qkv = grad_mats = None
    if need_rot:  # (dY Y^T) R per block
        rotated = _qk_view(qkv, num_heads, tokens)[..., prefix:, :].contiguous()
        outer = torch.bmm(_columns(grad_cols, mats), _columns(rotated, mats).transpose(1, 2))
        grad_mats = torch.bmm(outer, mats)
    if need_x:  # dX = R^T dY, written over dY
        _rotate_into(grad_tokens, grad_cols, mats.transpose(1, 2))
        grad_qkv = grad
    return grad_qkv, grad_mats
