"""LOOPE: 1D sin-cos (sin and cos interleaved) of X = X_G + X_C, X_G the patch's 1-based index along the generalized
Hilbert (Gilbert) curve, X_C an offset in (-1, 1) computed from the image; the class token gets a learned vector.

The released code's layout is rebuilt here by hand (its parameter names and shapes) and its output recomputed with
plain torch operations, independently of visionpe's module."""

from __future__ import annotations

import math

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

import visionpe
from visionpe.absolute.loope import LOOPE, convert_released_state_dict, gilbert_curve, gilbert_index, sincos_1d
from visionpe.contract import UnsupportedSchemeError, refusal
from visionpe.integrations.timm_swap import SWAP_ENTRY, apply_position_scheme
from visionpe.parallel import sequence_parallel_refusal

SIZES = [(3, 5), (5, 3), (4, 7), (7, 4), (6, 9), (9, 6), (2, 5), (5, 2), (1, 6), (6, 1), (8, 8), (7, 7), (3, 10)]
PATCH = 4


def loope(grid_size=(4, 4), dim=16, **options) -> LOOPE:
    return visionpe.create_pos_embed("loope", dim=dim, num_heads=2, grid_size=grid_size, patch_size=PATCH, **options)


def images(batch: int, grid_size=(4, 4), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, grid_size[0] * PATCH, grid_size[1] * PATCH, generator=g)


def tiny_vit(pos_embed="loope", **kwargs) -> visionpe.VisionPEViT:
    args = dict(depth=1, embed_dim=16, num_heads=2, num_classes=3, img_size=16, patch_size=PATCH)
    return timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=pos_embed, **{**args, **kwargs})


# -- the curve ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("grid_size", SIZES)
def test_curve_visits_every_cell_once_through_neighbours(grid_size):
    height, width = grid_size
    cells = gilbert_curve(grid_size)
    assert sorted(cells) == [(y, x) for y in range(height) for x in range(width)]
    assert cells[0] == (0, 0)
    steps = [(abs(y1 - y0), abs(x1 - x0)) for (y0, x0), (y1, x1) in zip(cells, cells[1:], strict=False)]
    assert all(max(step) == 1 for step in steps)  # Chebyshev distance 1
    # what the curve guarantees beyond that: sides shared except for at most one diagonal step, and a diagonal
    # only where parity forces it (the longer side odd, the shorter even)
    diagonals = steps.count((1, 1))
    longer, shorter = max(grid_size), min(grid_size)
    assert diagonals <= (1 if longer % 2 and not shorter % 2 else 0)
    # gilbert_index inverts the order: patch y * W + x gets its step number
    rank = gilbert_index(grid_size)
    assert [int(rank[y * width + x]) for y, x in cells] == list(range(height * width))


def test_some_odd_by_even_grid_takes_its_diagonal_step():
    cells = gilbert_curve((4, 7))  # W = 7 odd (the longer side), H = 4 even: no path of side steps ends there
    steps = [(abs(y1 - y0), abs(x1 - x0)) for (y0, x0), (y1, x1) in zip(cells, cells[1:], strict=False)]
    assert steps.count((1, 1)) == 1


def recursive_gilbert(width: int, height: int) -> list[list[int]]:
    """The 1-based step number of each cell [y][x] of the generalized Hilbert curve entered along x, written as the
    recursion of its description (cut in two when much longer than wide, else in three)."""
    order: list[tuple[int, int]] = []

    def walk(x, y, ax, ay, bx, by):
        w, h = abs(ax + ay), abs(bx + by)
        dax, day = (ax > 0) - (ax < 0), (ay > 0) - (ay < 0)
        dbx, dby = (bx > 0) - (bx < 0), (by > 0) - (by < 0)
        if h == 1:
            order.extend((x + dax * i, y + day * i) for i in range(w))
            return
        if w == 1:
            order.extend((x + dbx * i, y + dby * i) for i in range(h))
            return
        ax2, ay2, bx2, by2 = ax // 2, ay // 2, bx // 2, by // 2
        if 2 * w > 3 * h:
            if abs(ax2 + ay2) % 2 and w > 2:
                ax2, ay2 = ax2 + dax, ay2 + day
            walk(x, y, ax2, ay2, bx, by)
            walk(x + ax2, y + ay2, ax - ax2, ay - ay2, bx, by)
            return
        if abs(bx2 + by2) % 2 and h > 2:
            bx2, by2 = bx2 + dbx, by2 + dby
        walk(x, y, bx2, by2, ax2, ay2)
        walk(x + bx2, y + by2, ax, ay, bx - bx2, by - by2)
        walk(x + (ax - dax) + (bx2 - dbx), y + (ay - day) + (by2 - dby), -bx2, -by2, -(ax - ax2), -(ay - ay2))

    walk(0, 0, width, 0, 0, height)
    table = [[0] * width for _ in range(height)]
    for step, (x, y) in enumerate(order):
        table[y][x] = step + 1
    return table


