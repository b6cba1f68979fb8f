import pytest
import torch

from visionpe.multimodal import (
    Allocation,
    MultimodalRotary,
    apply_multimodal_rotary,
    build_allocation,
    get_multimodal_scheme,
    get_position_ids,
    list_multimodal_schemes,
    rotate_half,
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


def rope_1d(positions, head_dim, base, dtype=torch.float):
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=dtype) / head_dim))
    phi = positions.to(dtype)[..., None] * inv
    return torch.cat((phi, phi), -1).cos(), torch.cat((phi, phi), -1).sin()


def _turns_every_pair_by_the_id(scheme):
    """Whether the scheme's allocation turns every pair by the id on ids equal on every row (its mix rows sum to 1,
    one table for every head): text-only ids then give 1-D RoPE. Not HoPE (zero-frequency pairs), nor MHRoPE (one
    table per head, some heads unrotated)."""
    entry = get_multimodal_scheme(scheme)
    allocation = build_allocation(entry.allocation, num_pairs=64, num_kv_heads=2, **entry.allocation_kwargs)
    return not allocation.per_head and torch.equal(allocation.mix.sum(-1), torch.ones(len(allocation.mix)))


@pytest.mark.parametrize("scheme", [s for s in list_multimodal_schemes() if _turns_every_pair_by_the_id(s)])
def test_text_only_equals_1d_rope(scheme):
    """All rows are arange exactly. Integer designs (int64 ids) give transformers' fp32 1-D RoPE bit for bit;
    fractional designs (float64 ids) give 1-D RoPE taken in fp64, rounded once to fp32."""
    types = torch.zeros(2, 9, dtype=torch.long)
    pos, _ = get_position_ids(scheme, types)
    assert torch.equal(pos, torch.arange(9).expand(3, 2, -1).to(pos.dtype))
    rot = MultimodalRotary.from_scheme(scheme, 128, base=1e6)
    cos, sin = rot(pos)
    assert cos.dtype == sin.dtype == torch.float32
    ref_cos, ref_sin = rope_1d(torch.arange(9).expand(2, -1), 128, 1e6)
    if pos.dtype == torch.long:
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
        return
    assert pos.dtype == torch.float64
    exact_cos, exact_sin = rope_1d(torch.arange(9).expand(2, -1), 128, 1e6, dtype=torch.float64)
    assert torch.equal(cos, exact_cos.float()) and torch.equal(sin, exact_sin.float())
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=1e-6)


def test_hope_text_only_is_not_1d_rope_lowest_bands_identity():
    pos, _ = get_position_ids("hope", torch.zeros(1, 3000, dtype=torch.long))
    assert pos.dtype == torch.float64  # a fractional design: its angles are taken in fp64
    cos, sin = MultimodalRotary.from_scheme("hope", 128, base=1e4)(pos)
    ref_cos, _ = rope_1d(torch.arange(3000)[None], 128, 1e4, dtype=torch.float64)
    ref_cos = ref_cos.float()
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


def _interleaved_rule(num_pairs, section):
    """The interleaved allocation by the letter, as the official code does: pair n -> h if n % 3 == 1 and
    n < 3 s_h, -> w if n % 3 == 2 and n < 3 s_w, else t."""
    return [
        1 if n % 3 == 1 and n < 3 * section[1] else 2 if n % 3 == 2 and n < 3 * section[2] else 0
        for n in range(num_pairs)
    ]


@pytest.mark.parametrize("num_pairs", range(1, 20))
def test_interleaved_allocation_honours_every_section_it_accepts(num_pairs):
    sections = [(num_pairs - h - w, h, w) for h in range(num_pairs + 1) for w in range(num_pairs + 1 - h)]
    for section in sections:
        rule = _interleaved_rule(num_pairs, section)
        honoured = tuple(rule.count(a) for a in range(3)) == section
        if honoured:
            got = axes("interleaved", num_pairs=num_pairs, mrope_section=section)
            assert got == rule and tuple(got.count(a) for a in range(3)) == section, section
        else:
            with pytest.raises(ValueError, match=rf"mrope_section \({section[0]}, .*num_pairs={num_pairs}"):
                build_allocation("interleaved", num_pairs=num_pairs, mrope_section=section)


@pytest.mark.parametrize(
    "num_pairs, section, fits",
    [(32, (10, 11, 11), "s_h <= 11 and s_w <= 10"), (4, (0, 2, 2), "s_h <= 1 and s_w <= 1")],
)
def test_interleaved_allocation_rejects_sections_it_cannot_honour(num_pairs, section, fits):
    # These were accepted and gave (11, 11, 10) and (2, 1, 1) pairs per axis.
    with pytest.raises(ValueError, match=rf"mrope_section \(.*\) does not fit .*num_pairs={num_pairs}.*{fits}"):
        build_allocation("interleaved", num_pairs=num_pairs, mrope_section=section)
    # the largest sections that fit are accepted: Qwen3.5's (11, 11, 10) on 32 pairs
    assert [axes("interleaved", num_pairs=32, mrope_section=(11, 11, 10)).count(a) for a in range(3)] == [11, 11, 10]


