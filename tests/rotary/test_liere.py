import functools
import itertools
import math

import pytest
import timm
import torch

import visionpe
from visionpe.grid import grid_coords
from visionpe.rotary import expm
from visionpe.rotary.block_rotation import apply_block_rotation
from visionpe.rotary.expm import (
    block_skew_expm,
    block_skew_expm_chunks,
    block_skew_expm_layers,
    linear_skew_expm,
    skew_from_params,
)
from visionpe.rotary.liere import LieRE
from visionpe.rotary.scaling import scale_frequencies, yarn_attention_factor

from ..model_checks import check_forward_backward


def _scores(scheme, coords, q, k):
    return scheme.rotate(q, coords) @ scheme.rotate(k, coords).transpose(-1, -2)


def _relative_error(scheme, coords, shift):
    """max |q.k change under a shift of all coordinates|, relative to max |q.k| (LieRE runs in fp32, as the paper)."""
    q, k = torch.randn(2, 1, scheme.num_heads, len(coords), scheme.head_dim).unbind(0)
    scores = _scores(scheme, coords, q, k)
    return ((scores - _scores(scheme, coords + shift, q, k)).abs().max() / scores.abs().max()).item()


@pytest.mark.parametrize("block_size", [4, 8])
def test_not_relative_for_blocks_of_three_or_more(block_size):
    scheme = LieRE(128, 2, block_size=block_size, init_scale=1.0)
    assert _relative_error(scheme, grid_coords((3, 5)), torch.tensor([2.0, -3.0])) > 1e-3


def test_relative_for_b2_and_for_one_axis():
    scheme = LieRE(128, 2, block_size=2, init_scale=1.0)
    assert _relative_error(scheme, grid_coords((3, 5)), torch.tensor([2.0, -3.0])) < 1e-5
    one_axis = LieRE(128, 2, block_size=8, init_scale=1.0)
    coords = grid_coords((1, 7)) * torch.tensor([0.0, 1.0])  # positions along x only: one generator
    assert _relative_error(one_axis, coords, torch.tensor([0.0, 3.0])) < 1e-5


def test_economized_polynomial_error_on_the_imaginary_segment():
    # the degree-12 polynomial that stands for exp on a scaled skew exponent (eigenvalues i lambda, |lambda| <=
    # _THETA): its largest error there is below the Taylor polynomial's on [-1.5, 1.5], which it replaced with one
    # squaring fewer; it is no longer that good on a segment twice as long
    coeffs = expm._economized_exp(expm._THETA, expm._ORDER)
    assert expm._DEGREE_SCALE == tuple(c * math.factorial(k) for k, c in enumerate(coeffs))

    def error(poly, theta):
        z = 1j * torch.linspace(-theta, theta, 4001, dtype=torch.float64)
        return float((sum(c * z**k for k, c in enumerate(poly)) - z.exp()).abs().max())

    taylor = [1 / math.factorial(k) for k in range(expm._ORDER + 1)]
    assert expm._THETA > 2.5 and error(coeffs, expm._THETA) < min(2.5e-8, error(taylor, 1.5))
    assert error(coeffs, 2 * expm._THETA) > 1e-3


