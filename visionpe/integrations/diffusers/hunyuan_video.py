"""HunyuanVideo (``HunyuanVideoTransformer3DModel``): its rotary in visionpe, and RIFLEx as its released code uses it.

HunyuanVideo patches a latent video (B, C, F, H, W) by (``patch_size_t``, ``patch_size``, ``patch_size``) = (1, 2, 2)
and numbers every token by its integer (frame, row, column). ``HunyuanVideoRotaryPosEmbed(patch_size, patch_size_t,
rope_dim=(16, 56, 56), theta=256)`` gives each axis a block of ``rope_dim[a]`` channels with float32 frequencies
256^(-2j / rope_dim[a]); visionpe's :class:`HunyuanVideoRotary` computes the same cos and sin, (S, 128) float32.

Default training grid (:data:`HUNYUAN_VIDEO`): 129 frames at 720 x 1280, the pipeline's defaults; the VAE compresses
time by 4 (129 frames -> 33 latent frames) and space by 8 (90 x 160 latents), patched 2 x 2: 33 x 45 x 80 tokens.
[reading: HunyuanVideo was trained on several resolutions up to this one; RIFLEx's released script generates at
544 x 960 (34 x 60 tokens) with this time axis.]

Timestep: the pipeline passes the flow-matching scheduler's timestep, sigma * 1000 in [0, 1000]: DyPE's t is
``timestep / 1000``.

RIFLEx (Zhao et al., arXiv 2502.15894; code: thu-ml/RIFLEx) on the time axis, as ``visionpe.set_extrapolation(
transformer, "riflex", axes=("time",), riflex_k=4)``: at a test length of L latent frames, band k of the time axis
becomes 0.9 * 2 pi / L. The paper's k for HunyuanVideo is 4 (``visionpe.rotary.scaling.identify_k(256, 16, 48)``:
the video repeats after N = 48 latent frames, the band of period N_4 = 50 is the nearest). Where visionpe and the
released code differ:

- The released ``get_1d_rotary_pos_embed_riflex`` edits band k whenever k is given, at any L; its scripts swap the
  rotary in only when L > N_k (training-free). visionpe edits only when L exceeds both N_k and the training length
  (33 latent frames): for the released settings (HunyuanVideo k = 4, N_k = 50; CogVideoX k = 2, N_k = 20, training
  length 13) N_k is beyond the training length, so both agree at every L. They differ for a band whose period is
  shorter than the training length (k <= 3 here): at N_k < L <= 33 the released script edits it, visionpe does not.
- The released fine-tuned checkpoints (Hunyuan-RIFLEx, CogVideoX-RIFLEx) set L = N_k once (66 and 25) and keep that
  frequency at every length; visionpe's riflex follows the current length, so it does not express those checkpoints.
- N_k: the released scripts take it as an argument (``--N_k 50``); visionpe reads it off the frequency table,
  round(2 pi / theta_k), which gives the same 50 and 20.
- k by default: without ``riflex_k`` visionpe takes the band whose period is nearest the training length (band 3,
  period 25, for HunyuanVideo's 33 frames; band 1 for CogVideoX's 13), not the paper's k: pass ``riflex_k``.
- CogVideoX 1.5 (``patch_size_t`` set): the released code does not apply RIFLEx to it (no k reaches its rotary);
  visionpe applies it as to CogVideoX 1.0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ...checks import check_int
from .patch import DiffusionFamily, register_family
from .wan import VIDEO_AXES, VideoRotary, _token_grid, grid_cos_sin

__all__ = ["HUNYUAN_VIDEO", "HunyuanVideoRotary"]


class HunyuanVideoRotary(nn.Module):
    """HunyuanVideo's ``rope``: ``hidden_states`` (B, C, F, H, W) in, ``(cos, sin)`` (S, sum(axes_dim)) float32 out,
    S = (F / patch_size_t)(H / patch_size)(W / patch_size), by a
    :class:`~visionpe.integrations.diffusers.wan.VideoRotary` (float32 frequencies, as the model).

    Args:
        axes_dim: the channels of the time, height and width blocks (the model's ``rope_axes_dim``).
        patch_size: the spatial patch side.
        patch_size_t: the temporal patch length.
        theta: the base of every axis (the model's ``rope_theta``, 256).
        train_grid_size: the training grid in tokens per axis (the modes' reference).
    """

    def __init__(
        self,
        axes_dim: Sequence[int],
        patch_size: int,
        patch_size_t: int,
        theta: float = 256.0,
        train_grid_size: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.patch_size = check_int(patch_size, "patch_size", min=1)
        self.patch_size_t = check_int(patch_size_t, "patch_size_t", min=1)
        self.rotary = VideoRotary(axes_dim, theta, train_grid_size, freqs_dtype=torch.float32)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        grid = _token_grid(hidden_states, 2, (self.patch_size_t, self.patch_size, self.patch_size))
        positions = [torch.arange(n, device=hidden_states.device, dtype=torch.float32) for n in grid]
        return grid_cos_sin(self.rotary, positions, grid)


def _build(model: nn.Module, own: nn.Module, train_grid_size) -> HunyuanVideoRotary:
    return HunyuanVideoRotary(
        tuple(own.rope_dim),
        own.patch_size,
        own.patch_size_t,
        float(own.theta),
        train_grid_size or HUNYUAN_VIDEO.default_train_grid,
    )


HUNYUAN_VIDEO = register_family(
    DiffusionFamily(
        name="hunyuan_video",
        class_names=("HunyuanVideoTransformer3DModel",),
        attribute="rope",
        build=_build,
        timestep_scale=1.0 / 1000.0,
        axis_names=VIDEO_AXES,
        # the pipeline's defaults: 129 frames -> 33 latent frames, 720 x 1280 -> 45 x 80 tokens
        default_train_grid=(33, 45, 80),
        own_module_class="HunyuanVideoRotaryPosEmbed",
    )
)
