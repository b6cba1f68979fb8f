"""CogVideoX (``CogVideoXTransformer3DModel``, 1.0 and 1.5): its rotary in visionpe, computed by the model itself.

CogVideoX takes its rotary as a forward argument, ``image_rotary_emb``, which the pipeline computes once per call
(``CogVideoXPipeline._prepare_rotary_positional_embeddings``, with diffusers' ``get_3d_rotary_pos_embed``): a head of
d channels is cut into a time block of d / 4 channels and height and width blocks of 3 d / 8 each (16, 24, 24 for
d = 64), base 10000, float32 frequencies, over these positions:

- CogVideoX 1.0 (``patch_size_t`` None; ``grid_type="linspace"``): frames 0 .. F - 1; rows and columns spread over
  the training grid (``sample_height / patch_size`` x ``sample_width / patch_size`` tokens, 30 x 45): the token grid
  is resized to fit it at its aspect ratio and centred (``get_resize_crop_region_for_grid``), and the positions are
  ``linspace(start, stop (n - 1) / n, n)`` over that region, fractional at any other size. Every resolution is thus
  mapped into the training grid: only the time axis can outgrow its training length.
- CogVideoX 1.5 (``patch_size_t`` set; ``grid_type="slice"``): integer positions of the (ceil(F / p_t), H / p,
  W / p) token grid, which the pipeline cuts from tables of ``sample_height / p`` x ``sample_width / p`` positions
  (a larger grid fails there; visionpe continues the positions past them).

visionpe computes the same cos and sin from the ``hidden_states`` shape and the model's config, in a forward
pre-hook that replaces the ``image_rotary_emb`` argument (the pipeline call stays as it was; an argument left None
is filled in too). The model keeps no rotary module, so visionpe's rotary sits in its ``embedding_dropout``:
:class:`CogVideoXRotary` is that same dropout (same p, called by the model as before) holding the
:class:`~visionpe.integrations.diffusers.wan.VideoRotary`. After ``remove_position_scheme`` the pre-hook
passes the arguments through untouched and takes itself off the model at that call. A model built with
``use_rotary_positional_embeddings=False`` (CogVideoX-2b: 3D sincos embeddings added to the tokens) has no rotary to
express: TypeError.

Training grid (:data:`COGVIDEOX`): CogVideoX 1.0 (5b, 5b-I2V) from its config: 49 frames (``sample_frames``) -> 13
latent frames (the VAE compresses time by ``temporal_compression_ratio`` = 4), ``sample_height`` x ``sample_width`` =
60 x 90 latents -> 30 x 45 tokens (480 x 720 px). CogVideoX 1.5: 81 frames at 768 x 1360 -> 21 latent frames padded
to 22, 11 x 48 x 85 tokens [reading of the CogVideoX1.5-5B model card; its config's ``sample_height`` and
``sample_width``, 300, bound the positions rather than giving the training size].

Timestep: the pipeline passes the DDIM / DPM scheduler's integer timestep in [0, 999] (1000 training steps): DyPE's t
is ``timestep / 999``, 1 at the first step of the trailing schedule.

RIFLEx: the released code uses k = 2 (period N_k = 20 latent frames) for CogVideoX-5B, at 97 frames (L = 25 latent
frames); see :mod:`visionpe.integrations.diffusers.hunyuan_video` for where visionpe differs from it.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import nn

from ...checks import check_int
from ...grid import validate_grid_size
from .patch import DiffusionFamily, register_family
from .wan import VIDEO_AXES, VideoRotary, _token_grid, grid_cos_sin

__all__ = ["COGVIDEOX", "COGVIDEOX_15_TRAIN_GRID", "CogVideoXRotary", "resize_crop_region"]

#: CogVideoX 1.5's training grid in tokens [reading: 81 frames at 768 x 1360, the CogVideoX1.5-5B model card]
COGVIDEOX_15_TRAIN_GRID = (11, 48, 85)


def resize_crop_region(grid_size: Sequence[int], base_size: Sequence[int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The region of the (rows, columns) ``base_size`` grid a token grid of ``grid_size`` is mapped onto by CogVideoX
    1.0's pipeline: resized to fit at its aspect ratio, centred; ``((top, left), (bottom, right))``.

    Example:
        >>> resize_crop_region((60, 90), (30, 45)), resize_crop_region((30, 90), (30, 45))
        (((0, 0), (30, 45)), ((8, 0), (23, 45)))
    """
    rows, cols = validate_grid_size(grid_size, ndims=(2,))
    base_rows, base_cols = validate_grid_size(base_size, "base_size", ndims=(2,))
    if rows / cols > base_rows / base_cols:
        height, width = base_rows, int(round(base_rows / rows * cols))
    else:
        height, width = int(round(base_cols / cols * rows)), base_cols
    top, left = int(round((base_rows - height) / 2.0)), int(round((base_cols - width) / 2.0))
    return (top, left), (top + height, left + width)


