"""A new rotary scheme is one registered class, and the generic tests cover it without being edited.

``FixedRope`` below is a throwaway scheme: axial-mixed RoPE with fixed frequencies, a
:class:`~visionpe.rotary.base.LinearRotary` that implements only ``frequencies()``. ``tests/conftest.py`` imports
this module before any test module is collected, so the scheme is in the registry when the generic tests build
their scheme lists from it (they then run on it as on every built-in scheme), and removes it when the run ends.
The tests here run the generic checks on it directly too, so that this file alone shows them passing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import timm
import torch

import visionpe
from visionpe.grid import grid_coords
from visionpe.registry import unregister_scheme
from visionpe.rotary.base import LinearRotary

from .model_checks import check_forward_backward

NAME = "test_fixed_rope"

if NAME in visionpe.list_schemes():  # the module imported a second time (another import path): replace the class
    unregister_scheme(NAME)


@visionpe.register_scheme(NAME)
class FixedRope(LinearRotary):
    """RoPE with fixed frequencies: pair j turns at rate 100^(-j / pairs) along the direction at angle j * 2.4 rad
    in the (y, x) plane (and at the same rate along t for video); nothing is learned."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        ndim: int = 2,
        coord_mode: str = "index",
        grid_size: Sequence[int] | None = None,
        extrapolation: str = "none",
        yarn_alpha: float = 1.0,
        yarn_beta: float = 32.0,
    ) -> None:
        super().__init__(dim, num_heads, depth, ndim, coord_mode, grid_size, extrapolation, yarn_alpha, yarn_beta)
        self.register_buffer("freqs", self.fixed_buffers()["freqs"], persistent=False)

    def fixed_buffers(self) -> dict[str, torch.Tensor]:
        """The frequency table, computed from the configuration (rebuilt after a meta-device build)."""
        pairs = self.head_dim // 2
        rate = 100.0 ** (-torch.arange(pairs, dtype=torch.float32) / pairs)
        angle = torch.arange(pairs, dtype=torch.float32) * 2.4
        rows = [rate * angle.sin(), rate * angle.cos()]  # coordinate columns (y, x)
        if self.ndim == 3:
            rows.insert(0, rate)  # (t, y, x)
        return {"freqs": torch.stack(rows)[None, None]}

    def frequencies(self) -> torch.Tensor:
        """(1, 1, ndim, head_dim // 2): the same frequencies in every block and head."""
        return self.freqs


def unregister() -> None:
    """Remove the scheme from the registry (the test run's end)."""
    if NAME in visionpe.list_schemes():
        unregister_scheme(NAME)


def test_the_generic_scheme_lists_include_it():
    from . import conftest

    assert NAME in conftest.ALL_SCHEMES and NAME in conftest.ROTARY and NAME in conftest.IN_ATTENTION
    assert NAME in conftest.EXTRAPOLATING and NAME in conftest.VIDEO  # LinearRotary's modes; the ndim option
    assert NAME not in conftest.LIE and NAME not in conftest.RECOMPILE_PER_GRID and NAME not in conftest.ONNX_FAILS


# test modules parametrized over the registry: each collected in the same run must hold tests of the new scheme
# (tests/reliability/test_compile.py runs one scheme per implementation family: this one shares LinearRotary's)
GENERIC_MODULES = [
    "tests.reliability.test_checkpoints",
    "tests.reliability.test_determinism",
    "tests.reliability.test_export",
    "tests.reliability.test_hostile_input",
    "tests.reliability.test_numerics",
    "tests.reliability.test_properties",
    "tests.reliability.test_regressions",
    "tests.models.test_patch_dropout",
    "tests.models.test_timm_features",
    "tests.models.test_vit",
    "tests.test_registry",
]


def test_the_generic_tests_collected_in_this_run_cover_it():
    from . import conftest

    covered, collected = set(), set()
    for item in conftest.COLLECTED:
        module = item.module.__name__
        collected.add(module)
        params = getattr(item, "callspec", None)
        if params is not None and NAME in params.params.values():
            covered.add(module)
    missing = [m for m in GENERIC_MODULES if m in collected and m not in covered]
    assert not missing, f"collected without a test of {NAME}: {missing}"
    # and every test function parametrized over all of visionpe's rotary schemes runs on this one too
    assert not conftest.uncovered_generic_tests(NAME)


def test_builds_by_name_in_the_timm_model_and_alone():
    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=NAME, depth=2, num_classes=3)
    assert isinstance(model.pos_schemes[NAME], FixedRope)
    assert model(torch.randn(1, 3, 224, 224)).shape == (1, 3)
    scheme = visionpe.create_pos_embed(NAME, dim=64, num_heads=2, depth=2)
    assert scheme.kind == "rotary" and scheme.scheme_name == NAME
    assert visionpe.create_pos_embed(NAME, dim=64, num_heads=2, ndim=3).coords((2, 3, 4)).shape == (24, 3)
    with pytest.raises(ValueError, match="unknown option"):
        visionpe.create_pos_embed(NAME, dim=64, num_heads=2, bogus=1)


@pytest.mark.parametrize("size", [(64, 64), (48, 80)])
def test_forward_backward(size):
    check_forward_backward(NAME, size)


def test_scores_depend_only_on_the_coordinate_difference():
    """q_i . k_j after rotation is the same when every coordinate moves by one shift (RoPE's relative property),
    and the rotation is not the identity."""
    scheme = visionpe.create_pos_embed(NAME, dim=64, num_heads=2, depth=2)
    q, k = torch.randn(2, 1, 2, 12, 32, dtype=torch.float64).unbind(0)
    coords = grid_coords((3, 4))
    for layer in (0, 1):
        scores = scheme.rotate(q, coords, layer) @ scheme.rotate(k, coords, layer).transpose(-2, -1)
        for shift in ([2.5, -1.25], [-7.0, 3.0]):
            moved = coords + torch.tensor(shift)
            shifted = scheme.rotate(q, moved, layer) @ scheme.rotate(k, moved, layer).transpose(-2, -1)
            torch.testing.assert_close(shifted, scores, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(scores, q @ k.transpose(-2, -1), atol=1e-2)
    # the rotation keeps norms: every pair is a plane rotation
    torch.testing.assert_close(scheme.rotate(q, coords).norm(dim=-1), q.norm(dim=-1))
    assert math.isclose(float(scheme.frequencies()[0, 0, 1, 0]), 1.0)  # pair 0: rate 1 along x


def test_hostile_input_errors():
    from .reliability.test_hostile_input import _rotate_cases, test_rotary_rotate

    for case in _rotate_cases():
        test_rotary_rotate(NAME, case)


def test_compiled_equals_eager():
    from torch._dynamo.utils import counters

    from .reliability.test_compile import test_scheme_compiles_and_matches_eager

    torch._dynamo.reset()
    counters.clear()
    try:
        test_scheme_compiles_and_matches_eager(NAME)
    finally:
        torch._dynamo.reset()
