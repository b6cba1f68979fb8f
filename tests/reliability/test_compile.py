"""torch.compile (default backend, inductor on CPU): every scheme and the multimodal rotary match eager to 1e-4 in
forward and gradients, a training step (new parameter values) reuses the graph, and a new input size runs on the
same dynamic-shape graph or recompiles cleanly instead of failing.

Each test compiles the smallest call that exercises the scheme (one scheme's prepare + apply, or one attention),
forward and backward; the model test compiles a one-block ViT. ``torch._dynamo.reset()`` before every test keeps
the compile caches of different schemes apart (a shared cache would fall back to eager after 8 entries).
"""

from contextlib import contextmanager
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import visionpe
from visionpe.multimodal import MultimodalRotary, apply_multimodal_rotary, get_position_ids
from visionpe.rotary import expm

from ..conftest import FAMILY_REPRESENTATIVES, RECOMPILE_PER_GRID
from .helpers import LIE, perturb_, tiny_vit

# One graph with dynamic shapes (torch.compile(dynamic=True)) runs all three grids of a scheme; a parameter update
# (a training step) reuses it too (LieRE and ComRoPE included: their squaring count is computed in the graph). The
# schemes of RECOMPILE_PER_GRID (tests/conftest.py, with the reasons) recompile cleanly for every new grid instead.
# ALiBi shares LookHere's per-offset code: one size keeps the suite short.
SIZES = [(3, 4), (4, 6), (5, 3)]
ONE_SIZE = {"alibi2d"}
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _scheme_call(name):
    """(scheme, fn(x, grid) -> tensor, input factory): one scheme's own computation, as the model runs it."""
    kwargs = {"grid_size": (4, 4)} if name == "learned" else {}  # learned: other grids resample the table
    scheme = perturb_(visionpe.create_pos_embed(name, dim=32, num_heads=2, depth=2, **kwargs))
    if scheme.kind == "rotary":

        def fn(qk, grid):
            return scheme.apply(qk, scheme.prepare(scheme.coords(grid, qk.device), 1, grid_size=grid), 1)

        return scheme, fn, lambda grid: torch.randn(2, 2, 2, 1 + grid[0] * grid[1], 16)
    if scheme.kind == "bias":

        def fn(q, grid):
            state = scheme.prepare(grid, 1, q.device)
            # biases read from the block's tokens (B, N, C) get q's channels as tokens
            tokens = {"tokens": q.transpose(1, 2).flatten(2)} if scheme.needs_tokens else {}
            if scheme.augments_qk:  # the bias as extra q/k channels, at the scale of the original heads
                q_aug, k_aug = scheme.augment_qk(q, q, state, 1, **tokens)
                return F.scaled_dot_product_attention(q_aug, k_aug, q, scale=q.shape[-1] ** -0.5)
            bias = scheme.attn_bias(q, q, state, 1, **tokens)
            return F.scaled_dot_product_attention(q, q, q, attn_mask=bias.to(q.dtype))

        return scheme, fn, lambda grid: torch.randn(2, 2, 1 + grid[0] * grid[1], 16)

    if "pixels" in getattr(scheme, "requires", ()):  # an encoding that reads the image (LOOPE): one image per grid
        (ph, pw), images = scheme.patch_size, {}

        def fn(x, grid):
            if grid not in images:
                generator = torch.Generator().manual_seed(grid[0] * 100 + grid[1])
                images[grid] = torch.randn(2, scheme.in_chans, grid[0] * ph, grid[1] * pw, generator=generator)
            return scheme(x, grid, 1, pixels=images[grid])

        return scheme, fn, lambda grid: torch.randn(2, 1 + grid[0] * grid[1], 32)

    def fn(x, grid):
        return scheme(x, grid, 1)

    return scheme, fn, lambda grid: torch.randn(2, 1 + grid[0] * grid[1], 32)


def _forward_backward(fn, module, x, *args):
    """Output and gradients (input first, then every trainable parameter of ``module``) of a weighted sum."""
    x = x.clone().requires_grad_(True)
    out = fn(x, *args)
    weights = torch.linspace(-1, 1, out.numel()).view(out.shape)
    params = [p for p in module.parameters() if p.requires_grad]
    return out, torch.autograd.grad((out * weights).sum(), [x, *params])


