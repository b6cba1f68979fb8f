"""visionpe's RIFLEx on the video transformers against the released formula (Zhao et al., "RIFLEx: A Free Lunch for
Length Extrapolation in Video Diffusion Transformers", arXiv 2502.15894; code thu-ml/RIFLEx), re-written here: on the
time axis, band k (1-based, fastest first) becomes 0.9 * 2 pi / L_test, L_test the number of latent frames, in the
float32 frequency table of the model, and nothing else changes.

On HunyuanVideo's and CogVideoX's own time axes (16 channels, base 256 and 10000) with the released settings
(HunyuanVideo k = 4, N_k = 50; CogVideoX-5B k = 2, N_k = 20, at 97 frames: L_test = 25), visionpe's frequencies and
cos / sin are the released ones, and a tiny HunyuanVideo and CogVideoX at twice the training frames give the output
of the original model whose rotary is the released one. Where the two differ is pinned down: the released function
edits band k at any L_test, its scripts only when L_test > N_k, visionpe when L_test exceeds N_k and the training
length."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import CogVideoXTransformer3DModel, HunyuanVideoTransformer3DModel  # noqa: E402
from diffusers.models.embeddings import get_1d_rotary_pos_embed  # noqa: E402
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoRotaryPosEmbed  # noqa: E402

import visionpe  # noqa: E402
from visionpe.integrations.diffusers import apply_position_scheme, patched_rotary  # noqa: E402
from visionpe.integrations.diffusers.hunyuan_video import HunyuanVideoRotary  # noqa: E402
from visionpe.rotary.scaling import identify_k  # noqa: E402

HUNYUAN_K, HUNYUAN_N_K = 4, 50  # the released script's defaults (--k 4 --N_k 50)
COGVIDEOX_K, COGVIDEOX_N_K = 2, 20  # the released README's CogVideoX-5B setting (--k 2 --N_k 20)
HUNYUAN_TRAIN = (33, 45, 80)  # 129 frames at 720 x 1280
COGVIDEOX_TRAIN = (13, 30, 45)  # 49 frames at 480 x 720


# --- the released formula, re-written ------------------------------------------------------------------------------


def released_frequencies(dim: int, theta: float, k: int | None = None, length: int | None = None) -> torch.Tensor:
    """The released code's float32 frequencies of one axis, band k set to 0.9 * 2 pi / length when k is given."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    if k is not None:
        freqs[k - 1] = 0.9 * 2 * torch.pi / length
    return freqs


