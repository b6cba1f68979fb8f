"""Hostile input at every public entry point: a ValueError or TypeError whose message names the argument, what was
expected and what was given; never a silent wrong answer (or a bare RuntimeError from deep inside torch)."""

import numpy as np
import pytest
import torch

import visionpe
from visionpe.grid import grid_coords, prefix_mask, validate_grid_size
from visionpe.multimodal import MultimodalRotary, apply_multimodal_rotary, get_position_ids

from ..conftest import ABSOLUTE, EXTRAPOLATING, EXTRAPOLATION_OPTIONS, FAMILY_REPRESENTATIVES
from .helpers import ROTARY, tiny_video, tiny_vit

NAN, INF = float("nan"), float("inf")
IMAGE_SEQ = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0]])  # T T <vs> | 2 x 3 merged image | <ve> T
IMAGE_GRID = torch.tensor([[1, 4, 6]])
VIDEO_SEQ = torch.tensor([[0, 0] + [2] * 12 + [0, 0]])
VIDEO_GRID = torch.tensor([[3, 4, 4]])


def _case(call, error, match, id):
    return pytest.param(call, error, match, id=id)


def _run(call, error, match):
    with pytest.raises(error, match=match):
        call()


# -- coordinates -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, error, match",
    [
        _case(lambda: grid_coords((2.0, 3)), TypeError, r"grid_size\[0\] must be an int, got float \(2.0\)", "float"),
        _case(lambda: grid_coords((2, -3)), ValueError, r"grid_size\[1\] must be positive, got -3", "negative"),
        _case(lambda: grid_coords((0, 3)), ValueError, r"grid_size\[0\] must be positive, got 0", "zero"),
        _case(lambda: grid_coords((True, 3)), TypeError, r"grid_size\[0\] must be an int, got bool", "bool"),
        _case(lambda: grid_coords((5,)), ValueError, r"grid_size must have 2 or 3 entries, got 1: \(5,\)", "rank"),
        _case(lambda: grid_coords("14x14"), TypeError, r"grid_size must be a tuple of ints, got str", "str"),
        _case(
            lambda: grid_coords(torch.tensor([2.5, 3.0])), TypeError, r"grid_size\[0\] must be an int", "float_tensor"
        ),
        _case(lambda: grid_coords((2, 3), mode="pixel"), ValueError, r"mode must be one of .* got 'pixel'", "mode"),
        _case(lambda: grid_coords((2, 3), mode="ref_scaled"), ValueError, r"needs ref_grid_size .* got None", "ref"),
        _case(lambda: prefix_mask(1, -4), ValueError, r"num_patches must be a non-negative int, got -4", "patches"),
        _case(lambda: prefix_mask(1, 2.5), TypeError, r"num_patches must be a non-negative int, got float", "float"),
        _case(lambda: prefix_mask(1, 2.5), ValueError, r"int, got float \(2.5\)", "float_is_value_error"),
        _case(lambda: prefix_mask(-1, 4), ValueError, r"num_prefix_tokens must be a non-negative int, got -1", "pre"),
    ],
)
def test_coordinate_builders(call, error, match):
    _run(call, error, match)


def test_integer_grids_of_any_integer_type_are_accepted():
    expected = grid_coords((2, 3))
    for grid in [np.array([2, 3]), (np.int64(2), 3), torch.tensor([2, 3]), [2, torch.tensor(3)]]:
        assert validate_grid_size(grid) == (2, 3)
        assert torch.equal(grid_coords(grid), expected)


# -- rotary schemes: rotate(x, coords, layer) ----------------------------------------------------------------------


def _rotary(name):
    return visionpe.create_pos_embed(name, dim=32, num_heads=2, depth=2)


