"""A new multimodal design is one position design and one registry entry, and the generic tests cover it without being
edited.

``strided_time_design`` below is a throwaway design: M-RoPE's ids with the frames of a video ``frame_step`` apart on
the time row (a visual token (t, i, j) of a block at cursor s sits at (s + step t, s + i, s + j)); a block advances
the cursor by its largest id + 1. The entry pairs it with M-RoPE's chunked frequency allocation. ``tests/conftest.py``
imports this module before any test module is collected, so the design is in ``MULTIMODAL_SCHEMES`` when the generic
tests build their lists from :func:`~visionpe.multimodal.list_multimodal_schemes` (ids, packing, rotary tables,
numerics at a million tokens, the Hugging Face adapters...), and removes it when the run ends.
"""

from __future__ import annotations

import pytest
import torch

from visionpe.checks import check_int
from visionpe.multimodal import MULTIMODAL_SCHEMES, MultimodalRotary, MultimodalScheme, get_position_ids
from visionpe.multimodal.design import DesignOutput, VisualLayout

NAME = "test_strided_time"


def strided_time_design(layout: VisualLayout, *, frame_step: int = 2) -> DesignOutput:
    """Visual token (t, i, j) at (step t, i, j) past its block's cursor; the block advances by its largest id + 1."""
    check_int(frame_step, "frame_step", min=1)
    local = torch.stack([layout.frame * frame_step, layout.row, layout.col])
    thw = layout.block_thw
    top = torch.maximum((thw[:, 0] - 1) * frame_step, thw[:, 1:].amax(1) - 1)
    return DesignOutput(local=local, advance=top + 1, block_top=top)


MULTIMODAL_SCHEMES[NAME] = MultimodalScheme(
    NAME, strided_time_design, "chunked", {"mrope_section": (16, 24, 24)}, "a throwaway design of the tests"
)


def unregister() -> None:
    """Remove the design from the registry (the test run's end)."""
    MULTIMODAL_SCHEMES.pop(NAME, None)


def test_the_generic_tests_collected_in_this_run_cover_it():
    from . import conftest

    assert not conftest.uncovered_generic_tests(NAME)


def test_ids_of_a_video_between_text():
    """T T | 3 frames of 2 x 2 | T: the frames 2 apart on row t, rows and columns on h and w; the text after the
    video continues at its largest id + 1 (cursor 2 + 4 + 1)."""
    types = torch.tensor([[0, 0] + [2] * 12 + [0]])
    pos, delta = get_position_ids(NAME, types, video_grid_thw=torch.tensor([[3, 4, 4]]))
    frames = [2 + 2 * t for t in range(3) for _ in range(4)]
    assert pos[:, 0].tolist() == [
        [0, 1, *frames, 7],
        [0, 1, *[2, 2, 3, 3] * 3, 7],
        [0, 1, *[2, 3, 2, 3] * 3, 7],
    ]
    assert delta.tolist() == [[8 - 15]]
    step_one, _ = get_position_ids(NAME, types, video_grid_thw=torch.tensor([[3, 4, 4]]), frame_step=1)
    mrope, _ = get_position_ids("mrope", types, video_grid_thw=torch.tensor([[3, 4, 4]]))
    assert torch.equal(step_one, mrope)  # with step 1 the design is M-RoPE's


def test_options_are_checked():
    types = torch.tensor([[0, 2, 2, 2, 2]])
    with pytest.raises(ValueError, match=r"frame_step must be .*got 0"):
        get_position_ids(NAME, types, video_grid_thw=torch.tensor([[1, 4, 4]]), frame_step=0)
    with pytest.raises(ValueError, match=rf"{NAME} got unknown option\(s\) \['step'\]"):
        get_position_ids(NAME, types, video_grid_thw=torch.tensor([[1, 4, 4]]), step=2)


def test_rotary_reads_the_time_row_on_the_first_section():
    pos, _ = get_position_ids(NAME, torch.tensor([[0] + [2] * 8]), video_grid_thw=torch.tensor([[2, 4, 4]]))
    angles = MultimodalRotary.from_scheme(NAME, 128, base=1e4).angles(pos)  # (1, L, 64)
    inv_freq = 1e4 ** (-torch.arange(0, 128, 2) / 128)
    torch.testing.assert_close(angles[0, :, :16], pos[0, 0, :, None].float() * inv_freq[:16])
    torch.testing.assert_close(angles[0, :, 16:40], pos[1, 0, :, None].float() * inv_freq[16:40])
