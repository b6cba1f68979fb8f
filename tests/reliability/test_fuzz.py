"""Hostile-input fuzzing of the public surface (hypothesis): random constructor arguments and random inputs for every
model entry point (the timm ViTs, the video ViT, the multi-view ViT with its cameras, ``apply_position_scheme`` on
timm's ViT, Eva and NaFlexVit, the Lightning ``Classifier`` and the open_clip tower).

Each draw either runs, and then a finite input gives a finite output, or raises ValueError or TypeError whose message
names an argument of the call (a keyword, a scheme name or option, ``x``...): never IndexError, ZeroDivisionError,
AssertionError, KeyError, a RuntimeError from inside torch, nor a NaN that the input did not hold. Pixel values are
not checked for NaN or inf (docs/reliability.md, "Not guaranteed"): an input that holds them may run and give NaN.

Scheme names are drawn from the registry (``visionpe.list_schemes()`` and ``visionpe.list_schemes("camera")``), so a
new scheme is fuzzed without editing this file. Each test runs ``VISIONPE_FUZZ_EXAMPLES`` examples (default 25, the
whole file in well under a minute on one core), derandomized so that CI draws the same examples on every run; a
nightly run sets a larger budget.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import math
import os
import re
from dataclasses import dataclass

import numpy as np
import pytest
import timm
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from timm.models.eva import Eva
from timm.models.vision_transformer import VisionTransformer

import visionpe
from visionpe.camera import Cameras, look_at
from visionpe.integrations.timm import apply_position_scheme
from visionpe.registry import get_scheme_class

EXAMPLES = int(os.environ.get("VISIONPE_FUZZ_EXAMPLES", "25"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

SCHEMES = visionpe.list_schemes()
CAMERA_SCHEMES = visionpe.list_schemes("camera")
NAN, INF = float("nan"), float("inf")

# values that are wrong for most arguments: zero, negative, fractional, non-finite, bool, None, strings, bad tuples
HOSTILE = st.sampled_from([0, -1, -8, 3, 2.5, NAN, INF, True, None, "8", "foo", (8,), (8, 8, 8), (0, 8), [], {}])
# values for scheme options: some valid, most wrong for the option they land on
OPTION_VALUES = st.sampled_from([0, -1, 1, 2, 0.5, NAN, INF, -INF, True, False, None, "x", "index", (2, 2), (1,), []])
# timm ViT arguments the fuzzer sets to hostile values (an unknown keyword included)
VIT_KEYS = (
    "img_size",
    "patch_size",
    "embed_dim",
    "depth",
    "num_heads",
    "num_classes",
    "in_chans",
    "mlp_ratio",
    "class_token",
    "global_pool",
    "reg_tokens",
    "no_embed_class",
    "dynamic_img_size",
    "dynamic_img_pad",
    "drop_rate",
    "patch_drop_rate",
    "drop_path_rate",
    "init_values",
    "bogus_argument",
)
# what a message may say for an argument: the scheme options are built from embed_dim and num_heads
ALIASES = {"embed_dim": ("dim", "head_dim"), "num_heads": ("head_dim", "heads")}
REFUSED = object()
# a dict is a mixed-resolution batch: its entries are the arguments patches, patch_coord and patch_valid
NAFLEX_NAMES = {"x", "patches", "patch_coord", "patch_valid"}


def _names(message: str, names) -> bool:
    return any(re.search(rf"\b{re.escape(str(name))}\b", message) for name in names)


def outcome(call, names):
    """``call()``'s result, or REFUSED when it raised a ValueError or TypeError whose message names one of ``names``.
    Any other exception (IndexError, ZeroDivisionError, AssertionError, KeyError, RuntimeError...) propagates and
    fails the test; so does a ValueError or TypeError that names none of them."""
    try:
        result = call()
    except (ValueError, TypeError) as err:
        message = str(err)
        if not _names(message, names):
            raise AssertionError(f"{type(err).__name__} names none of {sorted(map(str, names))}: {message}") from err
        _event(f"refused: {message.split(' ')[0]}")
        return REFUSED
    _event("ran")
    return result


def _event(text: str) -> None:
    """Count ``text`` in hypothesis' statistics (``--hypothesis-show-statistics``: what the draws exercised)."""
    if currently_in_test_context():
        event(text)


