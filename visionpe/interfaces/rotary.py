"""The typed interface between rotary schemes and attention.

A rotary scheme's ``prepare(coords, num_prefix_tokens, grid_size)`` runs once per forward and returns a
:class:`RotaryState`. Attention asks it for its block's :class:`LayerRotation` (``state.layer(i)``), which has a
fixed set of operations:

- :meth:`LayerRotation.rotate`: rotate q and k stacked as ``qk`` (..., B, heads, T, head_dim), the reference;
- :meth:`LayerRotation.rotate_kept`: the tokens patch dropout kept (default: placed back on the full sequence,
  rotated, gathered again; schemes with per-token tables gather their rows instead);
- :meth:`LayerRotation.rotate_qkv`: q and k inside the fused q/k/v projection output, returning q, k, v (default:
  cut q and k from it and :meth:`~LayerRotation.rotate` them; schemes that can rotate in place override it);
- :attr:`LayerRotation.basis`: a matrix P applied to every token's q and k before the rest of the rotation, which
  attention may fold into the projection weights (then it calls the operations of
  :meth:`LayerRotation.without_basis`); one P for both, or one for q and one for k;
- :meth:`LayerRotation.rotate_values` and :meth:`LayerRotation.unrotate_output`: a rotation of the values by the
  keys' positions and of attention's output back by the queries' positions (rotary value embeddings); the identity
  by default.

Every operation has a working default, so a new scheme implements :meth:`LayerRotation.rotate` and, in its state,
:meth:`RotaryState.layer`; the rest is optimisation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from ..tokens import gather_tokens, scatter_tokens

__all__ = ["RotaryState", "LayerRotation", "IdentityRotation", "ChainedRotation"]


def split_heads(qkv: torch.Tensor, batch: int, num_heads: int) -> torch.Tensor:
    """(3, B, num_heads, T, head_dim) view of a fused projection output (B * T, 3 * num_heads * head_dim)."""
    return qkv.reshape(batch, -1, 3, num_heads, qkv.shape[-1] // (3 * num_heads)).permute(2, 0, 3, 1, 4)


class LayerRotation(ABC):
    """The rotation of q and k in one block for one forward (see the module docstring).

    ``num_tokens`` is the length of the full sequence (prefix tokens included) the rotation was prepared for;
    :meth:`rotate_kept` indexes into it.
    """

    num_tokens: int = 0

    @property
    def basis(self) -> torch.Tensor | None:
        """(num_heads | 1, head_dim, head_dim) matrix P that :meth:`rotate` applies to every token's q and k first,
        or (2, num_heads | 1, head_dim, head_dim): one for q, one for k; None when there is none."""
        return None

    def without_basis(self) -> LayerRotation:
        """The rotation after :attr:`basis` (itself when there is none): what is left once P is folded into the
        q/k projection."""
        return self

    @abstractmethod
    def rotate(self, qk: torch.Tensor) -> torch.Tensor:
        """``qk`` (..., B, num_heads, num_tokens, head_dim), q and k stacked in front -> rotated, same shape."""

    def rotate_kept(self, qk: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Rotate the tokens patch dropout kept: ``qk`` (..., B, num_heads, K, head_dim) holds, per sample, the tokens
        ``keep`` (B, K) (int64 indices into the ``num_tokens`` tokens). Default: rotated on the full sequence
        (dropped rows zero) and gathered back."""
        return gather_tokens(self.rotate(scatter_tokens(qk, keep, self.num_tokens)), keep)

    def rotate_values(self, v: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The values v (B, num_heads, T | K, head_dim) as attention averages them: unchanged by default. A scheme
        that rotates values by their keys' positions returns R(p_j) v_j (``keep``: patch dropout's kept tokens)."""
        return v

    def unrotate_output(self, o: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Attention's output o (B, num_heads, T | K, head_dim) before the heads merge: unchanged by default; with
        rotated values, R(p_i)^T o_i by each query's position."""
        return o

    def fused_tables(self, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos/sin tables in :func:`~visionpe.rotary.functional.rotary_tables`' layout that rotate q and k exactly as
        :meth:`rotate_tokens` does (``keep``: patch dropout's kept tokens), or None (the default) when this rotation
        is not a rotation by such tables. A rotation that returns them runs on the fused kernel of blocks switched to
        ``rotary_backend="fused"`` (:func:`~visionpe.set_rotary_backend`); the others keep :meth:`rotate_qkv`.

        Shapes: (num_heads | 1, T, head_dim) shared by the batch, or (B, num_heads | 1, T | K, head_dim)."""
        return None

    def rotate_tokens(self, qk: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`rotate`, or :meth:`rotate_kept` when patch dropout kept ``keep``."""
        return self.rotate(qk) if keep is None else self.rotate_kept(qk, keep)

    def rotate_qkv(
        self, qkv: torch.Tensor, batch: int, num_heads: int, keep: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (each (B, num_heads, T, head_dim)) from the fused projection output ``qkv`` (B * T, 3 * num_heads
        * head_dim), q and k rotated (:meth:`rotate_tokens`; ``keep`` when ``qkv`` holds patch dropout's kept
        tokens). Schemes that can rotate inside ``qkv`` override this, so that q, k and v stay views of one buffer.
        """
        qkv = split_heads(qkv, batch, num_heads)
        # split (not slice or unbind): its backward is one cat, without zero-filled gradient buffers
        qk, v = qkv.split([2, 1])
        q, k = self.rotate_tokens(qk, keep).unbind(0)
        if torch.compiler.is_compiling():
            # inductor (torch 2.14) can fix the token stride of the q/k it saves for attention's backward in a graph
            # with dynamic shapes, which then fails at the next image size; the layout copy is fused away
            q, k = q.contiguous(), k.contiguous()
        return q, k, v.squeeze(0)


class IdentityRotation(LayerRotation):
    """No rotary scheme: q and k as they are."""

    def rotate(self, qk: torch.Tensor) -> torch.Tensor:
        return qk

    def rotate_kept(self, qk: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return qk

    def rotate_qkv(
        self, qkv: torch.Tensor, batch: int, num_heads: int, keep: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = split_heads(qkv, batch, num_heads)
        return q, k, v


class ChainedRotation(LayerRotation):
    """Several rotary schemes in one model, applied in order (each to the previous one's output)."""

    def __init__(self, rotations: Sequence[LayerRotation]) -> None:
        if not rotations:
            raise ValueError("rotations must hold at least one LayerRotation, got none")
        self.rotations = tuple(rotations)
        self.num_tokens = self.rotations[0].num_tokens

    @property
    def basis(self) -> torch.Tensor | None:
        return self.rotations[0].basis

    def without_basis(self) -> LayerRotation:
        return ChainedRotation([self.rotations[0].without_basis(), *self.rotations[1:]])

    def rotate(self, qk: torch.Tensor) -> torch.Tensor:
        for rotation in self.rotations:
            qk = rotation.rotate(qk)
        return qk

    def rotate_kept(self, qk: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        for rotation in self.rotations:
            qk = rotation.rotate_kept(qk, keep)
        return qk

    def rotate_values(self, v: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        for rotation in self.rotations:
            v = rotation.rotate_values(v, keep)
        return v

    def unrotate_output(self, o: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        for rotation in reversed(self.rotations):
            o = rotation.unrotate_output(o, keep)
        return o


class RotaryState(ABC):
    """What a rotary scheme's ``prepare`` builds once per forward for all blocks."""

    @abstractmethod
    def layer(self, index: int) -> LayerRotation:
        """The rotation of block ``index``."""