def test_curve_index_is_one_based_as_released():
    # the 4 x 4 Hilbert curve, counted from 1 (row-major); the released code counts its steps from 1
    expected = torch.tensor([[1, 2, 15, 16], [4, 3, 14, 13], [5, 8, 9, 12], [6, 7, 10, 11]]).flatten()
    pe = loope(context="learned")  # zero offsets at init: X = X_G
    assert torch.equal(pe.positions((4, 4)), expected.float())
    for n in range(1, 15):  # square grids: the released curve, entered along x
        reference = torch.tensor(recursive_gilbert(n, n)).flatten()
        assert torch.equal(loope((n, n), context="learned").positions((n, n)), reference.float()), n
    # the image context moves X by less than 1 around the same 1-based index
    image = loope()
    offsets = image.context_offsets((4, 4), images(2))
    assert offsets.shape == (2, 16) and offsets.abs().max() < 1
    torch.testing.assert_close(image.positions((4, 4), images(2)) - offsets, expected.float().expand(2, -1))


# -- the embedding -----------------------------------------------------------------------------------------------


def naive_interleaved(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Channel 2k: sin(X w_k), channel 2k + 1: cos(X w_k), w_k = 10000^(-2k/dim), one position at a time in float64."""
    w = [10000.0 ** (-2 * k / dim) for k in range(dim // 2)]
    rows = [[f(p * wk) for wk in w for f in (math.sin, math.cos)] for p in positions.tolist()]
    return torch.tensor(rows, dtype=torch.float32)


def test_sin_and_cos_are_interleaved():
    pe = loope(context="learned")
    x = torch.randn(2, 1 + 16, 16)
    out = pe(x, (4, 4), 1)
    expected = naive_interleaved(gilbert_index((4, 4)).float() + 1, 16)
    torch.testing.assert_close(out[:, 1:] - x[:, 1:], expected.expand(2, -1, -1), rtol=0, atol=1e-5)
    # the same channels as the concatenated layout, permuted
    halves = sincos_1d(torch.arange(5.0), 16)
    torch.testing.assert_close(sincos_1d(torch.arange(5.0), 16, interleaved=True)[:, 0::2], halves[:, :8])
    torch.testing.assert_close(sincos_1d(torch.arange(5.0), 16, interleaved=True)[:, 1::2], halves[:, 8:])


def test_the_class_token_gets_a_learned_vector():
    pe = loope(context="learned")
    assert isinstance(pe.prefix_embed, torch.nn.Parameter) and torch.equal(pe.prefix_embed, torch.zeros(1, 16))
    with torch.no_grad():
        pe.prefix_embed.normal_()
    x = torch.randn(2, 1 + 16, 16)
    out = pe(x, (4, 4), 1)
    torch.testing.assert_close(out[:, 0], x[:, 0] + pe.prefix_embed[0])
    out.sum().backward()
    assert torch.equal(pe.prefix_embed.grad, torch.full((1, 16), 2.0))  # one row per token, the batch summed
    # registers: a vector each; no_embed_class: none, the prefix passes unchanged
    registers = loope(context="learned", num_prefix_tokens=3)
    assert registers.prefix_embed.shape == (3, 16)
    plain = loope(context="learned", no_embed_class=True)
    assert plain.prefix_embed is None
    assert torch.equal(plain(x, (4, 4), 1)[:, 0], x[:, 0])
    with pytest.raises(ValueError, match="built with vectors for 3 prefix tokens, got 1"):
        registers(x, (4, 4), 1)
    model = tiny_vit(reg_tokens=2)
    assert model.pos_schemes["loope"].prefix_embed.shape == (3, 16)
    assert tiny_vit(class_token=False, global_pool="avg").pos_schemes["loope"].prefix_embed is None


def test_context_is_computed_from_each_image():
    pe = loope().eval()
    pe.load_released_state_dict(released_state_dict())  # weights of a trained scale (at init X_C is about 1e-3)
    pixels = images(3)
    offsets = pe.context_offsets((4, 4), pixels)
    # per image: in eval mode an image's offsets in a batch are its offsets alone, and two images differ
    torch.testing.assert_close(pe.context_offsets((4, 4), pixels[1:2])[0], offsets[1], rtol=0, atol=1e-6)
    assert (offsets[0] - offsets[1]).abs().max() > 1e-3
    x = torch.randn(3, 1 + 16, 16)
    out = pe(x, (4, 4), 1, pixels=pixels)
    expected = torch.stack([naive_interleaved(pe.positions((4, 4), pixels)[i].detach(), 16) for i in range(3)])
    torch.testing.assert_close(out[:, 1:] - x[:, 1:], expected, rtol=0, atol=1e-5)
    # the context network trains
    pe.train()(x, (4, 4), 1, pixels=pixels).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in pe.parameters())
    with pytest.raises(ValueError, match="computes its positions from the input image: call it with pixels="):
        pe(x, (4, 4), 1)
    with pytest.raises(ValueError, match=r"patches form the grid \(4, 4\), got \(3, 3, 20, 16\)"):
        pe(x, (4, 4), 1, pixels=torch.randn(3, 3, 20, 16))
    with pytest.raises(ValueError, match="pixels hold 2 images for a batch of 3"):
        pe(x, (4, 4), 1, pixels=pixels[:2])


# -- the released layout -----------------------------------------------------------------------------------------

WIDTHS = [(5, 32, PATCH), (32, 16, 5), (16, 8, 5), (8, 4, 5), (4, 1, 5)]


def released_state_dict(dim: int = 16, side: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """The released module's state dict for a side x side grid of PATCH-pixel patches, values drawn at random: its
    Sequential ``art_conv`` (convolutions at 0, 2, 4, 6, 8, the batch norm at 10, the linear map at 12), its
    buffers and its class-token vector."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for index, (c_in, c_out, kernel) in zip((0, 2, 4, 6, 8), WIDTHS, strict=True):
        state[f"art_conv.{index}.weight"] = 0.3 * torch.randn(c_out, c_in, kernel, kernel, generator=g)
        state[f"art_conv.{index}.bias"] = 0.1 * torch.randn(c_out, generator=g)
    state["art_conv.10.weight"] = 1 + 0.2 * torch.randn(1, generator=g)
    state["art_conv.10.bias"] = 0.2 * torch.randn(1, generator=g)
    state["art_conv.10.running_mean"] = 0.1 * torch.randn(1, generator=g)
    state["art_conv.10.running_var"] = 0.5 + torch.rand(1, generator=g)
    state["art_conv.10.num_batches_tracked"] = torch.tensor(7)
    state["art_conv.12.weight"] = 0.5 * torch.randn(side * side, side * side, generator=g)
    pixels = side * PATCH
    line = torch.linspace(-1, 1, pixels)
    state["cord"] = torch.stack(torch.meshgrid(line, line, indexing="ij"))
    state["wrap_pos_hilbert"] = torch.tensor(recursive_gilbert(side, side), dtype=torch.float32).reshape(-1, 1)
    state["div_term"] = torch.exp(torch.arange(0, dim, 2).float() * -(math.log(10000.0) / dim))[None]
    state["cls_token"] = torch.randn(1, dim, generator=g)
    return state


def released_output(state: dict[str, torch.Tensor], pixels: torch.Tensor, training: bool) -> torch.Tensor:
    """The (B, 1 + N, dim) embedding the released module adds to the tokens, recomputed from its state dict: the
    CNN over [image, y, x], batch norm, linear map, 2 sigmoid - 1 plus the 1-based curve index, sin in the even and
    cos in the odd channels, the class-token vector first."""
    h = torch.cat([pixels, state["cord"].expand(pixels.shape[0], -1, -1, -1)], dim=1)
    h = F.gelu(F.conv2d(h, state["art_conv.0.weight"], state["art_conv.0.bias"], stride=PATCH))
    for index in (2, 4, 6, 8):
        h = F.gelu(F.conv2d(h, state[f"art_conv.{index}.weight"], state[f"art_conv.{index}.bias"], padding=2))
    mean, var = state["art_conv.10.running_mean"].clone(), state["art_conv.10.running_var"].clone()
    h = F.batch_norm(h, mean, var, state["art_conv.10.weight"], state["art_conv.10.bias"], training=training)
    offsets = 2 * torch.sigmoid(h.flatten(1) @ state["art_conv.12.weight"].T) - 1
    angles = (offsets + state["wrap_pos_hilbert"][:, 0])[..., None] * state["div_term"]
    patches = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)
    cls = state["cls_token"].expand(pixels.shape[0], 1, -1)
    return torch.cat([cls, patches], dim=1)


