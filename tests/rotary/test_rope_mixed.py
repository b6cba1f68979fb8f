import pytest
import torch
from timm.layers import RotaryEmbeddingMixed, apply_rot_embed_cat

import visionpe
from visionpe.grid import grid_coords

from .helpers import relative_error


@pytest.mark.parametrize("ndim,grid", [(2, (3, 5)), (3, (2, 3, 5))])
def test_relative_property_for_any_frequencies(ndim, grid):
    rope = visionpe.create_pos_embed("rope_mixed", dim=128, num_heads=2, depth=3, ndim=ndim)
    with torch.no_grad():
        rope.freqs.normal_()  # any f: the angle stays linear in position
    shift = torch.tensor([2.0, -5.0, 9.0][:ndim])
    for layer in range(3):
        assert relative_error(rope.rotate, grid_coords(grid), shift, head_dim=64, layer=layer) < 1e-4


def test_matches_timm_rotary_embedding_mixed():
    dim, depth, heads, grid = 128, 3, 2, (3, 5)
    timm_rope = RotaryEmbeddingMixed(dim=dim, depth=depth, num_heads=heads, temperature=10, grid_indexing="xy")
    rope = visionpe.create_pos_embed("rope_mixed", dim=dim, num_heads=heads, depth=depth)
    assert rope.freqs.shape == timm_rope.freqs.shape  # (2, depth, heads, head_dim // 2)
    with torch.no_grad():
        rope.freqs.copy_(timm_rope.freqs)
    embed = timm_rope.get_embed(grid)  # (depth, heads, N, 2 * head_dim)
    x = torch.randn(2, heads, 15, dim // heads)
    for layer in range(depth):
        expected = apply_rot_embed_cat(x, embed[layer])
        assert torch.allclose(rope.rotate(x, grid_coords(grid), layer), expected, atol=1e-5)


def test_init_magnitudes_and_no_weight_decay():
    rope = visionpe.create_pos_embed("rope_mixed", dim=384, num_heads=6, depth=12)
    mag = torch.linalg.vector_norm(torch.stack([rope.freqs[0, ..., :16], rope.freqs[1, ..., :16]]), dim=0)
    expected = 10 ** (-4 * torch.arange(16) / 64)
    assert torch.allclose(mag, expected.expand_as(mag), atol=1e-6)
    assert torch.allclose(mag[0, 0, :3], torch.tensor([1.0, 0.866, 0.750]), atol=1e-3)
    assert rope.no_weight_decay() == {"freqs"}


def test_3d_temporal_component_is_non_zero():
    rope = visionpe.create_pos_embed("rope_mixed", dim=128, num_heads=2, depth=2, ndim=3)
    assert rope.freqs.shape[0] == 3 and (rope.freqs[2] != 0).all()


def test_angles_fp32_under_autocast():
    rope = visionpe.create_pos_embed("rope_mixed", dim=128, num_heads=2, depth=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cos, sin = rope.layer_tables(rope.prepare(grid_coords((64, 64))), 0)
    assert cos.dtype == torch.float32 and sin.dtype == torch.float32


def test_state_builds_one_layer_table_at_a_time():
    # per-layer frequencies: prepare keeps coordinates and frequencies, not (depth, heads, N, head_dim) tables
    from visionpe.rotary.base import LayerAngles
    from visionpe.rotary.functional import rotary_angles, rotary_tables

    rope = visionpe.create_pos_embed("rope_mixed", dim=128, num_heads=2, depth=3)
    coords = grid_coords((4, 5))
    state = rope.prepare(coords, num_prefix_tokens=1)
    assert isinstance(state, LayerAngles) and state.coords.shape == (20, 2)
    cos_all, sin_all = rotary_tables(rotary_angles(coords, rope.frequencies()), 1)  # every layer at once
    for layer in range(3):
        cos, sin = rope.layer_tables(state, layer)
        assert cos.shape == (2, 21, 64)
        assert torch.equal(cos, cos_all[layer]) and torch.equal(sin, sin_all[layer])