def argument_names(kwargs: dict) -> set:
    """The names a refusal of ``kwargs`` may cite: its keys (with their aliases) and the scheme names and options."""
    names = set(kwargs)
    for key in kwargs:
        names.update(ALIASES.get(key, ()))
    for key in ("pos_embed", "camera_embed"):
        value = kwargs.get(key)
        values = [value] if isinstance(value, str) else value if isinstance(value, (list, tuple)) else []
        names.update(v for v in values if isinstance(v, str))
    for key in ("pos_embed_kwargs", "camera_embed_kwargs"):
        options = kwargs.get(key)
        if isinstance(options, dict):
            names.update(options)
            names.update(k for v in options.values() if isinstance(v, dict) for k in v)
    return {n for n in names if n}


def assert_finite(out, inputs_finite: bool = True) -> None:
    """A finite input gives a finite output (no NaN or inf made inside the model)."""
    if inputs_finite:
        assert torch.isfinite(out.float()).all(), "a finite input gave a non-finite output"


# -- strategies ------------------------------------------------------------------------------------------------


def often(valid, hostile):
    """``valid`` three draws in four, else ``hostile`` (so that most draws build a model that then runs)."""
    return st.sampled_from((True, True, True, False)).flatmap(lambda ok: valid if ok else hostile)


def _widens_qk(name: str) -> bool:
    return bool(getattr(get_scheme_class(name), "augments_qk", False)) if name in SCHEMES else False


def scheme_names(names: list[str]):
    """One scheme, two (possibly the same one twice), or something that is not a scheme name."""
    one = st.sampled_from(names)
    two = st.lists(one, min_size=2, max_size=2)
    not_names = st.sampled_from([5, None, "", [], "no_such_scheme", ("none", 3)])
    return often(one, st.one_of(two, not_names))


@functools.cache
def _buildable(model_name: str) -> list[str]:
    """The registered schemes a tiny ``model_name`` builds with as ``pos_embed`` (default options): most draws take
    one of them, so that most draws also run a model; the others draw from every registered name."""
    tiny = dict(img_size=16, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=3)
    if "video" in model_name:
        tiny["num_frames"] = 2
    names = []
    for name in SCHEMES:
        with contextlib.suppress(ValueError, TypeError):
            timm.create_model(model_name, pos_embed=name, **tiny)
            names.append(name)
    return names


def buildable_names(model_name: str):
    """A scheme ``model_name`` builds with three draws in four, else what :func:`scheme_names` draws."""
    return often(st.deferred(lambda: st.sampled_from(_buildable(model_name))), scheme_names(SCHEMES + CAMERA_SCHEMES))


def _options_of(name: str) -> list[str]:
    """The options of scheme ``name``: its constructor's keywords but the model's dim, num_heads and depth."""
    params = inspect.signature(get_scheme_class(name).__init__).parameters.values()
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in keyword and p.name not in ("self", "dim", "num_heads", "depth")]


@st.composite
def scheme_options(draw, pos_embed):
    """Options for the schemes of ``pos_embed``: none, flat or keyed by scheme, one option set to a drawn value (an
    option the scheme does not take included), or something that is not a dict."""
    names = [pos_embed] if isinstance(pos_embed, str) else list(pos_embed) if isinstance(pos_embed, list) else []
    known = [n for n in names if n in SCHEMES + CAMERA_SCHEMES]
    form = draw(st.sampled_from(["none", "none", "empty", "flat", "keyed", "not_a_dict"]))
    if form == "none":
        return None
    if form == "not_a_dict":
        return draw(st.sampled_from(["base=10", 5, [("base", 10)]]))
    if form == "empty" or not known:
        return {}
    name = draw(st.sampled_from(known))
    options = {draw(st.sampled_from([*_options_of(name), "bogus_option"])): draw(OPTION_VALUES)}
    return options if form == "flat" else {name: options}


