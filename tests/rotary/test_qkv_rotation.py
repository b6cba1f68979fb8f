"""Rotations applied in place to the fused q/k/v projection output, as attention runs them: LieRE and ComRoPE's
block rotations, and the complex pair rotation of RoPE and STRING."""

import pytest
import timm
import torch

import visionpe
from visionpe.grid import grid_coords
from visionpe.interfaces.rotary import LayerRotation
from visionpe.rotary.base import TableRotation
from visionpe.rotary.block_rotation import apply_block_rotation, rotate_qkv_blocks_
from visionpe.rotary.expm import skew_from_params
from visionpe.rotary.functional import apply_rotary, rotary_tables, rotate_qkv_pairs_
from visionpe.rotary.lie_base import BlockRotation
from visionpe.rotary.liere import LieRE

from ..model_checks import random_keep

LIE_SCHEMES = ["liere", "comrope_ap", "comrope_ld"]
LINEAR_SCHEMES = ["rope_axial", "rope_mixed", "string_cayley", "string_circulant"]


def _rotations(heads_rot, tokens, blocks, b, dtype=torch.float64):
    """Orthogonal (heads | 1, N, blocks, b, b) rotations (the backward relies on R^T R = I)."""
    skew = skew_from_params(torch.randn(heads_rot, tokens, blocks, b * (b - 1) // 2, dtype=dtype), b)
    return torch.linalg.matrix_exp(skew)


def _cut(qkv, heads):
    """(q and k as attention cuts them, v) of a (B, T, 3 heads head_dim) projection."""
    parts = qkv.unflatten(-1, (3, heads, -1)).permute(2, 0, 3, 1, 4)
    return parts[:2], parts[2]


def _fused(rotation, qkv, batch, heads, keep=None):
    """(the (B, T, 3 heads head_dim) projection output after ``rotation.rotate_qkv``, whether q, k, v are still views
    of ``qkv``: rotated in place)."""
    q, k, v = rotation.rotate_qkv(qkv, batch, heads, keep)
    in_place = q.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    return torch.stack((q, k, v), 1).permute(0, 3, 1, 2, 4).flatten(2), in_place


@pytest.mark.parametrize("prefix", [0, 2])
@pytest.mark.parametrize("heads_rot", [1, 3])
@pytest.mark.parametrize("flat", [False, True])
def test_in_place_rotation_equals_apply_block_rotation(prefix, heads_rot, flat):
    heads, tokens, b = 3, 5, 4
    rot = _rotations(heads_rot, tokens, 2, b)
    qkv = torch.randn(2, prefix + tokens, 3 * heads * 2 * b, dtype=torch.float64)
    qk, v = _cut(qkv, heads)
    expected = apply_block_rotation(qk, rot, prefix)
    work = qkv.clone()
    if flat:  # (B * T, 3 heads head_dim), tokens per image given, as attention passes it
        out = rotate_qkv_blocks_(work.flatten(0, 1), rot, heads, prefix, tokens=prefix + tokens).view_as(qkv)
    else:
        out = rotate_qkv_blocks_(work, rot, heads, prefix)
        assert out is work
    out_qk, out_v = _cut(out, heads)
    assert torch.allclose(out_qk, expected, atol=1e-12)
    assert torch.equal(out_v, v) and torch.equal(out_qk[..., :prefix, :], qk[..., :prefix, :])


@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("heads_rot", [1, 2])
def test_in_place_rotation_gradients(prefix, heads_rot):
    # the backward recovers dL/dR from the rotated vectors, (dY Y^T) R: exact for orthogonal R, which
    # finite differences around an orthogonal R check
    heads, tokens, b = 2, 3, 4
    rot = _rotations(heads_rot, tokens, 2, b).requires_grad_()
    qkv = torch.randn(2, prefix + tokens, 3 * heads * 2 * b, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, r: rotate_qkv_blocks_(x.clone(), r, heads, prefix), (qkv, rot))


def test_in_place_rotation_rejects_bad_input():
    rot = _rotations(2, 4, 2, 4, torch.float32)
    qkv = torch.randn(2, 5, 48)
    with pytest.raises(ValueError, match="rot"):
        rotate_qkv_blocks_(qkv, rot, 2, num_prefix_tokens=0)  # 5 tokens, 4 rotations
    with pytest.raises(ValueError, match="num_heads"):
        rotate_qkv_blocks_(qkv, rot, 5, num_prefix_tokens=1)  # 48 is not 3 * 5 * head_dim
    with pytest.raises(ValueError, match="contiguous"):
        rotate_qkv_blocks_(torch.randn(2, 96, 5).transpose(1, 2)[..., :48], rot, 2, num_prefix_tokens=1)
    with pytest.raises(ValueError, match="tokens"):
        rotate_qkv_blocks_(qkv.flatten(0, 1), rot, 2, num_prefix_tokens=1, tokens=3)  # 10 rows, 3 per image
    with pytest.raises(ValueError, match="num_prefix_tokens"):
        rotate_qkv_blocks_(qkv, rot, 2, num_prefix_tokens=-1)


@pytest.mark.parametrize(
    ("name", "kwargs"), [("liere", {}), ("liere", {"block_size": 2}), ("comrope_ap", {}), ("comrope_ld", {})]
)
def test_scheme_rotate_qkv_equals_rotate(name, kwargs):
    # LieRE's plan squares and rotates in one step (the rotations are not kept); ComRoPE's and 2 x 2 LieRE's
    # rotate by their rotations: all equal the out-of-place apply, values and gradients
    scheme = visionpe.create_pos_embed(name, dim=64, num_heads=2, depth=2, **kwargs)
    for param in scheme.parameters():
        param.data.normal_(0, 0.3)
    tokens = 1 + 20
    qkv = torch.randn(3 * tokens, 3 * 64)

    def prepare():  # per run: the word tables built here are part of each run's graph
        return scheme.prepare(scheme.coords((4, 5)), 1, grid_size=(4, 5))

    def in_place(x):
        out, fused = _fused(prepare().layer(1), x.clone(), 3, 2)
        assert fused
        return out

    def out_of_place(x):
        x = x.view(3, tokens, -1)
        qk, v = _cut(x, 2)
        rotated = scheme.apply(qk, prepare(), 1)  # (2, B, heads, T, head_dim) back to (B, T, 3 heads head_dim)
        return torch.cat((rotated, v.unsqueeze(0))).permute(1, 3, 0, 2, 4).flatten(2)

    results = []
    for fn in (in_place, out_of_place):
        x = qkv.clone().requires_grad_()
        out = fn(x)
        weights = torch.linspace(-1, 1, out.numel()).view(out.shape)
        grads = torch.autograd.grad((out * weights).sum(), [x, *scheme.parameters()])
        results.append((out, grads))
    (out, grads), (ref, ref_grads) = results
    assert torch.allclose(out, ref, atol=1e-5)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):  # fp32 series and squarings: 1e-5 of the norm
        assert (grad - ref_grad).norm() <= 1e-5 * ref_grad.norm()


def test_rotate_qkv_in_place_only_with_autograd_in_eager_mode():
    # without autograd the rotation goes a chunk of tokens at a time (bounded memory at large grids): not in place
    scheme = LieRE(64, 2, depth=1)
    rotation = scheme.prepare(grid_coords((3, 3)), 1).layer(0)
    with torch.no_grad():
        assert not _fused(rotation, torch.randn(10, 192), 1, 2)[1]
    assert _fused(rotation, torch.randn(10, 192), 1, 2)[1]


@pytest.mark.parametrize("name", LIE_SCHEMES + LINEAR_SCHEMES)
def test_model_in_place_equals_out_of_place_and_keeps_less(monkeypatch, name):
    torch.manual_seed(0)
    model = timm.create_model(
        "visionpe_vit_small_patch16_224", pos_embed=[name], img_size=64, depth=2, embed_dim=96, num_heads=3
    )
    images = torch.randn(2, 3, 64, 64)
    owner = BlockRotation if name in LIE_SCHEMES else TableRotation
    calls = []
    original = owner.rotate_qkv

    def spy(self, qkv, *args):
        q, k, v = original(self, qkv, *args)
        calls.append(q.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr())
        return q, k, v

    def run():
        saved = set()

        def pack(tensor):
            saved.add((tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = model(images)
        out.square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return out, grads, sum(nbytes for _, nbytes in saved)

    monkeypatch.setattr(owner, "rotate_qkv", spy)
    out, grads, kept = run()
    assert calls == [True, True]
    monkeypatch.setattr(owner, "rotate_qkv", LayerRotation.rotate_qkv)  # the default: cut q and k, then rotate
    ref, ref_grads, ref_kept = run()
    assert torch.allclose(out, ref, atol=1e-5)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert (grad - ref_grad).norm() <= 1e-5 * ref_grad.norm()
    # no rotated copy of q and k kept for the backward: 2 (q, k) * B * T * dim fp32 per block fewer
    qk_bytes = 2 * 2 * (1 + 16) * 96 * 4
    assert ref_kept - kept >= 2 * qk_bytes


@pytest.mark.parametrize("heads_rot", [1, 3])
@pytest.mark.parametrize("flat", [False, True])
def test_pair_rotation_equals_apply_rotary(heads_rot, flat):
    heads, tokens, head_dim = 3, 7, 8
    cos, sin = rotary_tables(torch.randn(heads_rot, tokens - 1, head_dim // 2) * 3, num_prefix_tokens=1)
    qkv = torch.randn(2, tokens, 3 * heads * head_dim)
    qk, v = _cut(qkv, heads)
    expected = apply_rotary(qk, cos, sin)
    work = qkv.clone()
    out = rotate_qkv_pairs_(work.flatten(0, 1) if flat else work, cos, sin, heads).view_as(qkv)
    assert out.data_ptr() == work.data_ptr()
    out_qk, out_v = _cut(out, heads)
    assert torch.allclose(out_qk, expected, atol=1e-6) and torch.equal(out_v, v)


@pytest.mark.parametrize("heads_rot", [1, 3])
@pytest.mark.parametrize("mscale", [1.0, 1.3])
def test_pair_rotation_gradients_equal_apply_rotary(heads_rot, mscale):
    # the backward recovers dL/df from the rotated pairs, dL/dy conj(y) / conj(f): also for |f| != 1 (YaRN's
    # attention factor scales the tables)
    heads, tokens, head_dim = 3, 6, 8
    angles = (torch.randn(heads_rot, tokens, head_dim // 2) * 3).requires_grad_()
    qkv = torch.randn(2, tokens, 3 * heads * head_dim, requires_grad=True)
    weights = torch.randn(2, tokens, 3 * heads * head_dim)

    def in_place():
        cos, sin = rotary_tables(angles)
        return rotate_qkv_pairs_(qkv.clone(), cos * mscale, sin * mscale, heads)

    def out_of_place():
        cos, sin = rotary_tables(angles)
        qk, v = _cut(qkv, heads)
        rotated = apply_rotary(qk, cos * mscale, sin * mscale)
        return torch.cat((rotated, v.unsqueeze(0))).permute(1, 3, 0, 2, 4).flatten(2)

    grads = [torch.autograd.grad((fn() * weights).sum(), [qkv, angles]) for fn in (in_place, out_of_place)]
    for grad, ref in zip(*grads, strict=True):
        assert torch.allclose(grad, ref, atol=1e-5)


def test_pair_rotation_rejects_bad_input():
    cos, sin = rotary_tables(torch.randn(2, 5, 4))
    with pytest.raises(ValueError, match="float32"):
        rotate_qkv_pairs_(torch.randn(2, 5, 48, dtype=torch.float64), cos, sin, 2)
    with pytest.raises(ValueError, match="cos and sin"):
        rotate_qkv_pairs_(torch.randn(2, 6, 48), cos, sin, 2)  # 6 tokens, tables for 5
    with pytest.raises(ValueError, match="num_heads"):
        rotate_qkv_pairs_(torch.randn(2, 5, 48), cos, sin, 0)


@pytest.mark.parametrize("name", LINEAR_SCHEMES)
def test_linear_scheme_rotate_qkv_equals_rotate_at_a_larger_grid_with_yarn(name):
    scheme = visionpe.create_pos_embed(name, dim=64, num_heads=2, depth=2, grid_size=(3, 4), extrapolation="yarn")
    tokens = 1 + 30
    qkv = torch.randn(2 * tokens, 3 * 64)

    def run(in_place):
        rotation = scheme.prepare(scheme.coords((5, 6)), 1, grid_size=(5, 6)).layer(1)
        basis = rotation.basis
        x = qkv.clone()
        if basis is not None:  # STRING: P goes into the projection in attention; here onto the q and k columns
            rotation = rotation.without_basis()
            x = x.view(2, tokens, 3, 2, 32)
            x[:, :, :2] = (x[:, :, :2].unsqueeze(-2) @ basis.transpose(-1, -2)).squeeze(-2)
            x = x.view(2 * tokens, -1)
        if in_place:
            out, fused = _fused(rotation, x, 2, 2)
            assert fused
            return out
        qk, v = _cut(x.view(2, tokens, -1), 2)
        return torch.cat((rotation.rotate(qk), v.unsqueeze(0))).permute(1, 3, 0, 2, 4).flatten(2)

    assert torch.allclose(run(True), run(False), atol=1e-5)


@pytest.mark.parametrize("heads_table", [1, 2])
def test_pair_rotation_with_a_table_per_image_equals_apply(heads_table):
    # per-image tables (B, heads | 1, T, head_dim): patch dropout's kept rows, STRING's RGB-D positions
    torch.manual_seed(0)
    batch, tokens, heads = 3, 5, 2
    angles = torch.randn(batch, heads_table, tokens, 8, requires_grad=True)
    qkv = torch.randn(batch * tokens, 3 * heads * 16, requires_grad=True)
    weights = torch.randn(batch, tokens, 3 * heads * 16)

    def in_place():
        cos, sin = rotary_tables(angles)
        return rotate_qkv_pairs_(qkv.clone(), cos, sin, heads).view(batch, tokens, -1)

    def out_of_place():
        cos, sin = rotary_tables(angles)
        qk, v = _cut(qkv.view(batch, tokens, -1), heads)
        return torch.cat((apply_rotary(qk, cos, sin), v.unsqueeze(0))).permute(1, 3, 0, 2, 4).flatten(2)

    assert torch.allclose(in_place(), out_of_place(), atol=1e-6)
    grads = [torch.autograd.grad((fn() * weights).sum(), [qkv, angles]) for fn in (in_place, out_of_place)]
    for grad, ref in zip(*grads, strict=True):
        assert torch.allclose(grad, ref, atol=1e-5)
    cos, sin = rotary_tables(angles.detach())
    with pytest.raises(ValueError, match=r"\(B, num_heads \| 1, T, head_dim\) with B \* T rows"):
        rotate_qkv_pairs_(torch.randn(batch * tokens + 1, 3 * heads * 16), cos, sin, heads)


@pytest.mark.parametrize("name", LINEAR_SCHEMES)
def test_linear_scheme_rotate_qkv_with_kept_tokens_equals_rotate_kept(name):
    torch.manual_seed(0)
    scheme = visionpe.create_pos_embed(name, dim=64, num_heads=2, depth=2, grid_size=(3, 5))
    with torch.no_grad():
        for param in scheme.parameters():
            param.add_(0.1 * torch.randn_like(param))
    keep = random_keep()
    qkv = torch.randn(3 * 8, 3 * 64, requires_grad=True)
    weights = torch.randn(3, 8, 3 * 64)

    def run(in_place):
        rotation = scheme.prepare(scheme.coords((3, 5)), 1).layer(1)
        basis = rotation.basis
        x = qkv.clone()
        if basis is not None:  # STRING: P folded into the projection, as attention does
            rotation = rotation.without_basis()
            x = x.view(3, 8, 3, 2, 32)
            x = torch.cat(((x[:, :, :2].unsqueeze(-2) @ basis.transpose(-1, -2)).squeeze(-2), x[:, :, 2:]), 2)
            x = x.reshape(3 * 8, -1)
        if in_place:
            out, fused = _fused(rotation, x, 3, 2, keep)
            assert fused
            return out
        qk, v = _cut(x.view(3, 8, -1), 2)
        return torch.cat((rotation.rotate_kept(qk, keep), v.unsqueeze(0))).permute(1, 3, 0, 2, 4).flatten(2)

    params = [p for p in scheme.parameters() if p.requires_grad]
    outs, grads = [], []
    for in_place in (True, False):
        out = run(in_place)
        outs.append(out)
        grads.append(torch.autograd.grad((out * weights).sum(), [qkv, *params]))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for grad, ref in zip(*grads, strict=True):
        torch.testing.assert_close(grad, ref, atol=1e-4, rtol=1e-4)
