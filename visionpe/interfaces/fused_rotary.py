"""Fused rotary application: q and k of the fused q/k/v projection output rotated by cos/sin tables in one kernel.

The reference path (:meth:`~visionpe.interfaces.rotary.LayerRotation.rotate_qkv`) runs a rotation as several eager
operations: in low precision, each table cast to the activations' dtype, a channel swap, two products and a sum,
each a kernel with its own pass over q and k and each rounded. :func:`rotate_qkv_tables` is the same rotation
written for ``torch.compile``: inductor turns it into one kernel (Triton on a GPU, C++ on a CPU) that reads q and k
of every head from the projection output, rotates each pair (a, b) -> (a cos - b sin, a sin + b cos) in fp32 with
the fp32 tables and rounds the result once to the activations' dtype. v is copied by the same compiled call, so that
the compiled backward builds the gradient of the whole projection output itself (a view of the buffer would cost a
zero-filled gradient and a sum outside it).

Attention uses it for blocks switched to ``rotary_backend="fused"`` (:func:`~visionpe.set_rotary_backend`), for
every rotation by cos/sin tables (:func:`rotation_tables`). The function is compiled once per process (shapes
become dynamic on the first new one); inside a graph that ``torch.compile`` is already tracing (a compiled model)
the plain function is inlined instead, where inductor fuses it with its neighbours.
"""

from __future__ import annotations

import functools

import torch

from ..checks import check_instance, check_int
from .rotary import LayerRotation

__all__ = ["ROTARY_BACKENDS", "rotate_qkv_tables", "rotation_tables", "fused_rotate_qkv"]

ROTARY_BACKENDS = ("eager", "fused")


def rotation_tables(
    rotation: LayerRotation, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The cos/sin tables a block's rotation of q and k applies (its
    :meth:`~visionpe.interfaces.rotary.LayerRotation.fused_tables`), or None when it is no rotation by tables.

    Rotations by :func:`~visionpe.rotary.functional.rotary_tables` tables (RoPE-Axial, RoPE-Mixed, STRING once its
    basis P is folded into the projection, the other schemes built on :class:`~visionpe.rotary.base.LinearRotary`,
    and any custom rotation that returns its tables) give (num_heads | 1, T, head_dim), or (B, num_heads | 1,
    T | K, head_dim) for per-sample positions or the rows of patch dropout's kept tokens ``keep`` (B, K). Other
    rotations (Lie-group and ComRoPE block rotations, several schemes chained, a basis still to apply) give None.
    """
    check_instance(rotation, "rotation", LayerRotation, expected="a LayerRotation")
    return rotation.fused_tables(keep)


def rotate_qkv_tables(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k of a fused projection output rotated by cos/sin tables, and v: the function that is compiled.

    Args:
        qkv: contiguous floating-point (B * T, 3 * num_heads * head_dim) or (B, T, 3 * num_heads * head_dim): q, k
            and v of each token side by side (attention's projection output), any floating dtype.
        cos, sin: interleaved tables of :func:`~visionpe.rotary.functional.rotary_tables` (cos repeated per pair,
            sin signed -sin, +sin), (num_heads | 1, T, head_dim) shared by the B images or (B, num_heads | 1, T,
            head_dim), one per image; fp32 (the products are taken in fp32 whatever their dtype).
        num_heads: heads of the projection.

    Returns:
        q, k, v, each (B, num_heads, T, head_dim) in ``qkv``'s dtype: q and k rotated in fp32 and rounded once, v a
        copy. Equal to the reference path (:meth:`~visionpe.interfaces.rotary.LayerRotation.rotate_qkv`) to the rounding
        of its dtype; gradients flow to ``qkv`` and to the tables.

    Example:
        >>> from visionpe.rotary.functional import rotary_tables
        >>> cos, sin = rotary_tables(torch.tensor([[torch.pi / 2]]))  # one token, one pair
        >>> q, k, v = rotate_qkv_tables(torch.tensor([[1.0, 0.0, 0.0, 2.0, 5.0, 6.0]]), cos[None], sin[None], 1)
        >>> q.round(decimals=6) + 0.0, k.round(decimals=6) + 0.0, v
        (tensor([[[[0., 1.]]]]), tensor([[[[-2.,  0.]]]]), tensor([[[[5., 6.]]]]))
    """
    _check_tables(qkv, cos, sin, num_heads)
    return _rotate_qkv(qkv, cos, sin, num_heads)


