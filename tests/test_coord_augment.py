"""Training-time coordinate augmentation (visionpe.grid.CoordAugment): randomized positions (Ruoss et al., ACL 2023),
PoSE-style skips (Zhu et al., ICLR 2024) and DINOv3's shift, jitter and rescale (Siméoni et al., arXiv 2508.10104),
applied in training mode to every scheme that reads coordinates, never in eval mode."""

import math

import pytest
import timm
import torch

import visionpe
from visionpe.base import set_coord_augment
from visionpe.bias.distance import DistanceKernelBias
from visionpe.grid import (
    CoordAugment,
    grid_coords,
    grid_rows,
    randomized_coords,
    randomized_positions,
    shift_jitter_rescale,
    skip_positions,
)

from .conftest import ALL_SCHEMES, BIAS, COORD_CONSUMERS, scheme_class

GRID = (3, 5)
SMALL = dict(embed_dim=32, depth=1, num_heads=2, num_classes=0, img_size=(24, 40), patch_size=8)
IMAGES = torch.randn(1, 3, 24, 40, generator=torch.Generator().manual_seed(1))
RANDOMIZED = CoordAugment("randomized", max_grid_size=(7, 11))
# every scheme that reads coordinates (``consumes_coords``), and every other one
CONSUMERS = COORD_CONSUMERS
NON_CONSUMERS = [n for n in ALL_SCHEMES if n not in COORD_CONSUMERS]
# the bias schemes that read coordinates: in training with an augmentation their state keeps the drawn coordinates
BIAS_CONSUMERS = [n for n in BIAS if n in COORD_CONSUMERS]


def _model(pos_embed, **kwargs):
    torch.manual_seed(0)
    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=pos_embed, **{**SMALL, **kwargs})
    with torch.no_grad():  # position parameters that start at the identity get values
        for param in model.pos_schemes.parameters():
            param.add_(0.1 * torch.randn_like(param))
        for block in model.blocks:  # peaked attention, so that positions matter to the outputs
            block.attn.qkv.weight.mul_(8)
    return model


# -- the draws -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_randomized_positions_are_strictly_increasing_samples_of_the_larger_grid(seed):
    positions = randomized_positions((4, 6, 3), (9, 6, 20), generator=torch.Generator().manual_seed(seed))
    for axis, (n, limit) in enumerate(zip((4, 6, 3), (9, 6, 20), strict=True)):
        p = positions[axis]
        assert p.dtype == torch.int64 and p.shape == (n,)
        assert (p.diff() > 0).all() and p.min() >= 0 and p.max() <= limit - 1
    assert positions[1].tolist() == list(range(6))  # L = n: every position, in order


def test_randomized_positions_reach_the_whole_range():
    seen = torch.zeros(12, dtype=torch.bool)
    generator = torch.Generator().manual_seed(0)
    for _ in range(60):
        seen[randomized_positions((3, 4), (12, 4), generator=generator)[0]] = True
    assert seen.all()  # positions beyond the training grid are drawn (length generalisation)


