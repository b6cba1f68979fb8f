import math
import re

import pytest
import timm
import torch

import visionpe
from visionpe.grid import grid_coords
from visionpe.rotary.comrope_ap import ComRoPEAP
from visionpe.rotary.comrope_base import distinct_counts
from visionpe.rotary.comrope_ld import ComRoPELD
from visionpe.rotary.lie_base import LieBlockRotary
from visionpe.rotary.rope_axial import RopeAxial
from visionpe.rotary.scaling import scale_frequencies

from ..model_checks import check_forward_backward

CLASSES = [ComRoPEAP, ComRoPELD]


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("block_size, ndim, grid", [(2, 2, (3, 5)), (8, 2, (3, 5)), (4, 3, (2, 3, 4))])
def test_exact_relative_property(cls, block_size, ndim, grid):
    scheme = cls(128, 2, depth=2, block_size=block_size, ndim=ndim)
    coords = grid_coords(grid, mode="normalized")
    q, k = torch.randn(2, 1, 2, len(coords), 64).unbind(0)
    shift = torch.tensor([0.37, -0.81, 1.5][:ndim])
    scores = scheme.rotate(q, coords, 1) @ scheme.rotate(k, coords, 1).transpose(-1, -2)
    shifted = scheme.rotate(q, coords + shift, 1) @ scheme.rotate(k, coords + shift, 1).transpose(-1, -2)
    assert torch.allclose(scores, shifted, atol=1e-5)
    assert not torch.allclose(scores, q @ k.transpose(-1, -2), atol=1e-2)


@pytest.mark.parametrize("cls", CLASSES)
def test_zero_generators_give_identity(cls):
    scheme = cls(128, 2, init_std=0.0)
    x = torch.randn(2, 2, 15, 64)
    assert torch.allclose(scheme.rotate(x, grid_coords((3, 5), mode="normalized")), x, atol=1e-6)


def test_ap_b2_equals_axial_rope():
    axial = RopeAxial(64, 1, base=100.0)
    scheme = ComRoPEAP(64, 1, block_size=2)
    # AP block j rotates with coordinate column j mod 2 (0 = y, 1 = x); axial pairs [0, 16) read x, [16, 32) y.
    freqs = axial.freqs  # (ndim, 32), rows (y, x)
    x_pairs, y_pairs = torch.arange(16), torch.arange(16, 32)
    order = torch.stack((y_pairs, x_pairs), dim=1).flatten()  # block j <- axial pair order[j]
    rates = freqs.sum(0)[order]  # the one non-zero rate of each pair
    with torch.no_grad():
        scheme.blocks.zero_()
        scheme.blocks[0, 0, :, 1, 0] = rates  # P - P^T = [[0, -rate], [rate, 0]]
    coords = grid_coords((3, 5))
    x = torch.randn(1, 1, 15, 64)
    channels = torch.stack((2 * order, 2 * order + 1), dim=1).flatten()
    expected = axial.rotate(x, coords)[..., channels]
    assert torch.allclose(scheme.rotate(x[..., channels], coords), expected, atol=1e-5)


def test_positions_prefix_and_pi():
    scheme = ComRoPEAP(128, 2, grid_size=(4, 4))
    assert torch.allclose(scheme.coords((2, 4)), grid_coords((2, 4), mode="normalized"))
    train = ComRoPEAP(128, 2, grid_size=(4, 4), pos_norm="train_grid")
    assert torch.allclose(train.coords((8, 4))[:, 0].max(), torch.tensor(7.5 / 4))
    train.set_extrapolation("pi")
    prepared = train.prepare(train.coords((8, 4)), num_prefix_tokens=1, grid_size=(8, 4))
    state, prefix = prepared.coords, prepared.num_prefix_tokens
    # PI = test-grid norm, and the rotated prefix (the default) at the grid centre
    assert prefix == 0 and torch.allclose(state[1:], grid_coords((8, 4), mode="normalized"))
    assert torch.allclose(state[0], torch.tensor([0.5, 0.5]))
    rotating = ComRoPELD(128, 2, grid_size=(4, 4))
    prepared = rotating.prepare(rotating.coords((4, 4)), num_prefix_tokens=1)
    state, prefix = prepared.coords, prepared.num_prefix_tokens
    assert prefix == 0 and torch.equal(state[0], torch.tensor([0.5, 0.5]))
    identity = ComRoPEAP(128, 2, grid_size=(4, 4), rotate_prefix=False)
    qk = torch.randn(2, 1, 2, 17, 64)
    out = identity.apply(qk, identity.prepare(identity.coords((4, 4)), num_prefix_tokens=1), layer=0)
    assert torch.equal(out[..., :1, :], qk[..., :1, :])
    out = scheme.apply(qk, scheme.prepare(scheme.coords((4, 4)), num_prefix_tokens=1), layer=0)
    assert not torch.allclose(out[..., :1, :], qk[..., :1, :], atol=1e-3)