def _rotate_cases():
    x, coords = torch.randn(1, 2, 6, 16), grid_coords((2, 3))
    nan_coords = coords.clone()
    nan_coords[4, 1] = NAN
    inf_coords = coords.clone()
    inf_coords[0, 0] = INF
    shape = r"x must be a non-empty \(B, num_heads=2, N, head_dim=16\) tensor for \w+, got shape "
    return [
        ("int_x", lambda s: s.rotate(x.long(), coords), TypeError, r"x must be a floating-point tensor, got dtype"),
        ("list_x", lambda s: s.rotate(x.tolist(), coords), TypeError, r"x must be a \(B, num_heads=2, .*got list"),
        ("rank", lambda s: s.rotate(x[0], coords), ValueError, shape + r"\(2, 6, 16\)"),
        ("heads", lambda s: s.rotate(torch.randn(1, 3, 6, 16), coords), ValueError, shape + r"\(1, 3, 6, 16\)"),
        ("head_dim", lambda s: s.rotate(torch.randn(1, 2, 6, 8), coords), ValueError, shape + r"\(1, 2, 6, 8\)"),
        ("bnhd_layout", lambda s: s.rotate(x.transpose(1, 2), coords), ValueError, shape + r"\(1, 6, 2, 16\)"),
        ("empty_batch", lambda s: s.rotate(x[:0], coords), ValueError, shape + r"\(0, 2, 6, 16\)"),
        ("layer", lambda s: s.rotate(x, coords, layer=2), ValueError, r"layer must be an int in \[0, depth=2\).*got 2"),
        ("neg_layer", lambda s: s.rotate(x, coords, layer=-1), ValueError, r"layer must be an int .* got -1"),
        ("float_layer", lambda s: s.rotate(x, coords, layer=1.0), ValueError, r"layer must be an int .* got 1.0"),
        ("nan_coords", lambda s: s.rotate(x, nan_coords), ValueError, r"coords must be finite, got NaN or inf"),
        ("inf_coords", lambda s: s.rotate(x, inf_coords), ValueError, r"coords must be finite, got NaN or inf"),
        ("coords_rows", lambda s: s.rotate(x, grid_coords((2, 2))), ValueError, r"coords has 4 rows but x has 6"),
        ("coords_rank", lambda s: s.rotate(x, coords[:, 0]), ValueError, r"coords must have shape \(N, ndim\), got"),
        ("coords_3d", lambda s: s.rotate(x, grid_coords((1, 2, 3))), ValueError, r"2 axes, got coords with 3 axes"),
        ("coords_list", lambda s: s.rotate(x, coords.tolist()), TypeError, r"coords must be a torch.Tensor"),
        ("grid_float", lambda s: s.coords((2.5, 3)), TypeError, r"grid_size\[0\] must be an int, got float \(2.5\)"),
        ("grid_negative", lambda s: s.coords((2, -3)), ValueError, r"grid_size\[1\] must be positive, got -3"),
    ]


# Every case runs on one scheme per implementation family (tests/conftest.py: the family's rotate and prepare); every
# rotary scheme runs, on one instance, the cases that read what the scheme sets itself: its heads, head_dim and depth,
# its coordinate axes and its coordinate builder.
OWN_CASES = ("heads", "head_dim", "layer", "coords_3d", "grid_float", "grid_negative")


@pytest.mark.parametrize("case", _rotate_cases(), ids=lambda c: c[0])
@pytest.mark.parametrize("name", [n for n in FAMILY_REPRESENTATIVES if n in ROTARY])
def test_rotary_rotate(name, case):
    _, call, error, match = case
    _run(lambda: call(_rotary(name)), error, match)


@pytest.mark.parametrize("name", ROTARY)
def test_rotary_rotate_checks_what_the_scheme_sets(name):
    scheme = _rotary(name)
    cases = [case for case in _rotate_cases() if case[0] in OWN_CASES]
    assert len(cases) == len(OWN_CASES)
    for _, call, error, match in cases:
        with pytest.raises(error, match=match):
            call(scheme)


