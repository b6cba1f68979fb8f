"""Meta-device initialisation of every scheme: built on ``torch.device("meta")``, materialised with ``to_empty``, a
scheme holds the fixed tables of one built on the CPU, computes the same output from the same parameters, and keeps
its tables in the dtype they are computed in under a blanket ``model.to(torch.bfloat16)``.

The buffers are filled with NaN (or a wrong flag or index) after ``to_empty`` before each initialisation path runs, so
that a table left uninitialised fails whatever the allocator happened to hand back."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.models._manipulate import reinit_non_persistent_buffers

import visionpe
from visionpe.camera import Cameras, look_at
from visionpe.registry import get_scheme_class

SCHEMES = visionpe.list_schemes() + visionpe.list_schemes("camera")
IMAGE = (16, 24)  # a non-square 2 x 3 grid
TINY = dict(img_size=IMAGE, patch_size=8, depth=2, num_heads=2, num_classes=3)


def _cameras(batch: int = 2, views: int = 2) -> Cameras:
    g = torch.Generator().manual_seed(0)
    eyes = torch.randn(batch, views, 3, generator=g)
    eyes = 3 * eyes / eyes.norm(dim=-1, keepdim=True)
    k = torch.tensor([[16.0, 0, IMAGE[1] / 2], [0, 16.0, IMAGE[0] / 2], [0, 0, 1]]).expand(batch, views, 3, 3)
    return Cameras(look_at(eyes, torch.zeros(batch, views, 3)), k, IMAGE)


def _build(name: str, device: str) -> torch.nn.Module:
    opts = dict(getattr(get_scheme_class(name), "deterministic_options", None) or {})
    with torch.device(device):
        if get_scheme_class(name).kind == "camera":  # head_dim 24: RayRoPE's block of 2 * (3 + 3 * 3) channels
            return timm.create_model(
                "visionpe_mvvit_tiny_patch16", camera_embed=name, camera_embed_kwargs=opts, embed_dim=48, **TINY
            )
        return timm.create_model(
            "visionpe_vit_tiny_patch16_224", pos_embed=name, pos_embed_kwargs=opts, embed_dim=32, **TINY
        )


def _inputs(name: str) -> tuple:
    g = torch.Generator().manual_seed(1)
    if get_scheme_class(name).kind == "camera":
        return torch.randn(2, 2, 3, *IMAGE, generator=g), _cameras()
    return (torch.randn(2, 3, *IMAGE, generator=g),)


def _schemes(model: torch.nn.Module) -> dict[str, visionpe.PositionEncoding]:
    return {n: m for n, m in model.named_modules() if isinstance(m, visionpe.PositionEncoding)}


def _spoil(model: torch.nn.Module) -> None:
    """What uninitialised memory may hold: NaN, a set flag, a wrong index."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
            elif tensor.dtype == torch.bool:
                tensor.fill_(True)
            else:
                tensor.fill_(7)