def released_cos_sin(freqs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.outer(positions, freqs)
    return angles.cos().repeat_interleave(2, dim=1).float(), angles.sin().repeat_interleave(2, dim=1).float()


def released_script_applies(length: int, n_k: int) -> bool:
    """The released scripts' training-free rule: the RIFLEx rotary goes in only when L_test > N_k."""
    return length > n_k


class ReleasedHunyuanRotary(HunyuanVideoRotaryPosEmbed):
    """HunyuanVideo's rotary with the released RIFLEx time axis (band k at 0.9 * 2 pi / L_test), the others as
    diffusers computes them."""

    def __init__(self, own: HunyuanVideoRotaryPosEmbed, k: int, length: int) -> None:
        super().__init__(own.patch_size, own.patch_size_t, own.rope_dim, own.theta)
        self.k, self.length = k, length

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, frames, height, width = hidden_states.shape
        sizes = [frames // self.patch_size_t, height // self.patch_size, width // self.patch_size]
        grid = torch.stack(torch.meshgrid(*[torch.arange(n, dtype=torch.float32) for n in sizes], indexing="ij"))
        time = released_cos_sin(
            released_frequencies(self.rope_dim[0], self.theta, self.k, self.length), grid[0].flatten()
        )
        rest = [get_1d_rotary_pos_embed(self.rope_dim[i], grid[i].flatten(), self.theta, use_real=True) for i in (1, 2)]
        return torch.cat([time[0]] + [r[0] for r in rest], dim=1), torch.cat([time[1]] + [r[1] for r in rest], dim=1)


# --- the intrinsic band ----------------------------------------------------------------------------------------------


def test_identify_k_gives_the_papers_bands():
    # HunyuanVideo repeats after about 8 s, N = 48 latent frames: periods 6, 13, 25, 50, ... -> band 4, period 50
    assert identify_k(256, 16, 48) == (HUNYUAN_K, HUNYUAN_N_K)
    # CogVideoX's time axis (d = 64 / 4 = 16, base 10000): periods 6, 20, 63, ... -> band 2 has the period 20 the
    # released setting names
    assert identify_k(10000, 16, COGVIDEOX_N_K) == (COGVIDEOX_K, COGVIDEOX_N_K)
    periods = [round(2 * math.pi / float(f)) for f in released_frequencies(16, 256.0)]
    assert periods[:5] == [6, 13, 25, 50, 101]


# --- HunyuanVideo's frequency table ---------------------------------------------------------------------------------


def hunyuan_rotary(k: int | None = HUNYUAN_K) -> HunyuanVideoRotary:
    """visionpe's rotary of the released HunyuanVideo (16, 56, 56 channels, base 256), RIFLEx on the time axis."""
    rope = HunyuanVideoRotary((16, 56, 56), 2, 1, 256.0, HUNYUAN_TRAIN)
    visionpe.set_extrapolation(rope, "riflex", axes=("time",), riflex_k=k)
    return rope


def latents(frames: int, rows: int = 2, cols: int = 2, patch: int = 2) -> torch.Tensor:
    return torch.zeros(1, 1, frames, patch * rows, patch * cols)


@pytest.mark.parametrize("length", [51, 66, 129])
def test_hunyuan_frequencies_and_cos_sin_are_the_released(length):
    # L_test past N_k = 50: the released script swaps the RIFLEx rotary in, visionpe edits band 4
    assert released_script_applies(length, HUNYUAN_N_K)
    rope = hunyuan_rotary()
    freqs = rope.rotary.axis_frequencies((length, 2, 2))
    expected = released_frequencies(16, 256.0, HUNYUAN_K, length)
    assert freqs[0][0].dtype == torch.float32 and torch.equal(freqs[0][0], expected)
    assert torch.equal(freqs[1][0], released_frequencies(56, 256.0)) and torch.equal(freqs[2][0], freqs[1][0])
    # the cos and sin of every token: the released rotary's, bit for bit
    own = HunyuanVideoRotaryPosEmbed(2, 1, [16, 56, 56], 256.0)
    hidden = latents(length)
    for mine, theirs in zip(rope(hidden), ReleasedHunyuanRotary(own, HUNYUAN_K, length)(hidden), strict=True):
        assert torch.equal(mine, theirs)
    # and only band 4 of the time axis differs from the model's own rotary
    changed = (rope(hidden)[0] != own(hidden)[0]).any(0)
    assert changed.nonzero().flatten().tolist() == [6, 7]


@pytest.mark.parametrize("length", [20, 33, 40, 50])
def test_hunyuan_up_to_the_period_nothing_changes(length):
    # L_test <= N_k: the released scripts keep the model's rotary, and so does visionpe; the released function, given
    # k, would still edit band 4 (0.9 * 2 pi / L_test, faster than the model's 2 pi / 50.3 below L_test = 45)
    assert not released_script_applies(length, HUNYUAN_N_K)
    rope = hunyuan_rotary()
    own = HunyuanVideoRotaryPosEmbed(2, 1, [16, 56, 56], 256.0)
    hidden = latents(length)
    for mine, theirs in zip(rope(hidden), own(hidden), strict=True):
        assert torch.equal(mine, theirs)
    assert torch.equal(rope.rotary.axis_frequencies((length, 2, 2))[0][0], released_frequencies(16, 256.0))
    assert not torch.equal(released_frequencies(16, 256.0, HUNYUAN_K, length), released_frequencies(16, 256.0))


def test_a_band_shorter_than_the_training_length_is_where_they_differ():
    # band 3 (period 25 < 33 training frames) at L_test = 30: the released script edits it (30 > 25); visionpe does
    # not, the video being no longer than the training length; past the training length both edit it
    rope = hunyuan_rotary(k=3)
    assert released_script_applies(30, 25)
    assert torch.equal(rope.rotary.axis_frequencies((30, 2, 2))[0][0], released_frequencies(16, 256.0))
    assert torch.equal(rope.rotary.axis_frequencies((40, 2, 2))[0][0], released_frequencies(16, 256.0, 3, 40))


def test_without_riflex_k_visionpe_picks_another_band_than_the_paper():
    # the default band is the one whose period is nearest the training length (33: band 3, period 25), not the
    # paper's band 4 (nearest N = 48, where HunyuanVideo repeats): riflex_k must be given
    rope = hunyuan_rotary(k=None)
    assert torch.equal(rope.rotary.axis_frequencies((66, 2, 2))[0][0], released_frequencies(16, 256.0, 3, 66))


# --- CogVideoX's frequency table ------------------------------------------------------------------------------------


def cogvideox(**options) -> CogVideoXTransformer3DModel:
    """A random CogVideoX transformer with CogVideoX-5B's head (64 channels: time, height, width blocks of 16, 24,
    24) and config sizes (49 frames, 60 x 90 latents): one head, one block; ``options`` change the config."""
    torch.manual_seed(0)
    return CogVideoXTransformer3DModel(
        num_attention_heads=1,
        attention_head_dim=64,
        in_channels=4,
        out_channels=4,
        time_embed_dim=8,
        text_embed_dim=8,
        num_layers=1,
        max_text_seq_length=3,
        use_rotary_positional_embeddings=True,
        **options,
    ).eval()


def pipeline_rotary(model: CogVideoXTransformer3DModel, frames: int, height: int, width: int) -> tuple:
    pytest.importorskip("transformers")  # the pipeline module imports its text encoder's classes
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import CogVideoXPipeline

    pipe = SimpleNamespace(vae_scale_factor_spatial=8, transformer=model)
    return CogVideoXPipeline._prepare_rotary_positional_embeddings(pipe, 8 * height, 8 * width, frames, "cpu")


def released_cogvideox_rotary(model, frames: int, height: int, width: int, k: int, length: int) -> tuple:
    """The released CogVideoX RIFLEx rotary: the pipeline's, its time block from the released formula on the
    pipeline's time positions (linspace(0, F (F - 1) / F, F))."""
    cos, sin = pipeline_rotary(model, frames, height, width)
    positions = torch.linspace(0, frames * (frames - 1) / frames, frames, dtype=torch.float32)
    time = released_cos_sin(released_frequencies(16, 10000, k, length), positions)
    out = []
    for full, block in zip((cos, sin), time, strict=True):
        full = full.clone().reshape(frames, -1, full.shape[-1])
        full[..., :16] = block[:, None, :]
        out.append(full.reshape(-1, full.shape[-1]))
    return tuple(out)


def test_cogvideox_frequencies_and_cos_sin_are_the_released():
    # CogVideoX-5B at 97 frames: L_test = 25 latent frames, past N_k = 20 and the 13 training frames
    model = cogvideox()
    assert apply_position_scheme(model).train_grid_size == COGVIDEOX_TRAIN  # from the released config sizes
    visionpe.set_extrapolation(model, "riflex", axes=("time",), riflex_k=COGVIDEOX_K)
    rotary = patched_rotary(model)
    assert rotary.axes_dim == (16, 24, 24) and rotary.thetas == (10000.0,) * 3
    assert torch.equal(rotary.axis_frequencies((25, 30, 45))[0][0], released_frequencies(16, 10000, COGVIDEOX_K, 25))
    hidden = torch.zeros(1, 25, 4, 6, 10)  # 3 x 5 tokens: positions spread over the 30 x 45 training grid
    expected = released_cogvideox_rotary(model, 25, 6, 10, COGVIDEOX_K, 25)
    for mine, theirs in zip(model.embedding_dropout.cos_sin(hidden), expected, strict=True):
        assert torch.equal(mine, theirs)
    # at the training length (13 frames), and up to N_k, the pipeline's own rotary
    for frames in (13, 20):
        hidden = torch.zeros(1, frames, 4, 6, 10)
        for mine, theirs in zip(
            model.embedding_dropout.cos_sin(hidden), pipeline_rotary(model, frames, 6, 10), strict=True
        ):
            assert torch.equal(mine, theirs)


def test_the_released_code_has_no_riflex_for_cogvideox_15():
    # its 1.5 branch passes no k to the rotary: the pipeline's rotary at any length; visionpe applies RIFLEx there too
    model = cogvideox(patch_size_t=2, sample_height=300, sample_width=300, sample_frames=81)  # CogVideoX1.5-5B's
    assert apply_position_scheme(model).train_grid_size == (11, 48, 85)
    visionpe.set_extrapolation(model, "riflex", axes=("time",), riflex_k=COGVIDEOX_K)
    cos, _ = model.embedding_dropout.cos_sin(torch.zeros(1, 44, 4, 4, 4))  # 22 time tokens, past N_k = 20
    riflex = released_cos_sin(released_frequencies(16, 10000, COGVIDEOX_K, 22), torch.arange(22.0))[0]
    assert torch.equal(cos.reshape(22, -1, 64)[:, 0, :16], riflex)
    plain = pipeline_rotary(model, 44, 4, 4)[0]  # the released code's rotary for 1.5 at every length
    assert torch.equal(cos[:, 16:], plain[:, 16:]) and not torch.equal(cos, plain)


# --- end to end ----------------------------------------------------------------------------------------------------


def tiny_hunyuan() -> HunyuanVideoTransformer3DModel:
    """A random HunyuanVideo transformer with the released time axis (16 channels, base 256), 8 + 8 spatial channels;
    one head, one block of each kind."""
    torch.manual_seed(0)
    return HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=1,
        attention_head_dim=32,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        guidance_embeds=False,
        text_embed_dim=8,
        pooled_projection_dim=8,
        rope_axes_dim=(16, 8, 8),
    ).eval()


def hunyuan_inputs(frames: int) -> dict:
    generator = torch.Generator().manual_seed(1)
    return dict(
        hidden_states=torch.randn(1, 4, frames, 2, 2, generator=generator),
        timestep=torch.tensor([700.0]),
        encoder_hidden_states=torch.randn(1, 3, 8, generator=generator),
        encoder_attention_mask=torch.ones(1, 3),
        pooled_projections=torch.randn(1, 8, generator=generator),
        return_dict=False,
    )


def test_hunyuan_at_twice_the_frames_is_the_released_riflex():
    # 66 latent frames (261 frames, the released 2x setting) against the 33 of training: visionpe's riflex on the time
    # axis equals the original model whose rope is the released one
    inputs = hunyuan_inputs(66)
    released = tiny_hunyuan()
    released.rope = ReleasedHunyuanRotary(released.rope, HUNYUAN_K, 66)
    with torch.no_grad():
        expected = released(**inputs)[0]
        plain = tiny_hunyuan()(**inputs)[0]
    model = tiny_hunyuan()
    apply_position_scheme(model)  # the released grid, 33 x 45 x 80
    visionpe.set_extrapolation(model, "riflex", axes=("time",), riflex_k=HUNYUAN_K)
    with torch.no_grad():
        patched = model(**inputs)[0]
    assert (patched - expected).abs().max() <= 1e-5
    assert (expected - plain).abs().max() > 1e-4  # the edit reaches the output
    # at the training length the released scripts and visionpe leave the model as it is
    inputs = hunyuan_inputs(33)
    with torch.no_grad():
        assert (model(**inputs)[0] - tiny_hunyuan()(**inputs)[0]).abs().max() <= 1e-5


def test_cogvideox_at_twice_the_frames_is_the_released_riflex():
    generator = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 25, 4, 4, 4, generator=generator),
        encoder_hidden_states=torch.randn(1, 3, 8, generator=generator),
        timestep=torch.tensor([700]),
        return_dict=False,
    )
    model = cogvideox()
    expected_rotary = released_cogvideox_rotary(model, 25, 4, 4, COGVIDEOX_K, 25)
    pipeline = pipeline_rotary(model, 25, 4, 4)
    with torch.no_grad():
        expected = model(**inputs, image_rotary_emb=expected_rotary)[0]
        plain = model(**inputs, image_rotary_emb=pipeline)[0]
    apply_position_scheme(model)
    visionpe.set_extrapolation(model, "riflex", axes=("time",), riflex_k=COGVIDEOX_K)
    with torch.no_grad():
        patched = model(**inputs, image_rotary_emb=pipeline)[0]  # the pipeline's call, unchanged
    assert (patched - expected).abs().max() <= 1e-5
    assert (expected - plain).abs().max() > 1e-4