@pytest.mark.parametrize(
    "name, kwargs, match",
    [
        ("rope_axial", {"base": INF}, r"base must be positive and finite, got inf"),
        ("rope_axial", {"base": NAN}, r"base must be positive and finite, got nan"),
        ("rope_mixed", {"base": 0.0}, r"base must be positive and finite, got 0.0"),
        ("string_cayley", {"base": INF}, r"base must be positive and finite, got inf"),
        ("string_circulant", {"base": -1}, r"base must be positive and finite, got -1"),
        ("sincos", {"temperature": 0}, r"temperature must be a positive finite number, got 0"),
        ("sincos", {"temperature": INF}, r"temperature must be a positive finite number, got inf"),
        ("learned", {"num_prefix_tokens": -1}, r"num_prefix_tokens must be a non-negative int, got -1"),
        ("learned", {"grid_size": (2.5, 3)}, r"grid_size\[0\] must be an int, got float \(2.5\)"),
        ("rope_axial", {"coord_mode": "bogus"}, r"coord_mode must be one of \('index', .*\), got 'bogus'"),
        ("rope_mixed", {"coord_mode": "pixel"}, r"coord_mode must be one of \('index', .*\), got 'pixel'"),
        ("string_cayley", {"coord_mode": "ref_scaled"}, r"coord_mode='ref_scaled' .*got grid_size=None"),
        ("string_circulant", {"coord_mode": 1}, r"coord_mode must be one of \('index', .*\), got 1"),
        ("rope_axial", {"axis_pairs": (4.5, 3.5)}, r"axis_pairs\[0\] must be a positive int, got float \(4.5\)"),
        ("rope_axial", {"axis_pairs": (8, False)}, r"axis_pairs\[1\] must be a positive int, got bool \(False\)"),
        ("lookhere", {"directions": [NAN, None]}, r"directions\[0\] must be a finite angle in degrees .*got nan"),
        ("lookhere", {"directions": [0.0, -INF]}, r"directions\[1\] must be a finite angle in degrees .*got -inf"),
    ],
)
def test_scheme_options(name, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        visionpe.create_pos_embed(name, dim=32, num_heads=2, **kwargs)


@pytest.mark.parametrize("name", EXTRAPOLATING)
def test_rotate_with_extrapolation_needs_a_grid(name):
    options = {"grid_size": (2, 3), "extrapolation": "pi", **EXTRAPOLATION_OPTIONS.get(name, {})}
    scheme = visionpe.create_pos_embed(name, dim=32, num_heads=2, depth=2, **options)
    x, jittered = torch.randn(1, 2, 6, 16), grid_coords((2, 3)) + 0.25
    with pytest.raises(ValueError, match=r"extrapolation='pi'.*pass grid_size=\(\.\.\.\) to rotate"):
        scheme.rotate(x, jittered)
    with pytest.raises(ValueError, match=r"supports 2D grids, got a 3D grid_size \(1, 2, 3\)"):
        scheme.rotate(x, jittered, grid_size=(1, 2, 3))
    with pytest.raises(ValueError, match=r"grid_size\[1\] must be positive, got 0"):
        scheme.rotate(x, jittered, grid_size=(2, 0))
    assert scheme.rotate(x, jittered, grid_size=(4, 6)).shape == x.shape


@pytest.mark.parametrize("name", EXTRAPOLATING)
def test_train_grid_of_the_wrong_rank(name):
    options = {"grid_size": (2, 3), **EXTRAPOLATION_OPTIONS.get(name, {})}
    scheme = visionpe.create_pos_embed(name, dim=32, num_heads=2, **options)
    with pytest.raises(ValueError, match=r"train_grid_size must have 2 entries, got 3: \(1, 2, 3\)"):
        scheme.set_extrapolation("pi", train_grid_size=(1, 2, 3))


# -- absolute schemes: forward(x, grid_size, num_prefix_tokens) ----------------------------------------------------


def _absolute_cases():
    x = torch.randn(2, 1 + 6, 32)
    given = r"x must have shape \(B, 1 \+ 6, 32\) \(B >= 1, floating point\) for grid_size \(2, 3\) and 1 prefix"
    return [
        ("grid_vs_tokens", lambda s: s(x, (3, 3), 1), ValueError, r"x must have shape \(B, 1 \+ 9, 32\).*got shape"),
        ("width", lambda s: s(torch.randn(2, 7, 16), (2, 3), 1), ValueError, given + r".*got shape \(2, 7, 16\)"),
        ("rank", lambda s: s(x[0], (2, 3), 1), ValueError, given + r".*got shape \(7, 32\)"),
        ("empty_batch", lambda s: s(x[:0], (2, 3), 1), ValueError, given + r".*got shape \(0, 7, 32\)"),
        ("int_x", lambda s: s(x.long(), (2, 3), 1), ValueError, given + r".*dtype torch.int64"),
        ("prefix", lambda s: s(x, (2, 3), -1), ValueError, r"num_prefix_tokens must be a non-negative int, got -1"),
        ("grid_float", lambda s: s(x, (2.0, 3), 1), TypeError, r"grid_size\[0\] must be an int, got float \(2.0\)"),
        ("grid_3d", lambda s: s(torch.randn(2, 13, 32), (2, 2, 3), 1), ValueError, r"supports 2D"),
    ]


@pytest.mark.parametrize(
    "name, case",
    [
        pytest.param(name, case, id=f"{name}-{case[0]}")
        for name in ABSOLUTE
        for case in _absolute_cases()
        if not (name == "none" and case[0] == "grid_3d")  # "none" takes 3D grids
    ],
)
def test_absolute_forward(name, case):
    _, call, error, match = case
    kwargs = {"grid_size": (2, 3)} if name == "learned" else {}
    _run(lambda: call(visionpe.create_pos_embed(name, dim=32, num_heads=2, **kwargs)), error, match)


# -- bias schemes ------------------------------------------------------------------------------------------------


def test_lookhere_layer_type():
    lookhere = visionpe.create_pos_embed("lookhere", dim=32, num_heads=2, depth=4)
    q = torch.randn(1, 2, 7, 16)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, depth=4\) for LookHere, got 2.5"):
        lookhere.attn_bias(q, q, lookhere.prepare((2, 3), 1), 2.5)


