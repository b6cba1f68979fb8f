"""M-RoPE under Ulysses: a decoder layer of a tiny Qwen2-VL patched with visionpe's ``mrope``, its tokens and
(3, B, L) ids sharded on two gloo ranks, each rank's cos/sin from its own ids, equals the unsharded layer (forward
and gradients); and a packed row of two samples ((4, 1, L) ids, cu_seqlens) equals each sample alone."""

from __future__ import annotations

import copy

import pytest
import torch

from visionpe.parallel import average_gradients, gather_sequence, shard_sequence, shard_tensor

from .helpers import WORLD, assert_close, averaged, run_on_two_ranks

transformers = pytest.importorskip("transformers")
from visionpe.integrations.hf import apply_position_scheme  # noqa: E402
from visionpe.integrations.hf.sequence_parallel import enable_ulysses, local_position_embeddings  # noqa: E402

from ..integrations.test_hf import tiny_model  # noqa: E402

L = 16


def _mrope_ids(batch: int, offset: int = 0) -> torch.Tensor:
    """(3, batch, L) ids: 4 text tokens, a 2 x 4 image (one t, its h and w), 4 text tokens; rows shifted per sample."""
    text = torch.arange(4)
    t = torch.cat((text, torch.full((8,), 4), torch.arange(6, 10)))
    h = torch.cat((text, 4 + torch.arange(2).repeat_interleave(4), torch.arange(6, 10)))
    w = torch.cat((text, 4 + torch.arange(4).repeat(2), torch.arange(6, 10)))
    ids = torch.stack((t, h, w))[:, None] + offset
    return ids + torch.arange(batch).view(1, batch, 1)


def _layer_and_rotary():
    torch.manual_seed(0)
    model = apply_position_scheme(tiny_model("qwen2_vl"), "mrope")
    language = model.model.language_model
    language.config._attn_implementation = "sdpa"
    return language.layers[0].train(), language.rotary_emb


def _hf_cases(rank: int) -> list[str]:
    checked = []
    layer, rotary = _layer_and_rotary()
    hidden = torch.randn(2, L, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    weights = torch.randn(2, L, 64, generator=torch.Generator().manual_seed(2))
    ids = _mrope_ids(2)
    expected = layer(hidden, position_embeddings=rotary(hidden, ids))
    (expected * weights).sum().backward()
    for layout in ("contiguous", "zigzag"):
        sharded = copy.deepcopy(layer)
        sharded.zero_grad()
        enable_ulysses(sharded.self_attn)
        shard = shard_sequence(L, WORLD, rank, layout)
        x = hidden.detach().clone().requires_grad_(True)
        local = shard_tensor(x, shard, 1)
        out = sharded(
            local, position_embeddings=local_position_embeddings(rotary, local, ids, shard), sequence_shard=shard
        )
        full = gather_sequence(out, shard, dim=1)
        (full * weights).sum().backward()
        average_gradients(sharded)
        assert_close(full, expected, f"mrope-{layout} output")
        assert_close(averaged(x.grad), hidden.grad, f"mrope-{layout} input gradient")
        for (key, p), q in zip(layer.named_parameters(), sharded.parameters(), strict=True):
            assert_close(q.grad, p.grad, f"mrope-{layout} gradient of {key}")
        checked.append(f"mrope-{layout}")

    # a packed row: samples of 6 and 10 tokens, transformers' (4, 1, L) ids (text positions first)
    first, second = _mrope_ids(1)[..., :6], _mrope_ids(1)[..., :10]
    packed = torch.cat((first, second), -1)
    packed = torch.cat((torch.cat((torch.arange(6), torch.arange(10))).view(1, 1, L), packed))
    row = hidden[:1].detach()
    alone = [layer(row[:, :6], position_embeddings=rotary(row[:, :6], first))]
    alone.append(layer(row[:, 6:], position_embeddings=rotary(row[:, 6:], second)))
    for layout in ("contiguous", "zigzag"):
        sharded = copy.deepcopy(layer)
        enable_ulysses(sharded.self_attn)
        shard = shard_sequence(L, WORLD, rank, layout, cu_seqlens=torch.tensor([0, 6, L]))
        local = shard_tensor(row, shard, 1)
        out = sharded(
            local, position_embeddings=local_position_embeddings(rotary, local, packed, shard), sequence_shard=shard
        )
        assert_close(gather_sequence(out, shard, dim=1), torch.cat(alone, 1), f"packed-{layout} output")
        checked.append(f"packed-{layout}")
    return checked


def test_mrope_layer_under_ulysses_matches_unsharded(tmp_path):
    assert run_on_two_ranks(_hf_cases, tmp_path) == [
        "mrope-contiguous",
        "mrope-zigzag",
        "packed-contiguous",
        "packed-zigzag",
    ]
