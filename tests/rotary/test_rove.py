"""Rotary value embeddings (``rotate_values=True``): o_i = R(p_i)^T sum_j a_ij R(p_j) v_j, checked against a dense
computation written here, on every orthogonal rotary scheme that has the option."""

import math

import pytest
import timm
import torch

import visionpe
from visionpe.attention import PosAttention, PositionContext
from visionpe.rotary.base import LinearRotary
from visionpe.rotary.string_base import StringBase

DIM, HEADS, HEAD_DIM = 32, 2, 16
GRID = (3, 5)
# every scheme with the option; ComRoPE's positions are normalised, so its rotations turn less per patch
SCHEMES = {
    "rope_axial": {},
    "rope_mixed": {},
    "rope_learned": {},
    "gridpe": {},
    "string_cayley": {},
    "string_circulant": {},
    "liere": {},
    "comrope_ap": {"rotate_prefix": False},
    "comrope_ld": {},
}
# exactly relative: all but LieRE with blocks larger than 2 x 2 (its generators do not commute)
RELATIVE = {**{n: o for n, o in SCHEMES.items() if n != "liere"}, "liere": {"block_size": 2}}


def _scheme(name, depth=1, **kw):
    torch.manual_seed(0)
    scheme = visionpe.create_pos_embed(name, dim=DIM, num_heads=HEADS, depth=depth, rotate_values=True, **kw)
    with torch.no_grad():  # parameters that start at the identity (Cayley's skew) or at RoPE get other values
        for param in scheme.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return scheme


def _attention(**kw):
    torch.manual_seed(1)
    attn = PosAttention(DIM, num_heads=HEADS, qkv_bias=True, **kw)
    return attn.eval()


def _token_coords(scheme, coords, num_prefix_tokens):
    """Every token's position: the prefix tokens at the scheme's prefix position (ComRoPE's grid centre), else at 0
    (R(0) is what they get: the identity, or STRING's P)."""
    prefix = scheme.prefix_coords(num_prefix_tokens, coords) if hasattr(scheme, "prefix_coords") else None
    if prefix is None:
        prefix = coords.new_zeros(num_prefix_tokens, coords.shape[1])
    return torch.cat((prefix, coords))


def _rotation_matrices(scheme, coords, layer=0):
    """(T, heads, d, d) float64 matrices R(p_t), read off the scheme's own q/k rotation of the unit vectors."""
    eye = torch.eye(HEAD_DIM).repeat(len(coords), 1)  # token (t, c) is e_c at p_t
    rotated = scheme.rotate(eye.expand(1, HEADS, -1, -1), coords.repeat_interleave(HEAD_DIM, 0), layer)
    return rotated[0].unflatten(1, (len(coords), HEAD_DIM)).permute(1, 0, 3, 2).double()  # columns R e_c


def _pair_rotations(freqs, delta):
    """(..., heads, d, d) float64 RoPE matrices R(delta) from (heads | 1, ndim, d / 2) frequencies: pair n turns
    by delta . F[:, n] (interleaved pairs)."""
    angles = (delta.double()[..., None, :, None] * freqs.double()).sum(-2)  # (..., heads | 1, d / 2)
    cos, sin = angles.cos(), angles.sin()
    blocks = torch.stack((torch.stack((cos, -sin), -1), torch.stack((sin, cos), -1)), -2)  # (..., d/2, 2, 2)
    return _block_diag(blocks)


def _block_diag(blocks):
    """(..., m, 2, 2) -> (..., 2m, 2m) block-diagonal matrices."""
    m = blocks.shape[-3]
    out = blocks.new_zeros(*blocks.shape[:-3], 2 * m, 2 * m)
    for n in range(m):
        out[..., 2 * n : 2 * n + 2, 2 * n : 2 * n + 2] = blocks[..., n, :, :]
    return out


def _dense_output(attn, x, relative):
    """Attention's output: sum_j a_ij rel_ij v_j per head with ``relative`` (T, T, heads, d, d) = R(p_i)^T R(p_j),
    logits from q_i^T rel_ij k_j, through the output projection; float64."""
    B, T, _ = x.shape
    q, k, v = attn.qkv(x).view(B, T, 3, HEADS, HEAD_DIM).unbind(2)  # (B, T, heads, d)
    q, k, v = attn.q_norm(q).double(), attn.k_norm(k).double(), v.double()  # (norms act on each head's d)
    logits = torch.einsum("bihd,ijhde,bjhe->bhij", q, relative, k) / math.sqrt(HEAD_DIM)
    alpha = logits.softmax(-1)
    out = torch.einsum("bhij,ijhde,bjhe->bihd", alpha, relative, v)
    return attn.proj(out.reshape(B, T, DIM).float())


