"""Tiny random diffusers transformers (one block of each kind, tiny widths) and their inputs, for the tests of
visionpe.integrations.diffusers; nothing is downloaded. Skipped where diffusers is not installed."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")

import torch  # noqa: E402
from diffusers import FluxTransformer2DModel, QwenImageControlNetModel, QwenImageTransformer2DModel  # noqa: E402

CHANNELS = 8  # latent channels in and out
TEXT_CHANNELS = 8  # the text encoder's width
AXES = (4, 6, 6)  # rotary channels of the index, height and width axes (2, 3, 3 pairs)
TRAIN_GRID = (1, 4, 4)  # the training grid the tests patch with: 4 x 4 tokens


def tiny_flux(axes_dims_rope: tuple[int, int, int] = AXES) -> FluxTransformer2DModel:
    """A random Flux transformer: one double-stream and one single-stream block, 2 heads."""
    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=CHANNELS,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=sum(axes_dims_rope),
        num_attention_heads=2,
        joint_attention_dim=TEXT_CHANNELS,
        pooled_projection_dim=TEXT_CHANNELS,
        axes_dims_rope=axes_dims_rope,
    ).eval()


def flux_ids(height: int, width: int, index: int = 0) -> torch.Tensor:
    """The (height * width, 3) ids of an image's tokens as Flux's pipelines make them: (index, row, column)."""
    ids = torch.zeros(height, width, 3)
    ids[..., 0] = index
    ids[..., 1] = torch.arange(height)[:, None]
    ids[..., 2] = torch.arange(width)[None]
    return ids.reshape(-1, 3)


def flux_inputs(
    height: int,
    width: int,
    *,
    text: int = 3,
    reference: tuple[int, int] | None = None,
    timestep: float = 0.6,
    seed: int = 1,
) -> dict:
    """Keyword arguments of a Flux forward call on a ``height`` x ``width`` latent grid with ``text`` text tokens (ids
    0, 0, 0) and, for ``reference=(h, w)``, a Kontext-like reference image (index id 1) after the generated one.
    ``timestep`` is what the pipeline passes: the flow-matching sigma in [0, 1]."""
    generator = torch.Generator().manual_seed(seed)
    img_ids = flux_ids(height, width)
    if reference is not None:
        img_ids = torch.cat([img_ids, flux_ids(*reference, index=1)])
    return dict(
        hidden_states=torch.randn(1, len(img_ids), CHANNELS, generator=generator),
        encoder_hidden_states=torch.randn(1, text, TEXT_CHANNELS, generator=generator),
        pooled_projections=torch.randn(1, TEXT_CHANNELS, generator=generator),
        timestep=torch.tensor([timestep]),
        img_ids=img_ids,
        txt_ids=torch.zeros(text, 3),
        return_dict=False,
    )


def tiny_qwen(layered: bool = False, axes_dims_rope: tuple[int, int, int] = AXES) -> QwenImageTransformer2DModel:
    """A random Qwen-Image transformer, one block, 2 heads (``layered``: with the layered model's rotary)."""
    torch.manual_seed(0)
    return QwenImageTransformer2DModel(
        patch_size=1,
        in_channels=CHANNELS,
        out_channels=CHANNELS,
        num_layers=1,
        attention_head_dim=sum(axes_dims_rope),
        num_attention_heads=2,
        joint_attention_dim=TEXT_CHANNELS,
        axes_dims_rope=axes_dims_rope,
        use_layer3d_rope=layered,
    ).eval()


def tiny_qwen_controlnet() -> QwenImageControlNetModel:
    """A random Qwen-Image ControlNet, one block, 2 heads."""
    torch.manual_seed(0)
    return QwenImageControlNetModel(
        patch_size=1,
        in_channels=CHANNELS,
        out_channels=CHANNELS,
        num_layers=1,
        attention_head_dim=sum(AXES),
        num_attention_heads=2,
        joint_attention_dim=TEXT_CHANNELS,
        axes_dims_rope=AXES,
    ).eval()


def qwen_inputs(shapes: list[tuple[int, int, int]], *, text: int = 3, timestep: float = 0.6, seed: int = 1) -> dict:
    """Keyword arguments of a Qwen-Image forward call on the images ``shapes`` ((frames, height, width) each, the
    generated image first: Qwen-Image-Edit's layout) for a batch of one, with ``text`` text tokens; ``timestep`` is
    what the pipeline passes (timestep / 1000, in [0, 1])."""
    generator = torch.Generator().manual_seed(seed)
    tokens = sum(f * h * w for f, h, w in shapes)
    return dict(
        hidden_states=torch.randn(1, tokens, CHANNELS, generator=generator),
        encoder_hidden_states=torch.randn(1, text, TEXT_CHANNELS, generator=generator),
        timestep=torch.tensor([timestep]),
        img_shapes=[list(shapes)],
        return_dict=False,
    )


def run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """The model's output sample for ``inputs``, without gradient."""
    with torch.no_grad():
        return model(**inputs)[0]


def run_capturing_rotary(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, tuple]:
    """The model's output sample and what its ``pos_embed`` returned during the call."""
    seen = []
    handle = model.pos_embed.register_forward_hook(lambda module, args, output: seen.append(output))
    try:
        out = run(model, inputs)
    finally:
        handle.remove()
    assert len(seen) == 1, f"pos_embed ran {len(seen)} times in one forward call"
    return out, seen[0]


@pytest.fixture
def flux() -> FluxTransformer2DModel:
    return tiny_flux()


@pytest.fixture
def qwen() -> QwenImageTransformer2DModel:
    return tiny_qwen()
