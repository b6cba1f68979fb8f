"""Every (scheme, entry point) pair either works or refuses with the contract's error: no third outcome.

The pairs are generated from the registry (every registered scheme, the throwaway ones of the tests included) and the
registered entry points, so a new scheme or entry point enters with no edit here. For each pair the declared contract
(:func:`visionpe.contract.refusal`) says which outcome to expect, and the test checks that it is the one that happens:

- supported: the model builds, runs forward and backward, and its output depends on where the patches are (permuting
  them changes it by far more than float rounding; ``none`` is checked the other way), or, for a camera scheme, on
  the cameras;
- refused: :class:`~visionpe.contract.UnsupportedSchemeError` naming the scheme, before anything is built.

Causal attention, each extrapolation mode and each backend are checked the same way against what the schemes declare.
"""

from __future__ import annotations

import inspect

import pytest
import timm
import torch
import torch.distributed as dist
from timm.models.vision_transformer import VisionTransformer

import visionpe
from visionpe.base import PositionEncoding
from visionpe.camera import look_at
from visionpe.camera.cameras import Cameras
from visionpe.contract import UnsupportedSchemeError, check_schemes, entry_points, refusal
from visionpe.integrations.timm_swap import SWAP_ENTRY, apply_position_scheme
from visionpe.interfaces.fused_rotary import rotation_tables
from visionpe.models.multiview_vit import MULTIVIEW_CAMERA_ENTRY, MULTIVIEW_ENTRY
from visionpe.models.video_vit import VIDEO_ENTRY
from visionpe.models.vit import VIT_ENTRY
from visionpe.parallel import SEQUENCE_PARALLEL_ENTRY, SequenceParallelViT
from visionpe.registry import get_scheme_class, registered_schemes
from visionpe.rotary.scaling import EXTRAPOLATION_MODES

from .scripts import load_script

try:  # the clip extra: its entry point registers on import
    from visionpe.integrations.open_clip import OPEN_CLIP_ENTRY, register_visionpe_tower
except ImportError:
    OPEN_CLIP_ENTRY = None

SCHEMES = registered_schemes()
# head_dim 48: enough channels for every scheme's defaults (ComRoPE-AP in 3D: 3 blocks of 8; RayRoPE: a multiple of
# 24 for its 3 rays)
SHAPE = dict(embed_dim=96, num_heads=2, depth=2, patch_size=8, num_classes=3)
IMG = 32  # a 4 x 4 grid of 8-pixel patches


def _permute_patches(x: torch.Tensor, perm: torch.Tensor, patch: int = 8) -> torch.Tensor:
    """``x`` (..., C, H, W) with its patches moved: patch ``perm[i]`` goes to position i (row-major)."""
    *lead, c, h, w = x.shape
    gh, gw = h // patch, w // patch
    blocks = x.reshape(*lead, c, gh, patch, gw, patch).movedim(-3, -2).flatten(-4, -3)  # (..., C, gh*gw, p, p)
    blocks = blocks[..., perm, :, :]
    return blocks.unflatten(-3, (gh, gw)).movedim(-3, -2).reshape(x.shape)


def _cameras(views: int = 2, seed: int = 0) -> Cameras:
    g = torch.Generator().manual_seed(seed)
    eyes = torch.randn(1, views, 3, generator=g)
    eyes = 3 * eyes / eyes.norm(dim=-1, keepdim=True)
    k = torch.tensor([[32.0, 0, IMG / 2], [0, 32.0, IMG / 2], [0, 0, 1]]).expand(1, views, 3, 3)
    return Cameras(look_at(eyes, torch.zeros(1, views, 3)), k, (IMG, IMG))


