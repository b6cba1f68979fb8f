"""RoPE scaling (linear, dynamic NTK, YaRN) in MultimodalRotary, and its buffers on the meta device."""

import copy
import math

import pytest
import torch

from visionpe.multimodal import MultimodalRotary
from visionpe.multimodal.allocation import ALLOCATIONS, build_allocation
from visionpe.multimodal.rotary import ROPE_TYPES, RopeScaling

HEAD_DIM, BASE = 16, 1e4


def _default_inv_freq(base=BASE, dim=HEAD_DIM, dtype=torch.float64):
    return 1.0 / base ** (torch.arange(0, dim, 2, dtype=dtype) / dim)


def _ids(length, batch=2, offset=0):
    """(3, B, L) ids whose rows differ, so that the allocation matters."""
    t = torch.arange(offset, offset + length)
    return torch.stack([t, t // 2, t % 5])[:, None].expand(3, batch, length).contiguous()


def test_linear_scaling_is_position_interpolation():
    # theta_n / s at id p is theta_n at id p / s: the scaled tables equal the default ones at ids divided by s.
    scaled = MultimodalRotary(
        HEAD_DIM, base=BASE, mrope_section=(2, 3, 3), rope_scaling={"rope_type": "linear", "factor": 4.0}
    )
    plain = MultimodalRotary(HEAD_DIM, base=BASE, mrope_section=(2, 3, 3))
    ids = _ids(40)
    torch.testing.assert_close(scaled(ids)[0], plain(ids.double() / 4)[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(scaled.inv_freq, (_default_inv_freq() / 4).float(), rtol=1e-6, atol=0)
    assert scaled.attention_scaling == 1.0
    assert not torch.allclose(scaled(ids)[0], plain(ids)[0])


def _naive_yarn(factor, original, beta_fast=32.0, beta_slow=1.0, base=BASE, dim=HEAD_DIM):
    """YaRN written pair by pair: ramp over pair index between the pairs turning beta_fast and beta_slow times."""

    def pair_turning(rotations):  # the pair n with original / (2 pi / theta_n) = rotations
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(pair_turning(beta_fast)), 0), min(math.ceil(pair_turning(beta_slow)), dim - 1)
    out = []
    for n in range(dim // 2):
        theta = base ** (-2 * n / dim)
        ramp = min(max((n - low) / (high - low), 0.0), 1.0)  # 0: keep theta, 1: theta / factor
        out.append(theta / factor * ramp + theta * (1 - ramp))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("factor, original", [(4.0, 64), (2.0, 1000), (8.0, 16)])
def test_yarn_frequencies_and_attention_factor_follow_the_formula(factor, original):
    rot = MultimodalRotary(
        HEAD_DIM,
        base=BASE,
        allocation="lta",
        mrope_section=(2, 3, 3),
        rope_scaling={"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original},
    )
    expected = _naive_yarn(factor, original)
    torch.testing.assert_close(rot.inv_freq.double(), expected, rtol=1e-6, atol=0)
    assert rot.inv_freq[0] == 1.0 and torch.isclose(rot.inv_freq[-1].double(), expected[-1], rtol=1e-6)
    mscale = 0.1 * math.log(factor) + 1
    assert rot.attention_scaling == pytest.approx(mscale)
    # cos and sin carry YaRN's factor: the tables are mscale * (cos, sin) of the scaled angles
    ids = _ids(30)
    phi = rot.angles(ids)
    cos, sin = rot(ids)
    torch.testing.assert_close(cos, torch.cat((phi, phi), -1).cos() * mscale, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, torch.cat((phi, phi), -1).sin() * mscale, rtol=0, atol=1e-6)
    # fp64 ids take the same frequencies in fp64
    torch.testing.assert_close(rot.angles(ids.double()).float(), phi, rtol=1e-6, atol=1e-5)


def test_yarn_options():
    scaling = RopeScaling("yarn", max_position_embeddings=256, original_max_position_embeddings=64)
    assert scaling.yarn_factor == 4.0  # without a factor: max / original
    assert scaling.attention_scaling == pytest.approx(0.1 * math.log(4) + 1)
    both = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=64, mscale=2.0, mscale_all_dim=1.0)
    assert both.attention_scaling == pytest.approx((0.2 * math.log(4) + 1) / (0.1 * math.log(4) + 1))
    given = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=64, attention_factor=1.5)
    assert MultimodalRotary(HEAD_DIM, mrope_section=(2, 3, 3), rope_scaling=given).attention_scaling == 1.5
    narrow = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=4.0, beta_slow=2.0)
    assert not torch.equal(
        narrow.inverse_frequencies(BASE, HEAD_DIM),
        RopeScaling("yarn", factor=4.0, original_max_position_embeddings=64).inverse_frequencies(BASE, HEAD_DIM),
    )
    torch.testing.assert_close(
        narrow.inverse_frequencies(BASE, HEAD_DIM, dtype=torch.float64),
        _naive_yarn(4.0, 64, beta_fast=4.0, beta_slow=2.0),
        rtol=1e-12,
        atol=0,
    )


def _ntk_inv_freq(length, limit, factor, base=BASE, dim=HEAD_DIM):
    grown = base * (factor * length / limit - (factor - 1)) ** (dim / (dim - 2))
    return _default_inv_freq(grown, dim)


def test_dynamic_ntk_grows_with_the_longest_length_and_resets_below_the_limit():
    limit, factor = 32, 2.0
    rot = MultimodalRotary(
        HEAD_DIM,
        base=BASE,
        mrope_section=(2, 3, 3),
        rope_scaling={"rope_type": "dynamic", "factor": factor, "max_position_embeddings": limit},
    )
    plain = MultimodalRotary(HEAD_DIM, base=BASE, mrope_section=(2, 3, 3))
    short = _ids(20)
    assert torch.equal(rot(short)[0], plain(short)[0])  # within the limit: no scaling
    rot(_ids(50))  # s = 50 > 32: the base grows for s
    torch.testing.assert_close(rot.inv_freq.double(), _ntk_inv_freq(50, limit, factor), rtol=1e-5, atol=0)
    cos, _ = rot(_ids(40))  # 32 < 40 < 50: the frequencies of the longest length seen stay
    torch.testing.assert_close(rot.inv_freq.double(), _ntk_inv_freq(50, limit, factor), rtol=1e-5, atol=0)
    phi = (_ids(40).permute(1, 2, 0).double() @ rot.mix.double().T) * _ntk_inv_freq(50, limit, factor)
    torch.testing.assert_close(cos.double(), torch.cat((phi, phi), -1).cos(), rtol=0, atol=1e-5)
    # fp64 ids read the same state, in fp64
    torch.testing.assert_close(rot.angles(_ids(40).double()).float(), rot.angles(_ids(40)), rtol=1e-6, atol=1e-5)
    # a copy and a move keep the state
    moved = copy.deepcopy(rot).to(torch.bfloat16)
    assert moved.inv_freq.dtype == torch.float32 and torch.equal(moved.inv_freq, rot.inv_freq)
    rot(_ids(10))  # below the limit: back to the unscaled frequencies
    assert torch.equal(rot.inv_freq, plain.inv_freq)
    rot(_ids(60))
    moved.reset_parameters()  # starts afresh
    assert torch.equal(moved.inv_freq, plain.inv_freq) and not torch.equal(rot.inv_freq, plain.inv_freq)
    assert rot.attention_scaling == 1.0


def test_scaling_applies_to_head_wise_allocations():
    scaling = {"rope_type": "linear", "factor": 2.0}
    rot = MultimodalRotary(HEAD_DIM, allocation="head", num_kv_heads=4, rope_scaling=scaling)
    plain = MultimodalRotary(HEAD_DIM, allocation="head", num_kv_heads=4)
    ids = _ids(12)
    torch.testing.assert_close(rot.angles(ids), plain.angles(ids) / 2, rtol=1e-6, atol=0)


def test_transformers_rope_functions_give_the_same_frequencies():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = {
        "linear": {"factor": 3.0},
        "dynamic": {"factor": 2.0},
        "yarn": {"factor": 4.0, "original_max_position_embeddings": 24, "beta_fast": 16.0},
    }
    for rope_type, extra in cases.items():
        params = {"rope_type": rope_type, "rope_theta": 1e6, "mrope_section": [2, 3, 3], **extra}
        config = transformers.Qwen2VLTextConfig(
            hidden_size=64, num_attention_heads=4, max_position_embeddings=32, rope_parameters=dict(params)
        )
        scaling = RopeScaling.from_rope_parameters(config.rope_parameters, config.max_position_embeddings)
        for seq_len in (None, torch.tensor(77)):
            if seq_len is not None and rope_type != "dynamic":
                continue
            ref, ref_scale = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)
            ours = scaling.inverse_frequencies(1e6, HEAD_DIM, seq_len=seq_len)
            assert torch.equal(ours, ref), rope_type
            assert scaling.attention_scaling == ref_scale


@pytest.mark.parametrize(
    "scaling, error, message",
    [
        ({"rope_type": "longrope", "factor": 2.0}, ValueError, r"rope_type must be one of \('default', 'linear'"),
        ({"rope_type": 3}, TypeError, "rope_type must be a rope type name"),
        ({"rope_type": "linear"}, ValueError, "rope_type 'linear' needs a factor, got None"),
        ({"rope_type": "linear", "factor": -1.0}, ValueError, "factor must be positive and finite, got -1.0"),
        (
            {"rope_type": "linear", "factor": 2.0, "beta_fast": 4.0},
            ValueError,
            "beta_fast does not apply to rope_type 'linear'",
        ),
        ({"rope_type": "default", "factor": 2.0}, ValueError, "factor does not apply to rope_type 'default'"),
        (
            {"rope_type": "dynamic", "factor": 2.0},
            TypeError,
            "max_position_embeddings must be a positive int, got NoneType",
        ),
        ({"rope_type": "yarn", "factor": 2.0}, TypeError, "original_max_position_embeddings must be a positive int"),
        (
            {"rope_type": "yarn", "original_max_position_embeddings": 8},
            ValueError,
            "needs a factor, or max_position_embeddings",
        ),
        (
            {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8, "truncate": 1},
            TypeError,
            "truncate must be a bool",
        ),
        (
            {"rope_type": "linear", "factor": 2.0, "scale": 1},
            ValueError,
            r"rope_scaling has unknown key\(s\) \['scale'\]",
        ),
    ],
)
def test_bad_scaling_is_refused_naming_the_field(scaling, error, message):
    with pytest.raises(error, match=message):
        MultimodalRotary(HEAD_DIM, mrope_section=(2, 3, 3), rope_scaling=scaling)


def test_other_bad_scaling_arguments():
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8}
    with pytest.raises(ValueError, match="set rope_scaling's attention_factor instead of attention_scaling=2.0"):
        MultimodalRotary(HEAD_DIM, mrope_section=(2, 3, 3), rope_scaling=yarn, attention_scaling=2.0)
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 8}
    with pytest.raises(ValueError, match="head_dim must be >= 4, got 2"):
        MultimodalRotary(2, allocation="single_axis", rope_scaling=dynamic)
    with pytest.raises(TypeError, match="rope_scaling must be a RopeScaling, a dict of its fields or None, got str"):
        MultimodalRotary(HEAD_DIM, mrope_section=(2, 3, 3), rope_scaling="yarn")
    with pytest.raises(ValueError, match=r"rope_parameters\['rope_type'\] must be one of .*got 'llama3'"):
        RopeScaling.from_rope_parameters({"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match=r"partial_rotary_factor'\] must be 1"):
        RopeScaling.from_rope_parameters({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5})
    with pytest.raises(TypeError, match="rope_parameters must be a mapping"):
        RopeScaling.from_rope_parameters([("rope_type", "linear")])
    assert RopeScaling.from_rope_parameters(None) == RopeScaling()
    # transformers' defaults: original length = max length, beta 0 / None -> 32 / 1, legacy "type" key
    read = RopeScaling.from_rope_parameters({"type": "yarn", "factor": 2.0, "beta_fast": None, "rope_theta": 1.0}, 64)
    assert read == RopeScaling("yarn", factor=2.0, max_position_embeddings=64, original_max_position_embeddings=64)
    assert set(ROPE_TYPES) == {"default", "linear", "dynamic", "yarn"}


SECTIONS = {"chunked": (2, 3, 3), "lta": (2, 3, 3), "hope": (2, 3, 3), "ppe_split": (2, 3, 3), "interleaved": (4, 2, 2)}


@pytest.mark.parametrize("name", list(ALLOCATIONS))
def test_allocations_build_inside_a_meta_device_context(name):
    kwargs = {"num_kv_heads": 4} if name == "head" else {"mrope_section": SECTIONS[name]} if name in SECTIONS else {}
    ref = build_allocation(name, num_pairs=8, **kwargs)
    with torch.device("meta"):
        allocation = build_allocation(name, num_pairs=8, **kwargs)
    assert allocation.mix.device.type == "cpu" and torch.equal(allocation.mix, ref.mix)


# (PPE's multi-position split has its own rotary, PPERotary)
@pytest.mark.parametrize("name", [a for a in ALLOCATIONS if a != "ppe_split"])
def test_rotary_built_on_meta_is_right_after_to_empty(name):
    kwargs = {"num_kv_heads": 4} if name == "head" else {"mrope_section": SECTIONS[name]} if name in SECTIONS else {}
    scaling = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}
    ref = MultimodalRotary(HEAD_DIM, base=BASE, allocation=name, rope_scaling=scaling, **kwargs)
    with torch.device("meta"):
        rot = MultimodalRotary(HEAD_DIM, base=BASE, allocation=name, rope_scaling=scaling, **kwargs)
    assert rot.inv_freq.is_meta and rot.mix.is_meta
    rot.to_empty(device="cpu")  # uninitialised memory, replaced by the tables
    assert torch.equal(rot.inv_freq, ref.inv_freq) and torch.equal(rot.mix, ref.mix)
    ids = _ids(9)
    assert all(torch.equal(a, b) for a, b in zip(rot(ids), ref(ids), strict=True))
    # also for a rotary built on the CPU and emptied: to_empty never leaves garbage in the tables
    emptied = copy.deepcopy(ref).to_empty(device="cpu")
    assert torch.equal(emptied.inv_freq, ref.inv_freq) and torch.equal(emptied.mix, ref.mix)
    assert not any(True for _ in rot.state_dict())  # non-persistent: nothing to load


def test_moves_keep_fp32_tables_and_casts_of_wider_ones():
    rot = MultimodalRotary(HEAD_DIM, mrope_section=(2, 3, 3))
    ref = rot.inv_freq.clone()
    assert rot.half().inv_freq.dtype == torch.float32 and torch.equal(rot.inv_freq, ref)
    assert rot.double().inv_freq.dtype == torch.float64 and torch.equal(rot.inv_freq, ref.double())
    assert rot.mix.dtype == torch.float64