def _relative_from_matrices(mats):
    """R(p_i)^T R(p_j) for every pair: (T, T, heads, d, d)."""
    return torch.einsum("ihed,jhef->ijhdf", mats, mats)


@pytest.mark.parametrize("name", SCHEMES)
def test_output_equals_dense_sum_over_rotated_values(name):
    num_prefix_tokens = 1  # a cls token: the identity (ComRoPE-LD: rotated at the grid centre, as its q and k)
    scheme = _scheme(name, **SCHEMES[name])
    attn = _attention()
    coords = scheme.coords(GRID)
    x = torch.randn(2, num_prefix_tokens + len(coords), DIM, requires_grad=True)
    state = scheme.prepare(coords, num_prefix_tokens, GRID)
    out = attn(x, pos=PositionContext(rotary=[state]))
    all_coords = _token_coords(scheme, coords, num_prefix_tokens)
    expected = _dense_output(attn, x, _relative_from_matrices(_rotation_matrices(scheme, all_coords)))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # the backward of attention's in-place q/k rotation and of the value rotations, against the dense form's
    inputs = [x, *(p for p in scheme.parameters() if p.requires_grad)]
    weight = torch.randn_like(out)
    grads = torch.autograd.grad((out * weight).sum(), inputs)
    for got, want in zip(grads, torch.autograd.grad((expected * weight).sum(), inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    if isinstance(scheme, LinearRotary) and not isinstance(scheme, StringBase):
        # the same as sum_j a_ij R(p_j - p_i) v_j with R(delta) built from the frequencies alone
        delta = all_coords[None, :, :] - all_coords[:, None, :]  # (T, T, ndim): p_j - p_i
        relative = _pair_rotations(scheme.frequencies()[0].detach(), delta).expand(-1, -1, HEADS, -1, -1)
        torch.testing.assert_close(out, _dense_output(attn, x, relative).detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["string_cayley", "string_circulant"])
def test_string_with_qk_norm_rotates_values_by_the_unfolded_basis(name):
    # with q/k normalisation attention does not fold P into the projection: the state's own P rotates v
    scheme = _scheme(name)
    attn = _attention(qk_norm=True, norm_layer=torch.nn.LayerNorm)
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)
    coords = scheme.coords(GRID)
    x = torch.randn(2, 1 + len(coords), DIM)
    out = attn(x, pos=PositionContext(rotary=[scheme.prepare(coords, 1, GRID)]))
    # logits: (P q~)^T RoPE(p_j - p_i) (P k~) with q~ the normalised q; values rotated the same way
    mats = _rotation_matrices(scheme, _token_coords(scheme, coords, 1))
    expected = _dense_output(attn, x, _relative_from_matrices(mats))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["rope_mixed", "rope_axial"])
def test_zero_frequencies_give_plain_attention(name):
    scheme = _scheme(name)
    with torch.no_grad():
        scheme.freqs.zero_()
    attn = _attention()
    x = torch.randn(2, 1 + 15, DIM)
    coords = scheme.coords(GRID)
    out = attn(x, pos=PositionContext(rotary=[scheme.prepare(coords, 1, GRID)]))
    torch.testing.assert_close(out, attn(x), rtol=1e-6, atol=1e-6)  # timm's attention, no position
    scheme.rotate_values = False
    torch.testing.assert_close(out, attn(x, pos=PositionContext(rotary=[scheme.prepare(coords, 1, GRID)])))


def test_values_change_the_output_only_with_the_option():
    on, off = _scheme("rope_mixed"), _scheme("rope_mixed")
    off.rotate_values = False
    attn = _attention()
    coords, x = on.coords(GRID), torch.randn(2, 15, DIM)
    out_on = attn(x, pos=PositionContext(rotary=[on.prepare(coords, 0, GRID)]))
    out_off = attn(x, pos=PositionContext(rotary=[off.prepare(coords, 0, GRID)]))
    assert not torch.allclose(out_on, out_off, atol=1e-3)


@pytest.mark.parametrize("name", RELATIVE)
def test_output_is_invariant_to_a_global_shift(name):
    scheme = _scheme(name, **RELATIVE[name])
    attn = _attention()
    coords = scheme.coords(GRID)
    x = torch.randn(2, len(coords), DIM)
    shift = torch.tensor([3.0, -2.0]) * (coords.amax(0) - coords.amin(0) + 1)  # a few grid extents
    out = attn(x, pos=PositionContext(rotary=[scheme.prepare(coords, 0)]))
    moved = attn(x, pos=PositionContext(rotary=[scheme.prepare(coords + shift, 0)]))
    torch.testing.assert_close(moved, out, rtol=1e-4, atol=1e-5)


