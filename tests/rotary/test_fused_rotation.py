"""The fused rotary path (``set_rotary_backend(model, "fused")``, :mod:`visionpe.interfaces.fused_rotary`): q and k
of the projection output rotated by one compiled kernel equal the eager reference to the rounding of the activations'
dtype, in the forward and in every gradient (q/k/v and the learned frequencies), with a class token, with patch
dropout's kept tokens, and in a whole ViT; a model compiled with ``torch.compile`` keeps one graph.

Every test compiles on the CPU (inductor's C++ kernels) with tiny shapes; ``torch._dynamo.reset()`` around each keeps
the compile caches of different tests apart, as in ``tests/reliability/test_compile.py``.
"""

import re

import pytest
import timm
import torch
from torch._inductor.utils import run_and_get_code

import visionpe
from visionpe.interfaces.fused_rotary import fused_rotate_qkv, rotate_qkv_tables, rotation_tables
from visionpe.interfaces.rotary import ChainedRotation, IdentityRotation, LayerRotation
from visionpe.rotary.functional import apply_rotary

SCHEMES = ["rope_axial", "rope_mixed", "string_cayley", "string_circulant"]
# bf16: the eager path rounds the cast tables, both products and their sum, the fused one the result only
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
HEADS, HEAD_DIM, GRID, BATCH = 2, 16, (3, 4), 2
TOKENS = 1 + GRID[0] * GRID[1]  # a class token and the grid


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _scheme(name):
    scheme = visionpe.create_pos_embed(name, dim=HEADS * HEAD_DIM, num_heads=HEADS, depth=2)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # away from the init (identity STRING bases): every parameter matters
        for param in scheme.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    return scheme


def _rotation(scheme):
    """Block 1's rotation of q and k as attention applies it: STRING's basis P folded into the projection."""
    state = scheme.prepare(scheme.coords(GRID), 1, grid_size=GRID)
    return state.layer(1).without_basis()


def _run(rotate, scheme, qkv, weights):
    """q, k, v of ``rotate(qkv)`` and the gradients of a weighted sum: qkv's, then every learned parameter's."""
    leaf = qkv.detach().clone().requires_grad_(True)
    q, k, v = rotate(leaf * 1)  # the eager fp32 path rotates its input in place: not a leaf
    loss = sum((x.float() * w).sum() for x, w in zip((q, k, v), weights, strict=True))
    params = [p for p in scheme.parameters() if p.requires_grad]
    return (q, k, v), torch.autograd.grad(loss, [leaf, *params], allow_unused=True)


def _assert_close(fused, eager, tol):
    for got, want in zip(fused, eager, strict=True):
        if want is None:
            assert got is None
            continue
        assert got.dtype == want.dtype and got.shape == want.shape
        # the frequencies' gradients sum products over every token: their rounding scales with their largest entry
        atol = tol["atol"] * max(1.0, want.abs().max().item())
        torch.testing.assert_close(got.float(), want.float(), rtol=tol["rtol"], atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", SCHEMES)
def test_fused_equals_eager_forward_and_gradients(name, dtype):
    scheme = _scheme(name)
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(BATCH * TOKENS, 3 * HEADS * HEAD_DIM, generator=gen).to(dtype)
    weights = [torch.randn(BATCH, HEADS, TOKENS, HEAD_DIM, generator=gen) for _ in range(3)]
    # tables built inside each call, so that the frequencies' gradients flow through them
    fused_out, fused_grads = _run(lambda x: fused_rotate_qkv(_rotation(scheme), x, HEADS), scheme, qkv, weights)
    eager_out, eager_grads = _run(lambda x: _rotation(scheme).rotate_qkv(x, BATCH, HEADS), scheme, qkv, weights)
    _assert_close(fused_out, eager_out, TOL[dtype])
    assert fused_grads[0].dtype == dtype
    _assert_close(fused_grads, eager_grads, TOL[dtype])
    assert any(g is not None for g in fused_grads[1:]) == (name != "rope_axial")  # learned frequencies
    # the class token (row 0 of each image) is not rotated: its q and k are the projection's
    heads = qkv.view(BATCH, TOKENS, 3, HEADS, HEAD_DIM)
    torch.testing.assert_close(fused_out[0][:, :, 0].float(), heads[:, 0, 0].float(), **TOL[dtype])


def test_fused_rotates_patch_dropouts_kept_tokens():
    scheme = _scheme("string_cayley")
    gen = torch.Generator().manual_seed(2)
    keep = torch.stack([torch.cat((torch.zeros(1, dtype=torch.long), torch.randperm(12, generator=gen)[:5] + 1))
                        for _ in range(BATCH)])  # fmt: skip
    qkv = torch.randn(BATCH * keep.shape[1], 3 * HEADS * HEAD_DIM, generator=gen, dtype=torch.bfloat16)
    weights = [torch.randn(BATCH, HEADS, keep.shape[1], HEAD_DIM, generator=gen) for _ in range(3)]
    fused = _run(lambda x: fused_rotate_qkv(_rotation(scheme), x, HEADS, keep), scheme, qkv, weights)
    eager = _run(lambda x: _rotation(scheme).rotate_qkv(x, BATCH, HEADS, keep), scheme, qkv, weights)
    for got, want in zip(fused, eager, strict=True):
        _assert_close(got, want, TOL[torch.bfloat16])


def test_q_k_and_v_come_from_one_kernel():
    rotation = _rotation(_scheme("rope_mixed"))
    qkv = torch.randn(BATCH * TOKENS, 3 * HEADS * HEAD_DIM)
    with torch.no_grad():
        out, codes = run_and_get_code(fused_rotate_qkv, rotation, qkv, HEADS)
    calls = re.findall(r"^\s+(cpp_fused_\w+)\(", "\n".join(codes), flags=re.MULTILINE)
    assert len(calls) == 1, calls
    _assert_close(out, rotation.rotate_qkv(qkv.clone(), BATCH, HEADS), TOL[torch.float32])


class _OwnTables(LayerRotation):
    """A rotation written outside the library (not a TableRotation) that opts into the fused kernel."""

    def __init__(self, cos, sin):
        self.cos, self.sin, self.num_tokens = cos, sin, cos.shape[-2]

    def rotate(self, qk):
        return apply_rotary(qk, self.cos, self.sin)

    def fused_tables(self, keep=None):
        return (self.cos, self.sin) if keep is None else None


def test_a_custom_rotation_opts_in_by_returning_its_tables():
    table = _rotation(_scheme("rope_mixed"))
    rotation = _OwnTables(table.cos, table.sin)
    qkv = torch.randn(BATCH * TOKENS, 3 * HEADS * HEAD_DIM)
    with torch.no_grad():
        out, codes = run_and_get_code(fused_rotate_qkv, rotation, qkv, HEADS)
    assert len(re.findall(r"^\s+(cpp_fused_\w+)\(", "\n".join(codes), flags=re.MULTILINE)) == 1
    _assert_close(out, rotation.rotate_qkv(qkv.clone(), BATCH, HEADS), TOL[torch.float32])
    keep = torch.arange(3).expand(BATCH, -1)
    assert fused_rotate_qkv(rotation, qkv[: BATCH * 3].contiguous(), HEADS, keep) is None  # None: the eager path


def test_rotations_without_tables_fall_back():
    rotation = _rotation(_scheme("rope_axial"))
    qkv = torch.randn(BATCH * TOKENS, 3 * HEADS * HEAD_DIM)
    assert rotation_tables(IdentityRotation()) is None
    assert fused_rotate_qkv(ChainedRotation([rotation, rotation]), qkv, HEADS) is None
    assert fused_rotate_qkv(rotation, qkv.t().contiguous().t(), HEADS) is None  # not contiguous
    # STRING before its basis is folded: P is still to apply, so there are no tables to fuse
    assert rotation_tables(_scheme("string_cayley").prepare(_scheme("string_cayley").coords(GRID), 1).layer(0)) is None
    cos, sin = rotation_tables(rotation)
    assert cos.shape == (1, TOKENS, HEAD_DIM) and sin.shape == cos.shape


def _tiny_vit(name, **kwargs):
    torch.manual_seed(0)
    args = dict(depth=2, embed_dim=32, num_heads=2, num_classes=3, img_size=32, patch_size=8, reg_tokens=1)
    return timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=name, **{**args, **kwargs})