class Case:
    """A model built through one entry point, the inputs it takes and how they vary."""

    def __init__(self, model: torch.nn.Module, inputs: dict, kind: str = "image") -> None:
        self.model, self.inputs, self.kind = model, inputs, kind

    def __call__(self, **overrides) -> torch.Tensor:
        """The model's normalised tokens (B, T, C)."""
        inputs = {**self.inputs, **overrides}
        x = inputs.pop("x")
        return self.model.forward_features(x, **inputs)

    def moved(self, num_tokens: int) -> tuple[dict, torch.Tensor]:
        """Inputs with the positions changed (patches permuted, or the views' cameras exchanged), and for each token
        of their output the token of the original output that holds the same content (the prefix tokens and every
        grid of 16 patches (a view, a tubelet step) permuted alike)."""
        if self.kind == "cameras":
            cams = self.inputs["cameras"]
            return {"cameras": Cameras(cams.w2c.flip(1), cams.intrinsics, cams.image_size)}, torch.arange(num_tokens)
        perm = torch.randperm(16, generator=torch.Generator().manual_seed(1))
        prefix = num_tokens % 16
        grids = torch.arange(prefix, num_tokens).view(-1, 16)[:, perm].flatten()
        return {"x": _permute_patches(self.inputs["x"], perm)}, torch.cat((torch.arange(prefix), grids))


def _depth(views: int | None = None) -> torch.Tensor:
    shape = (1, IMG, IMG) if views is None else (1, views, IMG, IMG)
    return 2 + torch.rand(shape, generator=torch.Generator().manual_seed(2))


def _image_case(model: torch.nn.Module) -> Case:
    inputs = {"x": torch.randn(1, 3, IMG, IMG)}
    if getattr(model, "takes_depth", False):
        inputs["depth"] = _depth()
    return Case(model, inputs)


def build_vit(name: str) -> Case:
    return _image_case(timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=name, img_size=IMG, **SHAPE))


def build_video(name: str) -> Case:
    model = timm.create_model(
        "visionpe_video_vit_tiny_tubelet2x16", pos_embed=name, img_size=IMG, num_frames=4, **SHAPE
    )
    return Case(model, {"x": torch.randn(1, 3, 4, IMG, IMG)}, kind="video")


def build_mvvit(name: str) -> Case:
    model = timm.create_model("visionpe_mvvit_tiny_patch16", pos_embed=name, img_size=IMG, **SHAPE)
    return Case(model, {"x": torch.randn(1, 2, 3, IMG, IMG), "cameras": _cameras()})


def build_mvvit_camera(name: str) -> Case:
    model = timm.create_model("visionpe_mvvit_tiny_patch16", camera_embed=name, img_size=IMG, **SHAPE)
    inputs = {"x": torch.randn(1, 2, 3, IMG, IMG), "cameras": _cameras()}
    if any("patch_depth" in s.extra_inputs for s in model.camera_schemes.values()):
        inputs["depth"] = _depth(views=2)
    return Case(model, inputs, kind="cameras")


def build_swap(name: str) -> Case:
    model = VisionTransformer(img_size=IMG, **SHAPE)
    apply_position_scheme(model, name)
    return _image_case(model)


def build_classifier(name: str) -> Case:
    from visionpe.training import Classifier

    model_kwargs = {k: v for k, v in SHAPE.items() if k != "num_classes"} | {"img_size": IMG}
    module = Classifier(model_name="vit_tiny_patch16_224", pos_embed=name, model_kwargs=model_kwargs, num_classes=3)
    return _image_case(module.model)


def build_open_clip(name: str) -> Case:
    shape = {k: v for k, v in SHAPE.items() if k != "num_classes"}
    tower = register_visionpe_tower(f"contract_tower_{name}", pos_embed=name, img_size=IMG, **shape)
    return _image_case(timm.create_model(tower, num_classes=3))


def build_sequence_parallel(name: str) -> Case:
    # one rank of a one-process group (the _one_rank_group fixture): the sharded attention's whole code path; a
    # register token makes 18 tokens, which zig-zag cuts into 2 chunks
    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=name, img_size=IMG, reg_tokens=1, **SHAPE)
    return Case(SequenceParallelViT(model, mode="ring", layout="zigzag"), {"x": torch.randn(1, 3, IMG, IMG)})