def test_liere_is_only_approximately_relative():
    # 8 x 8 blocks with two axes: the generators do not commute, so a shift changes the output a little
    scheme = _scheme("liere")
    attn = _attention()
    coords = scheme.coords(GRID)
    x = torch.randn(2, len(coords), DIM)
    out = attn(x, pos=PositionContext(rotary=[scheme.prepare(coords, 0)]))
    moved = attn(x, pos=PositionContext(rotary=[scheme.prepare(coords + torch.tensor([3.0, -2.0]), 0)]))
    assert not torch.allclose(moved, out, atol=1e-5)


def _model(name, **kw):
    torch.manual_seed(0)
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224",
        pos_embed=name,
        pos_embed_kwargs={"rotate_values": True, **SCHEMES.get(name, {})},
        embed_dim=DIM,
        depth=1,
        num_heads=HEADS,
        num_classes=3,
        img_size=(48, 80),
        **kw,
    )
    with torch.no_grad():
        for param in model.pos_schemes.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model


@pytest.mark.parametrize("name", ["rope_mixed", "string_cayley", "liere"])
def test_patch_dropout_equals_the_full_grid_on_the_kept_tokens(name):
    model = _model(name, patch_drop_rate=0.5, reg_tokens=1).train()
    reference = _model(name, reg_tokens=1).train()
    reference.load_state_dict(model.state_dict())
    kept = []
    drop = model.patch_drop.forward
    model.patch_drop.forward = lambda x: (lambda out: kept.append(out[1]) or out)(drop(x))
    x = torch.randn(3, 3, 48, 80)
    torch.manual_seed(5)
    out = model.forward_features(x)
    prefix = model.num_prefix_tokens
    index = torch.cat((torch.arange(prefix).expand(3, -1), kept[0] + prefix), 1)
    # the full grid with the dropped tokens masked out as keys: the kept tokens see what they see under dropout
    visible = torch.zeros(3, prefix + 15, dtype=torch.bool).scatter_(1, index, True)
    full = reference.forward_features(x, attn_mask=visible[:, None, None, :])
    torch.testing.assert_close(out, full.gather(1, index[..., None].expand(-1, -1, DIM)), rtol=1e-5, atol=1e-5)
    out.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.pos_schemes.parameters())


@pytest.mark.parametrize(
    "name,opts",
    [
        ("rope_axial", {}),
        ("gridpe", {}),
        ("string_cayley", {}),
        ("liere", {"block_size": 2}),
        ("comrope_ap", {"pos_norm": "train_grid"}),
    ],
)
def test_yarn_leaves_the_value_rotation_unit(name, opts):
    scheme = _scheme(name, grid_size=GRID, extrapolation="yarn", **opts)
    grid = (6, 10)
    coords = scheme.coords(grid)
    rotation = scheme.prepare(coords, 1, grid).layer(0)
    v = torch.randn(2, HEADS, 1 + len(coords), HEAD_DIM)
    mscale = 0.1 * math.log(2) + 1
    qk = torch.stack((v, v))
    if isinstance(scheme, StringBase):  # the q/k rotation starts with P, which keeps norms
        assert rotation.basis is not None
    # q and k carry YaRN's multiplier, the values and the output do not: rotations keep every token's norm
    torch.testing.assert_close(rotation.rotate(qk).norm(dim=-1), mscale * qk.norm(dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotation.rotate_values(v).norm(dim=-1), v.norm(dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotation.unrotate_output(v).norm(dim=-1), v.norm(dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotation.unrotate_output(rotation.rotate_values(v)), v, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rotation.rotate_values(v), v, atol=1e-3)


def test_fold_string_keeps_outputs_with_rotated_values():
    model = _model("string_cayley").eval()
    x = torch.randn(2, 3, 48, 80)
    with torch.no_grad():
        before = model(x)
        visionpe.fold_string_(model)
        after = model(x)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)


def test_fold_string_refuses_an_output_norm_with_rotated_values():
    model = _model("string_cayley", scale_attn_norm=True)
    weights = model.blocks[0].attn.qkv.weight.clone()
    with pytest.raises(ValueError, match="rotate_values"):
        visionpe.fold_string_(model)
    assert torch.equal(model.blocks[0].attn.qkv.weight, weights)  # nothing folded


@pytest.mark.parametrize("name", ["rope_axial", "string_circulant", "comrope_ld"])
def test_rotate_values_must_be_a_bool(name):
    with pytest.raises(TypeError, match="rotate_values"):
        visionpe.create_pos_embed(name, dim=DIM, num_heads=HEADS, rotate_values="yes")
