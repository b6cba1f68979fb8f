"""Sequence-parallel attention for visionpe models: Ulysses and ring attention, with exact positions.

Each of P ranks holds N / P tokens of the sequence (:mod:`visionpe.parallel.sharding`); norms and MLPs run on the
local tokens, and only attention talks to the other ranks:

- ``mode="ulysses"`` (DeepSpeed-Ulysses, Jacobs et al., arXiv 2309.14509, 2023): an all-to-all turns (N / P tokens,
  H heads) into (N tokens, H / P heads), attention runs over the whole sequence for those heads, and a second
  all-to-all turns it back. H must be divisible by P.
- ``mode="ring"`` (Ring Attention, Liu et al., arXiv 2310.01889, 2023): each rank keeps its queries, the key/value
  chunks travel around the ring (P - 1 point-to-point shifts) and the partial results merge by their log-sum-exp
  (online softmax), so no rank holds more than two chunks of keys and values. With causal attention a chunk whose
  every pair is masked is skipped (its keys and values still travel), which is what the ``"zigzag"`` layout balances.

Positions are those of the global tokens. q and k are rotated on their own rank, before any exchange, by the rows of
the rotary state of their global indices (the path of patch dropout, :meth:`~visionpe.interfaces.rotary.LayerRotation.
rotate_kept`): every rotation is per token, so this is exact for every rotary scheme and costs the rank its own
tokens only; rotary value embeddings rotate v and the output the same way. A bias scheme whose logits depend on the
positions only (``batch_shared_bias``) gives the rows of the rank's queries through
:meth:`~visionpe.interfaces.LayerBias.logits` (``rows=`` slices of the global sequence, in chunks of at most
``bias_chunk_bytes``), of which the ring keeps the columns of the key chunk it holds, and Ulysses the rank's heads:
no (N, N, head_dim) tensor and no (N, N) bias of every head on one rank. Causality and packed samples
(``cu_seqlens``: a token attends within its sample) come from the global indices too.

Refused, with :class:`~visionpe.contract.UnsupportedSchemeError` and the reason (:func:`sequence_parallel_refusal`):
schemes that mix tokens outside attention (CPE's convolution between blocks: ``insert_after``, ``supports_causal``
False), bias schemes whose logits read q, k or the tokens of every position (``needs_tokens``, ``augments_qk``,
``batch_shared_bias`` False: iRPE's contextual modes, Cable, PaPE) or that add a value term from the whole
probability matrix (``needs_probs``: iRPE on v), camera schemes, and schemes reading inputs the sharded model does not
pass (``extra_inputs``). Patch dropout, mixed-resolution batches and an explicit ``attn_mask`` are refused at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from ..attention import PosAttention, PositionContext
from ..base import PositionEncoding
from ..checks import check_bool, check_choice, check_instance
from ..contract import EntryPoint, UnsupportedSchemeError, check_causal, declared, refusal, register_entry_point
from ..interfaces.bias import LayerBias
from ..interfaces.rotary import split_heads
from ..registry import registered_schemes
from .collectives import all_to_all, gather_sequence, group_rank, group_size, ring_shift
from .sharding import LAYOUTS, SequenceShard, shard_sequence, shard_tensor

__all__ = [
    "MODES",
    "SEQUENCE_PARALLEL_ENTRY",
    "SequenceParallelAttention",
    "SequenceParallelViT",
    "ShardedPositionContext",
    "check_sequence_parallel",
    "disable_sequence_parallel",
    "enable_sequence_parallel",
    "sequence_parallel_refusal",
    "shard_position_context",
]

MODES = ("ulysses", "ring")


def _sharding_rule(scheme: Any) -> str | None:
    """Why a scheme (a class: its declared defaults; or a built scheme: its options) cannot run sharded over the
    sequence, or None: tokens mixed outside attention, inputs the sharded model does not pass, and for bias schemes
    logits that read more than the positions, or a value term."""
    extra = sorted(declared(scheme, "extra_inputs", ()))
    if extra:
        return f"reads {' and '.join(extra)}, which the sharded model does not pass"
    if tuple(declared(scheme, "insert_after", ())) or not declared(scheme, "supports_causal", True):
        return (
            "mixes neighbouring tokens outside attention (a convolution over the token grid between blocks), which "
            "needs every token of the grid on one rank"
        )
    if declared(scheme, "kind", None) != "bias":
        return None
    if declared(scheme, "needs_tokens", False) or declared(scheme, "augments_qk", False):
        return "computes its bias from the features of every token (needs_tokens / augments_qk)"
    if declared(scheme, "needs_probs", False):
        return "adds a value term read from the whole attention-probability matrix (needs_probs)"
    if not declared(scheme, "batch_shared_bias", False):
        return "has logits that read q and k (batch_shared_bias=False), not the positions only"
    return None


#: :class:`SequenceParallelViT` (a ``visionpe_vit_*`` model with :func:`enable_sequence_parallel`): one image grid,
#: causal attention, no mixed-resolution batches; its rule (:func:`sequence_parallel_refusal`) refuses the schemes
#: that cannot be sharded exactly
SEQUENCE_PARALLEL_ENTRY = register_entry_point(
    EntryPoint(
        name="visionpe.parallel.SequenceParallelViT",
        argument="pos_embed",
        kinds=("absolute", "rotary", "bias"),
        causal=True,
        mixed_resolution=False,
        label="sequence parallel",
        rule=_sharding_rule,
    )
)


def sequence_parallel_refusal(name: str, scheme: PositionEncoding) -> str | None:
    """Why the built ``scheme`` (registered as ``name``) cannot run sharded over the sequence, or None.

    The contract's rules for :data:`SEQUENCE_PARALLEL_ENTRY` read on the built scheme (its options: iRPE in bias
    mode shards, its default contextual mode does not), or for a scheme outside the registry the entry point's rule
    alone: tokens mixed outside attention (``insert_after``, ``supports_causal``), ``extra_inputs``, and for bias
    schemes logits that read more than the positions (``needs_tokens``, ``augments_qk``, ``batch_shared_bias``) or a
    value term (``needs_probs``).
    """
    check_instance(scheme, "scheme", PositionEncoding, expected="a visionpe PositionEncoding")
    if name in registered_schemes():
        return refusal(SEQUENCE_PARALLEL_ENTRY, name, scheme)
    reason = _sharding_rule(scheme)
    return None if reason is None else f"{name!r} {reason}"


def check_sequence_parallel(model: nn.Module) -> None:
    """:class:`~visionpe.contract.UnsupportedSchemeError` unless every position scheme of ``model`` (its
    ``pos_schemes``, or every :class:`~visionpe.base.PositionEncoding` in it) can run sharded over the sequence."""
    check_instance(model, "model", nn.Module, expected="a torch.nn.Module")
    schemes = getattr(model, "pos_schemes", None)
    if isinstance(schemes, nn.ModuleDict):
        items = list(schemes.items())
    else:
        items = [(getattr(m, "scheme_name", type(m).__name__), m) for m in model.modules()]
        items = [(n, m) for n, m in items if isinstance(m, PositionEncoding)]
    for name, scheme in items:
        reason = sequence_parallel_refusal(name, scheme)
        if reason is not None:
            raise UnsupportedSchemeError(f"{SEQUENCE_PARALLEL_ENTRY.name} cannot use pos_embed={name!r}: {reason}")


@dataclass
class ShardedPositionContext(PositionContext):
    """A :class:`~visionpe.attention.PositionContext` built for the whole sequence, with the ``shard`` this rank
    holds and the sequence-parallel process ``group`` (None: the default one). :class:`SequenceParallelAttention`
    takes only this context."""

    shard: SequenceShard | None = None
    group: Any = None


def shard_position_context(pos: PositionContext, shard: SequenceShard, group: Any = None) -> ShardedPositionContext:
    """``pos`` (the states of the whole sequence) with the rank's ``shard`` and ``group``.

    Example:
        >>> from visionpe.parallel import shard_sequence
        >>> ctx = shard_position_context(PositionContext(), shard_sequence(8, 2, 0))
        >>> ctx.shard.index.tolist()
        [0, 1, 2, 3]
    """
    check_instance(pos, "pos", PositionContext, expected="a visionpe PositionContext")
    check_instance(shard, "shard", SequenceShard, expected="a visionpe.parallel.SequenceShard")
    if pos.groups is not None or pos.attn_mask is not None:
        raise ValueError("pos must be the context of one grid: a mixed-resolution batch cannot be sharded")
    if pos.keep is not None:
        raise ValueError("pos must hold every token: patch dropout (keep) cannot be sharded over the sequence")
    values = {f.name: getattr(pos, f.name) for f in fields(PositionContext)}
    return ShardedPositionContext(**values, shard=shard, group=group)


def _blocked(rows: torch.Tensor, cols: torch.Tensor, causal: bool, segments: torch.Tensor | None):
    """(R, C) bool, True where query ``rows`` may not read key ``cols`` (global indices); None when none is."""
    blocked = None
    if causal:
        blocked = cols[None, :] > rows[:, None]
    if segments is not None:
        other = segments[rows][:, None] != segments[cols][None, :]
        blocked = other if blocked is None else blocked | other
    return blocked


def _runs(index: torch.Tensor) -> list[tuple[int, int]]:
    """``index`` (global indices) as (start, stop) runs of consecutive values."""
    values = index.tolist()
    runs, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            runs.append((values[start], values[i - 1] + 1))
            start = i
    return runs


class SequenceParallelAttention(PosAttention):
    """:class:`~visionpe.attention.PosAttention` over a sequence sharded across the ranks of ``sp_group``
    (``sp_mode``: ``"ulysses"`` or ``"ring"``); swapped in by :func:`enable_sequence_parallel`, with the same
    parameters. Takes the rank's tokens (B, N / P, C) and a :class:`ShardedPositionContext`."""

    sp_mode: str = "ulysses"
    sp_group: Any = None

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        pos: PositionContext | None = None,
    ) -> torch.Tensor:
        if not isinstance(pos, ShardedPositionContext) or pos.shard is None:
            raise ValueError(
                "sequence-parallel attention takes the rank's tokens with a ShardedPositionContext "
                f"(visionpe.parallel.shard_position_context), got pos={type(pos).__name__}"
            )
        if attn_mask is not None:
            raise ValueError(
                "sequence-parallel attention builds its mask from the shard (is_causal, packed cu_seqlens); "
                "attn_mask is not taken, got a tensor"
            )
        if pos.groups is not None or pos.attn_mask is not None or pos.keep is not None or pos.camera:
            raise ValueError(
                "sequence-parallel attention takes the context of one grid without patch dropout or cameras"
            )
        if pos.group is not self.sp_group:
            raise ValueError("pos.group must be the group sequence parallelism was enabled with")
        shard = pos.shard.to(x.device)
        B, n, _ = x.shape
        if n != shard.local_tokens:
            raise ValueError(f"x must hold the shard's {shard.local_tokens} tokens (dim 1), got shape {tuple(x.shape)}")
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        q, k, v = split_heads(self.qkv(x), B, self.num_heads).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        rotation = pos.rotation(self.layer)
        keep = shard.index.expand(B, -1)
        if pos.rotary:  # each token by its own global position (patch dropout's path: every scheme, exactly)
            q, k = rotation.rotate_tokens(torch.stack((q, k)), keep).unbind(0)
            v = rotation.rotate_values(v, keep)
        layers = pos.bias_layers(self.layer, x)
        for layer in layers:
            self._check_layer(layer, q, k)
        if self.sp_mode == "ulysses":
            out = self._ulysses(q, k, v, layers, shard, is_causal)
        else:
            out = self._ring(q, k, v, layers, shard, is_causal)
        if pos.rotary:
            out = rotation.unrotate_output(out, keep)
        out = out.transpose(1, 2).reshape(B, n, self.attn_dim)
        out = self.norm(out)
        if gate is not None:
            out = out * gate
        return self.proj_drop(self.proj(out))

    @staticmethod
    def _check_layer(layer: LayerBias, q: torch.Tensor, k: torch.Tensor) -> None:
        augmented = layer.augment_qk(q, k)[0] is not q
        if layer.needs_probs or not layer.batch_shared or augmented:
            raise UnsupportedSchemeError(
                f"sequence-parallel attention cannot shard the bias {type(layer).__name__}: its logits must depend on "
                "the positions only (no value term, no channels appended to q and k, batch_shared)"
            )

    def _bias(
        self,
        layers: list[LayerBias],
        rows: torch.Tensor,
        cols: torch.Tensor | None,
        num_tokens: int,
        like: torch.Tensor,
    ) -> torch.Tensor | None:
        """The summed logits (1, heads, R, C) of the global query ``rows`` over the keys ``cols`` (None: all), from
        the layers' rows of every key in chunks of at most ``bias_chunk_bytes``; None without bias layers."""
        if not layers:
            return None
        head_dim, chunk = like.shape[-1], self.query_chunk_rows(1, num_tokens)
        keys = like.new_zeros(()).expand(1, self.num_heads, num_tokens, head_dim)  # positions-only: shapes are read
        pieces = []
        for start, stop in _runs(rows.cpu()):
            for a in range(start, stop, chunk):
                b = min(stop, a + chunk)
                queries = like.new_zeros(()).expand(1, self.num_heads, b - a, head_dim)
                term = None
                for layer in layers:
                    logits = layer.logits(queries, keys, slice(a, b))
                    if logits is not None:
                        logits = logits.expand(1, self.num_heads, b - a, num_tokens)
                        term = logits if term is None else term + logits
                if term is None:
                    return None
                pieces.append(term if cols is None else term.index_select(-1, cols))
        return torch.cat(pieces, -2)

    def _ulysses(self, q, k, v, layers, shard: SequenceShard, is_causal: bool) -> torch.Tensor:
        group, size = self.sp_group, shard.world_size
        if self.num_heads % size:
            raise ValueError(f"Ulysses needs num_heads divisible by the group size {size}, got {self.num_heads}")
        heads, rank = self.num_heads // size, shard.rank
        order = shard.gathered_order.to(q.device)
        inverse = torch.argsort(order)

        def to_tokens(t: torch.Tensor) -> torch.Tensor:  # (B, H, n, d) -> (B, H / P, N, d), global token order
            B, _, n, d = t.shape
            t = all_to_all(t.unflatten(1, (size, heads)).movedim(1, 0), group)  # slot i: rank i's tokens, my heads
            return t.permute(1, 2, 0, 3, 4).reshape(B, heads, size * n, d).index_select(2, inverse)

        q, k, v = (to_tokens(t) for t in (q, k, v))
        everything = torch.arange(shard.num_tokens, device=q.device)
        mask = self._bias(layers, everything, None, shard.num_tokens, q)
        if mask is not None:
            mask = mask[:, rank * heads : (rank + 1) * heads]
        segments = shard.segment_ids.to(q.device) if shard.cu_seqlens is not None else None
        blocked = _blocked(everything, everything, False, segments)
        if blocked is not None:
            mask = ~blocked if mask is None else mask.masked_fill(blocked, float("-inf"))
        out = self._attend(q, k, v, [], mask, is_causal, None)  # (B, H / P, N, d)
        B, _, _, d = out.shape
        out = out.index_select(2, order).reshape(B, heads, size, -1, d).permute(2, 0, 1, 3, 4)
        out = all_to_all(out, group)  # slot j: head group j of my tokens
        return out.movedim(0, 1).flatten(1, 2)

    def _ring(self, q, k, v, layers, shard: SequenceShard, is_causal: bool) -> torch.Tensor:
        group, size, rank = self.sp_group, shard.world_size, shard.rank
        dtype = torch.promote_types(q.dtype, torch.float32)
        rows = shard.index
        segments = shard.segment_ids.to(q.device) if shard.cu_seqlens is not None else None
        low = torch.finfo(dtype).min  # finite: a row masked so far weighs exp(low - max) = 0 once a key is read
        qs = q.to(dtype) * self.scale
        best = torch.full((*q.shape[:-1], 1), low, dtype=dtype, device=q.device)
        total = torch.zeros_like(best)
        acc = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=dtype, device=q.device)
        kv = torch.stack((k, v))
        for step in range(size):
            if step:
                kv = ring_shift(kv, group)
            cols = shard.indices_of((rank - step) % size).to(q.device)
            blocked = _blocked(rows, cols, is_causal, segments)
            if blocked is not None and bool(blocked.all()):
                if torch.is_grad_enabled() and kv.requires_grad:
                    # the chunk stays in the graph, so that every rank's backward runs the same ring shifts in the same
                    # order (a rank whose chunk was skipped would otherwise leave its neighbour waiting)
                    acc = acc + 0.0 * kv.sum()
                continue
            keys, values = kv.unbind(0)
            scores = qs @ keys.to(dtype).transpose(-2, -1)
            bias = self._bias(layers, rows, cols, shard.num_tokens, q)
            if bias is not None:
                scores = scores + bias.to(dtype)
            if blocked is not None:
                scores = scores.masked_fill(blocked, low)
            new = torch.maximum(best, scores.amax(-1, keepdim=True)).detach()  # a stabiliser: the result is free of it
            weights = torch.exp(scores - new)
            decay = torch.exp(best - new)
            total = total * decay + weights.sum(-1, keepdim=True)
            acc = acc * decay + self.attn_drop(weights) @ values.to(dtype)
            best = new
        return (acc / total).to(q.dtype)