def test_bad_input():
    with pytest.raises(ValueError, match="pos_norm must be one of"):
        ComRoPEAP(128, 2, pos_norm="bogus")
    with pytest.raises(ValueError, match="needs grid_size"):
        ComRoPELD(128, 2, pos_norm="train_grid")
    with pytest.raises(ValueError, match="would scale twice"):
        ComRoPEAP(128, 2, grid_size=(4, 4), extrapolation="pi")
    for mode in ("ntk", "yarn"):  # positions normalised by the test grid: a second scaling is refused
        with pytest.raises(ValueError, match=f"extrapolation='{mode}' with pos_norm='test_grid' would scale twice"):
            ComRoPELD(128, 2, grid_size=(4, 4), extrapolation=mode)
    scheme = ComRoPELD(128, 2, grid_size=(4, 4), pos_norm="train_grid")
    with pytest.raises(ValueError, match="supports 2D grids"):
        scheme.coords((2, 3, 4))
    for count in (-1, 1.5, True):  # the prefix count sets the rotated prefix rows
        with pytest.raises(
            ValueError, match=rf"num_prefix_tokens must be a non-negative int, got .*{re.escape(repr(count))}"
        ):
            scheme.prepare(scheme.coords((2, 3)), count, grid_size=(2, 3))
    with pytest.raises(ValueError, match="supports 2D grids"):  # the grid sets the prefix centre and the cells
        scheme.prepare(scheme.coords((2, 3)), 1, grid_size=(2, 3, 4))
    with pytest.raises(ValueError, match=r"grid_size\[1\] must be positive, got -3"):
        scheme.prepare(scheme.coords((2, 3)), 1, grid_size=(2, -3))
    with pytest.raises(ValueError, match="2 axes, got coords with 3 axes"):
        scheme.rotate(torch.randn(1, 2, 6, 64), grid_coords((1, 2, 3)))
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        visionpe.create_pos_embed("comrope_ap", dim=128, num_heads=2, block_size=5)


@pytest.mark.parametrize("cls", [ComRoPEAP, ComRoPELD])
def test_rotations_refuse_a_layer_past_the_depth(cls):
    scheme = cls(64, 4, depth=2, grid_size=(3, 5))
    coords = scheme.coords((3, 5))
    assert scheme.rotations(coords, 1).shape == (4, 15, scheme.num_blocks, 8, 8)
    for layer in (2, -1, True):
        with pytest.raises(ValueError, match=r"layer must be an int in \[0, depth=2\) for " + cls.__name__):
            scheme.rotations(coords, layer)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_heads": 0}, "num_heads must be .*got 0"),
        ({"num_heads": 3}, "dim must be divisible by num_heads, got dim=128, num_heads=3"),
        ({"depth": 0}, "depth must be .*got 0"),
        ({"depth": -1}, "depth must be .*got -1"),
        ({"init_std": float("inf")}, "init_std must be a finite non-negative number, got inf"),
        ({"init_std": float("nan")}, "init_std must be a finite non-negative number, got nan"),
        ({"init_std": -0.5}, "init_std must be a finite non-negative number, got -0.5"),
        ({"init_std": "1"}, r"init_std must be a finite non-negative number, got str \('1'\)"),
        ({"rotate_prefix": "no"}, r"rotate_prefix must be a bool, got str \('no'\)"),
        ({"jitter_std": -0.1}, "jitter_std must be a finite non-negative number, got -0.1"),
        ({"jitter_std": float("nan")}, "jitter_std must be a finite non-negative number, got nan"),
        ({"jitter_std": float("inf")}, "jitter_std must be a finite non-negative number, got inf"),
        ({"jitter_std": "0.1"}, r"jitter_std must be a finite non-negative number, got str \('0.1'\)"),
        ({"jitter_std": True}, r"jitter_std must be a finite non-negative number, got bool \(True\)"),
        ({"offset_std": -1}, "offset_std must be a finite non-negative number, got -1"),
        ({"offset_std": float("nan")}, "offset_std must be a finite non-negative number, got nan"),
        ({"offset_std": None}, r"offset_std must be a finite non-negative number, got NoneType \(None\)"),
    ],
)
def test_bad_construction(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**{"dim": 128, "num_heads": 2, **kwargs})