@st.composite
def vit_kwargs(draw, hostile_keys=VIT_KEYS):
    """A tiny model's arguments (width 16-64, depth 1-2, 16-32 px), up to two of them set to hostile values."""
    kwargs = dict(
        img_size=draw(st.sampled_from([16, 32, (16, 32)])),
        patch_size=draw(st.sampled_from([8, 16])),
        embed_dim=draw(st.sampled_from([16, 24, 32, 48, 64])),
        depth=draw(st.integers(1, 2)),
        num_heads=draw(st.sampled_from([1, 2, 4])),
        num_classes=3,
    )
    count = draw(st.sampled_from([0, 0, 1, 1, 2])) if hostile_keys else 0
    for key in draw(st.lists(st.sampled_from(hostile_keys or ("",)), min_size=count, max_size=count, unique=True)):
        kwargs[key] = draw(st.one_of(HOSTILE, st.sampled_from([1.5, -0.1, 1, "avg", "token"])))
    return kwargs


@dataclass(frozen=True)
class Batch:
    """A drawn input: ``x`` (a tensor made from the fields below, or ``value`` when it is not a tensor) and whether
    it is finite. The repr lists the fields, not the tensor, so that a failing example reads in one line."""

    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    scale: float = 1.0
    bad_value: float | None = None  # NaN or inf at flat position ``bad_index``
    bad_index: int = 0
    value: object = None  # not a tensor
    tensor: bool = True

    @property
    def finite(self) -> bool:
        return self.bad_value is None

    @property
    def x(self):
        if not self.tensor:
            return self.value
        x = torch.randn(self.shape, generator=torch.Generator().manual_seed(0)) * self.scale
        if self.bad_value is not None:
            x.view(-1)[self.bad_index] = self.bad_value
        if self.dtype == torch.bool:
            return x > 0
        if not self.dtype.is_floating_point:
            return x.nan_to_num().clamp(0, 255).to(self.dtype)
        return x.to(self.dtype)


FAULTS = ("empty", "channels", "channels_last", "rank-", "rank+", "zero", "indivisible")
DTYPES = (torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool)


