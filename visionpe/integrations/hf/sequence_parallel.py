"""Ulysses sequence parallelism for transformers language models with M-RoPE (Qwen2-VL and its relatives).

Each rank holds N / P tokens of the (packed) sequence and their ids: M-RoPE's (3, B, N) rows, or transformers'
packed (4, 1, N) (the text row first). :func:`local_position_embeddings` gives the model's rotary embedding (the
model's own, or the visionpe scheme :func:`~visionpe.integrations.hf.apply_position_scheme` put there) the rank's
own ids, so each rank's cos and sin are those of its global tokens, and every decoder layer rotates q and k locally,
before any exchange: exact, since the rotation is per token. The attention function registered here as
``"visionpe_ulysses"`` (transformers' ``AttentionInterface``) then exchanges heads for tokens
(:func:`~visionpe.parallel.all_to_all`), attends over the whole sequence for H / P heads (the keys of H_kv / P
heads when P divides H_kv, else repeated first) and exchanges back. Its mask comes from the shard's global indices:
causal for a causal module, and within each packed sample of ``cu_seqlens``; it takes no ``attention_mask`` (left
padding under sequence parallelism is a packed row with ``cu_seqlens``).

A forward passes ``sequence_shard=`` (the rank's :class:`~visionpe.parallel.SequenceShard`) and, for a group other
than the default one, ``sequence_group=``; transformers forwards both keyword arguments from the decoder layer to
the attention function::

    enable_ulysses(model)
    shard = shard_sequence(num_tokens, world_size, rank, cu_seqlens=cu_seqlens)
    cos_sin = local_position_embeddings(rotary, hidden, position_ids, shard)
    out = layer(shard_tensor(hidden, shard, 1), position_embeddings=cos_sin, sequence_shard=shard)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...checks import check_instance, check_tensor
from ...parallel import SequenceShard, all_to_all, group_rank, group_size, shard_tensor

__all__ = ["ATTENTION_NAME", "enable_ulysses", "local_position_embeddings", "ulysses_attention"]

ATTENTION_NAME = "visionpe_ulysses"


def _exchange_to_tokens(t: torch.Tensor, shard: SequenceShard, group: Any) -> torch.Tensor:
    """(B, H, n, d) of the local tokens -> (B, H / P, N, d) of every token in global order."""
    size, (B, heads, n, d) = shard.world_size, t.shape
    t = all_to_all(t.unflatten(1, (size, heads // size)).movedim(1, 0), group)
    t = t.permute(1, 2, 0, 3, 4).reshape(B, heads // size, size * n, d)
    return t.index_select(2, torch.argsort(shard.gathered_order).to(t.device))


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sequence_shard: SequenceShard | None = None,
    sequence_group: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function over a sequence sharded across ``sequence_group`` (Ulysses).

    Args:
        module: the attention module (``is_causal`` read from it, True by default).
        query: (B, H, N / P, d) the rank's queries, rotated by its own positions; key, value: (B, H_kv, N / P, d).
        attention_mask: must be None (the mask is built from the shard).
        dropout, scaling: as transformers passes them.
        sequence_shard: the rank's :class:`~visionpe.parallel.SequenceShard` (required).
        sequence_group: the sequence-parallel process group (None: the default one).

    Returns:
        (B, N / P, H, d) attention output of the rank's tokens, and None (no weights).
    """
    check_instance(
        sequence_shard, "sequence_shard", SequenceShard, expected="the rank's visionpe.parallel.SequenceShard"
    )
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(t, name, dtype="floating")
        if t.ndim != 4 or t.shape[2] != sequence_shard.local_tokens:
            raise ValueError(
                f"{name} must be (B, heads, {sequence_shard.local_tokens}, head_dim) for the shard, "
                f"got {tuple(t.shape)}"
            )
    if attention_mask is not None:
        raise ValueError(
            "ulysses_attention builds its mask from the shard (causal, packed samples from cu_seqlens); "
            "attention_mask must be None, got a tensor"
        )
    size, rank = group_size(sequence_group), group_rank(sequence_group)
    if (sequence_shard.world_size, sequence_shard.rank) != (size, rank):
        raise ValueError(
            f"sequence_shard is rank {sequence_shard.rank} of {sequence_shard.world_size}, "
            f"this process is rank {rank} of {size} in sequence_group"
        )
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % size or heads % kv_heads:
        raise ValueError(
            f"Ulysses needs the query heads ({heads}) divisible by the group size {size} and by the key heads "
            f"({kv_heads})"
        )
    if kv_heads % size:  # fewer key/value heads than ranks: each rank gets the copies its query heads read
        key, value = (t.repeat_interleave(heads // kv_heads, 1) for t in (key, value))
    shard = sequence_shard.to(query.device)
    q, k, v = (_exchange_to_tokens(t, shard, sequence_group) for t in (query, key, value))
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    causal = bool(getattr(module, "is_causal", True))
    mask = None
    if shard.cu_seqlens is not None:
        segments = shard.segment_ids
        mask = segments[:, None] == segments[None, :]
        if causal:
            mask = mask.tril()
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal and mask is None, scale=scaling
    )  # (B, H / P, N, d)
    B, _, _, d = out.shape
    out = out.index_select(2, shard.gathered_order).reshape(B, q.shape[1], size, -1, d).permute(2, 0, 1, 3, 4)
    out = all_to_all(out, sequence_group).movedim(0, 1).flatten(1, 2)  # (B, H, n, d)
    return out.transpose(1, 2).contiguous(), None


def enable_ulysses(model: nn.Module) -> nn.Module:
    """Register :func:`ulysses_attention` with transformers as ``"visionpe_ulysses"`` and make it the attention of
    ``model`` (a transformers model or a module holding its config as ``config``); returns ``model``."""
    check_instance(model, "model", nn.Module, expected="a transformers model")
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise TypeError(f"model must carry a transformers config (model.config), {type(model).__name__} has none")
    from transformers import AttentionInterface  # noqa: PLC0415 - transformers is optional for the package

    AttentionInterface.register(ATTENTION_NAME, ulysses_attention)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTENTION_NAME)
    else:
        config._attn_implementation = ATTENTION_NAME
    return model


