"""Wan (``WanTransformer3DModel``, and the VACE variant ``WanVACETransformer3DModel``): its rotary in visionpe.

Wan patches a latent video (B, C, F, H, W) by ``patch_size`` (1, 2, 2) and numbers every token by its integer
(frame, row, column). ``WanRotaryPosEmbed`` cuts a head of d channels into a time block of d - 4 (d // 6) channels
and height and width blocks of 2 (d // 6) channels each (44, 42, 42 for d = 128), every axis with base 10000 and
float64 frequencies (float32 where MPS is available), and keeps cos and sin of positions 0 .. ``rope_max_seq_len``
- 1 (1024) as buffers that it slices per input. visionpe's :class:`WanRotary` computes the same values from the
input's token grid (also past ``rope_max_seq_len`` positions, where the model's tables end) and returns them in the
dtype the model's tables have (they are buffers, cast with the model).

Default training grid (:data:`WAN`): Wan 2.1's pipeline generates 81 frames at 480 x 832 by default; the VAE
compresses time by 4 (81 frames -> 21 latent frames) and space by 8 (60 x 104 latents), patched 2 x 2: 21 x 30 x 52
tokens. [reading: the 720p checkpoints (Wan2.1-T2V-14B at 720 x 1280) were trained on 21 x 45 x 80; pass
``train_grid_size=(21, 45, 80)`` for them.]

Timestep: the Wan pipeline passes the flow-matching scheduler's timestep, sigma * 1000 in [0, 1000], so DyPE's t is
``timestep / 1000``. Wan 2.2 TI2V (``expand_timesteps``) passes one timestep per token; the patch reads the first,
which belongs to the first latent frame (0 when an image conditions that frame).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ...checks import check_instance, check_int
from ...grid import validate_grid_size
from ...rotary.scaling import check_riflex_k
from .patch import DiffusionFamily, register_family
from .rotary import DiffusionRotary

__all__ = ["VIDEO_AXES", "WAN", "VideoRotary", "WanRotary", "grid_cos_sin"]

#: the rotary axes of the video transformers, in the order of their channel blocks
VIDEO_AXES = ("time", "height", "width")


class VideoRotary(DiffusionRotary):
    """The :class:`DiffusionRotary` of the video transformers: the axes time, height, width.

    RIFLEx's ``riflex_k`` is checked against each axis' bands, ``axes_dim[a] / 2``, read off the channels rather than
    the frequency table, and a band an axis lacks is refused naming the axis (``time``) rather than its index.
    """

    def __init__(
        self,
        axes_dim: Sequence[int],
        theta: float | Sequence[float],
        train_grid_size: Sequence[int] | None = None,
        *,
        freqs_dtype: torch.dtype = torch.float64,
    ) -> None:
        super().__init__(axes_dim, theta, VIDEO_AXES, train_grid_size, freqs_dtype=freqs_dtype)

    def check_riflex_options(
        self, mode: str, riflex_k: int | Sequence[int | None] | None, train_grid_size: tuple[int, ...] | None = None
    ) -> tuple[int | None, ...] | None:
        if mode != "riflex" or riflex_k is None:
            return super().check_riflex_options(mode, riflex_k, train_grid_size)
        ks = check_riflex_k(riflex_k, len(self.axes_dim))
        for axis, (k, dim) in enumerate(zip(ks, self.axes_dim, strict=True)):
            if k and k > dim // 2:
                raise ValueError(
                    f"riflex_k[{axis}] must be a band of the {self.names[axis]} axis, which has {dim // 2} bands, "
                    f"got {k}"
                )
        return ks


def grid_cos_sin(
    rotary: DiffusionRotary, axis_positions: Sequence[torch.Tensor], grid_size: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every token of a grid of ``axis_positions[0] x axis_positions[1] x ...`` tokens (the first
    axis slowest, as the video transformers flatten their tokens), ``(S, rotary.dim)`` float32 each.

    Each axis' block is computed once per position of that axis by :meth:`DiffusionRotary.cos_sin` and broadcast
    over the other axes: the same values as computing every token's cos and sin, at a fraction of the cost.

    Args:
        rotary: the rotary (its axes in the order of ``axis_positions``).
        axis_positions: one 1-D tensor of positions per axis (integer or fractional), all on one device.
        grid_size: the number of positions per axis the modes compare with the training grid (None: no mode).

    Example:
        >>> rotary = VideoRotary((4, 4, 4), 10000.0)
        >>> cos, sin = grid_cos_sin(rotary, [torch.arange(2), torch.arange(3), torch.arange(5)], (2, 3, 5))
        >>> tuple(cos.shape), bool(cos[0].eq(1).all())
        ((30, 12), True)
    """
    check_instance(rotary, "rotary", DiffusionRotary, expected="a DiffusionRotary")
    ndim = len(rotary.axes_dim)
    if (
        not isinstance(axis_positions, (tuple, list))
        or len(axis_positions) != ndim
        or not all(isinstance(p, torch.Tensor) and p.ndim == 1 and p.numel() > 0 for p in axis_positions)
    ):
        shapes = (
            [tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__ for p in axis_positions]
            if isinstance(axis_positions, (tuple, list))
            else type(axis_positions).__name__
        )
        raise ValueError(f"axis_positions must be {ndim} non-empty 1-D tensors (one per axis), got {shapes}")
    if grid_size is not None:
        grid_size = validate_grid_size(grid_size, ndims=(ndim,))
    lengths = [p.numel() for p in axis_positions]
    device = axis_positions[0].device
    # one row per position index, one column per axis (shorter axes padded with 0, whose rows are not read)
    table = torch.zeros(max(lengths), ndim, dtype=torch.float32, device=device)
    for a, p in enumerate(axis_positions):
        table[: lengths[a], a] = p.to(device=device, dtype=torch.float32)
    out = []
    for values in rotary.cos_sin(table, grid_size):
        blocks, start = [], 0
        for a, d in enumerate(rotary.axes_dim):
            shape = [1] * ndim + [d]
            shape[a] = lengths[a]
            blocks.append(values[: lengths[a], start : start + d].reshape(shape).expand(*lengths, d))
            start += d
        out.append(torch.cat(blocks, dim=-1).reshape(-1, rotary.dim))
    return out[0], out[1]