@st.composite
def images(draw, layout: str, channels: int, sizes: tuple[int, ...], patch: int, mappings: bool = True) -> Batch:
    """A batch laid out as ``layout`` around a valid one (C = ``channels``, trailing sizes ``sizes``), with a drawn
    dtype, shape fault (empty batch, wrong channels, channels last, wrong rank, zero or indivisible sizes), contents
    (large, NaN, inf) or no tensor at all (a dict among them with ``mappings``: a mixed-resolution batch's form)."""
    if draw(st.integers(0, 9)) == 0:
        not_tensors = [None, 3.0, "image", [[0.0]], np.zeros((1, channels, *sizes), np.float32)] + [{}] * mappings
        return Batch(value=draw(st.sampled_from(not_tensors)), tensor=False)
    dims = layout.split(", ")
    c = dims.index("C")
    shape = [2 if d == "V" else 1 for d in dims[:c]] + [channels, *sizes]
    fault = draw(st.sampled_from(("none",) * 6 + FAULTS))
    if fault == "empty":
        shape[0] = 0
    elif fault == "channels":
        shape[c] = draw(st.sampled_from([1, channels + 1]))
    elif fault == "channels_last":
        shape = shape[:c] + shape[c + 1 :] + [channels]
    elif fault == "rank-":
        shape = shape[1:]
    elif fault == "rank+":
        shape = [1, *shape]
    elif fault == "zero":
        shape[-1] = 0
    elif fault == "indivisible":
        shape[-1] += draw(st.sampled_from([1, patch // 2 + 1]))
    numel = math.prod(shape)
    bad = draw(st.sampled_from([None, None, None, None, NAN, INF, -INF])) if numel else None
    return Batch(
        shape=tuple(shape),
        dtype=draw(st.sampled_from((torch.float32,) * 6 + DTYPES)),
        scale=draw(st.sampled_from([1.0, 1e3])),
        bad_value=bad,
        bad_index=draw(st.integers(0, numel - 1)) if bad is not None else 0,
    )


def _autocast(on: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()


# -- the timm ViTs ---------------------------------------------------------------------------------------------


def _head_dim(kwargs: dict) -> int | None:
    """embed_dim / num_heads when both are positive ints and one divides the other, else None."""
    dim, heads = kwargs.get("embed_dim"), kwargs.get("num_heads")
    if all(type(v) is int and v > 0 for v in (dim, heads)) and dim % heads == 0:
        return dim // heads
    return None


def _valid_images(model, leading=(1,)):
    embed = model.patch_embed
    size = tuple(embed.img_size)
    return torch.randn(*leading, embed.proj.in_channels, *size)


@FUZZ
@given(kwargs=vit_kwargs(), data=st.data())
def test_vit_constructor(kwargs, data):
    kwargs["pos_embed"] = data.draw(scheme_names(SCHEMES + CAMERA_SCHEMES))
    kwargs["pos_embed_kwargs"] = data.draw(scheme_options(kwargs["pos_embed"]))
    model = outcome(lambda: timm.create_model("visionpe_vit_tiny_patch16_224", **kwargs), argument_names(kwargs))
    if model is not REFUSED:
        assert_finite(model(_valid_images(model)))


@FUZZ
@given(
    pos_embed=st.sampled_from(SCHEMES),
    dynamic=st.booleans(),
    model_dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16]),
    autocast=st.booleans(),
    data=st.data(),
)
def test_vit_input(pos_embed, dynamic, model_dtype, autocast, data):
    kwargs = dict(img_size=16, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=3)
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224", pos_embed=pos_embed, dynamic_img_size=dynamic, **kwargs
    ).to(model_dtype)
    batch = data.draw(images("B, C, H, W", 3, (16, 16), 8))
    x, finite = batch.x, batch.finite
    method = data.draw(st.sampled_from(["forward", "forward_features", "forward_intermediates"]))
    with _autocast(autocast):
        out = outcome(lambda: getattr(model, method)(x), NAFLEX_NAMES)
    if out is not REFUSED:
        assert isinstance(x, torch.Tensor) and x.is_floating_point() and x.shape[0] >= 1
        assert autocast or x.dtype == model_dtype, "an input of another dtype than the model's ran outside autocast"
        assert_finite(out[0] if method == "forward_intermediates" else out, finite)


@FUZZ
@given(indices=st.one_of(st.integers(-3, 3), st.lists(st.integers(-3, 3), max_size=3), HOSTILE))
def test_vit_forward_intermediates_indices(indices):
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224", img_size=16, patch_size=8, embed_dim=16, depth=2, num_heads=2
    )
    out = outcome(lambda: model.forward_intermediates(torch.randn(1, 3, 16, 16), indices=indices), {"indices"})
    if out is not REFUSED:
        assert len(out[1]) >= 1


# -- the video ViT -----------------------------------------------------------------------------------------------


@FUZZ
@given(kwargs=vit_kwargs(VIT_KEYS + ("num_frames", "tubelet_size")), data=st.data())
def test_video_vit_constructor(kwargs, data):
    kwargs["pos_embed"] = data.draw(buildable_names("visionpe_video_vit_tiny_tubelet2x16"))
    kwargs["pos_embed_kwargs"] = data.draw(scheme_options(kwargs["pos_embed"]))
    kwargs.setdefault("num_frames", 4)
    kwargs.setdefault("tubelet_size", 2)
    assume(_head_dim(kwargs) != 4)  # a known gap: test_video_rotary_with_too_few_pairs_names_head_dim
    model = outcome(lambda: timm.create_model("visionpe_video_vit_tiny_tubelet2x16", **kwargs), argument_names(kwargs))
    if model is not REFUSED:
        embed = model.patch_embed
        x = torch.randn(1, embed.proj.in_channels, embed.num_frames, *embed.img_size)
        assert_finite(model(x))


