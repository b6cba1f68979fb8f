"""A visionpe ViT sharded over the sequence on two gloo ranks equals the unsharded model, forward and gradients.

One spawned process group per test function runs every case (spawning costs seconds): rope_axial (rotary) and
alibi2d (bias), Ulysses and ring, contiguous and zig-zag shards, causal and not; then a packed row of two images of
different grids (rope_axial, cu_seqlens) through one sharded block against each image alone.
"""

from __future__ import annotations

import copy

import timm
import torch

import visionpe  # noqa: F401  (registers the models)
from visionpe.attention import PositionContext
from visionpe.parallel import (
    SequenceParallelViT,
    average_gradients,
    enable_sequence_parallel,
    gather_sequence,
    shard_position_context,
    shard_sequence,
    shard_tensor,
)

from .helpers import WORLD, assert_close, averaged, run_on_two_ranks

# 3 x 5 patches and a class token: 16 tokens, 8 per rank, 4 per zig-zag chunk
SMALL = dict(img_size=(48, 80), embed_dim=32, depth=2, num_heads=4, num_classes=3)
CASES = [
    (scheme, mode, layout, causal)
    for scheme in ("rope_axial", "alibi2d")
    for mode in ("ulysses", "ring")
    for layout in ("contiguous", "zigzag")
    for causal in (False, True)
]


def _vit_cases(rank: int) -> list[str]:
    checked = []
    images = torch.randn(2, 3, 48, 80, generator=torch.Generator().manual_seed(1))
    for scheme, mode, layout, causal in CASES:
        torch.manual_seed(0)
        reference = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=scheme, **SMALL)
        sharded = SequenceParallelViT(copy.deepcopy(reference), mode=mode, layout=layout)
        weights = torch.randn(2, 3, generator=torch.Generator().manual_seed(2))
        name = f"{scheme}-{mode}-{layout}-{'causal' if causal else 'full'}"

        expected = reference(images, is_causal=causal)
        (expected * weights).sum().backward()
        out = sharded(images, is_causal=causal)
        (out * weights).sum().backward()
        average_gradients(sharded)
        assert_close(out, expected, f"{name} logits")
        for (key, p), q in zip(reference.named_parameters(), sharded.model.parameters(), strict=True):
            assert_close(q.grad, p.grad, f"{name} gradient of {key}")
        checked.append(name)
    return checked


def test_sharded_vit_matches_unsharded(tmp_path):
    assert run_on_two_ranks(_vit_cases, tmp_path) == [
        f"{s}-{m}-{lay}-{'causal' if c else 'full'}" for s, m, lay, c in CASES
    ]


GRIDS = ((2, 3), (2, 5))  # 6 + 10 = 16 tokens in one row


def _packed_cases(rank: int) -> list[str]:
    checked = []
    for mode in ("ulysses", "ring"):
        for layout in ("contiguous", "zigzag"):
            for causal in (False, True):
                torch.manual_seed(0)
                model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="rope_axial", **SMALL)
                block, scheme = model.blocks[0], model.pos_schemes["rope_axial"]
                coords = [scheme.model_coords(grid, None) for grid in GRIDS]
                x = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
                weights = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(4))

                # reference: each image alone, at its own positions
                outs, start = [], 0
                for c in coords:
                    pos = PositionContext(rotary=[scheme.prepare(c, 0)])
                    outs.append(block(x[:, start : start + len(c)], is_causal=causal, pos=pos))
                    start += len(c)
                (torch.cat(outs, 1) * weights).sum().backward()
                expected, grads = torch.cat(outs, 1).detach(), [p.grad.clone() for p in block.parameters()]

                sharded = copy.deepcopy(block)
                enable_sequence_parallel(sharded, mode=mode, layout=layout)
                shard = shard_sequence(16, WORLD, rank, layout, cu_seqlens=torch.tensor([0, 6, 16]))
                pos = shard_position_context(PositionContext(rotary=[scheme.prepare(torch.cat(coords), 0)]), shard)
                x2 = x.detach().clone().requires_grad_(True)
                local = sharded(shard_tensor(x2, shard, 1), is_causal=causal, pos=pos)
                out = gather_sequence(local, shard, dim=1)
                (out * weights).sum().backward()
                average_gradients(sharded)
                name = f"packed-{mode}-{layout}-{'causal' if causal else 'full'}"
                assert_close(out, expected, f"{name} output")
                assert_close(averaged(x2.grad), x.grad, f"{name} input gradient")
                for p, g in zip(sharded.parameters(), grads, strict=True):
                    assert_close(p.grad, g, f"{name} parameter gradient")
                checked.append(name)
    return checked


def test_sharded_packed_row_matches_each_sample_alone(tmp_path):
    assert len(run_on_two_ranks(_packed_cases, tmp_path)) == 8