def test_exponential_equals_matrix_exp():
    raw = torch.rand(6, 2, 28) * 2 * math.pi
    gen = skew_from_params(raw, 8)
    coords = grid_coords((4, 6))
    expected = torch.linalg.matrix_exp(torch.einsum("na,gaij->ngij", coords.double(), gen.double()).contiguous())
    assert torch.allclose(linear_skew_expm(gen, coords).double(), expected, atol=1e-5)
    small = linear_skew_expm(gen * 1e-3, coords)  # within the series' range: no squaring
    expected = torch.linalg.matrix_exp(torch.einsum("na,gaij->ngij", coords.double(), 1e-3 * gen.double()).contiguous())
    assert torch.allclose(small.double(), expected, atol=1e-6)


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_word_table_sums_the_words_and_its_gradient_checks(ndim):
    # W_alpha / |alpha|! is the sum of all products of |alpha| letters with letter counts alpha, over |alpha|!:
    # enumerated word by word up to degree 5 (3^5 words for 3 axes), against the table's recursion
    gen = skew_from_params(torch.randn(2, ndim, 3, dtype=torch.float64), 3)
    table = expm._word_table(gen)
    levels, _ = expm._monomials(ndim)
    offset = 0
    for degree, level in enumerate(levels[:6]):
        for i, alpha in enumerate(level):
            words = [
                w
                for w in itertools.product(range(ndim), repeat=degree)
                if all(w.count(a) == n for a, n in enumerate(alpha))
            ]
            total = sum(
                functools.reduce(torch.matmul, [gen[:, a] for a in w], torch.eye(3, dtype=gen.dtype).expand(2, 3, 3))
                for w in words
            )
            torch.testing.assert_close(table[:, offset + i], total / math.factorial(degree), rtol=1e-12, atol=1e-12)
        offset += len(level)
    assert table.shape[1] == sum(len(level) for level in levels) == math.comb(expm._ORDER + ndim, ndim)
    assert torch.autograd.gradcheck(expm._word_table, (gen.clone().requires_grad_(),))


def test_exponential_gradient_equals_matrix_exp_gradient():
    # the word table's, the series' and the squarings' backward together, against autograd through matrix_exp
    raw = (torch.rand(2, 3, 2, 28, dtype=torch.float64) * 2 * math.pi / 5).requires_grad_()
    coords = grid_coords((4, 6)).double()
    weight = torch.randn(2, len(coords), 3, 8, 8, dtype=torch.float64)
    (block_skew_expm(skew_from_params(raw, 8), coords, torch.float64).double() * weight).sum().backward()
    grad, raw.grad = raw.grad, None
    exponent = torch.einsum("na,hmaij->hnmij", coords, skew_from_params(raw, 8)).contiguous()
    (torch.linalg.matrix_exp(exponent) * weight).sum().backward()
    torch.testing.assert_close(grad, raw.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "block_size, expected", [(2, 9216), (4, 27648), (8, 64512), (16, 138240), (32, 285696), (64, 580608)]
)
def test_parameter_count_vit_base(block_size, expected):
    scheme = visionpe.create_pos_embed("liere", dim=768, num_heads=12, depth=12, block_size=block_size)
    assert sum(p.numel() for p in scheme.parameters()) == expected


def test_b2_recovers_rope_mixed_rotation():
    scheme = LieRE(64, 1, block_size=2, init_scale=1.0)
    coords = grid_coords((3, 5))
    x = torch.randn(1, 1, 15, 64)
    gen = scheme.generators(0)[0]  # (blocks, ndim, 2, 2); angle rate of block j on axis a is A[1, 0]
    rates = gen[:, :, 1, 0]  # (32, 2)
    assert torch.allclose(scheme.rotate(x, coords), _rotate_pairs(x, coords @ rates.T), atol=1e-5)