def test_bias_layer_and_piecewise_index():
    irpe = visionpe.create_pos_embed("irpe", dim=32, num_heads=2, depth=2)
    q = torch.randn(1, 2, 7, 16)
    state = irpe.prepare((2, 3), 1)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, depth=2\), got 2"):
        irpe.attn_bias(q, q, state, 2)
    with pytest.raises(ValueError, match=r"rel must be finite, got NaN or inf"):
        visionpe.irpe_piecewise_index(torch.tensor([0.0, NAN]), 1.9, 3.8, 15.2)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, depth=2\) for LookHere, got 5"):
        lookhere = visionpe.create_pos_embed("lookhere", dim=32, num_heads=2, depth=2)
        lookhere.attn_bias(q, q, lookhere.prepare((2, 3), 1), 5)


# -- models ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, error, match",
    [
        _case(
            lambda: tiny_vit("rope_axial")(torch.randn(0, 3, 32, 32)),
            ValueError,
            r"x must be a non-empty batch \(B, C, H, W\) with B >= 1, C = 3 .*got \(0, 3, 32, 32\)",
            "empty_batch",
        ),
        _case(
            lambda: tiny_vit("rope_axial")(torch.randn(2, 4, 32, 32)),
            ValueError,
            r"C = 3 .*got \(2, 4, 32, 32\)",
            "channels",
        ),
        _case(
            lambda: tiny_vit("rope_axial")(torch.randn(3, 32, 32)),
            ValueError,
            r"x must be a batch \(B, C, H, W\), got \(3, 32, 32\)",
            "rank",
        ),
        _case(
            lambda: tiny_vit("rope_axial")(torch.zeros(1, 3, 32, 32, dtype=torch.uint8)),
            TypeError,
            r"x must be a floating-point batch \(B, C, H, W\), got dtype torch.uint8",
            "uint8",
        ),
        _case(
            lambda: tiny_vit("rope_axial", dynamic_img_size=True)(torch.randn(1, 3, 0, 32)),
            ValueError,
            r"sizes >= 1, got \(1, 3, 0, 32\)",
            "zero_height",
        ),
        _case(
            lambda: tiny_vit("rope_axial", dynamic_img_size=True)(torch.randn(1, 3, 36, 32)),
            ValueError,
            r"x has image size 36x32, not divisible by the patch size 8x8; .*dynamic_img_pad=True",
            "not_multiple_input",
        ),
        _case(
            lambda: tiny_vit("learned", img_size=36),
            ValueError,
            r"img_size \(36, 36\) is not divisible by the patch size \(8, 8\).*dynamic_img_pad=True",
            "not_multiple_model",
        ),
        _case(
            lambda: tiny_vit("rope_axial").set_input_size(img_size=(36, 40)),
            ValueError,
            r"img_size \(36, 40\) is not divisible by the patch size \(8, 8\)",
            "not_multiple_resize",
        ),
        _case(
            lambda: tiny_vit("rope_axial").set_input_size(img_size=32.5),
            TypeError,
            r"img_size must be a positive int or \(H, W\) pair of positive ints, got float \(32.5\)",
            "float_resize",
        ),
        _case(
            lambda: visionpe.VisionPEViT(pos_embed=None, depth=1),
            TypeError,
            r"pos_embed must be a scheme name or a non-empty list of names, got None",
            "pos_embed_none",
        ),
        _case(
            lambda: tiny_vit(5),
            TypeError,
            r"pos_embed must be a scheme name or a non-empty list of names, got 5",
            "pos_embed_int",
        ),
        _case(
            lambda: tiny_vit("rope_axial", pos_embed_kwargs=[("base", 10)]),
            TypeError,
            r"pos_embed_kwargs must be a dict, got list",
            "kwargs_list",
        ),
        _case(
            lambda: tiny_video(pos_embed="rope_axial", num_frames=4)(torch.randn(0, 3, 4, 32, 32)),
            ValueError,
            r"x must be a non-empty batch \(B, C, T, H, W\) .*got \(0, 3, 4, 32, 32\)",
            "video_empty",
        ),
        _case(
            lambda: tiny_video(pos_embed="rope_axial", num_frames=4)(torch.randn(1, 3, 32, 32)),
            ValueError,
            r"x must be a batch \(B, C, T, H, W\), got \(1, 3, 32, 32\)",
            "video_rank",
        ),
        _case(
            lambda: tiny_video(tubelet_size=0),
            ValueError,
            r"tubelet_size must be a positive int, got 0",
            "video_tubelet_zero",
        ),
        _case(
            lambda: tiny_video(num_frames=4.0),
            TypeError,
            r"num_frames must be a positive int, got float \(4.0\)",
            "video_frames_float",
        ),
        _case(
            lambda: tiny_video(num_frames=4, dynamic_img_pad=True),
            ValueError,
            r"VideoPEViT does not pad frames: .*dynamic_img_pad must be False, got True",
            "video_pad",
        ),
        _case(
            lambda: tiny_video(pos_embed="rope_axial", num_frames=4)(torch.randn(1, 3, 4, 32, 32, dtype=torch.float64)),
            ValueError,
            r"x must have the model's dtype torch.float32 .*got dtype torch.float64",
            "video_f64",
        ),
        _case(
            lambda: tiny_video(pos_embed="rope_axial", num_frames=4)(torch.randn(1, 3, 5, 32, 32)),
            ValueError,
            r"x has clip size 5x32x32 \(T x H x W\), not divisible by the tubelet 2x16x16",
            "video_frames",
        ),
        _case(
            lambda: visionpe.set_extrapolation(tiny_vit("rope_axial"), "yarn", alpha="1"),
            TypeError,
            r"alpha must be a number \(YaRN's ramp bound\), got str",
            "yarn_alpha",
        ),
        _case(
            lambda: visionpe.set_extrapolation(tiny_vit("rope_axial"), "ntk", train_grid_size=(4.0, 4)),
            TypeError,
            r"train_grid_size\[0\] must be an int, got float",
            "train_grid",
        ),
    ],
)
def test_models(call, error, match):
    _run(call, error, match)