# entry point -> (its declaration, the builder); the Classifier reaches the swap with a timm model name
BUILDERS = {
    "vit": (VIT_ENTRY, build_vit),
    "video": (VIDEO_ENTRY, build_video),
    "mvvit": (MULTIVIEW_ENTRY, build_mvvit),
    "mvvit_camera": (MULTIVIEW_CAMERA_ENTRY, build_mvvit_camera),
    "swap": (SWAP_ENTRY, build_swap),
    "classifier": (SWAP_ENTRY, build_classifier),
    "sequence_parallel": (SEQUENCE_PARALLEL_ENTRY, build_sequence_parallel),
}
if OPEN_CLIP_ENTRY is not None:
    BUILDERS["open_clip"] = (OPEN_CLIP_ENTRY, build_open_clip)


@pytest.fixture(autouse=True)
def _one_rank_group(request):
    """A gloo process group of one rank around each test of the sequence-parallel entry point (torch.distributed's
    default group is process-wide state: it is torn down after the test)."""
    params = getattr(request.node, "callspec", None)
    if params is None or params.params.get("entry") != "sequence_parallel" or dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_every_registered_entry_point_is_exercised():
    assert {(e.name, e.argument) for e in entry_points()} == {(e.name, e.argument) for e, _ in BUILDERS.values()}


def _position_change(case: Case) -> float:
    """How much the output moves with the positions: without position information, each token of the moved
    input's output equals the original output's token of that content (normalised tokens: entries of order 1, float
    rounding about 1e-6)."""
    case.model.eval()
    with torch.no_grad():
        out = case()
        inputs, index = case.moved(out.shape[1])
        moved = case(**inputs)
    assert torch.isfinite(out).all() and torch.isfinite(moved).all()
    return (out[:, index] - moved).abs().max().item()


def _assert_position_sensitive(case: Case, name: str) -> None:
    change = _position_change(case)
    if name == "none":
        assert change < 1e-5, f"'none' depends on patch positions (change {change})"
        return
    if change <= 1e-4:
        # schemes whose position parameters start at zero or near it (iRPE's relative tables, as its paper
        # initialises them; SeqPE's small encoder) are position-blind at init by design: they must become
        # position-sensitive once those parameters move, as in training
        schemes = [m for m in case.model.modules() if isinstance(m, PositionEncoding)]
        with torch.no_grad():
            for param in (p for s in schemes for p in s.parameters() if p.is_floating_point()):
                param.add_(0.5 * torch.randn_like(param))
        change = _position_change(case)
    assert change > 1e-4, f"{name!r} ignores positions: output change {change}"


@pytest.mark.parametrize("entry", sorted(BUILDERS))
@pytest.mark.parametrize("name", SCHEMES)
def test_pair_works_or_refuses(name, entry):
    declared, build = BUILDERS[entry]
    # camera_embed="none" is the multi-view model's baseline without cameras (as camera_embed=None)
    reason = None if (entry, name) == ("mvvit_camera", "none") else refusal(declared, name)
    torch.manual_seed(0)
    if reason is not None:
        with pytest.raises(UnsupportedSchemeError, match=repr(name)):
            build(name)
        return
    case = build(name)
    case.model.train()
    out = case()
    assert torch.isfinite(out).all()
    out.mean(1).square().mean().backward()
    grads = [p.grad for p in case.model.parameters() if p.requires_grad]
    assert all(g is None or torch.isfinite(g).all() for g in grads) and any(g is not None for g in grads)
    _assert_position_sensitive(case, name)


