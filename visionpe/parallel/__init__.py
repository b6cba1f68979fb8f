"""Sequence parallelism: position-exact sharding of a sequence's tokens, ids and coordinates across ranks, and
Ulysses and ring attention for visionpe models (:mod:`visionpe.parallel.sharding`,
:mod:`visionpe.parallel.collectives`, :mod:`visionpe.parallel.attention`)."""

from .attention import (
    MODES,
    SEQUENCE_PARALLEL_ENTRY,
    SequenceParallelAttention,
    SequenceParallelViT,
    ShardedPositionContext,
    check_sequence_parallel,
    disable_sequence_parallel,
    enable_sequence_parallel,
    sequence_parallel_refusal,
    shard_position_context,
)
from .collectives import all_to_all, average_gradients, gather_sequence, group_rank, group_size, ring_shift
from .sharding import LAYOUTS, SequenceShard, merge_shards, shard_indices, shard_sequence, shard_tensor

__all__ = [
    "LAYOUTS",
    "MODES",
    "SEQUENCE_PARALLEL_ENTRY",
    "SequenceParallelAttention",
    "SequenceParallelViT",
    "SequenceShard",
    "ShardedPositionContext",
    "all_to_all",
    "average_gradients",
    "check_sequence_parallel",
    "disable_sequence_parallel",
    "enable_sequence_parallel",
    "gather_sequence",
    "group_rank",
    "group_size",
    "merge_shards",
    "ring_shift",
    "sequence_parallel_refusal",
    "shard_indices",
    "shard_position_context",
    "shard_sequence",
    "shard_tensor",
]
