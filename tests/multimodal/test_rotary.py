import pytest
import torch

from visionpe.multimodal import (
    MultimodalRotary,
    apply_multimodal_rotary,
    build_allocation,
    get_position_ids,
    list_multimodal_schemes,
)


def axes(name, **kw):
    return build_allocation(name, **kw).axis_of()


def test_chunked_allocation_qwen2vl():
    got = axes("chunked", num_pairs=64, mrope_section=(16, 24, 24))
    assert got == [0] * 16 + [1] * 24 + [2] * 24


@pytest.mark.parametrize("section, pairs", [((24, 20, 20), 64), ((11, 11, 10), 32)])
def test_interleaved_allocation_index_sets(section, pairs):
    got = axes("interleaved", num_pairs=pairs, mrope_section=section)
    h = [n for n, a in enumerate(got) if a == 1]
    w = [n for n, a in enumerate(got) if a == 2]
    assert h == list(range(1, 3 * section[1], 3)) and w == list(range(2, 3 * section[2], 3))
    if pairs == 64:
        assert [n for n, a in enumerate(got) if a == 0] == list(range(0, 60, 3)) + [60, 61, 62, 63]
    else:
        assert h[-1] == 31 and w[-1] == 29


def test_lta_hope_vrope_and_head_allocations():
    lta = axes("lta", num_pairs=64, mrope_section=(16, 24, 24))
    assert lta == [1, 2] * 24 + [0] * 16
    assert axes("hope", num_pairs=64) == [1, 2] * 24 + [-1] * 16
    assert axes("vrope", num_pairs=8) == [0, 1, 2, -2] * 2
    assert build_allocation("vrope", num_pairs=4).mix[3].tolist() == [-1.0, 1.0, 1.0]
    assert axes("head", num_pairs=64, num_kv_heads=8) == [0, 0, 1, 1, 1, 2, 2, 2]
    assert axes("head", num_pairs=64, num_kv_heads=8, mrope_section=(2, 2, 2)) == [0, 0, 1, 1, 2, 2, -1, -1]
    with pytest.raises(ValueError, match="must sum to num_pairs=64"):
        build_allocation("chunked", num_pairs=64, mrope_section=(16, 24, 20))
    with pytest.raises(ValueError, match="unknown allocation 'spiral'"):
        build_allocation("spiral", num_pairs=4)


def rope_1d(positions, head_dim, base):
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    phi = positions.float()[..., None] * inv
    return torch.cat((phi, phi), -1).cos(), torch.cat((phi, phi), -1).sin()


@pytest.mark.parametrize("scheme", [s for s in list_multimodal_schemes() if s not in ("hope", "mhrope")])
def test_text_only_equals_1d_rope(scheme):
    types = torch.zeros(2, 9, dtype=torch.long)
    pos, _ = get_position_ids(scheme, types)
    rot = MultimodalRotary.from_scheme(scheme, 128, base=1e6)
    cos, sin = rot(pos)
    ref_cos, ref_sin = rope_1d(torch.arange(9).expand(2, -1), 128, 1e6)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_hope_text_only_is_not_1d_rope_lowest_bands_identity():
    pos, _ = get_position_ids("hope", torch.zeros(1, 3000, dtype=torch.long))
    cos, sin = MultimodalRotary.from_scheme("hope", 128, base=1e4)(pos)
    ref_cos, _ = rope_1d(torch.arange(3000)[None], 128, 1e4)
    low = torch.cat([torch.arange(48, 64), torch.arange(112, 128)])
    assert (cos[..., low] == 1).all() and (sin[..., low] == 0).all()
    assert not torch.allclose(cos, ref_cos)
    assert torch.equal(cos[..., :48], ref_cos[..., :48])


def test_mhrope_heads_text_only():
    pos, _ = get_position_ids("mhrope", torch.zeros(2, 6, dtype=torch.long))
    rot = MultimodalRotary.from_scheme("mhrope", 16, base=1e4, num_kv_heads=4, mrope_section=(1, 1, 1))
    cos, sin = rot(pos)
    assert cos.shape == (2, 4, 6, 16)
    ref_cos, ref_sin = rope_1d(torch.arange(6).expand(2, -1), 16, 1e4)
    for head in range(3):
        assert torch.equal(cos[:, head], ref_cos) and torch.equal(sin[:, head], ref_sin)
    assert (cos[:, 3] == 1).all() and (sin[:, 3] == 0).all()


def test_mhrope_apply_maps_query_heads_to_kv_heads():
    rot = MultimodalRotary(8, allocation="head", num_kv_heads=2, mrope_section=(1, 1, 0))
    pos = torch.stack([torch.arange(5), torch.arange(5) * 3, torch.zeros(5, dtype=torch.long)])[:, None]
    cos, sin = rot(pos)
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    q_rot, k_rot = apply_multimodal_rotary(q, k, cos, sin)
    for g in range(4):
        expect, _ = apply_multimodal_rotary(q[:, g : g + 1], q[:, g : g + 1], cos[:, g // 2], sin[:, g // 2])
        assert torch.allclose(q_rot[:, g : g + 1], expect)
    assert torch.allclose(k_rot[:, 1:], apply_multimodal_rotary(k[:, 1:], k[:, 1:], cos[:, 1], sin[:, 1])[1])


def test_relative_property_and_partial_rotation():
    rot = MultimodalRotary(16, allocation="chunked", mrope_section=(4, 2, 2))
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(pq, pk):
        cq, sq = rot(torch.tensor(pq).view(3, 1, 1))
        ck, sk = rot(torch.tensor(pk).view(3, 1, 1))
        qr, _ = apply_multimodal_rotary(q, q, cq, sq)
        _, kr = apply_multimodal_rotary(k, k, ck, sk)
        return (qr * kr).sum()

    assert torch.allclose(score([3, 5, 7], [1, 2, 3]), score([12, 13, 14], [10, 10, 10]), atol=1e-5)
    cos, sin = rot(torch.zeros(3, 1, 1, dtype=torch.long) + 4)
    q_rot, _ = apply_multimodal_rotary(torch.randn(1, 2, 1, 24), torch.randn(1, 2, 1, 24), cos, sin)
    assert q_rot.shape == (1, 2, 1, 24)


def test_fp32_angles_under_autocast_and_float_ids():
    rot = MultimodalRotary.from_scheme("v2pe", 64, base=1e4)
    pos, _ = get_position_ids("v2pe", torch.tensor([[0, 1, 1, 1, 1, 0]]), torch.tensor([[1, 4, 4]]), delta=0.25)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cos, sin = rot(pos)
    assert cos.dtype == torch.float32
    assert torch.allclose(cos[0, 1, 0], torch.cos(torch.tensor(0.25)))
    with pytest.raises(ValueError, match=r"position_ids must be \(3, B, L\)"):
        rot(torch.zeros(2, 2, 2, 2))


def test_matches_transformers_rotary_tables():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    pos = torch.randint(0, 5000, (3, 2, 7))
    for cls, section, name in (
        (Qwen2VLRotaryEmbedding, [4, 6, 6], "chunked"),
        (Qwen3VLTextRotaryEmbedding, [6, 5, 5], "interleaved"),
    ):
        config = transformers.Qwen2VLTextConfig(
            hidden_size=128,
            num_attention_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": section},
        )
        ref_cos, ref_sin = cls(config)(torch.zeros(1, dtype=torch.float32), pos)
        cos, sin = MultimodalRotary(32, base=1e6, allocation=name, mrope_section=tuple(section))(pos)
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