def test_the_documented_example():
    # the example of the "Video models and RIFLEx" section of docs/diffusion.md, as it is there
    import torch
    from diffusers import HunyuanVideoTransformer3DModel

    import visionpe
    from visionpe.integrations.diffusers import apply_position_scheme, patched_rotary, remove_position_scheme

    torch.manual_seed(0)
    transformer = HunyuanVideoTransformer3DModel(  # tiny and random; its time axis is the released one (16, base 256)
        in_channels=4, out_channels=4, num_attention_heads=1, attention_head_dim=32, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=False,
        text_embed_dim=8, pooled_projection_dim=8, rope_axes_dim=(16, 8, 8),
    ).eval()  # fmt: skip
    inputs = dict(
        hidden_states=torch.randn(1, 4, 66, 2, 2),  # 66 latent frames (261 frames): twice the 33 of training
        timestep=torch.tensor([700.0]),  # what the pipeline passes, in [0, 1000]
        encoder_hidden_states=torch.randn(1, 3, 8),
        encoder_attention_mask=torch.ones(1, 3),
        pooled_projections=torch.randn(1, 8),
        return_dict=False,
    )
    with torch.no_grad():
        original = transformer(**inputs)[0]
        report = apply_position_scheme(transformer)  # no mode: the model's own rotary, expressed in visionpe
        assert report.train_grid_size == (33, 45, 80)  # HunyuanVideo's: 129 frames at 720 x 1280
        assert (transformer(**inputs)[0] - original).abs().max() <= 1e-5
        visionpe.set_extrapolation(transformer, "riflex", axes=("time",), riflex_k=4)  # the paper's k
        assert patched_rotary(transformer).axis_frequencies((66, 1, 1))[0][0][3] == 0.9 * 2 * torch.pi / 66
        riflex = transformer(**inputs)[0]
        assert not torch.allclose(riflex, original, atol=1e-4)
        remove_position_scheme(transformer)  # the model's own rotary back
        assert torch.equal(transformer(**inputs)[0], original)