def enable_sequence_parallel(
    model: nn.Module, group: Any = None, mode: str = "ulysses", layout: str = "contiguous"
) -> nn.Module:
    """Make every :class:`~visionpe.attention.PosAttention` of ``model`` a :class:`SequenceParallelAttention` over
    ``group`` (same parameters, in place); return ``model``.

    Args:
        model: a visionpe model (``visionpe_vit_*``) or any module with PosAttention blocks.
        group: the sequence-parallel process group (None: the default one); torch.distributed must be initialised.
        mode: ``"ulysses"`` (all-to-all over heads; num_heads divisible by the group size) or ``"ring"``.
        layout: ``"contiguous"`` or ``"zigzag"``, recorded for :class:`SequenceParallelViT` and the helpers.

    Raises:
        UnsupportedSchemeError: a position scheme that cannot be sharded exactly (:func:`sequence_parallel_refusal`).
    """
    check_instance(model, "model", nn.Module, expected="a torch.nn.Module")
    check_choice(mode, "mode", MODES)
    check_choice(layout, "layout", LAYOUTS)
    size = group_size(group)
    check_sequence_parallel(model)
    attentions = [m for m in model.modules() if isinstance(m, PosAttention)]
    if not attentions:
        raise ValueError(f"model must hold visionpe PosAttention blocks, {type(model).__name__} has none")
    for module in attentions:
        if type(module) not in (PosAttention, SequenceParallelAttention):
            raise TypeError(
                f"enable_sequence_parallel swaps PosAttention itself, got a subclass {type(module).__name__} whose "
                "forward it would bypass"
            )
        if mode == "ulysses" and module.num_heads % size:
            raise ValueError(
                f"mode='ulysses' needs num_heads divisible by the group size {size}, got num_heads={module.num_heads}"
            )
    for module in attentions:
        module.__class__ = SequenceParallelAttention
        module.sp_mode, module.sp_group = mode, group
    model.sequence_parallel = {"group": group, "mode": mode, "layout": layout}
    return model


