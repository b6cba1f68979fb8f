"""Diffusion transformers with an absolute sin-cos table (SD3, PixArt, DiT): the table expressed in visionpe equals
the model's at the training size and beyond, the modes (SD3's position interpolation) and the refusals."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import (  # noqa: E402
    DiTTransformer2DModel,
    PixArtTransformer2DModel,
    SD3Transformer2DModel,
    Transformer2DModel,
)
from diffusers.models.embeddings import get_2d_sincos_pos_embed  # noqa: E402

import visionpe  # noqa: E402
from visionpe.absolute.sincos import sincos_2d  # noqa: E402
from visionpe.contract import UnsupportedSchemeError  # noqa: E402
from visionpe.integrations.diffusers import (  # noqa: E402
    apply_position_scheme,
    patched_rotary,
    remove_position_scheme,
)
from visionpe.integrations.diffusers.tables import (  # noqa: E402
    CroppedSinCosPatchEmbed,
    InterpolatedSinCosPatchEmbed,
    grid_positions,
    sincos_table,
)

DIM = 16  # 2 heads of 8 channels


def reference_table(rows: torch.Tensor, cols: torch.Tensor, dim: int) -> torch.Tensor:
    """The released 2-D sin-cos formula, written again: per token [sin(x w), cos(x w), sin(y w), cos(y w)] with x
    the column's position, y the row's, w_k = 10000^(-k / (dim / 4)); float64, tokens row-major."""
    w = 10000.0 ** (-torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))
    out = []
    for y in rows.double().tolist():
        for x in cols.double().tolist():
            out.append(torch.cat([torch.sin(x * w), torch.cos(x * w), torch.sin(y * w), torch.cos(y * w)]))
    return torch.stack(out)


def sd3(pos_embed_max_size: int | None = 16, seed: int = 0) -> SD3Transformer2DModel:
    """Latent 16 x 16, patch 2: a training grid of 8 x 8 patches, the table 16 x 16 (2x the training side)."""
    torch.manual_seed(seed)
    return SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=8,
        caption_projection_dim=DIM,
        pooled_projection_dim=8,
        out_channels=4,
        pos_embed_max_size=pos_embed_max_size,
    ).eval()


def sd3_inputs(height: int, width: int, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, 4, height, width, generator=g),
        encoder_hidden_states=torch.randn(1, 3, 8, generator=g),
        pooled_projections=torch.randn(1, 8, generator=g),
        timestep=torch.tensor([500.0]),
        return_dict=False,
    )


def pixart() -> PixArtTransformer2DModel:
    torch.manual_seed(0)
    return PixArtTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,
        num_layers=1,
        cross_attention_dim=DIM,
        sample_size=16,
        patch_size=2,
        caption_channels=8,
        interpolation_scale=2,
    ).eval()


def dit() -> DiTTransformer2DModel:
    torch.manual_seed(0)
    return DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=1, sample_size=16
    ).eval()


def transformer_2d() -> Transformer2DModel:
    torch.manual_seed(0)
    return Transformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        sample_size=16,
        patch_size=2,
        norm_type="ada_norm_zero",
        num_embeds_ada_norm=1000,
    ).eval()


def interpolated_inputs(model, height: int, width: int, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = dict(
        hidden_states=torch.randn(1, 4, height, width, generator=g), timestep=torch.tensor([500]), return_dict=False
    )
    if isinstance(model, PixArtTransformer2DModel):
        x["encoder_hidden_states"] = torch.randn(1, 3, 8, generator=g)
        x["added_cond_kwargs"] = {"resolution": None, "aspect_ratio": None}
    else:
        x["class_labels"] = torch.tensor([3])
    return x


def run(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]


# the training size, 2x, a non-square grid, a smaller one (odd crop offsets)
SD3_SIZES = [(16, 16), (32, 32), (32, 24), (10, 14)]


def test_table_is_diffusers_table_and_visionpe_layout():
    for dim, size, base, scale in [(16, 16, 8, 1.0), (32, (6, 10), 4, 2.0), (1152, 64, 64, 2.0)]:
        h, w = (size, size) if isinstance(size, int) else size
        ours = sincos_table(grid_positions(h, base, scale), grid_positions(w, base, scale), dim).float()
        theirs = get_2d_sincos_pos_embed(dim, (h, w), base_size=base, interpolation_scale=scale).float()
        assert torch.equal(ours, theirs)
        # the layout of visionpe's sincos_2d (which works in float32) and of the formula written again
        rows, cols = grid_positions(h, base, scale), grid_positions(w, base, scale)
        coords = torch.stack(torch.meshgrid(rows, cols, indexing="ij"), -1).reshape(-1, 2)
        torch.testing.assert_close(ours, sincos_2d(coords, dim), atol=1e-5, rtol=0)
        if dim <= 32:
            torch.testing.assert_close(ours.double(), reference_table(rows, cols, dim), atol=1e-7, rtol=0)


@pytest.mark.parametrize("max_size", [16, None])
def test_sd3_identity_and_state_dict(max_size):
    model = sd3(max_size)
    refs = [run(model, sd3_inputs(*hw)) for hw in SD3_SIZES]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = apply_position_scheme(model)
    module = patched_rotary(model)
    assert report.family == "sd3" and report.train_grid_size == (8, 8) and report.rotary is module
    assert isinstance(module, CroppedSinCosPatchEmbed if max_size else InterpolatedSinCosPatchEmbed)
    for hw, ref in zip(SD3_SIZES, refs, strict=True):
        assert torch.equal(run(model, sd3_inputs(*hw)), ref), hw
    assert module.timestep is not None  # handed over by the model's pre-hook, read by no table mode
    patched = model.state_dict()
    assert list(patched) == list(state)  # SD3's persistent table keeps its key, PixArt-style tables stay out
    assert all(torch.equal(patched[k], v) for k, v in state.items())
    model.load_state_dict(state)  # strict: the same keys load back


@pytest.mark.parametrize("build", [pixart, dit, transformer_2d])
def test_interpolating_tables_identity_at_any_size(build):
    model = build()
    sizes = [(16, 16), (32, 32), (8, 8), (64, 64)]  # training, 2x, 1/2, 4x
    if build is pixart:  # DiT and Transformer2DModel unpatchify square grids only
        sizes += [(32, 24), (64, 8)]
    refs = [run(model, interpolated_inputs(model, *hw)) for hw in sizes]
    keys = list(model.state_dict())
    report = apply_position_scheme(model)
    assert report.family == "pixart" and isinstance(patched_rotary(model), InterpolatedSinCosPatchEmbed)
    for hw, ref in zip(sizes, refs, strict=True):
        assert torch.equal(run(model, interpolated_inputs(model, *hw)), ref), hw
    assert list(model.state_dict()) == keys


def test_remove_restores_the_model_after_a_mode():
    model = sd3()
    own = model.pos_embed
    x = sd3_inputs(32, 32)
    ref = run(model, x)
    apply_position_scheme(model)
    visionpe.set_extrapolation(model, "pi")
    assert not torch.allclose(run(model, x), ref)  # the mode changes the 2x output
    assert remove_position_scheme(model) is model
    assert model.pos_embed is own
    assert torch.equal(run(model, x), ref)
    with pytest.raises(UnsupportedSchemeError, match="no rotary scheme"):
        visionpe.set_extrapolation(model, "pi")


def test_sd3_pi_equals_pixart_positions_on_the_whole_denoiser():
    # a table exactly the training grid: SD3's pi at 2x is the table diffusers builds with pos_embed_max_size=None,
    # which interpolates as PixArt does
    cropped = sd3(pos_embed_max_size=8)
    interpolating = sd3(pos_embed_max_size=None)
    state = {k: v for k, v in cropped.state_dict().items() if k != "pos_embed.pos_embed"}
    interpolating.load_state_dict(state)
    apply_position_scheme(cropped)
    visionpe.set_extrapolation(cropped, "pi")
    for hw in [(16, 16), (32, 32), (32, 48)]:
        torch.testing.assert_close(
            run(cropped, sd3_inputs(*hw)), run(interpolating, sd3_inputs(*hw)), atol=1e-5, rtol=0
        )


def test_sd3_pi_positions_start_at_the_training_crop():
    model = sd3()  # table of 16 patches spaced 1/2 (16 / (16 / 8)); training crop: patches 4..11, from position 2
    apply_position_scheme(model)
    module = patched_rotary(model)
    rows, cols = module.positions(8, 16)
    assert torch.equal(rows, torch.arange(4, 12, dtype=torch.float64) / 2)  # none: the centre crop
    assert torch.equal(cols, torch.arange(16, dtype=torch.float64) / 2)
    visionpe.set_extrapolation(model, "pi")
    rows, cols = module.positions(16, 24)
    # PixArt's positions for the grid (arange(n) / (n / n0) / interpolation_scale, the table's step being 1/2)
    assert torch.allclose(rows, 2.0 + torch.arange(16, dtype=torch.float64) / (16 / 8) / 2, atol=1e-12)
    assert torch.allclose(cols, 2.0 + torch.arange(24, dtype=torch.float64) / (24 / 8) / 2, atol=1e-12)
    table = module.table(16, 24)[0].double()
    torch.testing.assert_close(table, reference_table(rows, cols, DIM), atol=1e-6, rtol=0)
    # within the training grid nothing changes
    assert torch.equal(module.positions(8, 6)[0], torch.arange(4, 12, dtype=torch.float64) / 2)


def test_sd3_pi_per_axis_and_beyond_the_table():
    model = sd3()
    apply_position_scheme(model)
    module = patched_rotary(model)
    visionpe.set_extrapolation(model, "pi", axes=("height",))
    rows, cols = module.positions(16, 16)
    assert torch.allclose(rows, 2.0 + torch.arange(16, dtype=torch.float64) / 4, atol=1e-12)
    assert torch.equal(cols, torch.arange(16, dtype=torch.float64) / 2)  # width keeps the crop
    # compressed positions are computed, not cropped: 24 rows are fine, 24 columns are not
    assert run(model, sd3_inputs(48, 16)).shape == (1, 4, 48, 16)
    with pytest.raises(ValueError, match=r"Width \(24\) cannot be greater than `pos_embed_max_size`: 16"):
        run(model, sd3_inputs(16, 48))
    visionpe.set_extrapolation(model, "pi")
    out = run(model, sd3_inputs(48, 48))
    assert out.shape == (1, 4, 48, 48) and torch.isfinite(out).all()


def test_sd3_beyond_the_table_raises_as_diffusers():
    model = sd3()
    with pytest.raises(ValueError, match=r"Height \(24\) cannot be greater than `pos_embed_max_size`: 16"):
        run(model, sd3_inputs(48, 16))
    apply_position_scheme(model)
    with pytest.raises(ValueError, match=r"Height \(24\) cannot be greater than `pos_embed_max_size`: 16"):
        run(model, sd3_inputs(48, 16))


@pytest.mark.parametrize("build", [sd3, pixart])
def test_modes_without_meaning_are_refused_with_a_reason(build):
    model = build()
    apply_position_scheme(model)
    module = patched_rotary(model)
    reasons = {
        "ntk": "band by band",
        "yarn": "band by band",
        "riflex": "neither rotary bands nor a time axis",
        "dype": "over the diffusion timestep",
    }
    if build is pixart:
        reasons["pi"] = "interpolates positions already"
    for mode, reason in reasons.items():
        with pytest.raises(UnsupportedSchemeError, match=reason):
            visionpe.set_extrapolation(model, mode)
        assert module.extrapolation == "none"
    assert module.accepted_extrapolation() == (("none", "pi") if build is sd3 else ("none",))


def test_sd3_train_grid_beyond_the_table_is_refused():
    model = sd3()
    apply_position_scheme(model)
    with pytest.raises(UnsupportedSchemeError, match="must fit the model's table of 16 x 16 patches"):
        visionpe.set_extrapolation(model, "pi", train_grid_size=(8, 20))
    remove_position_scheme(model)
    with pytest.raises(ValueError, match="must fit the model's table"):
        apply_position_scheme(model, train_grid_size=(17, 8))
    assert getattr(model, "_visionpe_diffusers_patch", None) is None


def test_sd3_table_stored_in_lower_precision():
    # a float32 model loaded from a float16 file: its table holds float16 values, and so does visionpe's
    model = sd3()
    model.pos_embed.pos_embed.copy_(model.pos_embed.pos_embed.half().float())
    refs = [run(model, sd3_inputs(*hw)) for hw in SD3_SIZES[:2]]
    apply_position_scheme(model)
    for hw, ref in zip(SD3_SIZES[:2], refs, strict=True):
        assert torch.equal(run(model, sd3_inputs(*hw)), ref)


def test_sd3_in_bfloat16():
    model = sd3().to(torch.bfloat16)
    x = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) else v for k, v in sd3_inputs(32, 32).items()}
    ref = run(model, x)
    apply_position_scheme(model)
    assert patched_rotary(model).pos_embed.dtype == torch.bfloat16
    assert torch.equal(run(model, x), ref)


def test_sd3_checkpoint_table_with_another_scale_and_offset():
    # SD3's reference code builds its table from arange(M) / scaling_factor - offset; visionpe reads those
    # positions off the table's phases
    model = sd3()
    grid = torch.arange(16, dtype=torch.float32) / 1.7 - 2.0
    model.pos_embed.pos_embed.copy_(reference_table(grid, grid, DIM).float()[None])
    refs = [run(model, sd3_inputs(*hw)) for hw in SD3_SIZES]
    apply_position_scheme(model)
    module = patched_rotary(model)
    assert all(math.isclose(step, 1 / 1.7, rel_tol=1e-6) for step in module.step)
    assert all(abs(float(g[0]) + 2.0) < 1e-5 for g in module.grid)
    for hw, ref in zip(SD3_SIZES, refs, strict=True):
        torch.testing.assert_close(run(model, sd3_inputs(*hw)), ref, atol=1e-5, rtol=0)
    visionpe.set_extrapolation(model, "pi")
    rows, _ = module.positions(16, 16)
    assert torch.allclose(rows, grid[4].double() + torch.arange(16, dtype=torch.float64) / 1.7 / 2, atol=1e-5)


def test_a_table_that_is_not_sincos_is_refused():
    model = sd3()
    torch.manual_seed(3)
    model.pos_embed.pos_embed.copy_(torch.randn_like(model.pos_embed.pos_embed))
    with pytest.raises(ValueError, match="2-D sin-cos table of evenly spaced positions"):
        apply_position_scheme(model)
    assert getattr(model, "_visionpe_diffusers_patch", None) is None


def test_models_without_a_table_are_refused():
    model = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=1,
        joint_attention_dim=8,
        caption_projection_dim=8,
        pooled_projection_dim=8,
        out_channels=4,
    )
    model.pos_embed.pos_embed = None  # a PatchEmbed with pos_embed_type=None
    with pytest.raises(ValueError, match="must hold a sin-cos table"):
        apply_position_scheme(model)
    with pytest.raises(TypeError, match="patch_embed must be diffusers' PatchEmbed"):
        CroppedSinCosPatchEmbed(torch.nn.Linear(2, 2))


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="length must be a positive int, got 0"):
        grid_positions(0, 8)
    with pytest.raises(ValueError, match="base_size must be a positive number of patches"):
        grid_positions(4, 0)
    with pytest.raises(TypeError, match="interpolation_scale must be a positive number"):
        grid_positions(4, 8, "2")
    with pytest.raises(ValueError, match="dim must be divisible by 4"):
        sincos_table(torch.zeros(2), torch.zeros(2), 6)
    with pytest.raises(TypeError, match="rows must be a real"):
        sincos_table([0.0], torch.zeros(2), 8)
    with pytest.raises(ValueError, match="cols must be a non-empty 1-D tensor"):
        sincos_table(torch.zeros(2), torch.zeros(2, 2), 8)
    model = sd3()
    apply_position_scheme(model)
    with pytest.raises(ValueError, match="height must be a positive int, got 0"):
        patched_rotary(model).positions(0, 4)
