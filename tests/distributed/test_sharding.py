"""The sharding helpers in one process: round trips, the zig-zag order, packed samples, refusals and bad input."""

from __future__ import annotations

import pytest
import timm
import torch

import visionpe  # noqa: F401  (registers the models)
from visionpe.contract import UnsupportedSchemeError
from visionpe.parallel import (
    check_sequence_parallel,
    merge_shards,
    sequence_parallel_refusal,
    shard_indices,
    shard_sequence,
    shard_tensor,
)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_shards_cover_the_sequence_once_and_merge_back(layout, world_size):
    ids = torch.arange(3 * 2 * 16).view(3, 2, 16)  # M-RoPE's (3, B, L) ids
    shards = [shard_sequence(16, world_size, r, layout) for r in range(world_size)]
    assert torch.cat([s.index for s in shards]).sort().values.tolist() == list(range(16))
    pieces = [shard_tensor(ids, s) for s in shards]
    assert all(p.shape == (3, 2, 16 // world_size) for p in pieces)
    assert torch.equal(merge_shards(pieces, layout), ids)
    tokens = torch.randn(2, 16, 5)  # activations, token dimension 1
    assert torch.equal(merge_shards([shard_tensor(tokens, s, 1) for s in shards], layout, 1), tokens)


def test_zigzag_gives_rank_r_chunks_r_and_2p_minus_1_minus_r():
    assert shard_indices(16, 4, 0, "zigzag").tolist() == [0, 1, 14, 15]
    assert shard_indices(16, 4, 1, "zigzag").tolist() == [2, 3, 12, 13]
    assert shard_indices(16, 4, 3, "zigzag").tolist() == [6, 7, 8, 9]
    assert shard_indices(16, 4, 3, "contiguous").tolist() == [12, 13, 14, 15]
    # causal pairs (i >= j) per rank: zig-zag balances them, contiguous does not
    zigzag = [int(sum(i + 1 for i in shard_indices(16, 4, r, "zigzag").tolist())) for r in range(4)]
    contiguous = [int(sum(i + 1 for i in shard_indices(16, 4, r).tolist())) for r in range(4)]
    assert len(set(zigzag)) == 1 and len(set(contiguous)) == 4


def test_packed_ids_and_cu_seqlens_per_rank():
    cu_seqlens = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    packed = torch.arange(4 * 16).view(4, 1, 16)  # transformers' packed (4, 1, L): text row and M-RoPE rows
    shard = shard_sequence(16, 2, 1, "zigzag", cu_seqlens=cu_seqlens)
    assert shard.index.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert shard.segment_ids.tolist() == [0] * 5 + [1] * 7 + [2] * 4
    assert shard.local_segment_ids.tolist() == [0, 1, 1, 1, 1, 1, 1, 1]
    assert shard.local_cu_seqlens.tolist() == [0, 1, 8]  # token 4 ends sample 0; 5..11 are sample 1
    assert shard.cu_seqlens.tolist() == [0, 5, 12, 16]  # the global view, for attention
    assert shard_tensor(packed, shard)[:, 0, 0].tolist() == [4, 20, 36, 52]
    # rank 0 holds tokens 0..3 and 12..15: a run breaks at the zig-zag seam though both are in samples 0 and 2
    other = shard_sequence(16, 2, 0, "zigzag", cu_seqlens=cu_seqlens)
    assert other.local_cu_seqlens.tolist() == [0, 4, 8]
    seam = shard_sequence(8, 2, 0, "zigzag", cu_seqlens=torch.tensor([0, 8]))  # one sample: tokens 0, 1, 6, 7
    assert seam.local_cu_seqlens.tolist() == [0, 2, 4]


def test_shard_tensor_is_differentiable():
    x = torch.randn(2, 8, 3, requires_grad=True)
    shard_tensor(x, shard_sequence(8, 2, 1), 1).sum().backward()
    assert x.grad[:, 4:].eq(1).all() and x.grad[:, :4].eq(0).all()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: shard_indices(10, 4, 0), "num_tokens must be divisible by world_size = 4"),
        (lambda: shard_indices(12, 4, 0, "zigzag"), r"divisible by 2 \* world_size"),
        (lambda: shard_indices(16, 2, 2), r"rank must be an int in \[0, 1\], got 2"),
        (lambda: shard_indices(16, 2, 0, "striped"), "layout must be one of"),
        (lambda: shard_indices(16, 0, 0), "world_size must be a positive int, got 0"),
        (lambda: shard_sequence(8, 2, 0, cu_seqlens=torch.tensor([0, 3, 7])), "cu_seqlens must rise strictly from 0"),
        (lambda: shard_sequence(8, 2, 0, cu_seqlens=torch.tensor([0, 3, 3, 8])), "every sample non-empty"),
        (lambda: shard_sequence(8, 2, 0, cu_seqlens=torch.tensor([[0, 8]])), "cu_seqlens must be 1-D"),
        (lambda: shard_sequence(8, 2, 0, cu_seqlens=torch.tensor([0.0, 8.0])), "cu_seqlens must be an integer"),
        (lambda: shard_tensor(torch.zeros(2, 6), shard_sequence(8, 2, 0)), "num_tokens=8 along dim=1"),
        (lambda: shard_tensor(torch.zeros(2, 8), shard_sequence(8, 2, 0), dim=2), r"dim must be an int in \[-2, 1\]"),
        (lambda: shard_tensor(torch.zeros(8), [0, 1]), "shard must be a visionpe.parallel.SequenceShard"),
        (lambda: merge_shards([torch.zeros(4), torch.zeros(3)]), "pieces must all have one shape"),
        (lambda: merge_shards([]), "pieces must hold one shard per rank"),
    ],
)
def test_bad_input_names_the_argument(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


def _tiny_vit(pos_embed: str, options: dict):
    shape = dict(embed_dim=32, num_heads=2, depth=1)
    return timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=pos_embed, pos_embed_kwargs=options, **shape)


@pytest.mark.parametrize(
    ("pos_embed", "options", "reason"),
    [
        ("cpe", {}, "mixes neighbouring tokens outside attention"),
        ("cable", {}, "needs_tokens"),
        ("irpe", {"mode": "contextual", "on": "qk"}, "batch_shared_bias=False"),
        ("irpe", {"mode": "contextual", "on": "qkv"}, "needs_probs"),
    ],
)
def test_schemes_that_cannot_be_sharded_are_refused(pos_embed, options, reason):
    model = _tiny_vit(pos_embed, options)
    assert reason in sequence_parallel_refusal(pos_embed, model.pos_schemes[pos_embed])
    with pytest.raises(UnsupportedSchemeError, match=reason):
        check_sequence_parallel(model)


@pytest.mark.parametrize(
    ("pos_embed", "options"), [("rope_axial", {}), ("alibi2d", {}), ("sincos", {}), ("irpe", {"mode": "bias"})]
)
def test_schemes_of_positions_only_are_taken(pos_embed, options):
    model = _tiny_vit(pos_embed, options)
    check_sequence_parallel(model)