def _assert_buffers_equal(model: torch.nn.Module, reference: torch.nn.Module, persistent: bool = True) -> None:
    ours, theirs = dict(model.named_buffers()), dict(reference.named_buffers())
    assert ours.keys() == theirs.keys()
    keys = set(reference.state_dict())
    for key, value in theirs.items():
        if persistent or key not in keys:
            assert ours[key].dtype == value.dtype, key
            torch.testing.assert_close(ours[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("name", SCHEMES)
def test_meta_built_scheme_equals_the_cpu_built_one(name):
    torch.manual_seed(0)
    reference = _build(name, "cpu").eval()
    model = _build(name, "meta")
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    for scheme in _schemes(model).values():  # the one rule: every buffer a scheme registers is a fixed table it names
        assert set(scheme._buffers) - {k for k, v in scheme._buffers.items() if v is None} <= set(
            scheme.fixed_buffers()
        ), f"{type(scheme).__name__} registers buffers that fixed_buffers() does not compute"

    # to_empty alone: the non-persistent tables are rebuilt on the move
    model.to_empty(device="cpu")
    _assert_buffers_equal(model, reference, persistent=False)

    # timm's hook restores the non-persistent ones; reset_parameters every buffer and the parameters
    _spoil(model)
    reinit_non_persistent_buffers(model)
    _assert_buffers_equal(model, reference, persistent=False)
    _spoil(model)
    for scheme in _schemes(model).values():
        torch.manual_seed(1)
        scheme.reset_parameters()
        args, kwargs = scheme._init_arguments
        torch.manual_seed(1)
        fresh = type(scheme)(*args, **kwargs)  # the constructor's draws under the same seed
        for key, value in fresh.state_dict().items():
            torch.testing.assert_close(scheme.state_dict()[key], value, rtol=0, atol=0, msg=key)
    _assert_buffers_equal(model, reference)

    # the same parameters give the same output
    model.load_state_dict(reference.state_dict())
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(*_inputs(name)), reference(*_inputs(name)), rtol=0, atol=0)


@pytest.mark.parametrize("name", SCHEMES)
def test_timm_init_path_after_to_empty_gives_a_finite_model(name):
    """timm's ``init_weights`` (what a meta-built timm model is initialised with) reaches every scheme's
    ``reset_parameters``: nothing uninitialised is left in the position schemes."""
    model = _build(name, "meta")
    model.to_empty(device="cpu")
    _spoil(model)
    model.init_weights()
    for key, tensor in _schemes(model).items():
        for sub, value in [*tensor.named_parameters(), *tensor.named_buffers()]:
            if value.is_floating_point():
                assert torch.isfinite(value).all(), f"{key}.{sub}"
    with torch.no_grad():
        assert torch.isfinite(model.eval()(*_inputs(name))).all()


@pytest.mark.parametrize("name", SCHEMES)
def test_tables_keep_their_dtype_under_a_blanket_bf16_move(name):
    reference = _build(name, "cpu")
    model = _build(name, "cpu").to(torch.bfloat16)
    keys = set(reference.state_dict())
    for key, value in reference.named_buffers():
        if key not in keys and value.is_floating_point():
            assert dict(model.named_buffers())[key].dtype == value.dtype, key
            torch.testing.assert_close(dict(model.named_buffers())[key], value, rtol=0, atol=0)
    double = _build(name, "cpu").double()  # a wider cast keeps the computed values
    for key, value in reference.named_buffers():
        if key not in keys and value.is_floating_point():
            assert dict(double.named_buffers())[key].dtype == torch.float64, key
            torch.testing.assert_close(dict(double.named_buffers())[key], value.double(), rtol=0, atol=0)


def test_reset_parameters_refuses_a_parameter_reshaped_since_construction():
    scheme = visionpe.create_pos_embed("learned", dim=32, num_heads=2, grid_size=(2, 3))
    scheme.set_grid_size((3, 3))
    with pytest.raises(RuntimeError, match="pos_embed.*load its values from a state dict"):
        scheme.reset_parameters()


def test_fixed_buffers_naming_an_unregistered_buffer_raises():
    class Broken(visionpe.create_pos_embed("rope_axial", dim=32, num_heads=2).__class__):
        def fixed_buffers(self):
            return {**super().fixed_buffers(), "missing": torch.zeros(1)}

    with pytest.raises(RuntimeError, match="missing.*not buffers the scheme registered"):
        Broken(dim=32, num_heads=2).init_non_persistent_buffers()


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("visionpe_vit_tiny_patch16_224", {"pos_embed": ["learned", "rope_mixed"], "reg_tokens": 2}),
        ("visionpe_video_vit_tiny_tubelet2x16", {"pos_embed": "rope_axial"}),
        ("visionpe_mvvit_tiny_patch16", {"pos_embed": "rope_axial", "camera_embed": "gta"}),
    ],
)
def test_lightnings_meta_device_materialisation_leaves_no_module_uninitialised(name, kwargs):
    # what Lightning's ModelParallelStrategy / FSDPStrategy do to a model built on the meta device: to_empty, then
    # reset_parameters on every module holding tensors, warning about those without one
    import warnings

    from lightning.fabric.utilities.init import _materialize_distributed_module

    with torch.device("meta"):
        model = timm.create_model(name, depth=1, embed_dim=32, num_heads=2, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _materialize_distributed_module(model, torch.device("cpu"))
    incomplete = [str(w.message) for w in caught if "initialization incomplete" in str(w.message)]
    assert not incomplete, incomplete
    for param_name, param in model.named_parameters():
        assert torch.isfinite(param).all(), param_name
    for token in (model.cls_token, getattr(model, "reg_token", None)):
        if token is not None:  # timm's init: N(0, 1e-6^2)
            assert 0 < token.abs().max() < 1e-4
