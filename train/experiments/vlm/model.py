"""A tiny Qwen2-VL built from a config (no downloaded weights), with its position scheme swapped by visionpe.

The network is transformers' ``Qwen2VLForConditionalGeneration`` as it is: its vision tower (patch embedding,
vision blocks with 2-D rotary, 2 x 2 patch merger), its decoder and its LM head, only small. The vocabulary is
the task vocabulary of :mod:`experiments.vlm.tasks`. :func:`~visionpe.integrations.hf.apply_position_scheme`
then replaces the decoder's position design and rotary allocation with the chosen scheme.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from visionpe.integrations.hf import apply_position_scheme

from .schemes import get_bench_scheme
from .tasks import PATCH_SIZE, SPATIAL_MERGE_SIZE, TOKENS, VOCAB_SIZE

__all__ = ["VLMSize", "MODEL_SIZES", "build_tiny_vlm"]


@dataclass(frozen=True)
class VLMSize:
    """Sizes of the tiny model. ``head_dim`` = hidden_size / num_heads (Qwen2-VL's rule) must be a multiple of
    8 so that every allocation has whole (t, h, w) sections."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 128
    vision_dim: int = 32
    vision_depth: int = 1
    vision_heads: int = 2
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vision_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 8:
            raise ValueError(
                f"hidden_size / num_heads must be a multiple of 8, got {self.hidden_size} / {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads = {self.num_heads} must be a multiple of num_kv_heads = {self.num_kv_heads}")
        if self.vision_dim % self.vision_heads or (self.vision_dim // self.vision_heads) % 4:
            raise ValueError(
                f"vision_dim / vision_heads must be a multiple of 4, got {self.vision_dim} / {self.vision_heads}"
            )
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)) or self.rope_theta <= 1:
            raise ValueError(f"rope_theta must be a number > 1, got {self.rope_theta!r}")


MODEL_SIZES = {"tiny": VLMSize(), "small": VLMSize(hidden_size=128, intermediate_size=256, vision_dim=64)}


def _chunked_section(num_pairs: int) -> list[int]:
    """Qwen2-VL's (16, 24, 24) of 64 pairs, scaled to ``num_pairs`` with h == w."""
    spatial = round(num_pairs * 24 / 64)
    return [num_pairs - 2 * spatial, spatial, spatial]


def build_tiny_vlm(scheme: str = "mrope", size: VLMSize | None = None, seed: int = 0):
    """A freshly initialised ``Qwen2VLForConditionalGeneration`` using the benchmark scheme ``scheme``.

    Args:
        scheme: a name from :data:`~experiments.vlm.schemes.BENCH_SCHEMES` (``rope_1d``, ``mrope``...).
        size: model sizes; default :class:`VLMSize` (hidden 64, 2 decoder layers, 4 heads of 16, vision tower
            of depth 1 and width 32, patches of 7 px, one input channel, temporal patch size 1).
        seed: initialisation seed (the global RNG is left as it was).

    Returns:
        The model in training mode, with ``apply_position_scheme`` applied using the scheme's evaluation
        options; ``model.bench_scheme`` holds the :class:`BenchScheme`.

    Example:
        >>> model = build_tiny_vlm("videorope")
        >>> model.visionpe_scheme, model.config.vision_config.patch_size
        ('videorope', 7)
    """
    import transformers

    entry = get_bench_scheme(scheme)
    size = VLMSize() if size is None else size
    if not isinstance(size, VLMSize):
        raise TypeError(f"size must be a VLMSize, got {type(size).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    head_dim = size.hidden_size // size.num_heads
    config = transformers.Qwen2VLConfig(
        text_config={
            "vocab_size": VOCAB_SIZE,
            "hidden_size": size.hidden_size,
            "intermediate_size": size.intermediate_size,
            "num_hidden_layers": size.num_layers,
            "num_attention_heads": size.num_heads,
            "num_key_value_heads": size.num_kv_heads,
            "max_position_embeddings": 4096,
            "pad_token_id": TOKENS["<pad>"],
            "bos_token_id": TOKENS["<bos>"],
            "eos_token_id": TOKENS["<ask>"],
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": float(size.rope_theta),
                "mrope_section": _chunked_section(head_dim // 2),
            },
        },
        vision_config={
            "depth": size.vision_depth,
            "embed_dim": size.vision_dim,
            "hidden_size": size.hidden_size,
            "num_heads": size.vision_heads,
            "mlp_ratio": 2,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": SPATIAL_MERGE_SIZE,
            "temporal_patch_size": 1,
            "in_channels": 1,
        },
        image_token_id=TOKENS["<img>"],
        video_token_id=TOKENS["<vid>"],
        vision_start_token_id=TOKENS["<vs>"],
        vision_end_token_id=TOKENS["<ve>"],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2VLForConditionalGeneration(config)
    apply_position_scheme(model, entry.scheme, **entry.options)
    model.bench_scheme = entry
    model.bench_size = asdict(size)
    return model