# -- multimodal position ids -----------------------------------------------------------------------------------


def _ids(scheme="mrope", types=IMAGE_SEQ, image=IMAGE_GRID, video=None, mask=None, **kwargs):
    return lambda: get_position_ids(scheme, types, image, video, mask, **kwargs)


@pytest.mark.parametrize(
    "call, error, match",
    [
        _case(_ids(types=IMAGE_SEQ[:0]), ValueError, r"at least one sample and one token, got shape \(0, 11\)", "B0"),
        _case(_ids(types=IMAGE_SEQ[:, :0], image=None), ValueError, r"one token, got shape \(1, 0\)", "L0"),
        _case(
            _ids(
                types=torch.zeros(2, 4, dtype=torch.long), image=None, mask=torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])
            ),
            ValueError,
            r"attention_mask marks every token of sample 1 as padding",
            "all_padding",
        ),
        _case(
            _ids(mask=torch.full((1, 11), 0.5)),
            ValueError,
            r"attention_mask must hold 1 \(token\) or 0 \(padding\), got 0.5 in sample 0 at position 0",
            "mask_half",
        ),
        _case(_ids(mask=torch.full((1, 11), 2)), ValueError, r"attention_mask must hold 1 .* got 2", "mask_two"),
        _case(_ids(mask=torch.full((1, 11), NAN)), ValueError, r"attention_mask must hold 1 .* got nan", "mask_nan"),
        _case(_ids(mask=torch.ones(1, 10)), ValueError, r"attention_mask must be a \(B, L\) tensor like", "mask_shape"),
        _case(_ids(types=IMAGE_SEQ[0]), ValueError, r"token_type_ids must be a \(B, L\) integer tensor", "types_1d"),
        _case(_ids(types=IMAGE_SEQ.float()), ValueError, r"integer tensor, got shape .* torch.float32", "types_fp"),
        _case(_ids(image=IMAGE_GRID.float()), TypeError, r"image_grid_thw must hold integers, got dtype", "grid_fp"),
        _case(_ids(image=torch.tensor([[1, -4, 6]])), ValueError, r"image_grid_thw\[0\] = \(1, -4, 6\) must be", "neg"),
        _case(_ids(image=torch.tensor([1, 4, 6])), ValueError, r"must have shape \(num, 3\).*got \(3,\)", "grid_1d"),
        _case(
            _ids(image=torch.tensor([[1, 4, 4]])),
            ValueError,
            r"sample 0 has image tokens from position 7 that no row of image_grid_thw covers",
            "grid_vs_tokens",
        ),
        _case(
            _ids(types=VIDEO_SEQ, image=None, video=torch.tensor([[4, 4, 4]])),
            ValueError,
            r"video_grid_thw\[0\] = \(4, 4, 4\) needs 16 video tokens .* only 12 left",
            "video_vs_tokens",
        ),
        _case(_ids(pad_value=NAN), ValueError, r"pad_value must be finite .* got nan", "pad_nan"),
        _case(_ids(pad_value=INF), ValueError, r"pad_value must be finite .* got inf", "pad_inf"),
        _case(_ids("v2pe", delta=INF), ValueError, r"delta must be positive and finite, got \[inf\]", "v2pe_inf"),
        _case(_ids("v2pe", delta=NAN), ValueError, r"delta must be positive and finite, got \[nan\]", "v2pe_nan"),
        _case(_ids("videorope", delta=-2.0), ValueError, r"delta must be positive and finite", "videorope"),
        _case(_ids("hope", temporal_scale=INF), ValueError, r"temporal_scale must be positive and finite", "hope"),
        _case(_ids("circle_rope", radius=NAN), ValueError, r"radius must be a positive finite number .* nan", "R"),
        _case(_ids("circle_rope", image_shift=INF), ValueError, r"image_shift must be finite, got inf", "shift"),
        _case(
            _ids("mrope_interleaved", spatial_reset=True, temporal_stride=NAN),
            ValueError,
            r"temporal_stride must be positive and finite, got nan",
            "stride_nan",
        ),
        _case(
            _ids("mrope_abs_time", types=VIDEO_SEQ, image=None, video=VIDEO_GRID, second_per_grid_ts=[NAN]),
            ValueError,
            r"second_per_grid_ts must hold 1 non-negative finite values .* got \[nan\]",
            "spg_nan",
        ),
        _case(
            _ids("mrope_abs_time", types=VIDEO_SEQ, image=None, video=VIDEO_GRID, second_per_grid_ts="0.5"),
            TypeError,
            r"second_per_grid_ts must be a tensor or list of 1 numbers, got str",
            "spg_str",
        ),
        _case(
            _ids("mrope_abs_time", types=VIDEO_SEQ, image=None, video=VIDEO_GRID, second_per_grid_ts=[1.0, 2.0]),
            ValueError,
            r"second_per_grid_ts must hold 1 .* got \[1.0, 2.0\]",
            "spg_count",
        ),
        _case(
            _ids(
                "mrope_abs_time",
                types=VIDEO_SEQ,
                image=None,
                video=VIDEO_GRID,
                second_per_grid_ts=[1.0],
                tokens_per_second=NAN,
            ),
            ValueError,
            r"tokens_per_second must be positive and finite, got nan",
            "tps_nan",
        ),
        _case(_ids(spatial_merge_size=0), ValueError, r"spatial_merge_size must be a positive int, got 0", "merge"),
    ],
)
def test_multimodal_position_ids(call, error, match):
    _run(call, error, match)


