"""Patch dropout (timm's ``patch_drop_rate``) with every rotary and bias scheme: positions, rotations and biases are
gathered with the kept indices.

Reference: the same model without patch dropout, on the full grid, with the dropped patches masked out as keys.
Tokens then only see the kept tokens, so the kept tokens' outputs must equal the patch-dropped model's.
"""

import pytest
import timm
import torch

import visionpe  # noqa: F401 - registers the visionpe_vit_* models with timm
from visionpe.rotary.base import LinearRotary

from ..conftest import IN_ATTENTION, PATCH_DROP_DIFFERS, ROTARY, scheme_class
from ..model_checks import random_keep

SMALL = dict(embed_dim=64, depth=2, num_heads=2, num_classes=5, img_size=(48, 80))
# every registered rotary and bias scheme (absolute schemes act before the blocks), and two combinations
SCHEMES = [
    *(
        pytest.param(n, marks=pytest.mark.xfail(reason=PATCH_DROP_DIFFERS[n], strict=True))
        if n in PATCH_DROP_DIFFERS
        else n
        for n in IN_ATTENTION
    ),
    ["learned", "rope_mixed"],
    ["rope_axial", "alibi2d"],
]
# the rotary schemes whose rotation is a cos/sin table per token (LinearRotary): rotate_kept gathers the tables
TABLE_SCHEMES = [n for n in ROTARY if issubclass(scheme_class(n), LinearRotary)]
OPTIONS = {"irpe": {"on": "qkv", "shared_heads": False}}  # the value term too (explicit attention)


def _model(pos_embed, **kw):
    name = pos_embed if isinstance(pos_embed, str) else None
    torch.manual_seed(0)
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224", pos_embed=pos_embed, pos_embed_kwargs=OPTIONS.get(name), **{**SMALL, **kw}
    )
    with torch.no_grad():  # position parameters that start at zero (iRPE tables) or at the identity get values
        for param in model.pos_schemes.parameters():
            param.add_(0.1 * torch.randn_like(param))
    for scheme in model.pos_schemes.values():  # the model and its reference draw no coordinates (rope_dinov3 would)
        if scheme.coord_augment is not None:
            scheme.coord_augment = None
    return model


@pytest.mark.parametrize("pos_embed", SCHEMES, ids=str)
def test_kept_tokens_equal_the_full_grid_with_dropped_keys_masked(pos_embed, reg_tokens=2):
    """The kept tokens (cls and two registers among them, so several prefix tokens) equal the full grid's with the
    dropped keys masked."""
    model = _model(pos_embed, patch_drop_rate=0.5, reg_tokens=reg_tokens).train()
    reference = _model(pos_embed, reg_tokens=reg_tokens).train()
    reference.load_state_dict(model.state_dict())
    kept = []
    drop = model.patch_drop.forward
    model.patch_drop.forward = lambda x: (lambda out: kept.append(out[1]) or out)(drop(x))
    x = torch.randn(3, 3, 48, 80)
    out = model.forward_features(x)
    keep = kept[0]
    prefix = model.num_prefix_tokens
    num_tokens = prefix + 3 * 5
    assert out.shape == (3, prefix + keep.shape[1], 64)  # 15 patches, 7 kept (timm: int(15 * 0.5))
    index = torch.cat((torch.arange(prefix).expand(3, -1), keep + prefix), 1)
    visible = torch.zeros(3, num_tokens, dtype=torch.bool).scatter_(1, index, True)
    mask = visible[:, None, None, :].expand(-1, 1, num_tokens, -1)
    full = reference.forward_features(x, attn_mask=mask)
    expected = full.gather(1, index[..., None].expand(-1, -1, 64))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)

    out.square().mean().backward()
    for name, param in model.pos_schemes.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), f"{pos_embed}: gradient of {name}"
    assert any(p.grad.abs().sum() > 0 for p in model.pos_schemes.parameters() if p.grad is not None) or not list(
        model.pos_schemes.parameters()
    )


@pytest.mark.parametrize("pos_embed", ["liere", "irpe"])
def test_training_step_and_eval_without_dropout(pos_embed):
    model = _model(pos_embed, patch_drop_rate=0.25, dynamic_img_size=True)
    plain = _model(pos_embed, dynamic_img_size=True)
    plain.load_state_dict(model.state_dict())
    logits = model.train()(torch.randn(2, 3, 64, 64))
    assert logits.shape == (2, 5) and torch.isfinite(logits).all()
    logits.logsumexp(1).mean().backward()
    x = torch.randn(2, 3, 48, 80)
    model.eval(), plain.eval()
    with torch.no_grad():  # evaluation keeps every patch: the model is the one without patch dropout
        assert torch.equal(model(x), plain(x))


def test_patch_dropout_still_refused_for_a_conv_between_blocks():
    with pytest.raises(ValueError, match="'cpe' runs after blocks \\(0,\\)"):  # the PEG convolves the whole grid
        _model("cpe", patch_drop_rate=0.5)


@pytest.mark.parametrize("name", TABLE_SCHEMES)
def test_table_schemes_rotate_the_kept_tokens_from_gathered_tables(name):
    # the gathered tables (rotate_kept) against the generic path: rotate on the full sequence, dropped rows zero,
    # and gather back; STRING with its P not folded into the projection (as with qk_norm)
    from visionpe.tokens import gather_tokens, scatter_tokens

    torch.manual_seed(0)
    scheme = visionpe.create_pos_embed(name, dim=64, num_heads=2, depth=2, grid_size=(3, 5))
    with torch.no_grad():
        for param in scheme.parameters():
            param.add_(0.1 * torch.randn_like(param))
    state = scheme.prepare(scheme.coords((3, 5)), num_prefix_tokens=1)
    keep = random_keep()
    qk = torch.randn(2, 3, 2, 8, 32, requires_grad=True)
    for layer in (0, 1):
        fast = state.layer(layer).rotate_kept(qk, keep)
        slow = gather_tokens(scheme.apply(scatter_tokens(qk, keep, 16), state, layer), keep)
        torch.testing.assert_close(fast, slow, atol=1e-6, rtol=1e-5)
        params = [p for p in scheme.parameters() if p.requires_grad]
        grads = torch.autograd.grad(fast.square().sum(), [qk, *params], retain_graph=True)
        ref = torch.autograd.grad(slow.square().sum(), [qk, *params], retain_graph=True)
        for a, b in zip(grads, ref, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)  # sums over tokens in another order
    with pytest.raises(ValueError, match=r"qk must have shape \(\.\.\., B=3, num_heads, K=4, head_dim=32\)"):
        state.layer(0).rotate_kept(qk, keep[:, :4])
    with pytest.raises(ValueError, match=r"keep must be an int64 \(B, K\) index"):
        state.layer(0).rotate_kept(qk, keep.int())