@pytest.mark.parametrize("block_size, ndim", [(64, 2), (32, 3), (64, 3)])
def test_ap_needs_a_block_per_axis(block_size, ndim):
    # AP: block j turns with axis j mod ndim only, so fewer blocks than axes would leave an axis without one
    with pytest.raises(
        ValueError, match=f"block_size must .* got block_size={block_size} with head_dim=64, ndim={ndim}"
    ):
        ComRoPEAP(128, 2, block_size=block_size, ndim=ndim)
    # LD: every block turns with every axis, one block per head serves all of them
    grid = (3, 5) if ndim == 2 else (2, 3, 4)
    coords = grid_coords(grid)
    scheme = ComRoPELD(128, 2, block_size=block_size, ndim=ndim)
    x = torch.randn(1, 2, len(coords), 64)
    out = scheme.rotate(x, coords)
    assert out.shape == x.shape and torch.allclose(out.norm(dim=-1), x.norm(dim=-1), atol=1e-4)
    # exactly ndim blocks per head: AP builds and rotates
    ap = ComRoPEAP(32 * ndim, 2, block_size=16, ndim=ndim)
    x = torch.randn(1, 2, len(coords), 16 * ndim)
    assert ap.num_blocks == ndim and ap.rotate(x, coords).shape == x.shape


@pytest.mark.parametrize("name", ["comrope_ap", "comrope_ld"])
@pytest.mark.parametrize("size", [(224, 224), (384, 384), (160, 288)])
def test_model_forward_backward(name, size):
    check_forward_backward(name, size)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("block_size, ndim, grid", [(2, 2, (3, 5)), (8, 2, (4, 6)), (4, 3, (2, 3, 4))])