def test_randomized_coords_keep_rows_columns_and_order():
    coords = randomized_coords(GRID, (7, 11), generator=torch.Generator().manual_seed(3)).reshape(*GRID, 2)
    y, x = coords[..., 0], coords[..., 1]
    assert (y == y[:, :1]).all() and (x == x[:1, :]).all()  # a grid row keeps one y, a column one x
    assert (y[:, 0].diff() > 0).all() and (x[0].diff() > 0).all()
    assert y.max() <= 6 and x.max() <= 10 and (y == y.round()).all()
    # the grid's coordinates in another mode are those of the larger grid at the same rows and columns
    normalized = randomized_coords(GRID, (7, 11), "normalized", generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(normalized, (coords.reshape(-1, 2) + 0.5) / torch.tensor([7.0, 11.0]))


def test_grid_rows_are_row_major_indices_of_the_larger_grid():
    y, x = torch.tensor([0, 2, 5]), torch.tensor([1, 4])
    rows = grid_rows((y, x), (6, 7))
    expected = grid_coords((6, 7))[rows]
    assert torch.equal(expected, torch.stack(torch.meshgrid(y.float(), x.float(), indexing="ij"), -1).reshape(-1, 2))


@pytest.mark.parametrize("seed", range(8))
def test_pose_skips_cut_each_axis_once_and_shift_the_second_chunk(seed):
    grid, limits = (4, 6), (10, 6 + 7)
    for positions, n, limit in zip(
        skip_positions(grid, limits, generator=torch.Generator().manual_seed(seed)), grid, limits, strict=True
    ):
        steps = positions.diff()
        jumps = (steps != 1).nonzero().flatten()
        assert positions[0] == 0 and (steps >= 1).all() and len(jumps) <= 1  # one cut: two runs of consecutive ints
        shift = int(positions[-1]) - (n - 1)  # the second chunk's u (0 when the draw was no skip)
        assert 0 <= shift <= limit - n
        if len(jumps):
            cut = int(jumps[0]) + 1
            assert 1 <= cut <= n - 1 and int(steps[jumps[0]]) == 1 + shift


def test_pose_draws_every_cut_and_shift():
    cuts, shifts = set(), set()
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        (x,) = skip_positions((1, 4), (1, 7), generator=generator)[1:]
        shift = int(x[-1]) - 3
        shifts.add(shift)
        if shift:
            cuts.add(int((x.diff() != 1).nonzero()[0]) + 1)
    assert shifts == {0, 1, 2, 3} and cuts == {1, 2, 3}
    assert skip_positions((1, 5), (1, 5))[0].tolist() == [0]  # an axis of length 1 (and L = n) is not moved


def test_dinov3_steps_follow_the_explicit_formula_in_order():
    coords = grid_coords(GRID, "normalized_pm1")
    out = shift_jitter_rescale(coords, 0.4, 1.5, 2.0, generator=torch.Generator().manual_seed(7))
    generator = torch.Generator().manual_seed(7)
    shift = torch.empty(2).uniform_(-0.4, 0.4, generator=generator)
    jitter = torch.empty(2).uniform_(-math.log(1.5), math.log(1.5), generator=generator).exp()
    rescale = torch.empty(1).uniform_(-math.log(2.0), math.log(2.0), generator=generator).exp()
    torch.testing.assert_close(out, (coords + shift) * jitter * rescale, rtol=0, atol=0)
    assert (shift.abs() <= 0.4).all() and ((jitter >= 1 / 1.5) & (jitter <= 1.5)).all()


@pytest.mark.parametrize("seed", range(6))
def test_dinov3_rescale_is_one_factor_in_range_for_both_axes(seed):
    coords = grid_coords(GRID, "normalized_pm1") + 2  # no zero coordinate
    factor = shift_jitter_rescale(coords, rescale=2.0, generator=torch.Generator().manual_seed(seed)) / coords
    assert torch.allclose(factor, factor[0, 0], rtol=1e-6, atol=0)
    assert 0.5 <= factor[0, 0] <= 2.0
    jittered = shift_jitter_rescale(coords, jitter=3.0, generator=torch.Generator().manual_seed(seed)) / coords
    assert not torch.allclose(jittered[:, 0], jittered[:, 1])  # jitter: one factor per axis


def test_one_draw_per_call_and_a_generator_reproduces_it():
    augment = CoordAugment("randomized", max_grid_size=(9, 9), generator=torch.Generator().manual_seed(0))
    first, second = augment.apply(grid_coords, GRID), augment.apply(grid_coords, GRID)
    assert not torch.equal(first, second)
    again = CoordAugment("randomized", max_grid_size=(9, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.apply(grid_coords, GRID), first)
    torch.manual_seed(4)
    global_draw = CoordAugment("pose", max_grid_size=12).apply(grid_coords, GRID)
    torch.manual_seed(4)
    assert torch.equal(CoordAugment("pose", max_grid_size=12).apply(grid_coords, GRID), global_draw)


# -- schemes and models ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["rope_axial", "comrope_ap", "sincos", "alibi2d"])
def test_eval_coordinates_are_the_grid(name):
    scheme = visionpe.create_pos_embed(name, dim=32, num_heads=2, depth=1)
    scheme.coord_augment = RANDOMIZED
    assert not torch.equal(scheme.forward_coords(GRID), scheme.coords(GRID))  # training: drawn
    scheme.eval()
    assert torch.equal(scheme.forward_coords(GRID), scheme.coords(GRID))
    if name != "comrope_ap":  # ComRoPE normalises by the grid
        assert torch.equal(scheme.forward_coords(GRID), grid_coords(GRID))
    scheme.train()
    scheme.coord_augment = None
    assert torch.equal(scheme.forward_coords(GRID), scheme.coords(GRID))


@pytest.mark.parametrize("name", CONSUMERS)
def test_eval_outputs_equal_a_model_without_augmentation(name):
    augmented = _model(name, coord_augment={"kind": "randomized", "max_grid_size": 9}).eval()
    plain = _model(name).eval()
    set_coord_augment(plain, None)  # a scheme's own default augmentation too (rope_dinov3's rescale)
    assert augmented.pos_schemes[name].coord_augment == CoordAugment("randomized", max_grid_size=9)
    assert plain.pos_schemes[name].coord_augment is None
    with torch.no_grad():
        assert torch.equal(augmented.forward_features(IMAGES), plain.forward_features(IMAGES))


@pytest.mark.parametrize(  # a rotary, two biases and an absolute scheme, each kind
    "name,kind", [("rope_axial", "randomized"), ("alibi2d", "pose"), ("kerple_log", "dinov3"), ("sincos", "dinov3")]
)
def test_training_outputs_change_with_the_draw(name, kind):
    options = {"max_grid_size": 12} if kind != "dinov3" else {"jitter": 2.0, "rescale": 2.0}
    model = _model(name, coord_augment=CoordAugment(kind, **options))
    with torch.no_grad():
        model.eval()
        evaluated = model.forward_features(IMAGES)
        model.train()
        torch.manual_seed(1)
        first = model.forward_features(IMAGES)
        second = model.forward_features(IMAGES)
    assert not torch.allclose(first, evaluated, atol=1e-4) and not torch.allclose(first, second, atol=1e-4)


@pytest.mark.parametrize("name", ["rope_axial", "alibi2d"])
def test_an_exactly_relative_scheme_ignores_a_global_shift(name):
    """Without prefix tokens, a shift of every coordinate is invisible to a relative scheme; jitter is not."""
    options = dict(class_token=False, global_pool="avg")
    model = _model(name, coord_augment=CoordAugment("dinov3", shift=3.0), **options)
    with torch.no_grad():
        reference = model.eval().forward_features(IMAGES)
        shifted = model.train().forward_features(IMAGES)
        torch.testing.assert_close(shifted, reference, rtol=1e-5, atol=1e-5)
        set_coord_augment(model, CoordAugment("dinov3", jitter=2.0))
        assert not torch.allclose(model.forward_features(IMAGES), reference, atol=1e-4)


@pytest.mark.parametrize("name", BIAS_CONSUMERS)
def test_bias_of_drawn_coordinates_is_the_per_offset_bias_at_grid_coordinates(name):
    """The per-pair path (drawn coordinates) at an identity draw (L = the grid) gives the per-offset tables' bias
    exactly, for every block of query rows."""
    torch.manual_seed(0)
    scheme = visionpe.create_pos_embed(name, dim=32, num_heads=2, depth=2)
    with torch.no_grad():
        for param in scheme.parameters():
            param.add_(0.1 * torch.randn_like(param))
    q = torch.randn(1, 2, 1 + 15, 16)
    scheme.eval()
    expected = scheme.attn_bias(q, q, scheme.prepare(GRID, 1), 1)
    scheme.train()
    scheme.coord_augment = CoordAugment("randomized", max_grid_size=GRID)
    state = scheme.prepare(GRID, 1)
    assert type(state).__name__ == "CoordinateState"
    rows = slice(0, 7)
    got, got_rows = scheme.attn_bias(q, q, state, 1), scheme.attn_bias(q[:, :, rows], q, state, 1, rows=rows)
    if not issubclass(scheme_class(name), DistanceKernelBias):  # ALiBi, LookHere: the same arithmetic on the same
        assert torch.equal(got, expected) and torch.equal(got_rows, expected[:, :, rows])  # distances
    else:  # learned kernels (pow, log1p) vectorised over another length: last-bit differences
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got_rows, expected[:, :, rows], rtol=1e-6, atol=1e-7)


def test_alibi_bias_of_drawn_coordinates_follows_the_distance_formula():
    scheme = visionpe.create_pos_embed("alibi2d", dim=32, num_heads=2)
    scheme.coord_augment = CoordAugment("pose", max_grid_size=(6, 9), generator=torch.Generator().manual_seed(5))
    coords = CoordAugment("pose", max_grid_size=(6, 9), generator=torch.Generator().manual_seed(5)).apply(
        grid_coords, GRID
    )
    q = torch.randn(1, 2, 2 + 15, 16)
    bias = scheme.attn_bias(q, q, scheme.prepare(GRID, 2), 0)[0]
    distance = ((coords[:, None, :] - coords[None, :, :]) ** 2).sum(-1).sqrt()  # naive ||p_i - p_j||
    expected = torch.zeros(2, 17, 17)
    expected[:, 2:, 2:] = -scheme.slopes[:, None, None] * distance
    torch.testing.assert_close(bias, expected, rtol=1e-6, atol=1e-6)


def test_lookhere_views_follow_the_drawn_offsets():
    """A head looking right (LH-180, 0 degrees) sees the keys with x_j >= x_i of the drawn coordinates."""
    scheme = visionpe.create_pos_embed("lookhere", dim=48, num_heads=3)  # heads: right, down, undirected
    augment = CoordAugment("dinov3", jitter=3.0, shift=1.0, generator=torch.Generator().manual_seed(2))
    scheme.coord_augment = augment
    coords = CoordAugment("dinov3", jitter=3.0, shift=1.0, generator=torch.Generator().manual_seed(2)).apply(
        grid_coords, GRID
    )
    q = torch.randn(1, 3, 15, 16)
    bias = scheme.attn_bias(q, q, scheme.prepare(GRID, 0), 0)[0]
    dx = coords[None, :, 1] - coords[:, None, 1]
    assert torch.equal(torch.isfinite(bias[0]), dx >= 0)
    distance = ((coords[:, None, :] - coords[None, :, :]) ** 2).sum(-1).sqrt()
    slope = scheme.layer_slopes[0] * scheme.head_slopes[2]
    torch.testing.assert_close(bias[2], -slope * distance, rtol=1e-6, atol=1e-6)


def test_fourier_corners_move_with_the_draw():
    scheme = visionpe.create_pos_embed("fourier", dim=32, num_heads=2, num_groups=2)
    scheme.coord_augment = CoordAugment("dinov3", rescale=2.0, generator=torch.Generator().manual_seed(0))
    drawn, corners = scheme.forward_coords(GRID, coords_fn=scheme.positions), scheme.positions(GRID)
    factor = drawn[-1, -1, -1] / corners[-1, -1, -1]  # the last corner, (1, 1)
    assert drawn.shape == (15, 2, 2) and factor != 1 and torch.allclose(drawn, corners * factor)


def test_set_coord_augment_on_a_model_leaves_table_schemes_alone():
    model = _model(["learned", "rope_axial"])
    assert set_coord_augment(model, {"kind": "pose", "max_grid_size": 8}) == ["pos_schemes.rope_axial"]
    assert model.pos_schemes.rope_axial.coord_augment.kind == "pose"
    assert model.pos_schemes.learned.coord_augment is None
    assert set_coord_augment(model.pos_schemes.rope_axial, None) == [""]
    assert model.pos_schemes.rope_axial.coord_augment is None


@pytest.mark.parametrize("name", NON_CONSUMERS)
def test_schemes_that_read_no_coordinates_refuse_an_augmentation(name):
    scheme = visionpe.create_pos_embed(name, dim=32, num_heads=2)
    with pytest.raises(ValueError, match="coord_augment applies to schemes that read coordinates"):
        scheme.coord_augment = RANDOMIZED
    with pytest.raises(ValueError, match="coord_augment"):
        _model(name, coord_augment=RANDOMIZED)
    scheme.coord_augment = None  # clearing is always allowed


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"kind": "mixup"}, ValueError, "kind must be one of"),
        ({"kind": "randomized"}, ValueError, "needs max_grid_size"),
        ({"kind": "pose", "max_grid_size": 0}, ValueError, "max_grid_size must be a positive int"),
        ({"kind": "pose", "max_grid_size": 2.5}, TypeError, "max_grid_size"),
        ({"kind": "pose", "max_grid_size": (4,)}, ValueError, "max_grid_size must have 2 or 3 entries"),
        ({"kind": "randomized", "max_grid_size": 8, "rescale": 2.0}, ValueError, "rescale applies to kind='dinov3'"),
        ({"kind": "dinov3"}, ValueError, "at least one of shift, jitter, rescale"),
        ({"kind": "dinov3", "rescale": 0.5}, ValueError, "rescale must be a finite factor >= 1"),
        ({"kind": "dinov3", "jitter": float("inf")}, ValueError, "jitter must be a finite factor >= 1"),
        ({"kind": "dinov3", "shift": -1.0}, ValueError, "shift must be a finite number >= 0"),
        ({"kind": "dinov3", "shift": "1"}, TypeError, "shift must be"),
        ({"kind": "dinov3", "rescale": 2.0, "max_grid_size": 8}, ValueError, "max_grid_size applies to"),
        ({"kind": "dinov3", "rescale": 2.0, "generator": 0}, TypeError, "generator must be a torch.Generator"),
    ],
)
def test_bad_options_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        CoordAugment(**kwargs)


def test_bad_values_and_calls_name_the_argument():
    with pytest.raises(TypeError, match=r"coord_augment got unknown key\(s\) \['scale'\]"):
        CoordAugment.from_value({"kind": "dinov3", "scale": 2})
    with pytest.raises(TypeError, match="coord_augment must name its kind"):
        CoordAugment.from_value({"rescale": 2})
    with pytest.raises(TypeError, match="coord_augment must be a CoordAugment, a dict of its fields or None"):
        _model("rope_axial", coord_augment="randomized")
    with pytest.raises(ValueError, match=r"max_grid_size must be at least the grid"):
        CoordAugment("randomized", max_grid_size=4).apply(grid_coords, GRID)
    with pytest.raises(ValueError, match="max_grid_size must have 2 entries"):
        randomized_positions(GRID, (7, 8, 9))
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        set_coord_augment("model", None)
    with pytest.raises(TypeError, match="coords must be a floating-point"):
        shift_jitter_rescale(torch.arange(4), rescale=2.0)