def fused_rotate_qkv(
    rotation: LayerRotation, qkv: torch.Tensor, num_heads: int, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """q, k, v from the projection output ``qkv`` rotated as ``rotation.rotate_qkv(qkv, B, num_heads, keep)``
    does, by the compiled :func:`rotate_qkv_tables`; None where the rotation has no tables
    (:func:`rotation_tables`), ``qkv`` is not contiguous (a projection that returns a view) or the call is traced for
    TorchScript or ONNX export: the caller then runs ``rotate_qkv``. Inside a graph being compiled the plain
    function is traced instead of the compiled one."""
    if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or not qkv.is_contiguous():
        return None
    tables = rotation_tables(rotation, keep)
    if tables is None:
        return None
    cos, sin = tables
    _check_tables(qkv, cos, sin, num_heads)
    if torch.compiler.is_compiling():
        return _rotate_qkv(qkv, cos, sin, num_heads)
    return _compiled_rotation()(qkv, cos, sin, num_heads)


def _check_tables(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> None:
    """ValueError unless ``qkv`` is a contiguous floating-point fused projection output with an even head_dim and
    ``cos``/``sin`` are matching tables of T rows whose image count divides its rows."""
    check_int(num_heads, "num_heads", min=1)
    for name, value in (("qkv", qkv), ("cos", cos), ("sin", sin)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    unit = 6 * num_heads  # 3 * num_heads heads of an even head_dim
    if qkv.ndim not in (2, 3) or qkv.shape[-1] % unit or not qkv.is_floating_point() or not qkv.is_contiguous():
        raise ValueError(
            f"qkv must be a contiguous floating-point (B * T, 3 * num_heads * head_dim) or (B, T, 3 * num_heads * "
            f"head_dim) tensor with num_heads={num_heads} and an even head_dim, got shape {tuple(qkv.shape)}, dtype "
            f"{qkv.dtype}, strides {qkv.stride()}"
        )
    head_dim, rows = qkv.shape[-1] // (3 * num_heads), qkv.numel() // qkv.shape[-1]
    if (
        cos.ndim not in (3, 4)
        or cos.shape != sin.shape
        or cos.shape[-3] not in (1, num_heads)
        or cos.shape[-1] != head_dim
        or rows % cos.shape[-2]
        or (cos.ndim == 4 and rows != cos.shape[0] * cos.shape[-2])
    ):
        raise ValueError(
            f"cos and sin must have shape (num_heads | 1, T, head_dim={head_dim}) with T dividing qkv's {rows} rows, "
            f"or (B, num_heads | 1, T, head_dim) with B * T rows; got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )


def _rotate_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rotate_qkv_tables` without the checks (the body that is compiled or traced)."""
    tokens, head_dim = cos.shape[-2], qkv.shape[-1] // (3 * num_heads)
    # selects (not unbind): their backward is a pointwise write of each part's gradient into one buffer
    heads = qkv.view(-1, tokens, 3, num_heads, head_dim)
    q, k, v = (heads.select(2, part).transpose(1, 2) for part in range(3))
    # one cos and one sin per pair: the interleaved tables repeat cos and carry sin as (-sin, +sin)
    c, s = cos[..., ::2].float(), sin[..., 1::2].float()

    def turn(x: torch.Tensor) -> torch.Tensor:
        a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).to(x.dtype)

    # three separate outputs (no common base): the compiled backward then builds qkv's whole gradient
    return turn(q), turn(k), v.clone(memory_format=torch.contiguous_format)


@functools.cache
def _compiled_rotation():
    # shapes start static and become dynamic at the first new one (another image size, batch or patch dropout
    # rate), so that a run compiles at most twice per kind of call (dtype, per-sample tables, grad mode)
    return torch.compile(_rotate_qkv)