def _check_compiled_matches_eager(fn, module, make_input, sizes, recompile: tuple[bool, ...]):
    """Compiled (dynamic shapes) == eager, forward and every gradient, at each size; ``recompile[i]``: whether call
    i may compile a new graph (else the stance fails on any recompile). Returns the compiled function."""
    compiled = torch.compile(fn, dynamic=True)
    for i, size in enumerate(sizes):
        x = make_input(size)
        ref, ref_grads = _forward_backward(fn, module, x, size)
        with torch.compiler.set_stance("default" if recompile[i] else "fail_on_recompile"):
            out, grads = _forward_backward(compiled, module, x, size)
        torch.testing.assert_close(out, ref, **TOL, msg=lambda m, s=size: f"forward at {s}: {m}")
        for j, (got, want) in enumerate(zip(grads, ref_grads, strict=True)):
            torch.testing.assert_close(got, want, **TOL, msg=lambda m, s=size, j=j: f"gradient {j} at {s}: {m}")
    return compiled


@contextmanager
def _squaring_counts():
    """The squaring counts of the eager matrix exponentials (LieRE, ComRoPE) computed inside the block, in a list."""
    counts, eager_counts = [], expm._eager_squaring_counts
    with mock.patch.object(expm, "_eager_squaring_counts", lambda n2: counts.append(eager_counts(n2)) or counts[-1]):
        yield counts


def _check_more_squarings_reuse_the_graph(scheme, fn, compiled, make_input, size, counts):
    """Generators 6 times larger need more squarings than ``counts`` saw: the compiled graph computes the count when
    it runs, so it is reused (no recompile) and still matches eager, forward and gradients."""
    before = max(max(c) for c in counts)
    with torch.no_grad():
        for param in scheme.parameters():
            param.mul_(6.0)
    counts.clear()
    x = make_input(size)
    ref, ref_grads = _forward_backward(fn, scheme, x, size)
    assert max(max(c) for c in counts) > before, f"scaling the generators did not change the count: {before}"
    with torch.compiler.set_stance("fail_on_recompile"):
        out, grads = _forward_backward(compiled, scheme, x, size)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(grads, ref_grads, **TOL)


@pytest.mark.parametrize("name", FAMILY_REPRESENTATIVES)
def test_scheme_compiles_and_matches_eager(name):
    """One scheme per implementation family (tests/conftest.py): what compiles is the family's code. For LieRE and
    ComRoPE the graph is then reused with generators that need more squarings."""
    torch.manual_seed(0)
    scheme, fn, make_input = _scheme_call(name)
    dynamic = name not in RECOMPILE_PER_GRID
    sizes = SIZES[:1] if name in ONE_SIZE else SIZES if dynamic else SIZES[:2]
    with _squaring_counts() as counts:
        compiled = _check_compiled_matches_eager(fn, scheme, make_input, sizes, (True, not dynamic, not dynamic))
        if name != "none":  # "none" adds nothing, so there is no graph
            assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled (eager fallback)"
        # a training step changes the parameters, not the graph
        perturb_(scheme, scale=0.05, seed=1)
        x, size = make_input(sizes[-1]), sizes[-1]
        with torch.compiler.set_stance("fail_on_recompile"):
            out, grads = _forward_backward(compiled, scheme, x, size)
        ref, ref_grads = _forward_backward(fn, scheme, x, size)
        torch.testing.assert_close(out, ref, **TOL)
        torch.testing.assert_close(grads, ref_grads, **TOL)
        if name in LIE:
            _check_more_squarings_reuse_the_graph(scheme, fn, compiled, make_input, size, counts)