# the sequence-parallel forward takes no explicit mask: tests/distributed compares its causal attention with the
# unsharded model's, scheme by scheme
@pytest.mark.parametrize("entry", [e for e in sorted(BUILDERS) if BUILDERS[e][0].causal and e != "sequence_parallel"])
@pytest.mark.parametrize("name", SCHEMES)
def test_causal_attention_is_causal_or_refused(name, entry):
    declared, build = BUILDERS[entry]
    if refusal(declared, name) is not None:
        return  # the pair itself is refused: test_pair_works_or_refuses checks it
    case = build(name)
    model = case.model.eval()
    x = case.inputs["x"]
    extra = {k: v for k, v in case.inputs.items() if k != "x"}
    if not get_scheme_class(name).supports_causal:
        with pytest.raises(UnsupportedSchemeError, match=repr(name)):
            model.forward_features(x, is_causal=True, **extra)
        return
    with torch.no_grad():
        tokens = model.forward_features(x, is_causal=True, **extra)
        n = tokens.shape[1]
        explicit = torch.ones(n, n, dtype=torch.bool).tril()
        masked = model.forward_features(x, attn_mask=explicit, **extra)
        # the last patch changed: every earlier token is unchanged
        later = x.clone()
        if case.kind == "video":  # the last tubelet's last patch: the last token
            later[..., -1, -8:, -8:] += 1.0
        else:
            later[..., -8:, -8:] += 1.0
        changed = model.forward_features(later, is_causal=True, **extra)
    torch.testing.assert_close(tokens, masked, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(changed[:, : n - 1], tokens[:, : n - 1], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(changed[:, -1], tokens[:, -1])


def test_causal_attention_on_an_entry_point_without_it_is_refused():
    declared = MULTIVIEW_ENTRY
    assert not declared.causal
    from visionpe.contract import check_causal

    with pytest.raises(UnsupportedSchemeError, match="no causal attention"):
        check_causal(declared, {})


@pytest.mark.parametrize("name", [n for n in SCHEMES if refusal(VIT_ENTRY, n) is None])
def test_extrapolation_modes_work_or_refuse(name):
    """Each mode either switches the model (which then runs at twice the grid, still position-sensitive) or raises
    the contract's error; nothing in between (a mode a scheme would ignore)."""
    case = build_vit(name)
    model = case.model
    model.set_input_size(img_size=2 * IMG)  # a 4 x 4 training grid, run at 8 x 8
    scheme = model.pos_schemes[name]
    supported = tuple(getattr(scheme, "supported_extrapolation", ()))
    x = torch.randn(1, 3, 2 * IMG, 2 * IMG)
    for mode in EXTRAPOLATION_MODES:
        try:
            visionpe.set_extrapolation(model, mode, train_grid_size=IMG // 8)
        except UnsupportedSchemeError as err:
            assert mode not in supported or "train_grid" in str(err) or "pos_norm" in str(err), (mode, str(err))
            continue
        assert mode in supported, f"{name!r} accepted extrapolation={mode!r} it does not declare"
        assert scheme.extrapolation == mode
        case.inputs = {"x": x}
        with torch.no_grad():
            assert torch.isfinite(model.eval()(x)).all()


def test_extrapolation_options_the_mode_does_not_read_are_refused():
    model = build_vit("rope_axial").model
    with pytest.raises(UnsupportedSchemeError, match="alpha applies to extrapolation='yarn' only"):
        visionpe.set_extrapolation(model, "pi", alpha=0.5)
    with pytest.raises(UnsupportedSchemeError, match="riflex_k applies to extrapolation='riflex' only"):
        visionpe.set_extrapolation(model, "yarn", riflex_k=2)
    assert model.pos_schemes.rope_axial.extrapolation == "none"  # nothing switched
    visionpe.set_extrapolation(model, "yarn", alpha=0.5, beta=16, train_grid_size=4)  # an int: every axis
    assert model.pos_schemes.rope_axial.train_grid_size == (4, 4)
    with pytest.raises(UnsupportedSchemeError, match="no rotary scheme"):
        visionpe.set_extrapolation(build_vit("alibi2d").model, "pi")


def _fuses_rotation(model: torch.nn.Module) -> bool:
    ctx = model.position_context((4, 4), torch.device("cpu"))
    rotation = ctx.rotation(0)
    if rotation.basis is not None:
        rotation = rotation.without_basis()
    return bool(ctx.rotary) and rotation_tables(rotation, None) is not None


def _fuses_bias(model: torch.nn.Module) -> bool:
    ctx = model.position_context((4, 4), torch.device("cpu"))
    q = torch.randn(1, 2, 17, 48)
    return bool(ctx.bias) and all(s.fused_bias(q, q, state, 0) is not None for s, state in ctx.bias)


@pytest.mark.parametrize("name", [n for n in SCHEMES if refusal(VIT_ENTRY, n) is None])
def test_backends_act_where_declared_and_refuse_elsewhere(name):
    """A scheme declares the non-default backends that act on it, checked against what it builds: cos/sin tables
    for the fused rotary kernel, per-offset terms for FlexAttention. Switching a model to a backend that acts on
    none of its schemes raises."""
    model = build_vit(name).model
    cls = get_scheme_class(name)
    assert ("fused" in cls.rotary_backends) == _fuses_rotation(model)
    assert ("flex" in cls.attention_backends) == _fuses_bias(model)
    for setter, backend, capability in (
        (visionpe.set_rotary_backend, "fused", "rotary_backends"),
        (visionpe.set_attention_backend, "flex", "attention_backends"),
    ):
        if backend in getattr(cls, capability):
            setter(model, backend)
        else:
            with pytest.raises(UnsupportedSchemeError, match="would change nothing"):
                setter(model, backend)
    visionpe.set_rotary_backend(model, "eager")  # the defaults always apply
    visionpe.set_attention_backend(model, "sdpa")


@pytest.mark.parametrize("name", SCHEMES)
def test_declared_grid_ranks_build(name):
    """``grid_ranks`` is what the class builds for: each declared rank builds a scheme that takes that grid."""
    cls = get_scheme_class(name)
    assert cls.grid_ranks and set(cls.grid_ranks) <= {2, 3}
    takes_ndim = "ndim" in inspect.signature(cls.__init__).parameters
    for rank in cls.grid_ranks:
        options = {"ndim": rank} if takes_ndim else {}
        if issubclass(cls, PositionEncoding) and cls.kind == "camera":
            continue  # camera schemes take the 2D grid of each view; the multi-view model checks them
        scheme = visionpe.create_pos_embed(name, dim=96, num_heads=2, depth=1, **options)
        scheme.check_grid((2,) * rank)


def test_unknown_names_list_only_what_the_entry_point_takes():
    with pytest.raises(ValueError, match="unknown position scheme 'nope'") as err:
        check_schemes(MULTIVIEW_CAMERA_ENTRY, ["nope"])
    listed = str(err.value).split("valid names: ")[1].split(", ")
    assert listed == visionpe.list_schemes("camera")
    with pytest.raises(ValueError) as err:
        timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="nope")
    listed = str(err.value).split("valid names: ")[1].split(", ")
    assert "gta" not in listed and "rope_axial" in listed


def test_camera_scheme_on_an_image_model_names_where_it_works():
    """Without cameras a camera scheme adds no position at all: the image models refuse it and say where it works."""
    with pytest.raises(UnsupportedSchemeError, match=r"'gta' needs cameras.*visionpe_mvvit_\*.*camera_embed"):
        timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="gta", img_size=64)


def test_the_compatibility_page_shows_the_generated_table():
    script = load_script("scripts/compatibility_table.py")
    page = script.PAGE.read_text()
    assert script.render(page) == page, "docs/compatibility.md is out of date: python scripts/compatibility_table.py"
    own = [n for n in SCHEMES if get_scheme_class(n).__module__.startswith("visionpe.")]
    assert own and all(f"| `{name}` |" in page for name in own)
