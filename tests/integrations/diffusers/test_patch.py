"""What apply_position_scheme, set_extrapolation and remove_position_scheme refuse on a diffusers transformer, what
each scaling mode changes (the named axes' frequencies only, as visionpe's scale_frequencies computes them),
torch.compile over a patched model, and the examples of the Diffusion transformers page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from diffusers import UNet2DModel
from torch import nn

import visionpe
from visionpe.integrations.diffusers import (
    apply_position_scheme,
    find_diffusers_family,
    patched_rotary,
    remove_position_scheme,
)
from visionpe.rotary.scaling import axis_scale_factors, scale_frequencies, yarn_attention_factor

from .conftest import AXES, TRAIN_GRID, flux_ids, flux_inputs, qwen_inputs, run, run_capturing_rotary, tiny_qwen

DOCS_PAGE = Path(__file__).resolve().parents[3] / "docs" / "diffusion.md"


def tiny_unet() -> UNet2DModel:
    return UNet2DModel(
        sample_size=8,
        in_channels=1,
        out_channels=1,
        layers_per_block=1,
        block_out_channels=(8,),
        down_block_types=("DownBlock2D",),
        up_block_types=("UpBlock2D",),
        norm_num_groups=4,
    )


@pytest.mark.parametrize(
    "model", [nn.Linear(2, 2), tiny_unet(), "FluxTransformer2DModel"], ids=lambda m: type(m).__name__
)
def test_an_unsupported_model_is_refused_with_the_supported_classes(model):
    name = type(model).__name__
    with pytest.raises(TypeError, match=rf"got {name}; supported: .*FluxTransformer2DModel \(flux\)") as error:
        apply_position_scheme(model)
    assert "QwenImageTransformer2DModel (qwenimage)" in str(error.value)
    with pytest.raises(TypeError, match=name):
        find_diffusers_family(model)


def test_a_model_whose_rotary_was_replaced_by_another_module_is_refused(flux):
    flux.pos_embed = nn.Identity()
    with pytest.raises(TypeError, match=r"FluxTransformer2DModel.pos_embed must be diffusers' FluxPosEmbed.*Identity"):
        apply_position_scheme(flux)


@pytest.mark.parametrize(
    "train_grid_size, error, match",
    [
        ((4, 4), ValueError, r"train_grid_size must have 3 entries, got 2"),
        ((1, 0, 4), ValueError, r"train_grid_size\[1\]"),
        ((1, 4.0, 4), TypeError, r"train_grid_size\[1\]"),
        ("64", TypeError, r"train_grid_size must be a tuple of ints, got str"),
    ],
)
def test_a_bad_train_grid_size_is_refused_and_nothing_is_patched(flux, train_grid_size, error, match):
    own = flux.pos_embed
    with pytest.raises(error, match=match):
        apply_position_scheme(flux, train_grid_size=train_grid_size)
    assert flux.pos_embed is own and not flux._forward_pre_hooks


def test_patching_twice_and_removing_from_an_unpatched_model_are_refused(flux):
    with pytest.raises(ValueError, match="not patched by visionpe; nothing to remove"):
        remove_position_scheme(flux)
    with pytest.raises(ValueError, match="apply_position_scheme"):
        patched_rotary(flux)
    apply_position_scheme(flux)
    with pytest.raises(ValueError, match="patched already"):
        apply_position_scheme(flux)
    remove_position_scheme(flux)
    with pytest.raises(ValueError, match="nothing to remove"):
        remove_position_scheme(flux)
    for function in (remove_position_scheme, patched_rotary):
        with pytest.raises(TypeError, match="torch.nn.Module, got str"):
            function("flux")


@pytest.mark.parametrize(
    "mode, options, error, match",
    [
        ("pi", {"axes": ("time",)}, ValueError, r"axes must name axes of DiffusionRotary.*'time' not among them"),
        ("dype", {"axes": ("index",)}, ValueError, r"'index' numbers the images"),
        ("ntk", {"axes": ("height", "height")}, ValueError, "must not repeat"),
        ("none", {"axes": ("height",)}, ValueError, "axes applies to"),
        ("yarn", {"dype_method": "ntk"}, ValueError, "dype_method applies to extrapolation='dype' only"),
        ("pi", {"dype_exponent": 1.0}, ValueError, "dype_exponent applies to extrapolation='dype' only"),
        ("dype", {"dype_method": "pi"}, ValueError, "dype_method"),
        ("dype", {"dype_exponent": 0.0}, ValueError, "dype_exponent"),
        (
            "riflex",
            {"riflex_k": (0, 4, 0)},
            ValueError,
            r"riflex_k\[1\] must be a band of axis 1, which has 3 bands",
        ),
        ("longrope", {}, ValueError, "extrapolation must be one of"),
    ],
)
def test_set_extrapolation_refuses_what_the_patched_rotary_cannot_do(flux, mode, options, error, match):
    apply_position_scheme(flux, train_grid_size=TRAIN_GRID)
    rotary = patched_rotary(flux)
    with pytest.raises(error, match=match):
        visionpe.set_extrapolation(flux, mode, **options)
    assert rotary.extrapolation == "none"  # nothing switched


def expected_cos_sin(ids: torch.Tensor, freqs: torch.Tensor, mscale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin in Flux's layout from an axial (3, P) frequency matrix: axis a's pairs turn with ids[:, a]."""
    cos, sin, start = [], [], 0
    for axis, dim in enumerate(AXES):
        angles = ids[:, axis].double()[:, None] * freqs[axis, start : start + dim // 2]
        cos.append(angles.cos().repeat_interleave(2, dim=1).float() * mscale)
        sin.append(angles.sin().repeat_interleave(2, dim=1).float() * mscale)
        start += dim // 2
    return torch.cat(cos, dim=1), torch.cat(sin, dim=1)


@pytest.mark.parametrize("mode", ["pi", "ntk", "yarn", "riflex"])
@pytest.mark.parametrize("axes", [("height",), ("width",), None], ids=str)
def test_each_mode_changes_only_the_named_axes_as_scale_frequencies(flux, mode, axes):
    # 8 x 10 tokens, trained on 4 x 4: factors 2 (height) and 2.5 (width); the index axis is never scaled
    inputs = flux_inputs(8, 10, text=3)
    _, original = run_capturing_rotary(flux, inputs)
    apply_position_scheme(flux, train_grid_size=TRAIN_GRID)
    visionpe.set_extrapolation(flux, mode, axes=axes)
    _, (cos, sin) = run_capturing_rotary(flux, inputs)

    rotary = patched_rotary(flux)
    named = {"height", "width"} if axes is None else set(axes)
    factors = axis_scale_factors((1, 8, 10), TRAIN_GRID)
    factors = tuple(s if name in named else 1.0 for s, name in zip(factors, rotary.names, strict=True))
    freqs = scale_frequencies(rotary.frequencies(), factors, mode, TRAIN_GRID)
    mscale = yarn_attention_factor(factors) if mode == "yarn" else 1.0
    ids = torch.cat([inputs["txt_ids"], inputs["img_ids"]])
    expected_cos, expected_sin = expected_cos_sin(ids, freqs, mscale)
    torch.testing.assert_close(cos, expected_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, expected_sin, rtol=0, atol=1e-6)
    # block by block: a named axis changed, the others kept their frequencies (YaRN's multiplier applies to all)
    blocks = {"index": slice(0, 4), "height": slice(4, 10), "width": slice(10, 16)}
    for name, block in blocks.items():
        same = torch.allclose(cos[:, block], original[0][:, block] * mscale, rtol=0, atol=1e-6)
        assert same == (name not in named), (name, mode, axes)


FLUX_MODES = ["none", "pi", "ntk", "yarn", "riflex", "dype"]


@pytest.mark.parametrize("mode", FLUX_MODES)
def test_a_compiled_patched_flux_equals_eager(flux, mode):
    # torch.compile over the whole patched model (AOTAutograd, without inductor's code generation: seconds on a CPU),
    # at twice the training side so that the mode changes the frequencies; DyPE reads the timestep the hook hands over
    apply_position_scheme(flux, train_grid_size=TRAIN_GRID)
    visionpe.set_extrapolation(flux, mode)
    inputs = flux_inputs(8, 8)
    eager = run(flux, inputs)
    compiled = torch.compile(flux, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(run(compiled, inputs), eager, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", FLUX_MODES)
def test_no_graph_break_in_patched_flux_in_any_mode(flux, mode):
    # the rotary reads the grid off its ids on their device (no host sync) and the timestep pre-hook hands over a
    # tensor: both trace into the model's one graph, with a Kontext reference image too
    apply_position_scheme(flux, train_grid_size=TRAIN_GRID)
    visionpe.set_extrapolation(flux, mode)
    patched_rotary(flux).timestep = torch.tensor([0.7])  # what the hook sets; DyPE reads it
    explanation = torch._dynamo.explain(flux.pos_embed)(flux_ids(8, 8))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    explanation = torch._dynamo.explain(flux)(**flux_inputs(8, 6, reference=(4, 4)))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["none", "yarn", "dype"])
def test_no_graph_break_in_patched_qwenimage_in_any_mode(mode):
    # Qwen-Image's grid comes from img_shapes (Python ints), its timestep stays a tensor: no host sync at all
    model = tiny_qwen()
    apply_position_scheme(model, train_grid_size=TRAIN_GRID)
    visionpe.set_extrapolation(model, mode)
    explanation = torch._dynamo.explain(model)(**qwen_inputs([(1, 8, 8)]))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    torch._dynamo.reset()


def test_the_examples_of_the_diffusion_page_run():
    # every Python block of docs/diffusion.md runs as written, in order, in one namespace, but the one that loads a
    # released checkpoint (from_pretrained downloads its weights)
    blocks = re.findall(r"^```python\n(.*?)^```", DOCS_PAGE.read_text(encoding="utf-8"), re.MULTILINE | re.DOTALL)
    runnable = [block for block in blocks if "from_pretrained" not in block]
    assert len(runnable) >= 5, "the page lost its examples"
    namespace: dict = {}
    for block in runnable:
        exec(compile(block, str(DOCS_PAGE), "exec"), namespace)


def test_a_copy_of_a_patched_model_feeds_its_own_rotary_and_is_removed_on_its_own(flux):
    import copy

    apply_position_scheme(flux, train_grid_size=(1, 4, 4))
    clone = copy.deepcopy(flux)
    visionpe.set_extrapolation(clone, "dype")
    with torch.no_grad():
        clone(**flux_inputs(8, 8, timestep=0.3))
    assert float(patched_rotary(clone).timestep) == pytest.approx(0.3)
    assert patched_rotary(flux).timestep is None  # the original's rotary was not fed by the copy's call
    remove_position_scheme(clone)
    assert patched_rotary(flux).extrapolation == "none"  # the original is still patched, its hook in place
    with torch.no_grad():
        flux(**flux_inputs(4, 4, timestep=0.8))
    assert float(patched_rotary(flux).timestep) == pytest.approx(0.8)


def test_dype_reads_the_largest_of_per_token_timesteps(flux):
    # Wan 2.2's image-to-video passes one timestep per token, 0 for the clean conditioning frame
    apply_position_scheme(flux)
    rotary = patched_rotary(flux)
    rotary.set_timestep(torch.tensor([[0.0, 0.0, 700.0, 700.0]]), 1 / 1000)
    assert float(rotary.timestep) == pytest.approx(0.7)
