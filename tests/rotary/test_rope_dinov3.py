"""rope_dinov3: DINOv3's RoPE (Siméoni et al., "DINOv3", arXiv 2508.10104) against the formula as the released
``RopePositionEmbedding.forward`` and ``rope_apply`` compute it, written out below, with and without the training-time
coordinate augmentation (seeded draws)."""

import math

import pytest
import timm
import torch

import visionpe
from visionpe.grid import CoordAugment, grid_coords
from visionpe.rotary.functional import rotary_angles
from visionpe.rotary.rope_dinov3 import dinov3_periods, half_to_interleaved

GRID = (3, 5)
HEAD_DIM = 32


def _reference_rope(
    height, width, head_dim, normalize="separate", training=False, shift=None, jitter=None, rescale=None, periods=None
):
    """sin, cos (HW, head_dim) as DINOv3 builds them: coordinates in [-1, 1], shift, jitter, rescale, angles
    2 pi c / T tiled over the two halves."""
    if periods is None:
        periods = 100.0 ** (2 * torch.arange(head_dim // 4, dtype=torch.float32) / (head_dim // 2))
    denominators = {"separate": (height, width), "max": (max(height, width),) * 2, "min": (min(height, width),) * 2}
    den_h, den_w = denominators[normalize]
    coords_h = torch.arange(0.5, height) / den_h
    coords_w = torch.arange(0.5, width) / den_w
    coords = torch.stack(torch.meshgrid(coords_h, coords_w, indexing="ij"), dim=-1).flatten(0, 1)
    coords = 2.0 * coords - 1.0
    if training and shift is not None:
        coords = coords + torch.empty(2).uniform_(-shift, shift)[None, :]
    if training and jitter is not None:
        coords = coords * torch.empty(2).uniform_(-math.log(jitter), math.log(jitter)).exp()[None, :]
    if training and rescale is not None:
        coords = coords * torch.empty(1).uniform_(-math.log(rescale), math.log(rescale)).exp()
    angles = (2 * math.pi * coords[:, :, None] / periods[None, None, :]).flatten(1).tile(2)
    return angles.sin(), angles.cos()


def _reference_rotate(x, sin, cos):
    """DINOv3's rope_apply on the patch tokens after the prefix tokens: channel c turns with channel c + d/2."""
    prefix = x.shape[-2] - sin.shape[0]
    patches = x[..., prefix:, :]
    first, second = patches.chunk(2, dim=-1)
    rotated = patches * cos + torch.cat((-second, first), dim=-1) * sin
    return torch.cat((x[..., :prefix, :], rotated), dim=-2)


def _scheme(**kwargs):
    return visionpe.create_pos_embed("rope_dinov3", dim=2 * HEAD_DIM, num_heads=2, depth=2, **kwargs)


def _rotate(scheme, qk, grid, prefix):
    state = scheme.prepare(scheme.model_coords(grid), prefix, grid_size=grid)
    return scheme.apply(qk, state, 1), state.layer(1)


def test_periods_are_the_released_ones():
    periods = dinov3_periods(64)
    assert periods.dtype == torch.float32 and periods.shape == (16,)
    torch.testing.assert_close(periods[:3], torch.tensor([1.0, 1.334, 1.778]), rtol=0, atol=1e-3)
    torch.testing.assert_close(periods[-1], torch.tensor(74.99), rtol=0, atol=1e-2)
    low, high = 0.5, 40.0  # the min/max parametrisation: geometric from min_period to max_period
    expected = low * (high / low) ** torch.linspace(0, 1, 8)
    torch.testing.assert_close(dinov3_periods(32, None, low, high), expected, rtol=1e-6, atol=0)


def test_frequencies_turn_the_first_quarter_of_pairs_with_y_and_the_rest_with_x():
    freqs = _scheme().frequencies()[0, 0]  # (2, d/2): rows y, x
    rates = 2 * math.pi / dinov3_periods(HEAD_DIM)
    quarter = HEAD_DIM // 4
    assert torch.equal(freqs[0, :quarter], rates) and (freqs[0, quarter:] == 0).all()
    assert torch.equal(freqs[1, quarter:], rates) and (freqs[1, :quarter] == 0).all()


@pytest.mark.parametrize("normalize", ["separate", "max", "min"])
def test_eval_rotation_equals_dinov3_with_channels_relabelled(normalize):
    scheme = _scheme(normalize_coords=normalize).eval()
    torch.manual_seed(0)
    q, k = torch.randn(2, 2, 2, 2 + 15, HEAD_DIM)  # two prefix tokens, DINOv3's channel layout
    sin, cos = _reference_rope(*GRID, HEAD_DIM, normalize)
    order = half_to_interleaved(HEAD_DIM)
    rotated, rotation = _rotate(scheme, torch.stack((q, k))[..., order], GRID, 2)
    # the tables: pair j of visionpe is DINOv3's angle j
    half = HEAD_DIM // 2
    torch.testing.assert_close(rotation.cos[0, 2:, 0::2], cos[:, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(rotation.sin[0, 2:, 1::2], sin[:, :half], rtol=0, atol=1e-6)
    reference_q, reference_k = _reference_rotate(q, sin, cos), _reference_rotate(k, sin, cos)
    torch.testing.assert_close(rotated[0], reference_q[..., order], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rotated[1], reference_k[..., order], rtol=1e-6, atol=1e-6)
    logits = rotated[0] @ rotated[1].transpose(-1, -2)  # q . k is DINOv3's: the relabelling cancels
    torch.testing.assert_close(logits, reference_q @ reference_k.transpose(-1, -2), rtol=1e-5, atol=1e-5)
    assert torch.equal(rotated[..., :2, :], torch.stack((q, k))[..., :2, order])  # prefix tokens not rotated


@pytest.mark.parametrize(
    "options",
    [{}, {"shift_coords": 0.3, "jitter_coords": 1.5, "rescale_coords": 2.0}, {"jitter_coords": 3.0}],
    ids=["released", "all", "jitter"],
)
def test_training_draws_equal_dinov3_seeded(options):
    scheme = _scheme(normalize_coords="max", **options).train()
    bounds = {  # the scheme's options; rescale 2 unless given (the released default)
        "shift": options.get("shift_coords"),
        "jitter": options.get("jitter_coords"),
        "rescale": options.get("rescale_coords", 2.0),
    }
    qk = torch.randn(2, 1, 2, 1 + 15, HEAD_DIM)
    order = half_to_interleaved(HEAD_DIM)
    for seed in (3, 4):
        torch.manual_seed(seed)
        rotated, _ = _rotate(scheme, qk[..., order], GRID, 1)
        torch.manual_seed(seed)
        sin, cos = _reference_rope(*GRID, HEAD_DIM, "max", training=True, **bounds)
        torch.testing.assert_close(rotated, _reference_rotate(qk, sin, cos)[..., order], rtol=1e-6, atol=1e-6)
    eval_rotated, _ = _rotate(scheme.eval(), qk[..., order], GRID, 1)
    assert not torch.allclose(rotated, eval_rotated, atol=1e-3)  # the draws changed the rotation


def test_eval_tables_are_bit_identical_to_a_scheme_without_augmentation():
    augmented, plain = _scheme(), _scheme(rescale_coords=None)
    assert augmented.coord_augment == CoordAugment("dinov3", rescale=2.0) and plain.coord_augment is None
    qk = torch.randn(2, 1, 2, 16, HEAD_DIM)
    _, eval_rotation = _rotate(augmented.eval(), qk, GRID, 1)
    _, plain_rotation = _rotate(plain, qk, GRID, 1)  # training mode: nothing to draw
    assert torch.equal(eval_rotation.cos, plain_rotation.cos) and torch.equal(eval_rotation.sin, plain_rotation.sin)
    _, train_rotation = _rotate(augmented.train(), qk, GRID, 1)
    assert not torch.equal(train_rotation.cos, plain_rotation.cos)


@pytest.mark.parametrize("seed", range(4))
def test_rescale_is_one_factor_in_range_for_both_axes(seed):
    scheme = _scheme(rescale_coords=3.0)
    torch.manual_seed(seed)
    factor = scheme.model_coords((4, 6)) / scheme.coords((4, 6))  # no zero coordinate on even grids
    assert torch.allclose(factor, factor[0, 0], rtol=1e-6, atol=0) and 1 / 3 <= factor[0, 0] <= 3


def test_coordinates_and_the_index_step_interpolate():
    """c = 2 (i + 0.5) / n - 1 in (-1, 1) on every grid: per index step the angle grows by 4 pi / (n T)."""
    scheme = _scheme()
    assert torch.equal(scheme.coords(GRID), grid_coords(GRID, "normalized_pm1"))
    quarter, periods = HEAD_DIM // 4, dinov3_periods(HEAD_DIM)
    for width in (5, 10):
        angles = rotary_angles(scheme.coords((3, width)), scheme.frequencies()[0, 0])
        step = angles[1, quarter:] - angles[0, quarter:]  # x pairs, from column 0 to 1
        torch.testing.assert_close(step, 4 * math.pi / (width * periods), rtol=1e-5, atol=1e-6)
        assert scheme.coords((3, width)).abs().max() < 1


def test_the_model_takes_the_released_augmentation_or_another():
    kw = dict(embed_dim=64, depth=1, num_heads=2, num_classes=0, img_size=(24, 40), patch_size=8)
    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="rope_dinov3", **kw)
    assert model.pos_schemes.rope_dinov3.coord_augment == CoordAugment("dinov3", rescale=2.0)
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224",
        pos_embed="rope_dinov3",
        coord_augment={"kind": "pose", "max_grid_size": 9},
        **kw,
    )
    assert model.pos_schemes.rope_dinov3.coord_augment.kind == "pose"
    visionpe.set_coord_augment(model, None)
    assert model.pos_schemes.rope_dinov3.coord_augment is None
    with pytest.raises(ValueError, match="rope_dinov3: RopeDinoV3 supports extrapolation modes"):
        visionpe.set_extrapolation(model, "pi")


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"normalize_coords": "both"}, ValueError, "normalize_coords must be one of"),
        ({"rescale_coords": 0.5}, ValueError, "rescale_coords must be a finite number >= 1"),
        ({"jitter_coords": True}, TypeError, "jitter_coords must be"),
        ({"shift_coords": -0.1}, ValueError, "shift_coords must be a finite number >= 0"),
        ({"min_period": 0.5, "max_period": 10.0}, ValueError, "give either base or both min_period and max_period"),
        ({"base": None, "min_period": 0.5}, ValueError, "give either base or both"),
        ({"base": -1.0}, ValueError, "base must be a positive finite number"),
        ({"base": None, "min_period": 8.0, "max_period": 2.0}, ValueError, "min_period must be at most max_period"),
    ],
)
def test_bad_options_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        _scheme(**kwargs)


def test_half_to_interleaved_rejects_odd_sizes():
    assert half_to_interleaved(4).tolist() == [0, 2, 1, 3]
    with pytest.raises(ValueError, match="head_dim must be a positive even int, got 5"):
        half_to_interleaved(5)