def _rotate_pairs(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Channel pairs (2j, 2j + 1) of ``x`` (..., N, d) turned by ``angle`` (N, d / 2), as RoPE-Mixed turns them."""
    pairs = x.unflatten(-1, (-1, 2))
    cos, sin = angle.cos(), angle.sin()
    return torch.stack(
        (pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 0] * sin + pairs[..., 1] * cos), -1
    ).flatten(-2)


def test_prefix_tokens_not_rotated():
    scheme = LieRE(128, 2, depth=2)
    coords = grid_coords((2, 3))
    qk = torch.randn(2, 1, 2, 8, 64)
    out = scheme.apply(qk, scheme.prepare(coords, num_prefix_tokens=2, grid_size=(2, 3)), layer=1)
    assert torch.equal(out[..., :2, :], qk[..., :2, :])
    assert not torch.allclose(out[..., 2:, :], qk[..., 2:, :])


def test_pi_scales_positions_and_other_modes_are_rejected():
    scheme = LieRE(128, 2, grid_size=(7, 7), extrapolation="pi")
    coords = grid_coords((14, 21))
    state = scheme.prepare(coords, grid_size=(14, 21)).coords
    assert torch.allclose(state, coords / torch.tensor([2.0, 3.0]))
    for mode in ("ntk", "yarn"):  # b = 8: the generators do not commute, there are no frequencies
        with pytest.raises(ValueError, match="supports extrapolation modes"):
            scheme.set_extrapolation(mode)
    with pytest.raises(ValueError, match="8 x 8 blocks has no frequencies to rescale"):
        scheme.scaled_generators(scheme.layer_generators(), (2.0, 3.0))


@pytest.mark.parametrize("mode", ["pi", "ntk", "yarn"])
def test_b2_scales_like_rope_mixed(mode):
    # 2 x 2 blocks are RoPE-Mixed with learned rates: NTK and YaRN rescale them as RoPE-Mixed's frequencies
    scheme = LieRE(64, 1, depth=2, block_size=2, init_scale=1.0, grid_size=(3, 4), extrapolation=mode)
    scheme.set_extrapolation(mode, alpha=0.1, beta=1.0)  # YaRN's ramp inside these rates on a 3 x 4 grid
    grid, factors = (6, 10), (2.0, 2.5)
    coords = grid_coords(grid)
    x = torch.randn(1, 1, 60, 64)
    rates = scheme.generators(1)[0][:, :, 1, 0].T  # (ndim, 32)
    if mode == "pi":
        angle, mscale = (coords / torch.tensor(factors)) @ rates, 1.0
    else:
        angle = coords @ scale_frequencies(rates.detach(), factors, mode, (3, 4), 0.1, 1.0)
        mscale = yarn_attention_factor(factors) if mode == "yarn" else 1.0
    out = scheme.apply(x, scheme.prepare(coords, grid_size=grid), layer=1)
    assert torch.allclose(out, _rotate_pairs(x, angle) * mscale, atol=1e-5)
    if mode != "pi":  # the rule is not PI's
        assert not torch.allclose(angle, (coords / torch.tensor(factors)) @ rates, atol=1e-3)


def test_bad_input():
    with pytest.raises(ValueError, match="block_size must be >= 2 and divide head_dim=64"):
        LieRE(128, 2, block_size=6)
    with pytest.raises(ValueError, match="ndim must be 2 or 3"):
        LieRE(128, 2, ndim=4)
    scheme = LieRE(128, 2)
    with pytest.raises(ValueError, match="2 axes, got coords with 3 axes"):
        scheme.rotate(torch.randn(1, 2, 6, 64), grid_coords((1, 2, 3)))
    with pytest.raises(ValueError, match="supports 2D grids"):
        scheme.coords((2, 3, 4))
    with pytest.raises(ValueError, match="coords has 6 rows"):
        scheme.rotate(torch.randn(1, 2, 5, 64), grid_coords((2, 3)))
    with pytest.raises(ValueError, match="init_scale"):
        LieRE(128, 2, init_scale=float("nan"))


def test_video_3d():
    scheme = LieRE(128, 2, ndim=3)
    out = scheme.rotate(torch.randn(1, 2, 12, 64), grid_coords((2, 2, 3)))
    assert out.shape == (1, 2, 12, 64) and torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["liere"])
@pytest.mark.parametrize("size", [(224, 224), (384, 384), (160, 288)])
def test_model_forward_backward(name, size):
    check_forward_backward(name, size)


def test_block_layout_matches_linear_skew_expm():
    gen = skew_from_params(torch.rand(3, 4, 2, 6), 4)  # (heads, blocks, ndim, b, b)
    coords = grid_coords((3, 4))
    rot = block_skew_expm(gen, coords)
    assert rot.shape == (3, 12, 4, 4, 4) and rot.dtype == torch.float32
    flat = linear_skew_expm(gen.flatten(0, 1), coords)  # (N, heads * blocks, b, b)
    assert torch.allclose(rot, flat.view(12, 3, 4, 4, 4).transpose(0, 1), atol=1e-6)


@pytest.mark.parametrize("prefix", [0, 2])
@pytest.mark.parametrize("heads_rot", [1, 3])
def test_apply_block_rotation_equals_dense_product(prefix, heads_rot):
    heads, tokens, b = 3, 5, 4
    rot = linear_skew_expm(skew_from_params(torch.rand(heads_rot * 8, 1, 6), b), torch.rand(tokens, 1) * 4)
    rot = rot.view(tokens, heads_rot, 8, b, b).transpose(0, 1)  # (heads | 1, N, blocks, b, b)
    qkv = torch.randn(2, tokens + prefix, 3, heads, 32)
    qk = qkv.permute(2, 0, 3, 1, 4)[:2]  # strided (2, B, heads, tokens, head_dim), as attention passes it
    out = apply_block_rotation(qk, rot, prefix)
    full = torch.cat((torch.eye(b).expand(heads_rot, prefix, 8, b, b), rot), dim=1)
    expected = torch.einsum("htkij,sbhtkj->sbhtki", full, qk.unflatten(-1, (8, b))).flatten(-2)
    assert out.shape == qk.shape and torch.allclose(out, expected, atol=1e-5)
    assert torch.equal(out[..., :prefix, :], qk[..., :prefix, :])
    low = apply_block_rotation(qk.bfloat16(), rot, prefix)
    assert low.dtype == torch.bfloat16 and torch.allclose(low.float(), expected, atol=0.1)


@pytest.mark.parametrize("block_size", [2, 8])
@pytest.mark.parametrize("prefix", [0, 1])
def test_chunked_no_grad_apply_equals_whole(monkeypatch, block_size, prefix):
    # without autograd, apply builds and applies the rotations a few tokens at a time: same result as the whole
    scheme = LieRE(128, 2, depth=2, block_size=block_size, init_scale=1.0)
    # fp64 series: in fp32 a chunk's product may round differently from the whole's (its blocking, and the
    # threads' split, depend on the token count) and each squaring doubles that, up to a few 1e-6 here; in fp64
    # only the chunking itself can make the two differ
    scheme.series_dtype = torch.float64
    state = scheme.prepare(grid_coords((5, 7)), num_prefix_tokens=prefix)
    qk = torch.randn(2, 3, 2, prefix + 35, 64)
    whole = apply_block_rotation(qk, scheme.rotations(state.coords, 1), prefix)
    monkeypatch.setattr("visionpe.rotary.lie_base._CHUNK_TOKENS", 8)
    with torch.no_grad():
        chunked = scheme.apply(qk, state, 1)
    assert torch.allclose(chunked, whole, atol=1e-6)
    assert torch.equal(chunked[..., :prefix, :], qk[..., :prefix, :])


def test_block_skew_expm_chunks_equal_slices():
    # the squaring count comes from all tokens, so a chunk equals the slice of the whole even far from the origin
    gen = skew_from_params(torch.rand(2, 3, 2, 28), 8)
    coords = grid_coords((6, 6)) * 3
    whole = block_skew_expm(gen, coords)
    build = block_skew_expm_chunks(gen, coords)
    for start, stop in ((0, 5), (5, 36), (30, 31)):
        assert torch.allclose(build(start, stop), whole[:, start:stop], atol=1e-6)


@pytest.mark.parametrize("prefix", [0, 2])
@pytest.mark.parametrize("heads_rot", [1, 3])
def test_apply_block_rotation_gradients(prefix, heads_rot):
    # the hand-written backward (R^T dY for x, dY X^T for the rotations) against finite differences
    heads, tokens, b = 3, 4, 4
    rot = torch.randn(heads_rot, tokens, 2, b, b, dtype=torch.float64, requires_grad=True)
    qkv = torch.randn(2, tokens + prefix, 3, heads, 2 * b, dtype=torch.float64)
    qk = qkv.permute(2, 0, 3, 1, 4)[:2].detach().requires_grad_()  # strided, as attention passes it
    assert torch.autograd.gradcheck(lambda x, r: apply_block_rotation(x, r, prefix), (qk, rot))


def test_apply_block_rotation_keeps_x_not_a_copy():
    # the backward copies the rotated tokens again: what stays saved is x's own storage (in attention a view of
    # the qkv projection, alive anyway) and the rotations, never a second copy of the tokens
    qkv = torch.randn(2, 7, 3, 3, 8, requires_grad=True)
    qk = qkv.permute(2, 0, 3, 1, 4)[:2]
    rot = torch.linalg.matrix_exp(skew_from_params(torch.randn(3, 6, 2, 6), 4)).requires_grad_()
    saved = []

    def pack(tensor):
        saved.append(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = apply_block_rotation(qk, rot, 1)
    assert set(saved) <= {qkv.untyped_storage().data_ptr(), rot.untyped_storage().data_ptr()}, saved
    out.square().sum().backward()
    assert qkv.grad is not None and rot.grad is not None
    # and the result keeps x's memory order, (B, N, 2, heads, head_dim) for q and k cut from qkv, so that
    # attention's output (and the reshape after it) keeps timm's layout
    assert out.permute(1, 3, 0, 2, 4).is_contiguous()
    assert torch.allclose(
        out[..., 1:, :], (rot @ qk[..., 1:, :].unflatten(-1, (2, 4)).unsqueeze(-1)).squeeze(-1).flatten(-2)
    )


@pytest.mark.parametrize("count", [0, 1, 3])
def test_token_last_squarings_gradients(count):
    rot = torch.randn(2, 2, 3, 3, 5, dtype=torch.float64, requires_grad=True)  # (H, M, b, b, n)
    assert torch.autograd.gradcheck(lambda r: expm._TokenLastSquarings.apply(r, count), (rot,))
    out = expm._TokenLastSquarings.apply(rot, count)
    expected = rot.permute(0, 4, 1, 2, 3)
    for _ in range(count):
        expected = expected @ expected
    assert out.shape == (2, 5, 2, 3, 3) and torch.allclose(out, expected)


@pytest.mark.parametrize("block_size", [4, 8])
def test_token_last_and_bmm_exponentials_agree(monkeypatch, block_size):
    # large stacks square tokens-last, small ones with bmm: same rotations and the same gradients either way
    params = (torch.rand(2, 3, 2, block_size * (block_size - 1) // 2, dtype=torch.float64) * 0.7).requires_grad_()
    coords = grid_coords((4, 5)) * 1.5
    weights = torch.randn(2, 20, 3, block_size, block_size, dtype=torch.float64)
    results = []
    for stack in (0, 10**9):  # everything tokens-last, then everything bmm
        monkeypatch.setattr(expm, "_TOKEN_LAST_MIN_STACK", stack)
        rot = block_skew_expm(skew_from_params(params, block_size), coords, torch.float64)
        results.append((rot, torch.autograd.grad((rot * weights).sum(), params)[0]))
    (fast, grad_fast), (slow, grad_slow) = results
    assert torch.allclose(fast, slow, atol=1e-6) and torch.allclose(grad_fast, grad_slow, rtol=1e-5, atol=1e-6)
    orthogonal = fast.double() @ fast.double().transpose(-1, -2)
    assert torch.allclose(orthogonal, torch.eye(block_size, dtype=torch.float64).expand_as(orthogonal), atol=1e-5)


def test_layer_plan_equals_per_layer_exponentials():
    # word tables and squaring counts set up for all layers at once: each layer as if computed alone, even when
    # the layers need different squaring counts
    gen = skew_from_params(torch.rand(3, 2, 4, 2, 6) * torch.tensor([0.1, 1.0, 4.0]).view(3, 1, 1, 1, 1), 4)
    coords = grid_coords((5, 6))
    build = block_skew_expm_layers(gen, coords, torch.float64)
    for layer in range(3):
        assert torch.allclose(build(layer, 0, 30), block_skew_expm(gen[layer], coords), atol=1e-6)
        assert torch.allclose(build(layer, 7, 19), block_skew_expm(gen[layer], coords)[:, 7:19], atol=1e-6)
    with pytest.raises(ValueError, match=r"generators must have shape \(L, H, M, ndim, b, b\)"):
        block_skew_expm_layers(gen[0], coords)


def test_layer_plan_reads_every_squaring_count_at_once(monkeypatch):
    # one device-to-host read per plan (a GPU waits for its queue at each), with each layer's own count
    gen = skew_from_params(torch.rand(3, 2, 4, 2, 6) * torch.tensor([0.1, 1.0, 4.0]).view(3, 1, 1, 1, 1), 4)
    coords = grid_coords((5, 6))
    reads, counts_of = [], expm._eager_squaring_counts
    monkeypatch.setattr(expm, "_eager_squaring_counts", lambda norm2: reads.append(counts_of(norm2)) or reads[-1])
    build = block_skew_expm_layers(gen, coords, torch.float64)
    for layer in range(3):
        build(layer, 0, 30)
    assert len(reads) == 1 and len(set(reads[0])) == 3, reads  # one read; three different counts
    assert expm._eager_squaring_counts(torch.zeros(2, 0)) == [0, 0]


@pytest.mark.parametrize("name", ["liere", "comrope_ap", "comrope_ld"])
def test_gpu_squaring_path_matches_cpu_path(monkeypatch, name):
    # devices outside _TOKEN_LAST_DEVICES (CUDA) square with one bmm per squaring and rotate with the built
    # rotations; a training step there gives the CPU path's logits and gradients
    torch.manual_seed(0)
    model = timm.create_model(
        "visionpe_vit_small_patch16_224",
        pos_embed=name,
        img_size=64,
        depth=2,
        pos_embed_kwargs={"init_scale": 3.0} if name == "liere" else None,
    )
    images = torch.randn(2, 3, 64, 64)
    monkeypatch.setattr(expm, "_TOKEN_LAST_MIN_STACK", 0)  # this small grid's stacks too
    squared, tokens_last = [], expm._squared
    monkeypatch.setattr(expm, "_squared", lambda rot, count: squared.append(count) or tokens_last(rot, count))
    results = []
    for devices in (("cpu",), ()):
        monkeypatch.setattr(expm, "_TOKEN_LAST_DEVICES", devices)
        squared.clear()
        model.zero_grad()
        logits = model(images)
        logits.square().mean().backward()
        results.append((logits, [p.grad.clone() for p in model.pos_schemes.parameters()]))
        assert (max(squared, default=0) > 0) == bool(devices), squared  # tokens-last squarings on CPU only
    (cpu, cpu_grads), (gpu, gpu_grads) = results
    torch.testing.assert_close(gpu, cpu, rtol=1e-5, atol=1e-5)
    for got, expected in zip(gpu_grads, cpu_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["liere", "comrope_ap", "comrope_ld"])
def test_traced_forms_match_eager(monkeypatch, name):
    # what a compiled graph runs (the squaring count as a tensor, every squaring up to the maximum kept where the
    # count asks for it, no distinct coordinate values, the plain-autograd block product), run eagerly by making
    # the code believe it is compiling: the same logits and gradients, with generators large enough that the
    # layers' counts differ from the initial ones
    torch.manual_seed(0)
    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=name, img_size=48, depth=2)
    with torch.no_grad():
        for param in model.pos_schemes.parameters():
            param.mul_(4.0)
    images = torch.randn(2, 3, 48, 48)
    counts, eager_counts = [], expm._eager_squaring_counts
    monkeypatch.setattr(expm, "_eager_squaring_counts", lambda norm2: counts.append(eager_counts(norm2)) or counts[-1])
    selected, selected_apply = [], expm._SelectedSquarings.apply
    monkeypatch.setattr(
        expm._SelectedSquarings, "apply", lambda *args: selected.append(args[1]) or selected_apply(*args)
    )
    results = []
    for traced in (False, True):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda traced=traced: traced)
        model.zero_grad()
        logits = model(images)
        logits.square().mean().backward()
        results.append((logits, [p.grad.clone() for p in model.pos_schemes.parameters()]))
    assert counts and selected and max(map(max, counts)) == int(max(selected)) > 0, (counts, selected)
    (eager, eager_grads), (traced, traced_grads) = results
    torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-5)
    for got, expected in zip(traced_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_selected_squarings_match_a_python_count():
    # the compiled graph's squarings: R^(2^s) for a tensor count s, forward and gradient as s plain squarings
    rot = torch.linalg.matrix_exp(skew_from_params(torch.randn(5, 6, dtype=torch.float64), 4)).requires_grad_(True)
    weights = torch.randn(5, 4, 4, dtype=torch.float64)
    for count in (0, 1, 3, expm.MAX_COMPILED_SQUARINGS):
        expected = rot
        for _ in range(count):
            expected = expected @ expected
        got = expm._SelectedSquarings.apply(rot, torch.tensor(float(count), dtype=torch.float64))
        torch.testing.assert_close(got, expected)
        (grad,) = torch.autograd.grad((got * weights).sum(), rot)
        (expected_grad,) = torch.autograd.grad((expected * weights).sum(), rot)
        torch.testing.assert_close(grad, expected_grad)


def test_dense_blocks_match_matrix_exp():
    # blocks above the token-last limit (b = 32) square with bmm: the same exp(sum_a p_a A_a) as matrix_exp
    scheme = LieRE(64, 2, block_size=32, init_scale=0.3)
    coords = grid_coords((3, 4))
    x = torch.randn(1, 2, 12, 32)
    gen = scheme.generators(0)  # (heads, 1, ndim, 32, 32)
    exponent = torch.einsum("na,haij->hnij", coords.double(), gen[:, 0].double()).contiguous()
    expected = torch.linalg.matrix_exp(exponent)
    out = scheme.rotate(x, coords)
    assert torch.allclose(out, (expected.float() @ x.unsqueeze(-1)).squeeze(-1), atol=1e-4)
    out.square().sum().backward()
    assert scheme.generator_params.grad.abs().sum() > 0


@pytest.mark.parametrize("block_size", [2, 8])
def test_layer_out_of_range_is_refused_not_clamped(block_size):
    # audit: a layer >= depth silently took the last layer's generators
    scheme = LieRE(64, 2, depth=2, block_size=block_size)
    coords = grid_coords((3, 5))
    state = scheme.prepare(coords, 1)
    qk = torch.randn(2, 1, 2, 16, 32)
    qkv = torch.randn(16, 3 * 64)
    for layer in (2, 5, -1, 1.5, True):
        with pytest.raises(ValueError, match=rf"layer must be an int in \[0, depth=2\) for LieRE, got {layer!r}"):
            scheme.apply(qk, state, layer)
        with torch.no_grad(), pytest.raises(ValueError, match=r"layer must be an int in \[0, depth=2\) for LieRE"):
            scheme.apply(qk, state, layer)
        with pytest.raises(ValueError, match=r"layer must be an int in \[0, depth=2\) for LieRE"):
            state.layer(layer).rotate_qkv(qkv.clone(), 1, 2)
        with pytest.raises(ValueError, match=r"layer must be an int in \[0, depth=2\) for LieRE"):
            scheme.rotations(coords, layer)
    assert scheme.apply(qk, state, 1).shape == qk.shape