class CogVideoXRotary(nn.Dropout):
    """CogVideoX's ``embedding_dropout`` (the same dropout) holding visionpe's rotary of the model, a
    :class:`~visionpe.integrations.diffusers.wan.VideoRotary`; :meth:`cos_sin` computes the ``image_rotary_emb`` of
    a ``hidden_states`` as the pipeline does.

    Args:
        p: the dropout probability (the model's ``dropout``).
        axes_dim: the channels of the time, height and width blocks (d / 4, 3 d / 8, 3 d / 8).
        patch_size: the spatial patch side.
        patch_size_t: the temporal patch length (CogVideoX 1.5), or None (1.0).
        base_size: the (rows, columns) of tokens of ``sample_height`` x ``sample_width``: 1.0's training grid, into
            which its positions are fitted.
        train_grid_size: the training grid in tokens per axis (the modes' reference).
        theta: the base of every axis (10000).
        inplace: the dropout's ``inplace``.
    """

    def __init__(
        self,
        p: float,
        axes_dim: Sequence[int],
        patch_size: int,
        patch_size_t: int | None,
        base_size: Sequence[int],
        train_grid_size: Sequence[int] | None = None,
        theta: float = 10000.0,
        inplace: bool = False,
    ) -> None:
        super().__init__(p, inplace)
        self.patch_size = check_int(patch_size, "patch_size", min=1)
        self.patch_size_t = None if patch_size_t is None else check_int(patch_size_t, "patch_size_t", min=1)
        self.base_size = validate_grid_size(base_size, "base_size", ndims=(2,))
        self.rotary = VideoRotary(axes_dim, theta, train_grid_size, freqs_dtype=torch.float32)

    def positions(self, hidden_states: torch.Tensor) -> tuple[list[torch.Tensor], tuple[int, int, int]]:
        """The pipeline's positions of each axis for ``hidden_states`` (B, F, C, H, W), and the grid the modes read:
        (tokens in time, the rows and columns of the region the positions span)."""
        p_t = 1 if self.patch_size_t is None else self.patch_size_t
        frames, rows, cols = _token_grid(hidden_states, 1, (1, self.patch_size, self.patch_size))
        device = hidden_states.device

        def spread(start: int, stop: int, n: int) -> torch.Tensor:
            return torch.linspace(start, stop * (n - 1) / n, n, device=device, dtype=torch.float32)

        if self.patch_size_t is None:
            (top, left), (bottom, right) = resize_crop_region((rows, cols), self.base_size)
            axes = [spread(0, frames, frames), spread(top, bottom, rows), spread(left, right, cols)]
            return axes, (frames, bottom - top, right - left)
        frames = (frames + p_t - 1) // p_t
        axes = [torch.arange(n, device=device, dtype=torch.float32) for n in (frames, rows, cols)]
        return axes, (frames, rows, cols)

    def cos_sin(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``image_rotary_emb`` for ``hidden_states`` (B, F, C, H, W): ``(cos, sin)``, (S, sum(axes_dim)) float32."""
        axes, grid = self.positions(hidden_states)
        return grid_cos_sin(self.rotary, axes, grid)


class _RotaryArgumentHook:
    # forward pre-hook of the model: image_rotary_emb computed by the model's CogVideoXRotary (module-level, so that
    # a model holding it pickles)

    def __init__(self, model: nn.Module) -> None:
        names = list(inspect.signature(type(model).forward).parameters)[1:]
        self.hidden_position = names.index("hidden_states")
        self.rotary_position = names.index("image_rotary_emb")

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        carrier = getattr(module, "embedding_dropout", None)
        if not isinstance(carrier, CogVideoXRotary):  # remove_position_scheme put the model's dropout back
            for key in [k for k, hook in module._forward_pre_hooks.items() if hook is self]:
                del module._forward_pre_hooks[key]
                module._forward_pre_hooks_with_kwargs.pop(key, None)
            return None
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[self.hidden_position]
        # the rotary has this call's timestep already: the patch's timestep hook runs before every other pre-hook
        emb = carrier.cos_sin(hidden)
        if len(args) > self.rotary_position:
            args = (*args[: self.rotary_position], emb, *args[self.rotary_position + 1 :])
        else:
            kwargs = {**kwargs, "image_rotary_emb": emb}
        return args, kwargs


def _released_train_grid(config) -> tuple[int, int, int]:
    if config.patch_size_t is not None:
        return COGVIDEOX_15_TRAIN_GRID
    frames = (config.sample_frames - 1) // config.temporal_compression_ratio + 1
    return frames, config.sample_height // config.patch_size, config.sample_width // config.patch_size


def _build(model: nn.Module, own: nn.Module, train_grid_size) -> CogVideoXRotary:
    config = model.config
    if not config.use_rotary_positional_embeddings:
        raise TypeError(
            f"{type(model).__name__} must use rotary position embeddings for visionpe to express them, but its config "
            "has use_rotary_positional_embeddings=False (sincos or learned embeddings added to the tokens): there is "
            "no rotary to express"
        )
    head = config.attention_head_dim
    carrier = CogVideoXRotary(
        own.p,
        (head // 4, head // 8 * 3, head // 8 * 3),
        config.patch_size,
        config.patch_size_t,
        (config.sample_height // config.patch_size, config.sample_width // config.patch_size),
        train_grid_size or _released_train_grid(config),
        inplace=own.inplace,
    )
    carrier.train(own.training)
    if not any(isinstance(hook, _RotaryArgumentHook) for hook in model._forward_pre_hooks.values()):
        model.register_forward_pre_hook(_RotaryArgumentHook(model), with_kwargs=True)
    return carrier


COGVIDEOX = register_family(
    DiffusionFamily(
        name="cogvideox",
        class_names=("CogVideoXTransformer3DModel",),
        attribute="embedding_dropout",
        build=_build,
        timestep_scale=1.0 / 999.0,
        axis_names=VIDEO_AXES,
        # CogVideoX 1.0's config: 49 frames -> 13 latent frames, 60 x 90 latents (480 x 720 px) -> 30 x 45 tokens
        default_train_grid=(13, 30, 45),
        own_module_class="Dropout",
    )
)