def test_model_compiles_and_recompiles_for_new_image_sizes():
    """A one-block ViT with a learned table (resampled eagerly, behind a graph break) and RoPE-Mixed: any batch size
    runs on the first graph, and new image sizes, non-square included, keep compiling and matching eager (timm's
    PatchEmbed fixes H and W in its graph, so a new size recompiles part of the model)."""
    torch.manual_seed(0)
    model = perturb_(tiny_vit(["learned", "rope_mixed"], dynamic_img_size=True))

    def fn(images, size):
        return model(images)

    calls = [(4, 32, 48), (6, 32, 48), (4, 48, 40), (6, 40, 56)]  # (batch, H, W); batch 3 would merge with C = 3
    make_input = lambda s: torch.randn(s[0], 3, *s[1:])  # noqa: E731
    _check_compiled_matches_eager(fn, model, make_input, calls, recompile=(True, False, True, True))
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled (eager fallback)"


@pytest.mark.parametrize(
    "scheme, kwargs",
    [
        ("mrope", {"mrope_section": (2, 3, 3)}),
        ("mrope_interleaved", {"mrope_section": (4, 2, 2)}),
        ("v2pe", {}),
        ("mhrope", {"num_kv_heads": 2}),
    ],
    ids=["chunked", "interleaved", "float_ids", "per_head"],
)
def test_multimodal_rotary_compiles_and_matches_eager(scheme, kwargs):
    """Ids -> cos/sin -> rotated q and k, for integer and float (V2PE) ids and per-head tables (MHRoPE)."""
    torch.manual_seed(0)
    rotary = MultimodalRotary.from_scheme(scheme, 16, base=1e4, **kwargs)
    q_weight = torch.randn(4, 16, 16)

    def fn(q, pos):
        cos, sin = rotary(pos)
        rq, rk = apply_multimodal_rotary(q, q[:, ::2] @ q_weight[:2], cos, sin)
        return torch.cat([rq, rk], dim=1)

    def make_input(image_hw):
        h, w = image_hw
        types = torch.tensor([[0, 0] + [1] * (h * w) + [0, 0, 0]])
        pos, _ = get_position_ids(scheme, types, torch.tensor([[1, 2 * h, 2 * w]]))
        return torch.randn(1, 4, types.shape[1], 16), pos

    compiled = torch.compile(fn, dynamic=True)
    for i, image_hw in enumerate([(2, 3), (3, 4), (4, 2)]):
        q, pos = make_input(image_hw)
        ref, (ref_grad,) = _forward_backward(fn, torch.nn.Module(), q, pos)
        with torch.compiler.set_stance("default" if i == 0 else "fail_on_recompile"):
            out, (grad,) = _forward_backward(compiled, torch.nn.Module(), q, pos)
        torch.testing.assert_close(out, ref, **TOL)
        torch.testing.assert_close(grad, ref_grad, **TOL)
    assert counters["stats"]["unique_graphs"] >= 1


# the LieRE and ComRoPE schemes that are not their family's representative (whose test above does the same)
@pytest.mark.parametrize("name", [n for n in LIE if n not in FAMILY_REPRESENTATIVES])
def test_lie_exponentials_follow_the_weights_on_one_graph(name):
    """LieRE's and ComRoPE's squaring count is set by the generators' norms: the compiled graph computes it when it
    runs (every possible squaring, kept where the count asks for it), so weights that change the count reuse the
    graph and still match eager, forward and gradients. ComRoPE-LD is checked here: compiled, it takes every token's
    exponential in one series (no distinct values), a form the family test (ComRoPE-AP) does not run."""
    torch.manual_seed(0)
    scheme, fn, make_input = _scheme_call(name)
    size = SIZES[1]
    with _squaring_counts() as counts:
        compiled = _check_compiled_matches_eager(fn, scheme, make_input, [size], recompile=(True,))
        _check_more_squarings_reuse_the_graph(scheme, fn, compiled, make_input, size, counts)


@pytest.mark.parametrize("name", visionpe.list_schemes())
def test_whole_model_compiles_without_graph_breaks(name):
    # torch._dynamo.explain traces the whole model's forward as torch.compile does (without inductor's code
    # generation): the position code must not split the graph, or CUDA graphs and max-autotune lose the model
    model = perturb_(tiny_vit(name, depth=2)).eval()
    explanation = torch._dynamo.explain(model)(torch.randn(2, 3, 32, 32))
    assert explanation.graph_break_count == 0, [str(reason.reason)[:200] for reason in explanation.break_reasons]