@pytest.mark.parametrize("training", [False, True])
def test_released_weights_give_the_released_output(training):
    state = released_state_dict()
    pe = loope()
    pe.load_released_state_dict(state)
    assert torch.equal(pe.context_weight, state["art_conv.12.weight"])
    assert torch.equal(pe.context_norm.running_var, state["art_conv.10.running_var"])
    pixels, x = images(3), torch.randn(3, 1 + 16, 16)
    pe.train(training)
    with torch.no_grad():
        out = pe(x, (4, 4), 1, pixels=pixels)
    torch.testing.assert_close(out - x, released_output(state, pixels, training), rtol=0, atol=1e-5)
    # their ViT's state dict holds the module under pos_embedding.; other keys are left alone
    whole = {f"pos_embedding.{k}": v for k, v in released_state_dict(seed=1).items()} | {"classifier.weight": x}
    pe.load_released_state_dict(whole, prefix="pos_embedding.")
    assert torch.equal(pe.prefix_embed, whole["pos_embedding.cls_token"])


def test_released_state_dict_is_checked_against_the_scheme():
    assert set(convert_released_state_dict(released_state_dict())) == set(loope().state_dict())
    with pytest.raises(ValueError, match=r"wrap_pos_hilbert \(25, 1\) is not the curve index .* grid \(4, 4\)"):
        loope().load_released_state_dict(released_state_dict(side=5))
    with pytest.raises(ValueError, match=r"div_term \(1, 16\) is not the spectrum of dim=16"):
        loope().load_released_state_dict(released_state_dict(dim=32))
    with pytest.raises(ValueError, match=r"'art_conv.13.weight' is not a key of the released LOOPE module"):
        loope().load_released_state_dict(released_state_dict() | {"art_conv.13.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"cord \(2, 20, 20\) is not the coordinates of an image"):
        loope().load_released_state_dict(released_state_dict() | {"cord": torch.zeros(2, 20, 20)})
    with pytest.raises(ValueError, match="has no 'cord'"):
        loope().load_released_state_dict({k: v for k, v in released_state_dict().items() if k != "cord"})
    with pytest.raises(ValueError, match="computes its context from the image, got context='learned'"):
        loope(context="learned").load_released_state_dict(released_state_dict())


def test_initialisation_draws_as_the_released_layers():
    # the released module's layers drawn in order under one seed: nn.Conv2d's and nn.Linear's default draws
    torch.manual_seed(3)
    convs = []
    for i, (c_in, c_out, kernel) in enumerate(WIDTHS):
        stride, padding = (PATCH, 0) if i == 0 else (1, 2)
        convs.append(torch.nn.Conv2d(c_in, c_out, kernel, stride, padding))
    linear = torch.nn.Linear(16, 16, bias=False)
    torch.manual_seed(3)
    pe = loope()
    for i, conv in zip((0, 2, 4, 6, 8), convs, strict=True):
        assert torch.equal(pe.context_net[i].weight, conv.weight) and torch.equal(pe.context_net[i].bias, conv.bias)
    assert torch.equal(pe.context_weight, linear.weight)


# -- other grids (visionpe's addition) ---------------------------------------------------------------------------


def test_other_grids_go_through_the_training_grid():
    pe = loope().eval()
    with torch.no_grad():
        pe.context_weight.normal_()
    pixels = images(2, (6, 8))
    values = pe.context_map(pixels).flatten(1)
    to_train = visionpe.create_pos_embed("learned", dim=2, num_heads=1, grid_size=(6, 8), num_prefix_tokens=0)
    with torch.no_grad():
        to_train.pos_embed.copy_(values.T[None])
        logits = to_train.resampled((4, 4))[0].T @ pe.context_weight.T  # the map on the training grid, then W
        back = visionpe.create_pos_embed("learned", dim=2, num_heads=1, grid_size=(4, 4), num_prefix_tokens=0)
        back.pos_embed.copy_(logits.T[None])
        expected = 2 * torch.sigmoid(back.resampled((6, 8))[0].T) - 1
        torch.testing.assert_close(pe.context_offsets((6, 8), pixels), expected, rtol=0, atol=1e-6)
        # set_input_size composes the two resamplings with the linear map: the same offsets on the new grid
        pe.set_grid_size((6, 8))
        assert pe.grid_size == (6, 8) and pe.context_weight.shape == (48, 48)
        torch.testing.assert_close(pe.context_offsets((6, 8), pixels), expected, rtol=0, atol=1e-5)
    # a checkpoint of the 4 x 4 grid loads into a model built for 6 x 6 as set_grid_size brings it there
    small, large = tiny_vit(), tiny_vit(img_size=24)
    report = visionpe.load_timm_state_dict(large, small.state_dict())
    assert report.resampled == ["pos_schemes.loope.context_weight ((16, 16) -> (36, 36))"]
    small.pos_schemes["loope"].set_grid_size((6, 6))
    torch.testing.assert_close(large.pos_schemes["loope"].context_weight, small.pos_schemes["loope"].context_weight)


def test_non_square_and_padded_images():
    model = tiny_vit(dynamic_img_size=True, dynamic_img_pad=True).eval()
    pixels = torch.randn(2, 3, 14, 23)  # 4 x 6 patches, the last row and column padded
    tokens = model.patch_embed(pixels).flatten(1, 2)
    scheme = model.pos_schemes["loope"]
    with torch.no_grad():
        features = model._pos_embed_grid(model.patch_embed(pixels), pixels)[0]
        cls = model.cls_token.expand(2, -1, -1)
        expected = scheme(torch.cat([cls, tokens], 1), (4, 6), 1, pixels=pixels)
        assert torch.equal(features, expected)
        assert torch.isfinite(model(pixels)).all()
    padded = F.pad(torch.cat([pixels, torch.zeros(2, 2, 14, 23)], 1), (0, 1, 0, 2))
    ys, xs = torch.linspace(-1, 1, 14), torch.linspace(-1, 1, 23)
    padded[:, 3:, :14, :23] = torch.stack(torch.meshgrid(ys, xs, indexing="ij"))
    with torch.no_grad():
        torch.testing.assert_close(scheme.context_map(pixels), scheme.context_norm(scheme.context_net(padded)))


def test_learned_context_is_resampled_like_the_learned_table():
    pe = loope((3, 5), context="learned")
    learned = visionpe.create_pos_embed("learned", dim=1, num_heads=1, grid_size=(3, 5), num_prefix_tokens=0)
    with torch.no_grad():
        pe.context.normal_()
        learned.pos_embed.copy_(pe.context)
    torch.testing.assert_close(pe.context_offsets((6, 8)), learned.resampled((6, 8))[0, :, 0], rtol=0, atol=0)
    x = torch.randn(1, 1 + 28, 16)
    pe(x, (4, 7), 1).square().sum().backward()  # through the bicubic resampling
    assert pe.context.grad.abs().sum() > 0
    pe.set_grid_size((6, 8))  # the model's set_input_size
    assert pe.grid_size == (6, 8) and pe.context.shape == (1, 48, 1)
    torch.testing.assert_close(pe.context[0, :, 0], learned.resampled((6, 8))[0, :, 0], rtol=0, atol=0)


# -- the model and the entry points ------------------------------------------------------------------------------


def test_the_vit_passes_its_images_and_trains_every_parameter_without_decay():
    model = tiny_vit().eval()
    pixels = images(2)
    with torch.no_grad():
        tokens = model.patch_embed(pixels)
        prefix = torch.cat([model.cls_token.expand(2, -1, -1), tokens], 1)
        expected = model.pos_schemes["loope"](prefix, (4, 4), 1, pixels=pixels)
        assert torch.equal(model._pos_embed_grid(tokens, pixels)[0], expected)
        with pytest.raises(ValueError, match="call it with pixels="):
            model._pos_embed_grid(tokens)  # timm's hook alone has no image
    scheme = model.pos_schemes["loope"]
    assert scheme.patch_size == (PATCH, PATCH) and scheme.in_chans == 3
    decay_free = model.no_weight_decay()
    assert {f"pos_schemes.loope.{n}" for n, _ in scheme.named_parameters()} <= decay_free
    assert "pos_schemes.loope.context_weight" in decay_free


def test_entry_points_that_do_not_pass_the_image_refuse_it():
    reason = refusal(SWAP_ENTRY, "loope")
    assert reason.startswith("'loope' needs pixels (the input image") and "does not provide" in reason
    with pytest.raises(UnsupportedSchemeError, match=r"apply_position_scheme cannot use pos_embed='loope'.*pixels"):
        apply_position_scheme(
            VisionTransformer(img_size=16, patch_size=PATCH, embed_dim=16, depth=1, num_heads=2), "loope"
        )
    with pytest.raises(UnsupportedSchemeError, match=r"visionpe_mvvit_\*.*'loope' needs pixels"):
        timm.create_model("visionpe_mvvit_tiny_patch16", pos_embed="loope", img_size=16, patch_size=PATCH, depth=1)
    assert "needs pixels" in sequence_parallel_refusal("loope", tiny_vit().pos_schemes["loope"])
    # the learned context reads no image: the visionpe ViT takes it in mixed-resolution batches and causal attention
    assert not loope(context="learned").requires and loope().requires == {"pixels"}


def test_mixed_resolution_batches_and_causal_attention_are_refused():
    model = tiny_vit(dynamic_img_size=True).eval()
    patches = torch.randn(2, 16, PATCH * PATCH * 3)
    coord = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij"), -1).reshape(1, 16, 2)
    batch = {"patches": patches, "patch_coord": coord.expand(2, -1, -1), "patch_valid": torch.ones(2, 16, dtype=bool)}
    with pytest.raises(UnsupportedSchemeError, match=r"'loope' does not take mixed-resolution batches \(it reads"):
        model(batch)
    with pytest.raises(UnsupportedSchemeError, match="'loope' mixes every token with its neighbours"):
        model(images(1), is_causal=True)
    learned = tiny_vit(pos_embed_kwargs={"context": "learned"}, dynamic_img_size=True).eval()
    with torch.no_grad():
        assert torch.isfinite(learned(batch)).all() and torch.isfinite(learned(images(1), is_causal=True)).all()


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"loope needs an even dim >= 2 .*got dim=15"):
        visionpe.create_pos_embed("loope", dim=15, num_heads=1)
    with pytest.raises(ValueError, match=r"interpolation must be one of"):
        visionpe.create_pos_embed("loope", dim=16, num_heads=1, interpolation="area")
    with pytest.raises(ValueError, match=r"context must be one of"):
        visionpe.create_pos_embed("loope", dim=16, num_heads=1, context="patches")
    with pytest.raises(ValueError, match=r"patch_size\[1\] must be"):
        visionpe.create_pos_embed("loope", dim=16, num_heads=1, patch_size=(4, 0))
    with pytest.raises(ValueError, match=r"grid_size\[1\] must be positive, got 0"):
        gilbert_curve((3, 0))
    with pytest.raises(ValueError, match=r"grid_size must have 2 entries"):
        gilbert_index((2, 3, 4))
