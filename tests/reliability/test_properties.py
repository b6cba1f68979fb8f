"""Property-based tests (hypothesis) over random grids, paddings and batch mixes: the coordinate builders and
``get_position_ids``.

(Monotone text positions and batched = per-row on left padding are in tests/multimodal/test_position_ids.py.)
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import visionpe
from visionpe.bias.offsets import offset_state
from visionpe.grid import COORD_MODES, grid_coords
from visionpe.multimodal import get_position_ids, list_multimodal_schemes

from ..conftest import ROTARY, takes_option
from ..multimodal.helpers import NEEDS_TIME, max_videos, random_batch

SCHEMES = list_multimodal_schemes()
SETTINGS = settings(max_examples=30, deadline=None)
sizes = st.integers(1, 9)
grids = st.one_of(st.tuples(sizes, sizes), st.tuples(st.integers(1, 4), sizes, sizes))


@SETTINGS
@given(grid=grids, mode=st.sampled_from(COORD_MODES), ref=st.integers(1, 12))
def test_grid_coords_are_row_major_in_every_mode(grid, mode, ref):
    ref_grid = (ref,) * len(grid)
    coords = grid_coords(grid, mode=mode, ref_grid_size=ref_grid if mode == "ref_scaled" else None)
    assert coords.shape == (math.prod(grid), len(grid)) and coords.dtype == torch.float32
    # token k sits at unravel(k) (the last axis, x, runs fastest); each mode is a per-axis affine map of it
    index = torch.stack(torch.unravel_index(torch.arange(math.prod(grid)), grid), dim=1).float()
    n = torch.tensor(grid, dtype=torch.float32)
    expected = {
        "index": index,
        "centered": index - (n - 1) / 2,
        "normalized": (index + 0.5) / n,
        "ref_scaled": index * torch.tensor(ref_grid) / n,
    }[mode]
    torch.testing.assert_close(coords, expected, rtol=0, atol=1e-6)
    if mode == "normalized":
        assert ((coords > 0) & (coords < 1)).all()
    if mode == "centered":
        torch.testing.assert_close(coords.mean(0), torch.zeros(len(grid)), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ROTARY)
@settings(max_examples=10, deadline=None)
@given(grid=st.tuples(sizes, sizes), ref=st.tuples(sizes, sizes))
def test_scheme_coordinates_follow_their_mode(name, grid, ref):
    """Every rotary scheme's coordinate builder is grid_coords in its documented mode (ComRoPE's train-grid
    normalisation divides the cell centres by the training grid)."""
    kwargs = {"grid_size": ref} if takes_option(name, "grid_size") else {}
    scheme = visionpe.create_pos_embed(name, dim=32, num_heads=2, **kwargs)
    coords = scheme.coords(grid)
    if getattr(scheme, "pos_norm", None) == "train_grid":
        expected = (grid_coords(grid) + 0.5) / torch.tensor(ref)
    else:
        expected = grid_coords(grid, mode=scheme.coord_mode)
    torch.testing.assert_close(coords, expected, rtol=0, atol=1e-6)


@SETTINGS
@given(grid=st.tuples(sizes, sizes), prefix=st.integers(0, 2), data=st.data())
def test_offset_index_is_the_coordinate_difference(grid, prefix, data):
    """The per-offset index of the bias schemes, for any block of query rows and key columns (query chunks), points
    at the table entry of y_i - y_j, x_i - x_j, or at the extra entry for pairs with a prefix token."""
    total = prefix + math.prod(grid)
    r0 = data.draw(st.integers(0, total - 1))
    r1 = data.draw(st.integers(r0 + 1, total))
    c0 = data.draw(st.integers(0, total - 1))
    c1 = data.draw(st.integers(c0 + 1, total))
    full = data.draw(st.booleans())  # the cached full index and the one built per block agree
    state = offset_state(grid, prefix, None, full_state_max_tokens=total if full else 0)
    index = state.offset_index(range(r0, r1), range(c0, c1)).long()
    dy, dx = state.offsets()
    table = torch.stack([dy.flatten(), dx.flatten()], dim=1)  # (K, 2)
    coords = torch.cat([torch.full((prefix, 2), float("nan")), grid_coords(grid)])
    diff = coords[r0:r1, None, :] - coords[None, c0:c1, :]  # (R, C, 2); NaN where a prefix token is involved
    with_prefix = diff.isnan().any(-1)
    assert (index[with_prefix] == state.num_offsets).all()
    assert torch.equal(table[index[~with_prefix]], diff[~with_prefix])


# -- get_position_ids over random batch mixes ------------------------------------------------------------------------


def _batch(seed, scheme, padding, batch_size):
    gen = torch.Generator().manual_seed(seed)
    types, mask, image, video = random_batch(gen, batch_size=batch_size, max_videos=max_videos(scheme), padding=padding)
    kwargs = {}
    if scheme in NEEDS_TIME and video is not None:
        kwargs["second_per_grid_ts"] = torch.rand(len(video), generator=gen) * 2
    return types, mask, image, video, kwargs


def _valid(pos, mask):
    """Per sample, the ids of its valid tokens (3, n_b)."""
    return [pos[:, b, mask[b].bool()] for b in range(mask.shape[0])]


case = dict(seed=st.integers(0, 100_000), scheme=st.sampled_from(SCHEMES), batch_size=st.integers(1, 4))


@SETTINGS
@given(**case)
def test_left_and_right_padding_give_the_same_positions(seed, scheme, batch_size):
    results = []
    for padding in ("left", "right"):
        types, mask, image, video, kwargs = _batch(seed, scheme, padding, batch_size)
        pos, delta = get_position_ids(scheme, types, image, video, mask, **kwargs)
        results.append((_valid(pos, mask), delta))
        # the two delta conventions differ exactly by the padding of each row
        _, padded = get_position_ids(scheme, types, image, video, mask, delta_convention="padded", **kwargs)
        torch.testing.assert_close(padded - delta, (mask.sum(1, keepdim=True) - mask.shape[1]).to(delta.dtype))
    (left, left_delta), (right, right_delta) = results
    for a, b in zip(left, right, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(left_delta, right_delta)


@SETTINGS
@given(**case, extra=st.integers(1, 40), first=st.booleans(), padding=st.sampled_from(["left", "right"]))
def test_a_text_sample_added_to_the_batch_changes_no_other_sample(seed, scheme, batch_size, extra, first, padding):
    types, mask, image, video, kwargs = _batch(seed, scheme, padding, batch_size)
    pos, delta = get_position_ids(scheme, types, image, video, mask, **kwargs)
    length = max(types.shape[1], extra)
    pad = (length - types.shape[1], 0) if padding == "left" else (0, length - types.shape[1])

    def grow(t):
        return torch.nn.functional.pad(t, pad)

    new_mask = torch.zeros(1, length, dtype=mask.dtype)
    if padding == "left":
        new_mask[0, length - extra :] = 1
    else:
        new_mask[0, :extra] = 1
    rows = [grow(types), torch.zeros(1, length, dtype=types.dtype)]
    masks = [grow(mask), new_mask]
    if first:
        rows, masks = rows[::-1], masks[::-1]
    more_pos, more_delta = get_position_ids(scheme, torch.cat(rows), image, video, torch.cat(masks), **kwargs)
    keep = slice(1, None) if first else slice(0, batch_size)
    for a, b in zip(_valid(pos, mask), _valid(more_pos[:, keep], torch.cat(masks)[keep]), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(more_delta[keep], delta)
    text = more_pos[:, 0 if first else batch_size, torch.cat(masks)[0 if first else batch_size].bool()]
    assert torch.equal(text.double(), torch.arange(extra, dtype=torch.float64).expand(3, -1))


@SETTINGS
@given(**case, holes=st.integers(0, 2**31 - 1))
def test_masked_text_tokens_are_as_if_removed(seed, scheme, batch_size, holes):
    """Holes in the attention mask (masked text tokens, e.g. from packing) give the ids of the sequence without them."""
    types, mask, image, video, kwargs = _batch(seed, scheme, "left", batch_size)
    gen = torch.Generator().manual_seed(holes)
    drop = (torch.rand(types.shape, generator=gen) < 0.3) & (types == 0) & mask.bool()
    drop[:, -1] = False  # every sample keeps a token
    holed = mask.masked_fill(drop, 0)
    pos, delta = get_position_ids(scheme, types, image, video, holed, **kwargs)
    # the compacted batch: the same tokens without the holes, left-padded again
    length = int(holed.sum(1).max())
    compact_types = torch.zeros(batch_size, length, dtype=types.dtype)
    compact_mask = torch.zeros(batch_size, length, dtype=mask.dtype)
    for b in range(batch_size):
        kept = types[b, holed[b].bool()]
        compact_types[b, length - len(kept) :] = kept
        compact_mask[b, length - len(kept) :] = 1
    ref, ref_delta = get_position_ids(scheme, compact_types, image, video, compact_mask, **kwargs)
    for a, b in zip(_valid(pos, holed), _valid(ref, compact_mask), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(delta, ref_delta)