def test_whole_vit_fused_equals_eager():
    # Circulant-STRING: learned frequencies, and a basis folded into the projection for each forward
    eager = _tiny_vit("string_circulant", patch_drop_rate=0.25)
    fused = visionpe.set_rotary_backend(_tiny_vit("string_circulant", patch_drop_rate=0.25), "fused")
    fused.load_state_dict(eager.state_dict())
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # eval: every token
        torch.testing.assert_close(fused.eval()(images), eager.eval()(images), **TOL[torch.float32])
    grads = []
    for model in (fused, eager):  # training: the same patches dropped by the same seed
        torch.manual_seed(4)
        model.train()(images).square().sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for key, grad in grads[1].items():
        torch.testing.assert_close(grads[0][key], grad, rtol=1e-4, atol=1e-5, msg=key)


def test_fused_model_compiles_to_one_graph():
    model = visionpe.set_rotary_backend(_tiny_vit("string_cayley"), "fused").eval()
    images = torch.randn(2, 3, 32, 32)
    explanation = torch._dynamo.explain(model)(images)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons


def test_backend_switch_validates_and_sets_every_attention():
    model = _tiny_vit("rope_axial")
    attentions = [m for m in model.modules() if isinstance(m, visionpe.PosAttention)]
    assert [m.rotary_backend for m in attentions] == ["eager"] * 2  # the default
    assert visionpe.set_rotary_backend(model, "fused") is model
    assert [m.rotary_backend for m in attentions] == ["fused"] * 2
    visionpe.set_rotary_backend(model, "eager")
    assert [m.rotary_backend for m in attentions] == ["eager"] * 2
    with pytest.raises(ValueError, match=r"backend must be one of \('eager', 'fused'\), got 'triton'"):
        visionpe.set_rotary_backend(model, "triton")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        visionpe.set_rotary_backend("model", "fused")
    with pytest.raises(TypeError, match="rotation must be a LayerRotation, got Tensor"):
        rotation_tables(torch.zeros(1))
    qkv, cos = torch.zeros(TOKENS, 96), torch.zeros(1, TOKENS, HEAD_DIM)
    with pytest.raises(ValueError, match=r"qkv must be a contiguous .* num_heads=5 .* got shape \(13, 96\)"):
        rotate_qkv_tables(qkv, cos, cos, 5)
    with pytest.raises(ValueError, match=r"cos and sin must have shape .* got \(1, 13, 8\) and \(1, 13, 8\)"):
        rotate_qkv_tables(qkv, cos[..., :8], cos[..., :8], HEADS)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        rotate_qkv_tables(qkv, cos, cos, 0)
