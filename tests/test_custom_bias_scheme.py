"""A new bias scheme is one registered class, and the generic tests cover it without being edited.

``GaussianBias`` below is a throwaway scheme: a learned Gaussian of the patch distance, b_h(i, j) = -a_{l,h} d(i, j)^2
with a = softplus(w) per block and head. It is a :class:`~visionpe.bias.distance.DistanceKernelBias` that implements
only ``kernel()``: the base class supplies the per-offset state, the query chunks, FlexAttention's per-offset terms,
drawn coordinates (``coord_augment``) and weight decay. ``tests/conftest.py`` imports this module before any test
module is collected, so the scheme is in the registry when the generic tests build their scheme lists from it (they
then run on it as on every built-in scheme), and removes it when the run ends. The tests here run some generic checks
on it directly too, so that this file alone shows them passing (torch.compile runs one scheme of each implementation
family, here ``bam``'s: tests/reliability/test_compile.py).
"""

from __future__ import annotations

import timm
import torch
import torch.nn.functional as F
from torch import nn

import visionpe
from visionpe.bias.distance import DistanceKernelBias
from visionpe.grid import grid_coords
from visionpe.registry import unregister_scheme

from .model_checks import check_forward_backward

NAME = "test_gaussian_bias"

if NAME in visionpe.list_schemes():  # the module imported a second time (another import path): replace the class
    unregister_scheme(NAME)


@visionpe.register_scheme(NAME)
class GaussianBias(DistanceKernelBias):
    """b = -softplus(w) d^2, one w per block and head (and axis with ``distance="axis"``), w ~ U(-1, 1) at init."""

    def __init__(self, dim: int, num_heads: int, depth: int = 1, distance: str = "euclidean") -> None:
        super().__init__(dim, num_heads, depth, distance)
        self.width = nn.Parameter(self.kernel_parameter(uniform=2.0) - 1.0)

    def kernel(self, distances: torch.Tensor, layer: int) -> torch.Tensor:
        return -F.softplus(self.layer_parameter(self.width, layer, distances.dtype)) * distances.square()


def unregister() -> None:
    """Remove the scheme from the registry (the test run's end)."""
    if NAME in visionpe.list_schemes():
        unregister_scheme(NAME)


def test_the_generic_scheme_lists_include_it():
    from . import conftest

    assert NAME in conftest.ALL_SCHEMES and NAME in conftest.BIAS and NAME in conftest.IN_ATTENTION
    # DistanceKernelBias's declarations: ONNX refused (a strict xfail where tested), FlexAttention, 2D grids only
    assert NAME in conftest.ONNX_FAILS and NAME in conftest.RECOMPILE_PER_GRID and NAME in conftest.COORD_CONSUMERS
    assert NAME not in conftest.ROTARY and NAME not in conftest.VIDEO and NAME not in conftest.FAMILY_REPRESENTATIVES


def test_the_generic_tests_collected_in_this_run_cover_it():
    from . import conftest

    assert not conftest.uncovered_generic_tests(NAME)


def test_builds_by_name_in_the_timm_model_and_alone():
    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=NAME, depth=2, num_classes=3)
    assert isinstance(model.pos_schemes[NAME], GaussianBias)
    assert model(torch.randn(1, 3, 224, 224)).shape == (1, 3)
    scheme = visionpe.create_pos_embed(NAME, dim=64, num_heads=2, depth=2, distance="manhattan")
    assert scheme.kind == "bias" and scheme.scheme_name == NAME and scheme.width.shape == (2, 1, 2)
    assert visionpe.create_pos_embed(NAME, dim=64, num_heads=2, distance="axis").width.shape == (1, 2, 2)


def test_forward_backward():
    check_forward_backward(NAME, (48, 80))


def test_bias_is_the_gaussian_of_the_distance_and_zero_for_prefix_pairs():
    """On a non-square grid, every pair of patches gets -softplus(w) times its squared distance (y and x apart);
    pairs with the class token get 0."""
    torch.manual_seed(0)
    scheme = visionpe.create_pos_embed(NAME, dim=32, num_heads=2, depth=2)
    q = torch.randn(1, 2, 1 + 12, 16)
    for layer in (0, 1):
        bias = scheme.attn_bias(q, q, scheme.prepare((3, 4), 1), layer)[0]
        coords = grid_coords((3, 4))
        squared = (coords[:, None] - coords[None]).square().sum(-1)
        expected = -F.softplus(scheme.width[layer, 0])[:, None, None] * squared
        torch.testing.assert_close(bias[:, 1:, 1:], expected)
        assert (bias[:, 0] == 0).all() and (bias[:, :, 0] == 0).all()


def test_weight_decay_skips_the_kernel():
    assert visionpe.create_pos_embed(NAME, dim=32, num_heads=2).no_weight_decay() == {"width"}