def _token_grid(hidden_states: torch.Tensor, frames_dim: int, patch_size: Sequence[int]) -> tuple[int, int, int]:
    # the (frames, rows, columns) of tokens of a latent video, as the model's patch embedding cuts it
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.ndim != 5:
        raise ValueError(
            "hidden_states must be a 5-D latent video tensor, got "
            f"{tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__}"
        )
    frames, height, width = hidden_states.shape[frames_dim], hidden_states.shape[-2], hidden_states.shape[-1]
    p_t, p_h, p_w = patch_size
    return frames // p_t, height // p_h, width // p_w


class WanRotary(nn.Module):
    """Wan's ``rope``: ``hidden_states`` (B, C, F, H, W) in, ``(cos, sin)`` (1, S, 1, sum(axes_dim)) out, S = (F /
    p_t)(H / p_h)(W / p_w), by a :class:`VideoRotary`.

    Args:
        axes_dim: the channels of the time, height and width blocks (``WanRotaryPosEmbed``'s t_dim, h_dim, w_dim).
        patch_size: (p_t, p_h, p_w).
        theta: the base of every axis (10000 in Wan).
        train_grid_size: the training grid in tokens per axis (the modes' reference).
        freqs_dtype: the dtype of the frequencies and angles (float64, float32 where MPS is available, as Wan).
        table_dtype: the dtype of the returned cos and sin at construction (the model's tables'); it follows the
            module's casts (``.to(torch.bfloat16)``), as the model's tables do.
    """

    def __init__(
        self,
        axes_dim: Sequence[int],
        patch_size: Sequence[int],
        theta: float = 10000.0,
        train_grid_size: Sequence[int] | None = None,
        *,
        freqs_dtype: torch.dtype = torch.float64,
        table_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if isinstance(patch_size, (str, bytes)) or not isinstance(patch_size, Sequence) or len(patch_size) != 3:
            raise ValueError(f"patch_size must be (p_t, p_h, p_w), got {patch_size!r}")
        self.patch_size = tuple(check_int(p, f"patch_size[{i}]", min=1) for i, p in enumerate(patch_size))
        if not isinstance(table_dtype, torch.dtype) or not table_dtype.is_floating_point:
            raise TypeError(f"table_dtype must be a floating-point torch.dtype, got {table_dtype!r}")
        self.rotary = VideoRotary(axes_dim, theta, train_grid_size, freqs_dtype=freqs_dtype)
        # an empty buffer whose dtype follows the module's casts, as the model's cos/sin tables (buffers) do
        self.register_buffer("table_reference", torch.empty(0, dtype=table_dtype), persistent=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        grid = _token_grid(hidden_states, 2, self.patch_size)
        positions = [torch.arange(n, device=hidden_states.device) for n in grid]
        cos, sin = grid_cos_sin(self.rotary, positions, grid)
        dtype = self.table_reference.dtype
        shape = (1, cos.shape[0], 1, cos.shape[1])
        return cos.to(dtype).reshape(shape), sin.to(dtype).reshape(shape)


def _build(model: nn.Module, own: nn.Module, train_grid_size) -> WanRotary:
    # the model keeps no theta: WanRotaryPosEmbed is built with its default, 10000; checked below on its tables
    freqs_dtype = torch.float32 if torch.backends.mps.is_available() else torch.float64
    table = own.freqs_cos
    rope = WanRotary(
        (own.t_dim, own.h_dim, own.w_dim),
        own.patch_size,
        10000.0,
        train_grid_size or WAN.default_train_grid,
        freqs_dtype=freqs_dtype,
        table_dtype=table.dtype,
    )
    if table.device.type != "meta":
        rows = min(int(table.shape[0]), 16)
        positions = torch.arange(rows, device=table.device)
        cos, _ = grid_cos_sin(rope.rotary, [positions] * 3)
        # the first `rows` positions of each axis: the diagonal of the (rows, rows, rows) grid
        diagonal = cos.reshape(rows, rows, rows, -1)[positions, positions, positions]
        if not torch.allclose(diagonal.to(table.dtype).float(), table[:rows].float(), atol=1e-3, rtol=0):
            raise ValueError(
                f"{type(model).__name__}.rope must hold WanRotaryPosEmbed's tables of base 10000 for visionpe to "
                "express them, but its freqs_cos differs from them (a rotary of another base)"
            )
    return rope


WAN = register_family(
    DiffusionFamily(
        name="wan",
        class_names=("WanTransformer3DModel", "WanVACETransformer3DModel"),
        attribute="rope",
        build=_build,
        timestep_scale=1.0 / 1000.0,
        axis_names=VIDEO_AXES,
        # Wan 2.1 at the pipeline's defaults: 81 frames -> 21 latent frames, 480 x 832 -> 30 x 52 tokens
        default_train_grid=(21, 30, 52),
        own_module_class="WanRotaryPosEmbed",
    )
)
