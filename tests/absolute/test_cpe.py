import numpy as np
import pytest
import timm
import torch

import visionpe  # noqa: F401  (registers the models)
from visionpe.absolute.cpe import PEG, PositionEncodingGenerator


def _peg(dim=8, **kwargs) -> PEG:
    torch.manual_seed(0)
    peg = PEG(dim, depth=6, **kwargs)
    for param in peg.parameters():
        torch.nn.init.normal_(param)
    return peg


def test_translation_equivariant_away_from_border_and_prefix_untouched():
    peg, (h, w), dim = _peg(), (6, 9), 8
    grid = torch.randn(2, dim, h, w)
    shifted = torch.roll(grid, shifts=(1, 2), dims=(2, 3))
    prefix = torch.randn(2, 1, dim)

    def run(g):
        x = torch.cat([prefix, g.flatten(2).transpose(1, 2)], dim=1)
        out = peg(x, (h, w), 1)
        assert torch.equal(out[:, :1], prefix)
        return out[:, 1:].transpose(1, 2).reshape(2, dim, h, w)

    out, out_shifted = run(grid), run(shifted)
    # cells whose 3x3 neighbourhood is inside the grid and not wrapped by the roll
    torch.testing.assert_close(out_shifted[..., 3:-1, 4:-1], out[..., 2:-2, 2:-3])


def test_zero_padding_makes_border_tokens_differ():
    peg, (h, w) = _peg(), (4, 5)
    out = peg(torch.ones(1, h * w, 8), (h, w), 0).reshape(h, w, 8)
    interior = out[1:-1, 1:-1].reshape(-1, 8)
    torch.testing.assert_close(interior, interior[:1].expand_as(interior))
    assert not torch.allclose(out[0, 0], out[1, 1])


def test_non_square_grid_is_taken_from_grid_size():
    peg, (h, w) = _peg(), (3, 5)
    x = torch.randn(1, h * w, 8)
    conv = peg.pegs[0].proj
    expected = conv(x.transpose(1, 2).reshape(1, 8, h, w)) + x.transpose(1, 2).reshape(1, 8, h, w)
    torch.testing.assert_close(peg(x, (h, w), 0), expected.flatten(2).transpose(1, 2))
    assert not torch.allclose(peg(x, (h, w), 0), peg(x, (w, h), 0))


def test_placement_after_blocks_0_to_4_uses_one_peg_each():
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224", pos_embed="cpe", depth=6, pos_embed_kwargs={"insert_after": (0, 1, 2, 3, 4)}
    )
    scheme = model.pos_schemes["cpe"]
    assert len(scheme.pegs) == 5
    calls = []
    for i, peg in enumerate(scheme.pegs):
        peg.register_forward_hook(lambda *_, i=i: calls.append(i))
    model(torch.randn(1, 3, 224, 224))
    model(torch.randn(1, 3, 224, 224))
    assert calls == [0, 1, 2, 3, 4] * 2
    x = torch.randn(1, 197, 192)
    torch.testing.assert_close(scheme(x, (14, 14), 1, after_block=3), scheme.pegs[3](x, (14, 14), 1))
    assert {f"pos_schemes.cpe.pegs.{i}.proj.bias" for i in range(5)} <= model.no_weight_decay()


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="insert_after"):
        PEG(8, depth=2, insert_after=(0, 3))
    with pytest.raises(ValueError, match="insert_after"):
        PEG(8, depth=6, insert_after=(2, 1))
    with pytest.raises(ValueError, match="kernel_size"):
        PEG(8, kernel_size=2)
    peg = PEG(8)
    with pytest.raises(ValueError, match="2D grids"):
        peg(torch.randn(1, 24, 8), (2, 3, 4), 0)
    with pytest.raises(ValueError, match="tokens"):
        peg(torch.randn(1, 13, 8), (3, 5), 1)
    with pytest.raises(ValueError, match="after_block"):
        peg(torch.randn(1, 16, 8), (3, 5), 1, after_block=2)


@pytest.mark.parametrize(
    "dim, error, match",
    [
        (0, ValueError, r"dim must be a positive int, got 0"),
        (-8, ValueError, r"dim must be a positive int, got -8"),
        (8.0, TypeError, r"dim must be a positive int, got float \(8.0\)"),
        (True, TypeError, r"dim must be a positive int, got bool \(True\)"),
    ],
)
def test_bad_dim_raises_naming_dim(dim, error, match):
    with pytest.raises(error, match=match):
        PEG(dim)
    with pytest.raises(error, match=match):
        PositionEncodingGenerator(dim)


def test_insert_after_accepts_any_integer_type_but_not_bool():
    for given in (
        np.int64(2),
        torch.tensor(2),
        np.array([0, 2]),
        [np.int32(0), 2],
        torch.tensor([0, 2]),
        range(0, 3, 2),
    ):
        peg = PEG(8, depth=3, insert_after=given)
        assert peg.insert_after in ((2,), (0, 2)) and all(type(b) is int for b in peg.insert_after)
    for given in (True, (0, True), np.bool_(True), np.array([0.0]), 1.0, "0", None, {0: 1}):
        with pytest.raises(ValueError, match=r"insert_after must be increasing distinct block indices in \[0, 3\)"):
            PEG(8, depth=3, insert_after=given)


@pytest.mark.parametrize("size", [(224, 224), (384, 384), (160, 224)])
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("gap", [False, True])
def test_model_forward_backward(size, bf16, gap):
    torch.manual_seed(0)
    extra = {"class_token": False, "global_pool": "avg"} if gap else {}
    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="cpe", dynamic_img_size=True, depth=2, **extra)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(torch.randn(1, 3, *size))
    assert out.shape == (1, 1000) and torch.isfinite(out).all()
    out.float().sum().backward()
    for name, param in model.pos_schemes.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_init_and_weight_decay_follow_the_released_code():
    """Kernel ~ N(0, 2 / fan_out), fan_out = k * k * C_out / groups = k^2 (std sqrt(2/9) for 3 x 3), bias 0; the
    whole PEG (kernels and biases) is kept out of weight decay, as the released Twins / CPVT code does."""
    torch.manual_seed(0)
    big = PositionEncodingGenerator(4096, kernel_size=3)  # 36,864 kernel weights
    weight = big.proj.weight.detach()
    assert abs(weight.std().item() - (2 / 9) ** 0.5) < 0.01 and abs(weight.mean().item()) < 0.01
    assert torch.equal(big.proj.bias.detach(), torch.zeros(4096))
    five = PositionEncodingGenerator(1024, kernel_size=5)
    assert abs(five.proj.weight.detach().std().item() - (2 / 25) ** 0.5) < 0.01
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224",
        pos_embed="cpe",
        depth=3,
        img_size=32,
        pos_embed_kwargs={"insert_after": (0, 2)},
    )
    pegs = {n for n, _ in model.named_parameters() if n.startswith("pos_schemes.cpe.")}
    assert pegs == {f"pos_schemes.cpe.pegs.{i}.proj.{p}" for i in range(2) for p in ("weight", "bias")}
    assert pegs <= model.no_weight_decay()
    # timm's optimizer factory then decays none of them
    from timm.optim import create_optimizer_v2

    optimizer = create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05)
    decayed = {id(p) for group in optimizer.param_groups if group["weight_decay"] > 0 for p in group["params"]}
    assert not any(id(p) in decayed for n, p in model.named_parameters() if n in pegs)