# -- multimodal rotary -------------------------------------------------------------------------------------------


def _tables():
    rotary = MultimodalRotary(16, base=1e4, allocation="chunked", mrope_section=(2, 3, 3))
    pos, _ = get_position_ids("mrope", IMAGE_SEQ, IMAGE_GRID)
    return rotary, pos, *rotary(pos)


@pytest.mark.parametrize(
    "call, error, match",
    [
        _case(lambda: MultimodalRotary(16, base=INF), ValueError, r"base must be a finite number > 1, got inf", "inf"),
        _case(lambda: MultimodalRotary(16, base=NAN), ValueError, r"base must be a finite number > 1, got nan", "nan"),
        _case(
            lambda: MultimodalRotary(16, attention_scaling=NAN, mrope_section=(2, 3, 3)),
            ValueError,
            r"attention_scaling must be positive and finite, got nan",
            "scaling",
        ),
        _case(lambda: _tables()[0](_tables()[1] > 2), TypeError, r"position_ids must be integer or floating", "bool"),
        _case(
            lambda: _tables()[0](_tables()[1].float().index_fill(2, torch.tensor([4]), NAN)),
            ValueError,
            r"position_ids must be finite, got NaN or inf",
            "nan_ids",
        ),
        _case(lambda: _tables()[0](_tables()[1][:, :0]), ValueError, r"non-empty, got \(3, 0, 11\)", "empty_ids"),
        _case(lambda: _tables()[0](_tables()[1][0, 0]), ValueError, r"got \(11,\)", "ids_1d"),
    ],
)
def test_multimodal_rotary(call, error, match):
    _run(call, error, match)