def local_position_embeddings(
    rotary: nn.Module, hidden_states: torch.Tensor, position_ids: torch.Tensor, shard: SequenceShard
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rank's tokens from its own ids: ``rotary(hidden_states, shard of position_ids)``.

    Args:
        rotary: the language model's rotary embedding (``model.model.language_model.rotary_emb``).
        hidden_states: the rank's (B, N / P, C) hidden states (their dtype and device are read).
        position_ids: the whole sequence's ids, (3, B, N) M-RoPE rows, (4, B, N) packed with the text row first (it
            is dropped, as transformers does), or (B, N).
        shard: the rank's :class:`~visionpe.parallel.SequenceShard`.
    """
    check_instance(rotary, "rotary", nn.Module, expected="a rotary embedding module")
    check_tensor(position_ids, "position_ids", dtype="real")
    check_tensor(hidden_states, "hidden_states", dtype="floating")
    if position_ids.ndim == 3 and position_ids.shape[0] == 4:
        position_ids = position_ids[1:]
    if position_ids.ndim not in (2, 3) or (position_ids.ndim == 3 and position_ids.shape[0] != 3):
        raise ValueError(f"position_ids must be (3, B, N), (4, B, N) or (B, N), got {tuple(position_ids.shape)}")
    local = shard_tensor(position_ids, shard, -1)
    if hidden_states.shape[:2] != (local.shape[-2], local.shape[-1]):
        raise ValueError(
            f"hidden_states must be the rank's (B, {local.shape[-1]}, C) for ids of batch {local.shape[-2]}, "
            f"got {tuple(hidden_states.shape)}"
        )
    return rotary(hidden_states, local)
