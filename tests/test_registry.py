import pytest

import visionpe
from visionpe.registry import get_scheme_class, register_scheme, unregister_scheme

from .conftest import ALL_SCHEMES


def test_core_schemes_listed_by_kind():
    assert {"none", "learned", "sincos"} <= set(visionpe.list_schemes("absolute"))
    assert {"rope_axial", "rope_mixed"} <= set(visionpe.list_schemes("rotary"))


def test_unknown_scheme_lists_valid_names():
    with pytest.raises(ValueError, match="unknown position scheme 'bogus'.*rope_axial"):
        visionpe.create_pos_embed("bogus", dim=64, num_heads=2)


def test_unknown_option_and_bad_dims():
    with pytest.raises(ValueError, match="unknown option"):
        visionpe.create_pos_embed("rope_axial", dim=64, num_heads=2, temprature=10)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        visionpe.create_pos_embed("rope_axial", dim=64, num_heads=3)
    with pytest.raises(TypeError, match=r"dim must be a positive int, got str \('64'\)"):
        visionpe.create_pos_embed("rope_axial", dim="64", num_heads=2)
    with pytest.raises(ValueError, match="depth must be a positive int, got 0"):
        visionpe.create_pos_embed("rope_axial", dim=64, num_heads=2, depth=0)


# Position parameters that keep weight decay (CPE's PEGs are excluded whole, kernels and biases, as in the released
# Twins / CPVT code): the MLP of the learnable Fourier features and of FIRE (ordinary layers; only the frequencies
# W_r, and FIRE's c and threshold, are excluded), the linear maps from the block's tokens of PaPE, PaPE-RI and Cable
# (ordinary layers, as q/k/v), and SeqPE's per-block Linear(C, 2C) from its position vectors to the q/k multipliers
# (part of the ViT in the reference).
DECAYED_POSITION_PARAMETERS = {
    "fourier": {"encoder.mlp.0.weight", "encoder.mlp.2.weight"},
    "fire": {"fc1_weight", "fc2_weight"},
    "pape": {"ab"},
    "pape_ri": {"curvature"},
    "cable": {"weight"},
    "seqpe": {"qk_weight"},
}


@pytest.mark.parametrize("name", ALL_SCHEMES)
def test_weight_decay_skips_every_learned_position_parameter(name):
    """Learned position tables, frequencies, generators (LieRE, ComRoPE), STRING's P and iRPE's tables are kept out
    of weight decay by timm's optimizer factory (it decays the >= 2-D parameters not in no_weight_decay)."""
    import timm
    from timm.optim import create_optimizer_v2

    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=name, depth=2, img_size=32, patch_size=8)
    optimizer = create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05)
    decayed = {id(p) for group in optimizer.param_groups if group["weight_decay"] > 0 for p in group["params"]}
    prefix = f"pos_schemes.{name}."
    position = {n.removeprefix(prefix): p for n, p in model.named_parameters() if n.startswith(prefix)}
    assert {n for n, p in position.items() if id(p) in decayed} == DECAYED_POSITION_PARAMETERS.get(name, set())


def test_register_and_unregister():
    cls = get_scheme_class("sincos")
    with pytest.raises(ValueError, match="'sincos' is already registered to SinCosPosEmbed"):
        register_scheme("sincos")(type("Other", (cls,), {}))
    assert register_scheme("sincos")(cls) is cls  # the same class again: nothing changes
    assert unregister_scheme("sincos") is cls
    try:
        assert "sincos" not in visionpe.list_schemes()
        with pytest.raises(ValueError, match="unknown position scheme 'sincos'"):
            unregister_scheme("sincos")
    finally:
        register_scheme("sincos")(cls)
    assert visionpe.create_pos_embed("sincos", dim=32, num_heads=2).kind == "absolute"


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: visionpe.list_schemes("video"), ValueError, r"kind must be one of .* or None, got 'video'"),
        (lambda: get_scheme_class(3), TypeError, r"scheme name must be a str, got int \(3\)"),
    ],
)
def test_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()