@FUZZ
@given(pos_embed=buildable_names("visionpe_video_vit_tiny_tubelet2x16"), autocast=st.booleans(), data=st.data())
def test_video_vit_input(pos_embed, autocast, data):
    kwargs = dict(img_size=16, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=3, num_frames=4)
    kwargs["pos_embed"] = pos_embed  # a 2D-only scheme is refused, naming it
    model = outcome(lambda: timm.create_model("visionpe_video_vit_tiny_tubelet2x16", **kwargs), argument_names(kwargs))
    if model is REFUSED:
        return
    batch = data.draw(images("B, C, T, H, W", 3, (4, 16, 16), 8, mappings=False))
    x, finite = batch.x, batch.finite
    with _autocast(autocast):
        out = outcome(lambda: model(x), {"x"})
    if out is not REFUSED:
        assert_finite(out, finite)


# -- the multi-view ViT ----------------------------------------------------------------------------------------


def _cameras(batch: int, views: int, size: tuple[int, int]) -> Cameras:
    g = torch.Generator().manual_seed(0)
    eyes = torch.randn(batch, views, 3, generator=g)
    eyes = 3 * eyes / eyes.norm(dim=-1, keepdim=True)
    k = torch.tensor([[16.0, 0, size[1] / 2], [0, 16.0, size[0] / 2], [0, 0, 1]]).expand(batch, views, 3, 3)
    return Cameras(look_at(eyes, torch.zeros(batch, views, 3)), k, size)


@FUZZ
@given(kwargs=vit_kwargs(VIT_KEYS + ("num_views",)), data=st.data())
def test_multiview_vit_constructor(kwargs, data):
    kwargs["pos_embed"] = data.draw(buildable_names("visionpe_mvvit_tiny_patch16"))
    kwargs["camera_embed"] = data.draw(often(scheme_names(CAMERA_SCHEMES), st.one_of(st.none(), scheme_names(SCHEMES))))
    kwargs["camera_embed_kwargs"] = data.draw(scheme_options(kwargs["camera_embed"]))
    kwargs.setdefault("global_pool", "avg")
    model = outcome(lambda: timm.create_model("visionpe_mvvit_tiny_patch16", **kwargs), argument_names(kwargs))
    if model is not REFUSED:
        x = _valid_images(model, (1, 2))
        out = outcome(lambda: model(x, _cameras(1, 2, tuple(x.shape[-2:]))), {"depth"})  # known depths, when read
        if out is not REFUSED:
            assert_finite(out)


@FUZZ
@given(camera_embed=st.sampled_from(CAMERA_SCHEMES), autocast=st.booleans(), data=st.data())
def test_multiview_vit_input(camera_embed, autocast, data):
    kwargs = dict(img_size=16, patch_size=8, embed_dim=48, depth=1, num_heads=2, num_classes=3)
    model = outcome(lambda: timm.create_model("visionpe_mvvit_tiny_patch16", camera_embed=camera_embed, **kwargs), {})
    if model is REFUSED:
        return
    batch = data.draw(images("B, V, C, H, W", 3, (16, 16), 8))
    x, finite = batch.x, batch.finite
    # the cameras of one sample with two views (the valid batch's), of other counts, or not Cameras at all
    cameras = data.draw(st.sampled_from(["1x2", "1x2", "2x2", "1x3", "none", "dict"]))
    if cameras in ("none", "dict"):
        cameras = None if cameras == "none" else {"w2c": torch.eye(4)}
    else:
        cameras = _cameras(*map(int, cameras.split("x")), (16, 16))
    with _autocast(autocast):
        out = outcome(lambda: model(x, cameras), {"x", "cameras", "image_size", "depth"})
    if out is not REFUSED:
        assert_finite(out, finite)


# -- apply_position_scheme on timm's models ------------------------------------------------------------------------

TIMM_BASE = dict(img_size=16, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=3)


def _timm_model(family: str, dynamic: bool) -> torch.nn.Module:
    if family == "vit":
        return VisionTransformer(**TIMM_BASE, dynamic_img_size=dynamic)
    if family == "eva":
        return Eva(**TIMM_BASE, use_rot_pos_emb=True, dynamic_img_size=dynamic)
    args = {k: v for k, v in TIMM_BASE.items() if k != "img_size"}
    return timm.create_model("naflexvit_base_patch16_gap", pos_embed_grid_size=(2, 2), **args)


