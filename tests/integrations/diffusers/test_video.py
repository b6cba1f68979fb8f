"""The video families patched by visionpe (Wan and its VACE variant, HunyuanVideo, CogVideoX 1.0 and 1.5): with no
mode set, the same rotary (cos and sin bit for bit) and the same denoiser output as diffusers' at the training size,
at twice the side and at twice the frames; the way back; a mode on the time axis only changes the time block and
nothing else; the timestep mapping; CogVideoX's rotary computed by the model as its pipeline computes it."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import (  # noqa: E402
    CogVideoXTransformer3DModel,
    HunyuanVideoTransformer3DModel,
    WanTransformer3DModel,
    WanVACETransformer3DModel,
)
from diffusers.models.embeddings import get_3d_rotary_pos_embed  # noqa: E402
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed  # noqa: E402

import visionpe  # noqa: E402
from visionpe.integrations.diffusers import (  # noqa: E402
    DIFFUSERS_FAMILIES,
    DiffusionRotary,
    apply_position_scheme,
    find_diffusers_family,
    patched_rotary,
    remove_position_scheme,
)
from visionpe.integrations.diffusers.cogvideox import (  # noqa: E402
    COGVIDEOX,
    COGVIDEOX_15_TRAIN_GRID,
    CogVideoXRotary,
    resize_crop_region,
)
from visionpe.integrations.diffusers.hunyuan_video import HUNYUAN_VIDEO, HunyuanVideoRotary  # noqa: E402
from visionpe.integrations.diffusers.wan import VIDEO_AXES, WAN, WanRotary, grid_cos_sin  # noqa: E402

CHANNELS = 4  # latent channels in and out
TEXT = 8  # the text encoder's width
TRAIN = (4, 2, 2)  # the training grid the tests patch with, in tokens: 4 frames of 2 x 2


# --- tiny random models and their inputs -------------------------------------------------------------------------


def tiny_wan(rope_max_seq_len: int = 32, vace: bool = False) -> WanTransformer3DModel:
    """A random Wan transformer, one block, 2 heads of 24 channels (time, height, width blocks of 8, 8, 8)."""
    torch.manual_seed(0)
    options = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=24,
        in_channels=CHANNELS,
        out_channels=CHANNELS,
        text_dim=TEXT,
        freq_dim=8,
        ffn_dim=16,
        num_layers=1,
        rope_max_seq_len=rope_max_seq_len,
    )
    if vace:
        return WanVACETransformer3DModel(**options, vace_layers=[0], vace_in_channels=CHANNELS).eval()
    return WanTransformer3DModel(**options).eval()


def tiny_hunyuan(rope_axes_dim: tuple[int, int, int] = (8, 4, 4), heads: int = 2) -> HunyuanVideoTransformer3DModel:
    """A random HunyuanVideo transformer: one double-stream, one single-stream and one refiner block, base 256."""
    torch.manual_seed(0)
    return HunyuanVideoTransformer3DModel(
        in_channels=CHANNELS,
        out_channels=CHANNELS,
        num_attention_heads=heads,
        attention_head_dim=sum(rope_axes_dim),
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        guidance_embeds=False,
        text_embed_dim=TEXT,
        pooled_projection_dim=TEXT,
        rope_axes_dim=rope_axes_dim,
    ).eval()


def tiny_cogvideox(patch_size_t: int | None = None, **options) -> CogVideoXTransformer3DModel:
    """A random CogVideoX transformer, one block, 2 heads of 16 channels (time, height, width blocks of 4, 6, 6);
    ``sample_*`` sizes of 8 latents (4 x 4 tokens; 1.5: 16, whose 8 x 8 tokens bound the pipeline's positions)."""
    torch.manual_seed(0)
    side = 8 if patch_size_t is None else 16
    config = dict(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=CHANNELS,
        out_channels=CHANNELS,
        time_embed_dim=8,
        text_embed_dim=TEXT,
        num_layers=1,
        sample_width=side,
        sample_height=side,
        sample_frames=9,
        patch_size=2,
        patch_size_t=patch_size_t,
        max_text_seq_length=3,
        use_rotary_positional_embeddings=True,
    )
    config.update(options)
    return CogVideoXTransformer3DModel(**config).eval()


def video_inputs(family: str, frames: int, height: int, width: int, *, timestep: float = 500.0, seed: int = 1) -> dict:
    """Keyword arguments of a forward call on a latent video of ``frames`` x ``height`` x ``width`` latents, as the
    family's pipeline passes them (timestep in [0, 1000]; CogVideoX's frames before its channels)."""
    generator = torch.Generator().manual_seed(seed)
    text = torch.randn(1, 3, TEXT, generator=generator)
    if family.startswith("cogvideox"):
        latents = torch.randn(1, frames, CHANNELS, height, width, generator=generator)
        return dict(hidden_states=latents, encoder_hidden_states=text, timestep=torch.tensor([int(timestep)]))
    latents = torch.randn(1, CHANNELS, frames, height, width, generator=generator)
    inputs = dict(hidden_states=latents, timestep=torch.tensor([timestep]), encoder_hidden_states=text)
    if family == "hunyuan_video":
        inputs.update(encoder_attention_mask=torch.ones(1, 3), pooled_projections=torch.randn(1, TEXT))
    if family == "vace":
        inputs.update(control_hidden_states=torch.randn(1, CHANNELS, frames, height, width, generator=generator))
    return inputs


def pipeline_rotary(model: CogVideoXTransformer3DModel, frames: int, height: int, width: int) -> tuple:
    """CogVideoX's ``image_rotary_emb`` as its pipeline computes it for a latent video of that size."""
    pytest.importorskip("transformers")  # the pipeline module imports its text encoder's classes
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import CogVideoXPipeline

    pipe = SimpleNamespace(vae_scale_factor_spatial=8, transformer=model)
    return CogVideoXPipeline._prepare_rotary_positional_embeddings(pipe, 8 * height, 8 * width, frames, "cpu")


MODELS = {
    "wan": tiny_wan,
    "vace": lambda: tiny_wan(vace=True),
    "hunyuan_video": tiny_hunyuan,
    "cogvideox": tiny_cogvideox,
    "cogvideox_1.5": lambda: tiny_cogvideox(patch_size_t=2),
}

# latent sizes (frames, height, width) per family: the training grid TRAIN in tokens, twice its side, twice its
# frames, and another aspect ratio
SIZES = {
    "wan": [(4, 4, 4), (4, 8, 8), (8, 4, 4), (4, 4, 10)],
    "hunyuan_video": [(4, 2, 2), (4, 4, 4), (8, 2, 2), (4, 2, 5)],
    "cogvideox": [(4, 4, 4), (4, 8, 8), (8, 4, 4), (4, 4, 10), (4, 10, 4)],
    "cogvideox_1.5": [(8, 4, 4), (8, 8, 8), (16, 4, 4), (8, 4, 12)],
}
SIZES["vace"] = SIZES["wan"]
CASES = [(family, size) for family in MODELS for size in SIZES[family]]


def run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def rotary_of(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin the model's blocks receive for ``inputs``: its ``rope``'s output, or CogVideoX's
    ``image_rotary_emb`` (patched: computed by the model, else: by the pipeline)."""
    hidden = inputs["hidden_states"]
    with torch.no_grad():
        if isinstance(model, CogVideoXTransformer3DModel):
            if isinstance(model.embedding_dropout, CogVideoXRotary):
                return model.embedding_dropout.cos_sin(hidden)
            return pipeline_rotary(model, *hidden.shape[1:2], *hidden.shape[3:])
        return model.rope(hidden)


def with_rotary(model: torch.nn.Module, inputs: dict) -> dict:
    # CogVideoX's pipeline passes the rotary it computed (the patched model replaces it); the others compute their own
    if isinstance(model, CogVideoXTransformer3DModel):
        hidden = inputs["hidden_states"]
        return {**inputs, "image_rotary_emb": pipeline_rotary(model, hidden.shape[1], *hidden.shape[3:])}
    return inputs


def assert_same(mine: tuple, theirs: tuple) -> None:
    for a, b in zip(mine, theirs, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), (a - b).abs().max()


# --- identity ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family, size", CASES, ids=[f"{f}-{'x'.join(map(str, s))}" for f, s in CASES])
def test_patched_model_equals_the_original(family, size):
    model = MODELS[family]()
    inputs = with_rotary(model, video_inputs(family, *size))
    original_rotary = rotary_of(model, inputs)
    original = run(model, inputs)
    apply_position_scheme(model, train_grid_size=TRAIN)
    assert_same(rotary_of(model, inputs), original_rotary)
    patched = run(model, inputs)
    assert (patched - original).abs().max() <= 1e-5
    # the way back: the model's own module, the same outputs
    remove_position_scheme(model)
    assert torch.equal(run(model, inputs), original)


@pytest.mark.parametrize("family", list(MODELS))
def test_the_family_and_its_defaults(family):
    model = MODELS[family]()
    name = "wan" if family == "vace" else family.split("_1.5")[0]
    found = find_diffusers_family(model)
    assert found.name == name and found.axis_names == VIDEO_AXES
    report = apply_position_scheme(model)
    rotary = patched_rotary(model)
    assert isinstance(rotary, DiffusionRotary) and rotary is report.rotary and rotary.names == VIDEO_AXES
    expected = {
        "wan": (21, 30, 52),  # Wan 2.1: 81 frames at 480 x 832
        "hunyuan_video": (33, 45, 80),  # HunyuanVideo: 129 frames at 720 x 1280
        "cogvideox": (3, 4, 4),  # from the config: sample_frames 9 -> 3 latent frames, 8 x 8 latents -> 4 x 4
        "cogvideox_1.5": COGVIDEOX_15_TRAIN_GRID,
    }[name if family != "cogvideox_1.5" else family]
    assert report.train_grid_size == rotary.train_grid_size == expected
    assert visionpe.set_extrapolation(model, "riflex", axes=("time",)) == [f"{report.attribute}.rotary"]


def test_the_registered_defaults():
    assert WAN.default_train_grid == (21, 30, 52) and WAN.timestep_scale == 1 / 1000
    assert HUNYUAN_VIDEO.default_train_grid == (33, 45, 80) and HUNYUAN_VIDEO.timestep_scale == 1 / 1000
    assert COGVIDEOX.default_train_grid == (13, 30, 45) and COGVIDEOX.timestep_scale == 1 / 999
    # CogVideoX 1.0's released config gives its grid: 49 frames, 60 x 90 latents, patch 2
    model = tiny_cogvideox(sample_frames=49, sample_height=60, sample_width=90)
    assert apply_position_scheme(model).train_grid_size == COGVIDEOX.default_train_grid
    assert {f.name for f in (WAN, HUNYUAN_VIDEO, COGVIDEOX)} <= set(DIFFUSERS_FAMILIES)


@pytest.mark.parametrize(
    "family, timestep, expected",
    [("wan", 1000.0, 1.0), ("hunyuan_video", 250.0, 0.25), ("cogvideox", 999, 1.0), ("cogvideox", 0, 0.0)],
)
def test_the_timestep_reaches_the_rotary_in_0_1(family, timestep, expected):
    model = MODELS[family]()
    apply_position_scheme(model, train_grid_size=TRAIN)
    run(model, with_rotary(model, video_inputs(family, 4, 4, 4, timestep=timestep)))
    assert float(patched_rotary(model).timestep) == pytest.approx(expected)


# --- a mode on the time axis only ----------------------------------------------------------------------------------


def blocks(cos_sin: tuple, grid: tuple[int, int, int], axes_dim: tuple[int, int, int]) -> list[torch.Tensor]:
    """The cos of each axis' block, (frames, rows, columns, channels)."""
    cos = cos_sin[0].reshape(*grid, -1)
    starts = [0, axes_dim[0], axes_dim[0] + axes_dim[1]]
    return [cos[..., s : s + d] for s, d in zip(starts, axes_dim, strict=True)]


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("mode", ["riflex", "pi", "ntk", "dype"])
def test_a_mode_on_the_time_axis_changes_only_the_time_block(family, mode):
    model = MODELS[family]()
    p_t = 2 if family == "cogvideox_1.5" else 1
    p = 1 if family == "hunyuan_video" else 2
    options = {"riflex_k": 1} if mode == "riflex" else {}  # band 1 turns once in 6 frames: RIFLEx edits it at 8
    # twice the training frames, at the training side and at twice it
    for size in [(8 * p_t, 2 * p, 2 * p), (8 * p_t, 4 * p, 4 * p)]:
        inputs = with_rotary(model, video_inputs(family, *size))
        original_rotary, original = rotary_of(model, inputs), run(model, inputs)
        apply_position_scheme(model, train_grid_size=TRAIN)
        rotary = patched_rotary(model)
        visionpe.set_extrapolation(model, mode, axes=("time",), **options)
        rotary.timestep = 1.0  # DyPE's full extrapolation, for a call of the rotary outside the model
        grid = (8, size[1] // p, size[2] // p)
        mine, theirs = (
            blocks(rotary_of(model, inputs), grid, rotary.axes_dim),
            blocks(original_rotary, grid, rotary.axes_dim),
        )
        assert torch.equal(mine[1], theirs[1]) and torch.equal(mine[2], theirs[2])  # height and width untouched
        changed = (mine[0] != theirs[0]).any(dim=(0, 1, 2))
        assert changed.any()
        if mode == "riflex":  # band 1 of the time axis: its two channels, nothing else
            assert changed.tolist() == [True, True] + [False] * (rotary.axes_dim[0] - 2)
        assert not torch.allclose(run(model, inputs), original, atol=1e-5)
        remove_position_scheme(model)
    # at the training length nothing changes
    inputs = with_rotary(model, video_inputs(family, 4 * p_t, 4 * p, 4 * p))
    original = run(model, inputs)
    apply_position_scheme(model, train_grid_size=TRAIN)
    visionpe.set_extrapolation(model, mode, axes=("time",), **options)
    assert (run(model, inputs) - original).abs().max() <= 1e-5


@pytest.mark.parametrize("family", ["wan", "hunyuan_video", "cogvideox"])
@pytest.mark.parametrize("mode", ["none", "pi", "ntk", "yarn", "riflex", "dype"])
def test_no_graph_break_in_a_patched_video_model_in_any_mode(family, mode):
    # the grid comes from the latents' shape and the timestep stays a tensor: at twice the training frames and side
    # the patched model traces without a break (Wan, HunyuanVideo: one graph; CogVideoX: its rotary is computed by
    # a forward pre-hook, which dynamo compiles as a graph of its own before the model's), compiles with
    # fullgraph=True and equals the eager model
    model = MODELS[family]()
    apply_position_scheme(model, train_grid_size=TRAIN)
    visionpe.set_extrapolation(model, mode)
    p = 1 if family == "hunyuan_video" else 2
    inputs = video_inputs(family, 8, 4 * p, 4 * p)
    explanation = torch._dynamo.explain(model)(**inputs, return_dict=False)
    assert explanation.break_reasons == []
    assert explanation.graph_count == (2 if family == "cogvideox" else 1)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(run(compiled, inputs), run(model, inputs), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


# --- Wan -----------------------------------------------------------------------------------------------------------


def test_wan_in_bfloat16_equals_the_original():
    # the model's cos/sin tables are buffers, cast with the model; visionpe's rotary returns the same dtype
    model = tiny_wan().to(torch.bfloat16)
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in video_inputs("wan", 8, 8, 8).items()}
    original_rotary, original = rotary_of(model, inputs), run(model, inputs)
    apply_position_scheme(model, train_grid_size=TRAIN)
    assert_same(rotary_of(model, inputs), original_rotary)
    assert torch.equal(run(model, inputs), original)
    # patched in float32, then cast: the same as casting the original
    model = tiny_wan()
    apply_position_scheme(model, train_grid_size=TRAIN)
    model.to(torch.bfloat16)
    assert_same(rotary_of(model, inputs), original_rotary)


def test_wan_beyond_its_tables():
    # the model's tables end at rope_max_seq_len positions; visionpe continues them (as a model with longer tables)
    short, longer = tiny_wan(rope_max_seq_len=4), tiny_wan(rope_max_seq_len=32)
    inputs = video_inputs("wan", 8, 4, 4)
    with pytest.raises(RuntimeError):
        run(short, inputs)
    apply_position_scheme(short, train_grid_size=TRAIN)
    assert_same(rotary_of(short, inputs), rotary_of(longer, inputs))
    assert torch.equal(run(short, inputs), run(longer, inputs))


def test_wan_with_another_base_is_refused():
    model = tiny_wan()
    model.rope = WanRotaryPosEmbed(24, (1, 2, 2), 32, theta=500.0)
    with pytest.raises(ValueError, match="base 10000"):
        apply_position_scheme(model)
    assert isinstance(model.rope, WanRotaryPosEmbed)  # nothing was changed


# --- CogVideoX -----------------------------------------------------------------------------------------------------


def test_cogvideox_without_rotary_is_refused():
    model = tiny_cogvideox(use_rotary_positional_embeddings=False)
    with pytest.raises(TypeError, match="use_rotary_positional_embeddings=False"):
        apply_position_scheme(model)
    assert type(model.embedding_dropout) is torch.nn.Dropout and not model._forward_pre_hooks


@pytest.mark.parametrize("patch_size_t", [None, 2])
def test_cogvideox_computes_its_rotary_whatever_the_call_passes(patch_size_t):
    model = tiny_cogvideox(patch_size_t)
    frames = 4 if patch_size_t is None else 8
    inputs = with_rotary(model, video_inputs("cogvideox", frames, 8, 8))
    original = run(model, inputs)
    apply_position_scheme(model, train_grid_size=TRAIN)
    assert torch.equal(run(model, {**inputs, "image_rotary_emb": None}), original)
    assert torch.equal(
        run(model, {**inputs, "image_rotary_emb": tuple(t * 0 for t in inputs["image_rotary_emb"])}), original
    )
    # every argument positional, as gradient checkpointing wrappers or other callers may pass them
    order = ("hidden_states", "encoder_hidden_states", "timestep", "timestep_cond", "ofs", "image_rotary_emb")
    with torch.no_grad():
        positional = model(*[inputs.get(name) for name in order], return_dict=False)[0]
    assert torch.equal(positional, original)


def test_cogvideox_keeps_its_dropout_its_weights_and_their_names():
    model = tiny_cogvideox(dropout=0.25)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    apply_position_scheme(model)
    carrier = model.embedding_dropout
    assert isinstance(carrier, CogVideoXRotary) and isinstance(carrier, torch.nn.Dropout)
    assert carrier.p == 0.25 and not carrier.training
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    model.train()
    assert carrier.training
    # removed before any call, the model keeps the rotary's pre-hook until its next call: a module-level class,
    # so that the model still pickles
    remove_position_scheme(model)
    assert isinstance(pickle.loads(pickle.dumps(model)), CogVideoXTransformer3DModel)


def test_cogvideox_removal_takes_the_hook_away():
    model = tiny_cogvideox()
    own, hooks = model.embedding_dropout, dict(model._forward_pre_hooks)
    inputs = with_rotary(model, video_inputs("cogvideox", 8, 4, 4))
    original = run(model, inputs)
    apply_position_scheme(model, train_grid_size=TRAIN)
    visionpe.set_extrapolation(model, "riflex", riflex_k=1)
    assert not torch.equal(run(model, inputs), original)
    remove_position_scheme(model)
    assert model.embedding_dropout is own
    assert torch.equal(run(model, inputs), original)
    assert dict(model._forward_pre_hooks) == hooks  # gone at that call
    # patched again, removed again before any call, patched again: one rotary hook, the same outputs
    apply_position_scheme(model, train_grid_size=TRAIN)
    remove_position_scheme(model)
    apply_position_scheme(model, train_grid_size=TRAIN)
    assert torch.equal(run(model, inputs), original)
    assert len(model._forward_pre_hooks) == len(hooks) + 2  # the rotary's and the timestep's


def test_cogvideox_dype_reads_the_timestep_of_the_call():
    # the rotary is computed in the model's pre-hook: DyPE must see this call's timestep, not the previous one's
    model = tiny_cogvideox()
    apply_position_scheme(model, train_grid_size=TRAIN)
    visionpe.set_extrapolation(model, "dype")
    carrier, rotary = model.embedding_dropout, patched_rotary(model)
    outputs = {}
    for timestep in (999, 0, 500):
        inputs = with_rotary(model, video_inputs("cogvideox", 8, 4, 4, timestep=timestep))
        outputs[timestep] = run(model, inputs)
        assert float(rotary.timestep) == pytest.approx(timestep / 999)  # this call's, which the rotary read:
        expected = carrier.cos_sin(inputs["hidden_states"])
        remove_position_scheme(model)
        assert torch.equal(run(model, {**inputs, "image_rotary_emb": expected}), outputs[timestep])
        apply_position_scheme(model, train_grid_size=TRAIN)
        visionpe.set_extrapolation(model, "dype")
        carrier, rotary = model.embedding_dropout, patched_rotary(model)
    assert not torch.allclose(outputs[999], outputs[0], atol=1e-5)


def test_cogvideox_15_continues_past_the_pipelines_positions():
    # 1.5's pipeline cuts its positions from sample_height / p x sample_width / p tables (8 x 8 here) and fails
    # past them; visionpe's positions go on, as the pipeline's function does with larger tables
    model = tiny_cogvideox(patch_size_t=2)
    inputs = video_inputs("cogvideox_1.5", 4, 24, 20)  # 12 x 10 tokens
    with pytest.raises(RuntimeError):
        pipeline_rotary(model, 4, 24, 20)
    expected = get_3d_rotary_pos_embed(16, None, (12, 10), 2, grid_type="slice", max_size=(12, 10))
    original = run(model, {**inputs, "image_rotary_emb": expected})
    apply_position_scheme(model, train_grid_size=TRAIN)
    assert_same(model.embedding_dropout.cos_sin(inputs["hidden_states"]), expected)
    assert torch.equal(run(model, inputs), original)


def test_cogvideox_10_fits_every_resolution_into_its_training_grid():
    # the rows and columns are spread over the 4 x 4 training grid: a spatial mode never acts, the time axis does
    model = tiny_cogvideox()
    apply_position_scheme(model)  # the config's grid: (3, 4, 4)
    carrier = model.embedding_dropout
    for frames, rows, cols in [(3, 8, 8), (3, 40, 40), (6, 8, 24), (3, 24, 8)]:
        axes, grid = carrier.positions(torch.zeros(1, frames, CHANNELS, rows, cols))
        assert grid[0] == frames and grid[1] <= 4 and grid[2] <= 4
        assert float(axes[1].max()) < 4 and float(axes[2].max()) < 4
    inputs = with_rotary(model, video_inputs("cogvideox", 3, 16, 16))
    original = run(model, inputs)
    visionpe.set_extrapolation(model, "pi")
    assert torch.equal(run(model, inputs), original)


def test_resize_crop_region_is_the_pipelines():
    pytest.importorskip("transformers")
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

    for base in [(30, 45), (4, 4), (48, 85)]:
        for rows in range(1, 70, 7):
            for cols in range(1, 100, 9):
                expected = get_resize_crop_region_for_grid((rows, cols), base[1], base[0])
                assert resize_crop_region((rows, cols), base) == expected, (rows, cols, base)


# --- arguments -----------------------------------------------------------------------------------------------------


def test_bad_arguments_are_named():
    rotary = DiffusionRotary((4, 4, 4), 10000.0, VIDEO_AXES)
    with pytest.raises(TypeError, match="rotary must be a DiffusionRotary"):
        grid_cos_sin("rope", [torch.arange(2)] * 3)
    with pytest.raises(ValueError, match="axis_positions must be 3 non-empty 1-D tensors"):
        grid_cos_sin(rotary, [torch.arange(2)] * 2)
    with pytest.raises(ValueError, match="axis_positions"):
        grid_cos_sin(rotary, [torch.arange(2), torch.zeros(2, 2), torch.arange(2)])
    with pytest.raises(ValueError, match="grid_size"):
        grid_cos_sin(rotary, [torch.arange(2)] * 3, (2, 2))
    with pytest.raises(ValueError, match="hidden_states must be a 5-D latent video"):
        WanRotary((4, 4, 4), (1, 2, 2))(torch.zeros(1, 4, 4, 4))
    with pytest.raises(ValueError, match="hidden_states must be a 5-D latent video"):
        HunyuanVideoRotary((4, 4, 4), 1, 1)("video")
    with pytest.raises(ValueError, match="patch_size must be"):
        WanRotary((4, 4, 4), (2, 2))
    with pytest.raises(TypeError, match="table_dtype"):
        WanRotary((4, 4, 4), (1, 2, 2), table_dtype=torch.int64)
    with pytest.raises(ValueError, match="patch_size_t"):
        HunyuanVideoRotary((4, 4, 4), 1, 0)
    with pytest.raises(ValueError, match="base_size"):
        CogVideoXRotary(0.0, (4, 6, 6), 2, None, (4,))
    with pytest.raises(ValueError, match="grid_size"):
        resize_crop_region((0, 4), (4, 4))
    model = tiny_wan()  # time, height, width blocks of 8 channels: 4 bands each
    apply_position_scheme(model, train_grid_size=TRAIN)
    with pytest.raises(ValueError, match=r"riflex_k\[0\] must be a band of the time axis, which has 4 bands, got 5"):
        visionpe.set_extrapolation(model, "riflex", axes=("time",), riflex_k=(5, 0, 0))
    assert patched_rotary(model).extrapolation == "none"