def _apply_cases():
    _, _, cos, sin = _tables()
    q, k = torch.randn(1, 4, 11, 16), torch.randn(1, 2, 11, 16)
    fit = r"does not fit tables \(1, 11, 16\): it needs L = 11 tokens, batch 1"
    return [
        ("int_q", lambda: apply_multimodal_rotary(q.long(), k, cos, sin), TypeError, r"q must be floating point"),
        ("list_cos", lambda: apply_multimodal_rotary(q, k, cos.tolist(), sin), TypeError, r"cos must be a tensor"),
        ("rank", lambda: apply_multimodal_rotary(q[0], k, cos, sin), ValueError, r"q must be \(B, H, L, D\), got"),
        (
            "q_length",
            lambda: apply_multimodal_rotary(q[:, :, :9], k, cos, sin),
            ValueError,
            r"q \(1, 4, 9, 16\) " + fit,
        ),
        (
            "k_length",
            lambda: apply_multimodal_rotary(q, k[:, :, :5], cos, sin),
            ValueError,
            r"k \(1, 2, 5, 16\) " + fit,
        ),
        ("narrow", lambda: apply_multimodal_rotary(q[..., :8], k, cos, sin), ValueError, r"q \(1, 4, 11, 8\) " + fit),
        (
            "odd_table",
            lambda: apply_multimodal_rotary(q, k, cos[..., :15], sin[..., :15]),
            ValueError,
            r"rotated channels \(an even count\)",
        ),
        (
            "batch",
            lambda: apply_multimodal_rotary(q, k, cos.expand(2, -1, -1), sin.expand(2, -1, -1)),
            ValueError,
            r"batch 2 \(or tables of batch 1\)",
        ),
        ("table_shapes", lambda: apply_multimodal_rotary(q, k, cos, sin[0]), ValueError, r"cos and sin must share"),
    ]


@pytest.mark.parametrize("case", _apply_cases(), ids=lambda c: c[0])
def test_apply_multimodal_rotary(case):
    _, call, error, match = case
    _run(call, error, match)