@FUZZ
@given(
    family=st.sampled_from(["vit", "eva", "naflex", "not_a_model"]),
    dynamic=st.booleans(),
    autocast=st.booleans(),
    data=st.data(),
)
def test_apply_position_scheme(family, dynamic, autocast, data):
    model = data.draw(st.sampled_from([None, torch.nn.Linear(2, 2)])) if family == "not_a_model" else None
    model = model if family == "not_a_model" else _timm_model(family, dynamic)
    pos_embed = data.draw(st.one_of(st.none(), scheme_names(SCHEMES + CAMERA_SCHEMES)))
    options = data.draw(scheme_options(pos_embed))
    names = argument_names({"model": model, "pos_embed": pos_embed, "pos_embed_kwargs": options})
    report = outcome(lambda: apply_position_scheme(model, pos_embed, options), names)
    if report is REFUSED:
        return
    model.eval()
    assert_finite(model(torch.randn(1, 3, 16, 16)))
    batch = data.draw(images("B, C, H, W", 3, (16, 16), 8))
    x, finite = batch.x, batch.finite
    with _autocast(autocast):
        out = outcome(lambda: model(x), NAFLEX_NAMES)
    if out is not REFUSED:
        assert_finite(out, finite)


# -- the Lightning classifier ------------------------------------------------------------------------------------

CLASSIFIER_MODELS = ["visionpe_vit_tiny_patch16_224", "visionpe_video_vit_tiny_tubelet2x16", "vit_tiny_patch16_224"]


@FUZZ
@given(
    model_name=often(st.sampled_from(CLASSIFIER_MODELS), st.sampled_from(["", 5, None])),
    model_kwargs=often(st.just("drawn"), st.sampled_from([None, "depth=1", [("depth", 1)]])),
    hostile=often(
        st.just({}),
        st.sampled_from([{"num_classes": 1}, {"base_lr": NAN}, {"drop_path_rate": 1.0}, {"mixup": -1}, {"opt": "x"}]),
    ),
    data=st.data(),
)
def test_classifier(model_name, model_kwargs, hostile, data):
    from visionpe.training import Classifier

    pos_embed = data.draw(st.one_of(st.none(), scheme_names(SCHEMES)))
    pos_embed_kwargs = data.draw(scheme_options(pos_embed))
    if model_kwargs == "drawn":
        # hostile values only for visionpe's models: timm's own (vit_tiny_patch16_224) are built from model_kwargs as
        # given, with timm's checks (test_classifier_checks_the_model_kwargs_of_timm_models)
        model_kwargs = data.draw(vit_kwargs(VIT_KEYS if str(model_name).startswith("visionpe_") else ()))
        model_kwargs.pop("num_classes")
        if model_name == "visionpe_video_vit_tiny_tubelet2x16":
            model_kwargs["num_frames"] = 2
    args = dict(pos_embed=pos_embed, pos_embed_kwargs=pos_embed_kwargs, model_kwargs=model_kwargs, num_classes=3)
    args.update(hostile)
    names = argument_names(
        {"model_name": model_name, **args, **(model_kwargs if isinstance(model_kwargs, dict) else {})}
    )
    module = outcome(lambda: Classifier(model_name, **args), names)
    if module is REFUSED:
        return
    embed = module.model.patch_embed
    frames = (embed.num_frames,) if hasattr(embed, "num_frames") else ()
    assert_finite(module(torch.randn(1, embed.proj.in_channels, *frames, *embed.img_size)))


# -- the open_clip tower -----------------------------------------------------------------------------------------


