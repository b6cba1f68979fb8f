"""Query-chunked attention (large N with bias schemes, when autograd does not record it) equals the one-piece
computation, forward and backward."""

import pytest
import timm
import torch

import visionpe  # noqa: F401  (registers the models)
from visionpe.attention import PosAttention

CASES = [
    ("irpe", {}),
    ("irpe", {"on": "qkv", "method": "cross"}),  # value term: the explicit attention path
    ("irpe", {"mode": "bias", "on": "qk", "method": "euclidean"}),
    ("lookhere", {"variant": "45"}),
    ("alibi2d", {}),
    (["rope_mixed", "alibi2d"], {}),
]


def _loss_and_grads(model, images):
    model.zero_grad(set_to_none=True)
    out = model(images)
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _attend_rows(monkeypatch) -> list[int]:
    """Query rows of every ``PosAttention._attend`` call from now on (one call per chunk)."""
    rows, attend = [], PosAttention._attend

    def spy(self, q, *args, **kwargs):
        rows.append(q.shape[-2])
        return attend(self, q, *args, **kwargs)

    monkeypatch.setattr(PosAttention, "_attend", spy)
    return rows


@pytest.mark.parametrize("name, kwargs", CASES)
def test_chunked_attention_equals_unchunked(name, kwargs, monkeypatch):
    torch.manual_seed(0)
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224", pos_embed=name, pos_embed_kwargs=kwargs, depth=1, dynamic_img_size=True
    )
    for key, param in model.named_parameters():
        # what q and k are projected from is frozen: they need no gradient (unless a learned rotation turns them);
        # the bias tables and what follows attention do
        param.requires_grad_(not key.startswith(("patch_embed.", "cls_token", "blocks.0.norm1.", "blocks.0.attn.qkv.")))
    for scheme in model.pos_schemes.values():
        for param in scheme.parameters():
            torch.nn.init.normal_(param, std=0.2)  # position tables start at zero: make them matter
    images = torch.randn(2, 3, 64, 80)  # 4 x 5 patches + cls = 21 tokens
    full, full_grads = _loss_and_grads(model, images)

    # chunks of 2 rows: the last chunk is partial, and the first holds the cls row and a patch row
    rows = 2
    monkeypatch.setattr(PosAttention, "bias_chunk_bytes", rows * 2 * model.blocks[0].attn.num_heads * 21 * 4)
    assert model.blocks[0].attn.query_chunk_rows(2, 21) == rows
    for scheme in model.pos_schemes.values():
        if hasattr(scheme, "full_state_max_tokens"):
            monkeypatch.setattr(scheme, "full_state_max_tokens", 0)  # build rows from coordinates, as at 1024 px
    calls = _attend_rows(monkeypatch)
    chunked, chunked_grads = _loss_and_grads(model, images)
    # a bias of the positions only is one (1, heads, rows, N) block for the batch: chunks of twice the rows
    shared = all(scheme.batch_shared_bias for scheme in model.pos_schemes.values() if scheme.kind == "bias")
    expected = [4] * 5 + [1] if shared else [2] * 10 + [1]
    # RoPE-Mixed's learned frequencies give the rotated q and k a gradient: a recorded attention, one piece
    assert calls == ([21] if "rope_mixed" in name else expected)
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)
    assert chunked_grads.keys() == full_grads.keys()
    for key, grad in full_grads.items():
        torch.testing.assert_close(chunked_grads[key], grad, atol=1e-5, rtol=1e-4, msg=key)

    calls.clear()
    with torch.no_grad():  # inference: chunked for every scheme
        torch.testing.assert_close(model(images), full, atol=1e-5, rtol=1e-5)
    assert calls == expected


def test_recorded_attention_runs_in_one_piece(monkeypatch):
    # when autograd records the attention, each chunk's bias is kept for the backward anyway: chunks would keep
    # what the full bias does and only multiply the kernels
    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="alibi2d", depth=2, img_size=32)
    monkeypatch.setattr(PosAttention, "bias_chunk_bytes", 1)  # a chunk per query row, where chunks are taken
    calls = _attend_rows(monkeypatch)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert calls == [5, 5]  # 4 patches + cls, one piece per block
    calls.clear()
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    assert calls == [1] * 10


def test_small_attention_is_not_chunked():
    attn = timm.create_model("visionpe_vit_small_patch16_224", pos_embed="irpe", depth=1).blocks[0].attn
    assert attn.query_chunk_rows(8, 197) >= 197  # 224 px, batch 8: one piece, no speed cost
    assert attn.query_chunk_rows(1, 4097) < 4097  # 1024 px: chunked


@pytest.mark.parametrize("name, kwargs", [*CASES, ("rope_axial", {}), ("liere", {}), ("learned", {})])
def test_boolean_mask_is_a_mask_not_a_bias(name, kwargs):
    """A boolean attn_mask (SDPA's convention, True: may attend) means what it means for timm's Attention: keys
    it masks get no weight, whatever bias or rotary scheme runs; the same as the 0 / -inf float mask."""
    torch.manual_seed(0)
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224", pos_embed=name, pos_embed_kwargs=kwargs, depth=2, dynamic_img_size=True
    ).eval()
    images = torch.randn(2, 3, 64, 80)  # 4 x 5 patches + cls = 21 tokens
    allowed = torch.ones(21, 21, dtype=torch.bool)
    allowed[:, 16:] = False  # the last patch row is hidden from every query
    additive = torch.zeros(21, 21).masked_fill(~allowed, float("-inf"))
    with torch.no_grad():
        boolean = model.forward_features(images, attn_mask=allowed)
        reference = model.forward_features(images, attn_mask=additive)
        unmasked = model.forward_features(images)
    torch.testing.assert_close(boolean, reference, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(boolean[:, :16], unmasked[:, :16], atol=1e-3)  # the mask does change the output
