"""Bias schemes on FlexAttention: per-offset terms equal the dense bias, and the fused path equals SDPA's."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn.functional as F

import visionpe
from visionpe.attention import PositionContext, flex_attention_available
from visionpe.bias.offsets import OffsetBias, offset_score_mod

from ..conftest import BIAS, takes_option

pytestmark = pytest.mark.skipif(not flex_attention_available(), reason="this PyTorch has no FlexAttention")

GRID, PREFIX, HEADS, DIM = (3, 5), 1, 4, 32
# iRPE's other modes and targets: the query-side term reads the transposed offset, cross sums two lookups
IRPE_VARIANTS = [
    dict(method="product", mode="contextual", on="qk"),
    dict(method="cross", mode="bias", on="qk"),
    dict(method="euclidean", mode="contextual", on="k"),
]
CASES = [(name, {}) for name in BIAS] + [("irpe", options) for options in IRPE_VARIANTS]


def _scheme(name: str, options: dict):
    torch.manual_seed(0)
    extra = {"grid_size": GRID} if takes_option(name, "grid_size") else {}
    scheme = visionpe.create_pos_embed(name, dim=DIM, num_heads=HEADS, depth=2, **extra, **options)
    with torch.no_grad():  # every learned table and kernel away from its init
        for param in scheme.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return scheme.eval()


def _qk(batch: int = 2):
    n = PREFIX + GRID[0] * GRID[1]
    q, k, v = (torch.randn(batch, HEADS, n, DIM // HEADS) for _ in range(3))
    return q, k, v


def _dense(scheme, q, k, state, layer):
    tokens = torch.randn(q.shape[0], q.shape[2], DIM) if scheme.needs_tokens else None
    if scheme.augments_qk:
        return None
    return scheme.attn_bias(q, k, state, layer, **({"tokens": tokens} if scheme.needs_tokens else {}))


@pytest.mark.parametrize("name, options", CASES, ids=[f"{n}-{'-'.join(map(str, o.values()))}" for n, o in CASES])
def test_fused_terms_add_up_to_the_dense_bias(name, options):
    scheme = _scheme(name, options)
    state = scheme.prepare(GRID, PREFIX)
    q, k, _ = _qk()
    terms = scheme.fused_bias(q, k, state, layer=1)
    if terms is None:  # the dense path serves this scheme: it must not claim per-offset terms it cannot give
        # the dense path serves this scheme: it must not declare FlexAttention, which would then change nothing
        assert "flex" not in scheme.attention_backends, f"{name} declares FlexAttention but gives no per-offset terms"
        return
    assert "flex" in scheme.attention_backends, f"{name} gives per-offset terms but does not declare FlexAttention"
    fused = sum(term.dense() for term in terms)
    torch.testing.assert_close(fused.expand(2, HEADS, -1, -1), _dense(scheme, q, k, state, 1).expand(2, HEADS, -1, -1))


def _reference_score_mod_attention(q, k, v, score_mod, scale):
    """Attention with ``score_mod`` evaluated pair by pair in Python: the meaning of FlexAttention's argument."""
    b, h, n, _ = q.shape
    scores = (q @ k.transpose(-2, -1)) * scale
    idx = torch.arange(n)
    out = torch.empty_like(scores)
    for bi in range(b):
        for hi in range(h):
            out[bi, hi] = score_mod(scores[bi, hi], torch.tensor(bi), torch.tensor(hi), idx[:, None], idx[None, :])
    return out.softmax(-1) @ v


@pytest.mark.parametrize("name, options", [("irpe", IRPE_VARIANTS[0]), ("lookhere", {}), ("kerple_power", {})])
def test_score_mod_reads_the_same_values_as_the_dense_bias(name, options):
    scheme = _scheme(name, options)
    state = scheme.prepare(GRID, PREFIX)
    q, k, v = _qk()
    terms = scheme.fused_bias(q, k, state, layer=0)
    scale = (DIM // HEADS) ** -0.5
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=_dense(scheme, q, k, state, 0), scale=scale)
    got = _reference_score_mod_attention(q, k, v, offset_score_mod(terms), scale)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_flex_backend_model_equals_sdpa_at_a_non_square_size():
    """The compiled kernel inside a model (inference on the CPU; LookHere's -inf outside a head's view included)."""
    torch.manual_seed(0)
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224",
        pos_embed="lookhere",
        depth=1,
        embed_dim=32,
        num_heads=8,
        num_classes=3,
        img_size=(24, 40),
        patch_size=8,
    ).eval()
    x = torch.randn(2, 3, 24, 40)
    with torch.no_grad():
        expected = model(x)
        visionpe.set_attention_backend(model, "flex")
        got = model(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_flex_backend_falls_back_where_the_kernel_cannot_run():
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224", pos_embed="alibi2d", depth=1, embed_dim=32, num_heads=2, img_size=32
    )
    attn = visionpe.set_attention_backend(model, "flex").blocks[0].attn
    q, k = torch.randn(1, 2, 17, 16), torch.randn(1, 2, 17, 16)
    alibi = visionpe.create_pos_embed("alibi2d", dim=32, num_heads=2)
    state = alibi.prepare((4, 4), 1)
    pos = PositionContext(bias=[(alibi, state)])
    assert attn._fused_terms(q, k, pos, None, False, False) is not None
    assert attn._fused_terms(q, k, pos, torch.ones(17, 17, dtype=torch.bool), False, False) is None  # a mask
    assert attn._fused_terms(q, k, pos, None, True, False) is None  # causal
    assert attn._fused_terms(q, k, pos, None, False, True) is None  # dynamic-size export
    grad_q = q.clone().requires_grad_()
    assert attn._fused_terms(grad_q, k, pos, None, False, False) is None  # no CPU backward
    with torch.no_grad():
        assert attn._fused_terms(grad_q, k, pos, None, False, False) is not None
    pos.keep = torch.arange(17)[None]
    assert attn._fused_terms(q, k, pos, None, False, False) is None  # patch dropout
    fire = visionpe.create_pos_embed("fire", dim=32, num_heads=2, grid_size=(4, 4))
    pos = PositionContext(bias=[(fire, fire.prepare((4, 4), 1))])
    assert attn._fused_terms(q, k, pos, None, False, False) is None  # not a function of the offset
    visionpe.set_attention_backend(model, "sdpa")
    assert attn._fused_terms(q, k, PositionContext(bias=[(alibi, state)]), None, False, False) is None


def test_set_attention_backend_rejects_bad_input():
    with pytest.raises(ValueError, match="backend"):
        visionpe.set_attention_backend(torch.nn.Linear(2, 2), "triton")
    with pytest.raises(TypeError, match="model"):
        visionpe.set_attention_backend("vit", "flex")


def test_offset_score_mod_refuses_terms_on_different_grids():
    a = visionpe.create_pos_embed("alibi2d", dim=32, num_heads=2)
    q = torch.randn(1, 2, 5, 16)
    first = a.fused_bias(q, q, a.prepare((2, 2), 1), 0)
    second = a.fused_bias(q, q, a.prepare((1, 4), 1), 0)
    with pytest.raises(ValueError, match="one grid"):
        offset_score_mod(first + second)
    with pytest.raises(ValueError, match="at least one"):
        offset_score_mod([])
    assert isinstance(first[0], OffsetBias)