def test_per_value_rotations_equal_per_token_exponentials(cls, block_size, ndim, grid):
    # the fast path (one exponential per distinct coordinate value) against exp(sum_a x_a A_a) per token
    scheme = cls(128, 2, depth=2, block_size=block_size, ndim=ndim, rotate_prefix=True)
    coords = scheme.prepare(grid_coords(grid, mode="normalized"), num_prefix_tokens=1).coords
    jittered = coords + 0.01 * torch.randn_like(coords)  # every value distinct: no sharing at all
    for pos in (coords, jittered):
        fast, slow = scheme.rotations(pos, 1), LieBlockRotary.rotations(scheme, pos, 1)
        assert fast.shape == slow.shape == (2, len(pos), 64 // block_size, block_size, block_size)
        assert torch.allclose(fast, slow, atol=1e-6)
        weights = torch.randn_like(fast)
        grads = [torch.autograd.grad((rot * weights).sum(), list(scheme.parameters())) for rot in (fast, slow)]
        for g_fast, g_slow in zip(*grads, strict=True):
            assert torch.allclose(g_fast, g_slow, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("rotate_prefix", [False, True])
def test_chunked_no_grad_apply_equals_whole(monkeypatch, cls, rotate_prefix):
    # without autograd, apply gathers and applies the rotations a few tokens at a time: same result as the whole
    scheme = cls(128, 2, depth=2, rotate_prefix=rotate_prefix)
    state = scheme.prepare(grid_coords((5, 7), mode="normalized"), num_prefix_tokens=1)
    coords = state.coords
    qk = torch.randn(2, 3, 2, 36, 64)
    whole = scheme.apply(qk, state, 1)  # grad enabled: the whole stack at once
    monkeypatch.setattr("visionpe.rotary.lie_base._CHUNK_TOKENS", 8)
    with torch.no_grad():
        chunked = scheme.apply(qk, state, 1)
        parts = scheme.rotation_chunks(coords, 1)
        rot = torch.cat([parts(start, min(start + 8, len(coords))) for start in range(0, len(coords), 8)], 1)
    assert torch.allclose(chunked, whole, atol=1e-6)
    assert torch.allclose(rot, scheme.rotations(coords, 1), atol=1e-7)


@pytest.mark.parametrize("axes", [2, 3])
def test_ld_gathered_product_gradients(axes):
    # the hand-written backward of the gathered per-axis factors (kept as tables, gathered again) against
    # finite differences, with factors that do not commute so that every transpose and order is checked
    from visionpe.rotary.comrope_ld import _GatheredProduct

    tables = [torch.randn(2, 3 + a, 2, 3, 3, dtype=torch.float64, requires_grad=True) for a in range(axes)]
    rows = tuple(torch.randint(0, 3 + a, (5,)) for a in range(axes))
    assert torch.autograd.gradcheck(lambda *t: _GatheredProduct.apply(rows, *t), tuple(tables))
    expected = tables[0][:, rows[0]]
    for table, index in zip(tables[1:], rows[1:], strict=True):
        expected = expected @ table[:, index]
    assert torch.allclose(_GatheredProduct.apply(rows, *tables), expected)


def _count_grid_products(monkeypatch) -> list:
    from visionpe.rotary import comrope_ld

    calls = []
    real = comrope_ld.grid_product
    monkeypatch.setattr(comrope_ld, "grid_product", lambda *args: calls.append(1) or real(*args))
    return calls


def _dense_rotations(scheme, coords: torch.Tensor, layer: int) -> torch.Tensor:
    """Naive reference: torch.linalg.matrix_exp of sum_a x_a A_a per token and block, in fp64."""
    gen = scheme.generators(layer).double()  # (h, m, ndim, b, b)
    exponent = torch.einsum("na,hmaij->hnmij", coords.double(), gen).contiguous()
    return torch.linalg.matrix_exp(exponent).float()


@pytest.mark.parametrize("ndim, grid", [(2, (3, 5)), (3, (2, 3, 4))])
@pytest.mark.parametrize("prefix", [0, 1, 2])
def test_ld_grid_product_equals_per_token_exponentials(monkeypatch, ndim, grid, prefix):
    # patch tokens are a whole row-major grid: the rotations are one product per head and block of the per-axis
    # factors stacked side by side (grid_product), after the rotated prefix tokens' one rotation; same values and
    # gradients as exp(sum_a x_a A_a) per token (the series, and the dense matrix_exp)
    calls = _count_grid_products(monkeypatch)
    scheme = ComRoPELD(128, 2, depth=2, ndim=ndim)
    coords = scheme.prepare(grid_coords(grid, mode="normalized"), num_prefix_tokens=prefix).coords
    assert len(coords) == prefix + math.prod(grid) and (coords[:prefix] == 0.5).all()
    fast, slow = scheme.rotations(coords, 1), LieBlockRotary.rotations(scheme, coords, 1)
    dense = _dense_rotations(scheme, coords, 1)
    assert calls and torch.allclose(fast, slow, atol=1e-6) and torch.allclose(fast, dense, atol=1e-5)
    weights = torch.randn_like(fast)
    grads = [torch.autograd.grad((rot * weights).sum(), list(scheme.parameters())) for rot in (fast, slow, dense)]
    for g_fast, g_slow, g_dense in zip(*grads, strict=True):
        assert torch.allclose(g_fast, g_slow, atol=1e-4, rtol=1e-4)
        assert torch.allclose(g_fast, g_dense, atol=1e-4, rtol=1e-4)


def test_ld_prefix_grid_rows_splits_a_leading_position():
    from visionpe.rotary.comrope_ld import prefix_grid_rows

    grid = torch.cartesian_prod(torch.tensor([0, 2, 3]), torch.tensor([1, 4]))
    centre = torch.tensor([[1, 2]])
    for count in (0, 1, 3):
        lead, rows = prefix_grid_rows(torch.cat((centre.expand(count, -1), grid)))
        assert lead == count and [r.tolist() for r in rows] == [[0, 2, 3], [1, 4]]
    # a 1 x 1 grid at the prefix position: every row alike, the last one is the grid
    assert prefix_grid_rows(centre.expand(3, -1))[0] == 2
    # the prefix somewhere else, or a grid in another order: no split, the gather
    assert prefix_grid_rows(torch.cat((grid[:2], centre, grid[2:]))) == (0, None)
    assert prefix_grid_rows(torch.cat((centre, grid.flip(0)))) == (0, None)


def _tiny_vit(name: str, **kwargs):
    return timm.create_model(
        "visionpe_vit_tiny_patch16_224",
        pos_embed=name,
        depth=2,
        embed_dim=64,
        num_heads=2,
        num_classes=5,
        img_size=(48, 80),  # a 3 x 5 grid
        **kwargs,
    )


@pytest.mark.parametrize("prefix_kwargs", [{"class_token": False, "global_pool": "avg"}, {}, {"reg_tokens": 2}])
def test_ld_model_with_rotated_prefix_takes_the_grid_product(monkeypatch, prefix_kwargs):
    # the whole model, training (q and k rotated in place in the qkv output) and evaluation: the grid product
    # with the rotated prefix gives the outputs and gradients of the gather (every token's factors multiplied)
    from visionpe.rotary import comrope_ld

    torch.manual_seed(0)
    model = _tiny_vit("comrope_ld", **prefix_kwargs)
    x = torch.randn(2, 3, 48, 80)
    results = {}
    for fast in (True, False):
        calls = _count_grid_products(monkeypatch)
        if not fast:
            monkeypatch.setattr(comrope_ld, "prefix_grid_rows", lambda inverse: (0, None))
        model.train().zero_grad()
        out = model(x)
        out.square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        with torch.no_grad():
            evaluated = model.eval()(x)
        results[fast] = out.detach(), grads, evaluated
        assert bool(calls) == fast
    (out, grads, evaluated), (ref_out, ref_grads, ref_evaluated) = results[True], results[False]
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(evaluated, ref_evaluated, atol=1e-5)
    assert torch.allclose(out, evaluated, atol=1e-5)
    for g, ref in zip(grads, ref_grads, strict=True):
        assert torch.allclose(g, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("cls", CLASSES)
def test_prefix_rotated_at_the_grid_centre_by_default(cls):
    scheme = cls(128, 2, depth=2)
    assert scheme.rotate_prefix and scheme.jitter_std == scheme.offset_std == 0.0
    coords = scheme.coords((3, 6))
    state = scheme.prepare(coords, num_prefix_tokens=2, grid_size=(3, 6))
    assert state.num_prefix_tokens == 0 and torch.equal(state.coords[:2], torch.full((2, 2), 0.5))
    assert torch.equal(state.coords[2:], coords)
    # train-grid positions: the centre of the current grid, n / (2 n0) (0.5 on the training grid)
    train = cls(128, 2, pos_norm="train_grid", grid_size=(4, 4))
    state = train.prepare(train.coords((8, 6)), num_prefix_tokens=1, grid_size=(8, 6))
    assert torch.allclose(state.coords[0], torch.tensor([1.0, 0.75]))
    assert torch.allclose(train.prepare(train.coords((8, 6)), 1).coords[0], torch.tensor([1.0, 0.75]))
    assert torch.allclose(train.prepare(train.coords((4, 4)), 1, grid_size=(4, 4)).coords[0], torch.full((2,), 0.5))
    # the prefix keeps the relative property: its logits with the patches depend on differences only
    qk = torch.randn(2, 1, 2, 1 + 18, 64)
    logits = []
    for shift in (0.0, 0.3):
        pos = scheme.prepare(coords, 1, grid_size=(3, 6)).coords + shift
        rot = scheme.rotate(qk.flatten(0, 1), pos, 1).unflatten(0, (2, 1))
        logits.append(rot[0] @ rot[1].transpose(-1, -2))
    assert torch.allclose(*logits, atol=1e-5)


@pytest.mark.parametrize("cls", CLASSES)
def test_augmentations_only_in_training(cls):
    torch.manual_seed(0)
    plain = cls(128, 2, depth=2)
    augmented = cls(128, 2, depth=2, jitter_std=0.3, offset_std=0.2)
    augmented.load_state_dict(plain.state_dict())
    coords, grid = grid_coords((6, 7), mode="normalized"), (6, 7)
    qk = torch.randn(2, 1, 2, 1 + 42, 64)
    expected = plain.apply(qk, plain.eval().prepare(coords, 1, grid_size=grid), 1)
    augmented.eval()
    state = augmented.prepare(coords, 1, grid_size=grid)
    assert torch.equal(state.coords, plain.prepare(coords, 1, grid_size=grid).coords)
    assert torch.equal(augmented.apply(qk, state, 1), expected)
    augmented.train()
    moved = augmented.prepare(coords, 1, grid_size=grid).coords
    assert not torch.allclose(moved[1:], coords, atol=1e-3)


@pytest.mark.parametrize("pos_norm", ["test_grid", "train_grid"])
def test_jitter_in_cells_clamped_to_half_a_cell(pos_norm):
    torch.manual_seed(0)
    grid = (8, 10)
    scheme = ComRoPEAP(128, 2, pos_norm=pos_norm, grid_size=(4, 5), jitter_std=0.3)
    coords = scheme.coords(grid)
    cells = 1 / torch.tensor(grid if pos_norm == "test_grid" else (4.0, 5.0))
    deltas = torch.stack([scheme.prepare(coords, 2, grid_size=grid).coords for _ in range(200)])
    assert (deltas[:, :2] == deltas[0, :2]).all()  # prefix tokens: not jittered (only offset)
    jitter = (deltas[:, 2:] - coords) / cells  # in cells
    assert jitter.abs().max() <= 0.5 + 1e-4 and jitter.abs().max() > 0.49  # clamped, and the clamp is reached
    clamped = (torch.randn(10**6) * 0.3).clamp(-0.5, 0.5)  # the clamp at 1.67 sigma: std ~0.275
    assert abs(jitter.std().item() - clamped.std().item()) < 0.01 and abs(jitter.mean().item()) < 0.01
    # the count of distinct values stands for the grid side when grid_size is not given (test-grid norm)
    unsized = torch.stack([scheme.prepare(coords, 0).coords for _ in range(50)])
    assert ((unsized - coords) / cells).abs().max() <= 0.5 + 1e-4
    huge = ComRoPEAP(128, 2, jitter_std=100.0)  # every draw clamped: the whole grid moves by half a cell or less
    moved = (huge.prepare(coords, 0, grid_size=grid).coords - coords) / (1 / torch.tensor(grid))
    assert torch.allclose(moved.abs(), torch.full_like(moved, 0.5), atol=1e-4)


def test_jitter_leaves_time_axis_and_takes_the_gather(monkeypatch):
    calls = _count_grid_products(monkeypatch)
    scheme = ComRoPELD(96, 2, ndim=3, depth=2, block_size=8, jitter_std=0.5)
    coords = grid_coords((2, 3, 4), mode="normalized")
    state = scheme.prepare(coords, 1, grid_size=(2, 3, 4))
    assert torch.equal(state.coords[1:, 0], coords[:, 0]) and not torch.allclose(state.coords[1:, 1:], coords[:, 1:])
    rot = scheme.rotations(state.coords, 1)
    assert not calls and torch.allclose(rot, _dense_rotations(scheme, state.coords, 1), atol=1e-5)


@pytest.mark.parametrize("cls", CLASSES)
def test_offset_is_one_global_shift_and_keeps_the_logits(monkeypatch, cls):
    torch.manual_seed(0)
    calls = _count_grid_products(monkeypatch)
    scheme = cls(128, 2, depth=2, offset_std=0.5)
    coords, grid = grid_coords((3, 5), mode="normalized"), (3, 5)
    plain = torch.cat((torch.full((2, 2), 0.5), coords))
    shifts = torch.stack([scheme.prepare(coords, 2, grid_size=grid).coords - plain for _ in range(400)])
    assert torch.allclose(shifts, shifts[:, :1].expand_as(shifts), atol=1e-6)  # every token, the prefix too
    assert torch.allclose(shifts[:, 0].std(0), torch.full((2,), 0.5), atol=0.06)
    assert abs(shifts[:, 0].mean().item()) < 0.06
    # relative property: the attention logits do not depend on the draw
    qk = torch.randn(2, 1, 2, 2 + 15, 64)
    logits = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        rot = scheme.apply(qk, scheme.prepare(coords, 2, grid_size=grid), 1)
        logits.append(rot[0] @ rot[1].transpose(-1, -2))
    scheme.eval()
    rot = scheme.apply(qk, scheme.prepare(coords, 2, grid_size=grid), 1)
    assert torch.allclose(logits[0], logits[1], atol=1e-4)
    assert torch.allclose(logits[0], rot[0] @ rot[1].transpose(-1, -2), atol=1e-4)
    assert bool(calls) == (cls is ComRoPELD)  # a shifted grid is still a whole grid: the grid product


@pytest.mark.parametrize("name", ["comrope_ap", "comrope_ld"])
def test_model_augmentations_train_but_not_evaluate(name):
    torch.manual_seed(0)
    plain = _tiny_vit(name)
    augmented = _tiny_vit(name, pos_embed_kwargs={"jitter_std": 0.5, "offset_std": 0.3})
    augmented.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 48, 80)
    with torch.no_grad():
        assert torch.equal(augmented.eval()(x), plain.eval()(x))
        trained = [augmented.train()(x) for _ in range(2)]
    assert not torch.allclose(trained[0], trained[1], atol=1e-4)  # a new jitter every forward
    shifted = _tiny_vit(name, pos_embed_kwargs={"offset_std": 0.3})
    shifted.load_state_dict(plain.state_dict())
    with torch.no_grad():  # the offset alone: a global shift, the relative property keeps the outputs
        assert torch.allclose(shifted.train()(x), plain.train()(x), atol=1e-4)
    shifted(x).square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in shifted.pos_schemes.parameters())


def test_ld_grid_rows_only_for_a_whole_row_major_grid():
    from visionpe.rotary.comrope_ld import grid_rows

    inverse = torch.cartesian_prod(torch.tensor([0, 2, 3]), torch.tensor([1, 4]))
    rows = grid_rows(inverse)
    assert [r.tolist() for r in rows] == [[0, 2, 3], [1, 4]]
    assert grid_rows(inverse.flip(0)) is None  # every combination, but not in row-major order
    assert grid_rows(inverse[1:]) is None  # a combination missing
    assert grid_rows(torch.cat((inverse[:1], inverse))) is None  # a token twice (a prefix at a grid value)


def _ap_as_axial(train_grid):
    """An axial RoPE and a ComRoPE-AP with 2 x 2 blocks that turn at the same rates per grid cell (AP positions are
    (i + 0.5) / n0, so each block's rate is the axial rate times n0 of its axis), and the channel order that
    matches AP block j to its axial pair."""
    axial = RopeAxial(64, 1, base=100.0, grid_size=train_grid)
    scheme = ComRoPEAP(64, 1, block_size=2, pos_norm="train_grid", grid_size=train_grid)
    x_pairs, y_pairs = torch.arange(16), torch.arange(16, 32)
    order = torch.stack((y_pairs, x_pairs), dim=1).flatten()  # block j (axis j mod 2: y, x) <- axial pair order[j]
    cells = torch.tensor(train_grid, dtype=torch.float32)[torch.arange(32) % 2]
    with torch.no_grad():
        scheme.blocks.zero_()
        scheme.blocks[0, 0, :, 1, 0] = axial.freqs.sum(0)[order] * cells
    return axial, scheme, torch.stack((2 * order, 2 * order + 1), dim=1).flatten()


@pytest.mark.parametrize("mode", ["none", "pi", "ntk", "yarn"])
def test_ap_b2_equals_axial_rope_under_every_extrapolation(mode):
    # the eigenfrequency rules of ComRoPE reduce to the frequency rules of RoPE when each block is one plane
    axial, scheme, channels = _ap_as_axial((4, 6))
    for s in (axial, scheme):
        s.set_extrapolation(mode, alpha=0.05, beta=0.5)  # YaRN's ramp inside the bands of a 4 x 6 grid
    grid = (8, 9)
    qk = torch.randn(2, 1, 1, 72, 64)
    expected = axial.apply(qk, axial.prepare(grid_coords(grid), 0, grid_size=grid), 0)
    out = scheme.apply(qk[..., channels], scheme.prepare(scheme.coords(grid), 0, grid_size=grid), 0)
    # AP's positions sit half a cell from RoPE's: both are exactly relative, so the logits agree
    logits = expected[0] @ expected[1].transpose(-1, -2)
    assert torch.allclose(out[0] @ out[1].transpose(-1, -2), logits, atol=1e-4)
    if mode != "none":  # the test grid is larger than the training grid: something was rescaled
        plain = axial.apply(qk, axial.prepare(grid_coords(grid), 0), 0)
        assert not torch.allclose(plain[0] @ plain[1].transpose(-1, -2), logits, atol=1e-2)


def test_scaled_blocks_carry_the_rescaled_eigenfrequencies():
    scheme = ComRoPELD(64, 2, depth=2, block_size=8, grid_size=(4, 6), pos_norm="train_grid", extrapolation="ntk")
    factors = (2.0, 1.5)
    skew = scheme.layer_skew_blocks().detach().double()  # (L, h, m, b, b)
    scaled = scheme.axis_skew_blocks(factors).detach()  # (L, ndim, h, m, b, b)
    assert scaled.dtype == torch.float64 and torch.allclose(scaled, -scaled.transpose(-1, -2))
    for axis in range(2):  # each axis' generators are functions of S: they commute with it (and with each other)
        assert torch.allclose(scaled[:, axis] @ skew, skew @ scaled[:, axis], atol=1e-9)

    def rates(blocks, coeff):  # sorted eigenfrequencies per grid cell of coeff_aj * blocks_j, (L, h, ndim, m * b)
        freqs = torch.linalg.eigvals(blocks).imag.abs().sort(-1).values  # (L, [ndim,] h, m, b)
        cells = torch.tensor([4.0, 6.0], dtype=torch.float64)
        return (coeff[:, :, None, :, None].abs() * freqs / cells[:, None, None, None]).transpose(1, 2).flatten(-2)

    theta = scheme.axis_coefficients().detach().double()  # (L, ndim, m)
    before = rates(skew.unsqueeze(1).expand(-1, 2, -1, -1, -1, -1), theta)
    expected = scale_frequencies(before, factors, "ntk")
    after = rates(scaled, theta)
    assert torch.allclose(after.sort(-1).values, expected.sort(-1).values, rtol=1e-6, atol=1e-9)
    # NTK: per axis, layer and head the highest frequency is kept and the lowest divided by s_a
    assert torch.allclose(after.amax(-1), before.amax(-1), rtol=1e-6)
    assert torch.allclose(after.amin(-1), before.amin(-1) / torch.tensor(factors, dtype=torch.float64), rtol=1e-6)
    # YaRN with every band below alpha interpolates every frequency: S'_a = S / s_a
    scheme.set_extrapolation("yarn", alpha=1e3, beta=2e3)
    pi = scheme.axis_skew_blocks(factors).detach()
    assert torch.allclose(pi, skew.unsqueeze(1) / torch.tensor(factors, dtype=torch.float64)[:, None, None, None, None])


@pytest.mark.parametrize("name", ["comrope_ap", "comrope_ld"])
def test_model_ntk_and_yarn_switch_at_evaluation_and_train(name):
    torch.manual_seed(0)
    m = timm.create_model(
        "visionpe_vit_tiny_patch16_224",
        pos_embed=name,
        depth=2,
        img_size=64,
        dynamic_img_size=True,
        pos_embed_kwargs={"pos_norm": "train_grid"},
    ).eval()
    x = torch.randn(2, 3, 96, 112)
    with torch.no_grad():
        outs = {}
        for mode in ("none", "ntk", "yarn"):
            ramp = {"alpha": 0.05, "beta": 0.5} if mode == "yarn" else {}  # YaRN's options: yarn only
            visionpe.set_extrapolation(m, mode, **ramp)
            outs[mode] = m(x)
    assert all(torch.isfinite(o).all() for o in outs.values())
    assert not torch.allclose(outs["ntk"], outs["none"]) and not torch.allclose(outs["yarn"], outs["ntk"])
    m.train()  # gradients flow through the rescaled generators
    m(x).square().mean().backward()
    scheme = m.pos_schemes[name]
    grads = [p.grad for p in scheme.parameters()]
    assert grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("cls", CLASSES)
def test_time_norm_spatial_divides_frames_by_the_width_as_the_reference(cls):
    """The reference code's 3D positions: (f + 0.5) / n_side for the frame too (its grids are square); visionpe's
    default divides it by the frame count. time_norm='spatial' gives the reference's t, and the rotation of each
    token is the explicit blockdiag exp(sum_a x_a A_a) at those positions."""
    torch.manual_seed(0)
    grid = (2, 3, 5)  # (T, H, W), non-square
    t, y, x = torch.meshgrid(*(torch.arange(n, dtype=torch.float32) for n in grid), indexing="ij")
    expected = torch.stack(((t + 0.5) / 5, (y + 0.5) / 3, (x + 0.5) / 5), -1).reshape(-1, 3)
    spatial = cls(64, 2, depth=1, block_size=4, ndim=3, time_norm="spatial")
    default = cls(64, 2, depth=1, block_size=4, ndim=3)
    default.load_state_dict(spatial.state_dict())
    torch.testing.assert_close(spatial.coords(grid), expected)
    torch.testing.assert_close(default.coords(grid), expected * torch.tensor([5 / 2, 1.0, 1.0]))
    q = torch.randn(1, 2, 30, 32, dtype=torch.float64)
    generators = spatial.generators(0).double()  # (h, m, ndim, b, b)
    exponent = torch.einsum("na,hmaij->hnmij", expected.double(), generators)
    rot = torch.linalg.matrix_exp(exponent.contiguous())  # (h, N, m, b, b)
    naive = (rot @ q.view(1, 2, 30, 8, 4, 1)).flatten(-3)
    got = spatial.rotate(q.float(), spatial.coords(grid))
    torch.testing.assert_close(got.double(), naive, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(default.rotate(q.float(), default.coords(grid)).double(), naive, atol=1e-3)
    # the prefix sits at the reference's cls_position 0.5 on every axis, the time axis included
    torch.testing.assert_close(spatial.prefix_coords(1, expected, grid), torch.full((1, 3), 0.5))
    # with the training grid: the time axis is divided by the training width
    train = cls(64, 2, ndim=3, block_size=4, time_norm="spatial", pos_norm="train_grid", grid_size=(2, 3, 4))
    torch.testing.assert_close(train.coords((4, 3, 8))[1::24, 0], (torch.arange(4.0) + 0.5) / 4)
    with pytest.raises(ValueError, match=r"time_norm='spatial' normalises the time axis of a 3D .* got ndim=2"):
        cls(64, 2, time_norm="spatial")
    with pytest.raises(ValueError, match=r"time_norm must be one of \('frames', 'spatial'\), got 'width'"):
        cls(64, 2, ndim=3, time_norm="width")


def test_distinct_counts_match_unique():
    # the jitter's cell sizes without a grid count each axis' distinct values on the device (no data-dependent
    # shape for a compiled graph): the counts torch.unique gives
    coords = torch.tensor([[0.5, 0.1], [0.5, 0.2], [0.25, 0.1], [0.75, 0.1], [0.25, 0.3]])
    expected = [len(torch.unique(column)) for column in coords.unbind(1)]
    assert distinct_counts(coords).tolist() == expected == [3, 3]
    assert distinct_counts(torch.zeros(0, 3)).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match=r"coords must have shape \(N, ndim\)"):
        distinct_counts(torch.zeros(4))