@FUZZ
@given(vision=vit_kwargs(), autocast=st.booleans(), data=st.data())
def test_open_clip_tower(vision, autocast, data):
    open_clip = pytest.importorskip("open_clip")
    from visionpe.integrations.open_clip import register_open_clip_model

    vision.pop("num_classes")
    pos_embed = data.draw(scheme_names(SCHEMES + CAMERA_SCHEMES))
    text = dict(context_length=8, vocab_size=64, width=16, heads=2, layers=1)
    names = argument_names({"pos_embed": pos_embed, "vision": vision, **vision})
    name = outcome(
        lambda: register_open_clip_model(
            "visionpe-fuzz", pos_embed=pos_embed, embed_dim=16, vision=vision, text_cfg=text
        ),
        names,
    )
    if name is REFUSED:
        return
    # registration checks the names and the ViT's arguments; what a scheme needs of the shape (e.g. comrope_ap's
    # head_dim), when open_clip builds the tower
    model = outcome(lambda: open_clip.create_model(name).eval(), names)
    if model is REFUSED:
        return
    trunk = model.visual.trunk
    assert_finite(model.encode_image(_valid_images(trunk)))
    channels, patch = trunk.patch_embed.proj.in_channels, trunk.patch_embed.patch_size[0]
    batch = data.draw(images("B, C, H, W", channels, (32, 32), patch, mappings=False))
    x, finite = batch.x, batch.finite
    with _autocast(autocast):
        out = outcome(lambda: model.encode_image(x), {"x"})
    if out is not REFUSED:
        assert_finite(out, finite)


# -- what the fuzzer found: regressions, and the gaps left (strict xfails: a fix shows, then the marker comes off) --


@pytest.mark.parametrize("model_name", ["visionpe_video_vit_tiny_tubelet2x16", "open_clip_tower"])
def test_naflex_dict_refusal_names_x(model_name):
    """Models without mixed-resolution batches refuse a NaFlex dict (the video and open_clip fuzz tests draw none)."""
    if model_name == "open_clip_tower":
        from visionpe.integrations.open_clip import register_visionpe_tower

        tiny = dict(img_size=16, patch_size=8, embed_dim=32, depth=1, num_heads=2)
        model = timm.create_model(register_visionpe_tower("visionpe_fuzz_tower", pos_embed="rope_axial", **tiny))
    else:
        model = timm.create_model(model_name, pos_embed="rope_axial", img_size=16, depth=1, num_frames=2)
    assert outcome(lambda: model({"patches": torch.randn(1, 4, 768)}), {"x"}) is REFUSED


def test_classifier_refuses_an_unknown_model_name():
    from visionpe.training import Classifier

    assert outcome(lambda: Classifier("no_such_model", num_classes=3), {"model_name"}) is REFUSED


@pytest.mark.xfail(strict=True, reason="Classifier passes model_kwargs of timm's own ViTs to timm unchecked")
@pytest.mark.parametrize("kwargs", [dict(depth=2.5), dict(patch_size=0), dict(embed_dim=100, num_heads=3)])
def test_classifier_checks_the_model_kwargs_of_timm_models(kwargs):
    from visionpe.training import Classifier

    call = lambda: Classifier("vit_tiny_patch16_224", num_classes=3, model_kwargs=kwargs)  # noqa: E731
    assert outcome(call, set(kwargs)) is REFUSED


@pytest.mark.parametrize("name", ["harope", "rope_axial", "rope_learned"])
def test_video_rotary_with_too_few_pairs_names_head_dim(name):
    kwargs = dict(pos_embed=name, img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=4, num_frames=2)
    call = lambda: timm.create_model("visionpe_video_vit_tiny_tubelet2x16", **kwargs)  # noqa: E731
    assert outcome(call, {"head_dim", "embed_dim", "num_heads", name}) is REFUSED


@pytest.mark.parametrize("names", list(itertools.combinations([n for n in SCHEMES if _widens_qk(n)], 2)), ids=str)
def test_two_schemes_that_widen_qk_are_refused(names):
    """Refused when the model is built, naming pos_embed (it used to build, then refuse every batch: "q must have
    shape (B, 2, 5, 16) for this grid, got (1, 2, 5, 24)")."""
    kwargs = dict(pos_embed=list(names), img_size=16, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    model = outcome(lambda: timm.create_model("visionpe_vit_tiny_patch16_224", **kwargs), {"pos_embed"})
    assert model is REFUSED