def test_rotate_half_checks_its_input():
    assert rotate_half(torch.arange(4.0)).tolist() == [-2.0, -3.0, 0.0, 1.0]
    for bad in (torch.arange(5.0), torch.zeros(2, 0), torch.tensor(1.0)):
        with pytest.raises(ValueError, match=r"x must have an even, non-zero last dimension.*got shape"):
            rotate_half(bad)
    with pytest.raises(TypeError, match="x must be a floating point tensor, got list"):
        rotate_half([1.0, 2.0])
    with pytest.raises(TypeError, match="x must be a floating point tensor, got dtype torch.int64"):
        rotate_half(torch.arange(4))


def test_malformed_allocations_are_rejected():
    with pytest.raises(TypeError, match="mix must be a .* tensor .*got list"):
        Allocation([[1.0, 0.0, 0.0]] * 4)
    with pytest.raises(ValueError, match=r"mix must hold finite weights, got NaN or inf in rows \[0, 1, 2, 3\]"):
        Allocation(torch.full((4, 3), float("nan")))
    with pytest.raises(ValueError, match=r"mix must be \(P, 3\), one row per pair .*got \(4, 2\)"):
        Allocation(torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"mix must be \(P, 3\), one row per pair .*got \(0, 3\)"):
        Allocation(torch.zeros(0, 3))
    with pytest.raises(TypeError, match="mix must be an integer or floating point tensor, got dtype torch.bool"):
        Allocation(torch.ones(4, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="per_head must be a bool, got str"):
        Allocation(torch.eye(3), per_head="yes")
    # an Allocation's mix is a tensor and can be changed in place after construction; MultimodalRotary checks again
    allocation = build_allocation("chunked", num_pairs=4, mrope_section=(2, 1, 1))
    allocation.mix[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"allocation.mix must hold finite weights, got NaN or inf in rows \[1\]"):
        MultimodalRotary(8, allocation=allocation)
    cos, _ = MultimodalRotary(8, allocation=Allocation(torch.eye(3, dtype=torch.long)[[0, 0, 1, 2]]))(
        torch.ones(3, 1, 2)
    )
    assert torch.isfinite(cos).all()


def test_forward_dtype_must_be_a_floating_torch_dtype():
    rot = MultimodalRotary(8, allocation="chunked", mrope_section=(2, 1, 1))
    ids = torch.ones(3, 1, 2)
    with pytest.raises(TypeError, match=r"dtype must be a floating point torch.dtype .*got str \('bf16'\)"):
        rot(ids, dtype="bf16")
    for bad in (torch.int64, torch.bool, torch.complex64):
        with pytest.raises(ValueError, match=f"dtype must be a floating point torch.dtype or None, got {bad}"):
            rot(ids, dtype=bad)
    cos, sin = rot(ids, dtype=torch.float16)
    assert cos.dtype == sin.dtype == torch.float16


def test_build_allocation_name_must_be_a_string():
    with pytest.raises(TypeError, match=r"name must be an allocation name \(str\), one of chunked, .*got list"):
        build_allocation(["chunked"], num_pairs=4)


@pytest.mark.parametrize("scheme", list_multimodal_schemes())
def test_low_precision_tables_are_fp32_tables_cast_at_the_end(scheme):
    # the angles are fp32 whatever the table dtype (and under autocast); only cos and sin are cast.
    kw = {"num_kv_heads": 2} if get_multimodal_scheme(scheme).allocation == "head" else {}  # per-head tables
    rot = MultimodalRotary.from_scheme(scheme, 128, base=1e4, **kw)
    t = 3000.25 + 0.5 * torch.arange(16.0)  # large fractional ids: a bf16 angle would be off by up to 8 rad
    ids = torch.stack([t, t - 1.75, t + 0.125])[:, None].expand(3, 2, 16)
    ref_cos, ref_sin = (table.to(torch.bfloat16) for table in rot(ids, dtype=torch.float32))
    cos, sin = rot(ids, dtype=torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    # the ids discriminate: tables from bf16-rounded angles are different
    phi = rot.angles(ids).bfloat16().float()
    assert not torch.equal(torch.cat((phi, phi), -1).cos().to(torch.bfloat16), ref_cos)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto_cos, auto_sin = rot(ids, dtype=torch.bfloat16)
        auto_cos32, auto_sin32 = rot(ids)
    assert torch.equal(auto_cos, ref_cos) and torch.equal(auto_sin, ref_sin)
    ref_cos32, ref_sin32 = rot(ids)
    assert auto_cos32.dtype == torch.float32
    assert torch.equal(auto_cos32, ref_cos32) and torch.equal(auto_sin32, ref_sin32)