def disable_sequence_parallel(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_sequence_parallel`: every :class:`SequenceParallelAttention` becomes a PosAttention."""
    check_instance(model, "model", nn.Module, expected="a torch.nn.Module")
    for module in model.modules():
        if type(module) is SequenceParallelAttention:
            module.__class__ = PosAttention
            del module.sp_mode, module.sp_group
    model.__dict__.pop("sequence_parallel", None)
    return model


class SequenceParallelViT(nn.Module):
    """A ``visionpe_vit_*`` model run with its tokens sharded over the ranks of ``group``: every rank embeds the
    image (patch embedding, prefix tokens, absolute schemes), keeps its shard of the tokens through every block
    (norms and MLP on the shard, attention by ``mode``), and gathers the tokens before the final norm and the head.

    Every rank returns what the unsharded model returns; after a backward from that output, the gradients averaged
    over ``group`` (:func:`~visionpe.parallel.average_gradients`, or DDP over the same ranks) are the unsharded
    model's.

    Args:
        model: a :class:`~visionpe.models.vit.VisionPEViT` (modified in place by :func:`enable_sequence_parallel`).
        group, mode, layout: see :func:`enable_sequence_parallel`; prefix tokens + patches must be divisible by the
            group size (twice it for ``"zigzag"``).
    """

    def __init__(self, model: nn.Module, group: Any = None, mode: str = "ulysses", layout: str = "contiguous"):
        super().__init__()
        check_instance(model, "model", nn.Module, expected="a visionpe ViT (visionpe_vit_*)")
        if not all(hasattr(model, a) for a in ("pos_schemes", "_pos_embed_grid", "_run_blocks", "position_context")):
            raise TypeError(f"model must be a visionpe ViT (visionpe_vit_*), got {type(model).__name__}")
        if not isinstance(model.patch_drop, nn.Identity):
            raise ValueError(
                "model must have no patch dropout (patch_drop_rate=0): each sample would keep its own tokens"
            )
        self.model = enable_sequence_parallel(model, group, mode, layout)
        self.group, self.mode, self.layout = group, mode, layout

    def forward_shard(self, x: torch.Tensor, is_causal: bool = False) -> tuple[torch.Tensor, SequenceShard]:
        """Images (B, C, H, W) -> (this rank's tokens after the last block (B, N / P, C), its shard)."""
        model = self.model
        check_bool(is_causal, "is_causal")
        model._check_input(x)
        if is_causal:
            check_causal(SEQUENCE_PARALLEL_ENTRY, model.pos_schemes)
        tokens, grid_size = model._pos_embed_grid(model.patch_embed(x))
        tokens = model.norm_pre(tokens)
        shard = shard_sequence(tokens.shape[1], group_size(self.group), group_rank(self.group), self.layout).to(
            tokens.device
        )
        pos = shard_position_context(model.position_context(grid_size, tokens.device), shard, self.group)

        def insert(scheme, tokens, i):  # refused by enable_sequence_parallel; kept as the hook's contract
            raise UnsupportedSchemeError("schemes run between blocks cannot be sharded over the sequence")

        local = shard_tensor(tokens, shard, 1)
        for out in model._run_blocks(local, pos, None, insert, None, is_causal):
            local = out
        return local, shard

    def forward_features(self, x: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        """Images -> (B, num_prefix_tokens + N, C) normalised tokens, as the unsharded ``forward_features``."""
        local, shard = self.forward_shard(x, is_causal)
        return self.model.norm(gather_sequence(local, shard, self.group, dim=1))

    def forward(self, x: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        """Images -> the model's output (logits), on every rank."""
        return self.model.forward_head(self.forward_features(x, is_causal))
