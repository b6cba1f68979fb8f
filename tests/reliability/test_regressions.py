"""Regressions the ecosystem has hit (bugs reported against other position-encoding code): x/y swaps on non-square
grids, rope_deltas with left padding in mixed image/text batches, fractional temporal strides, stale deltas across
two ``generate`` calls.

(Already covered elsewhere: rope_axial == timm's ``grid_indexing="xy"`` and not ``"ij"``, iRPE rows-then-columns,
LookHere directions, sincos's first half on the column, CPE's (H, W) from the grid; deltas under left padding
per scheme; the fps-4 ``second_per_grid_ts=0.5`` collapse in forward.)
"""

import copy

import pytest
import torch
from timm.layers import resample_abs_pos_embed

import visionpe
from visionpe.multimodal import get_position_ids
from visionpe.rotary.string_base import StringBase

from .helpers import ALL_SCHEMES, ROTARY, perturb_, tiny_vit

# -- x/y on non-square grids ---------------------------------------------------------------------------------------

HEIGHT, WIDTH = 4, 6  # a 32 x 48 image with 8 px patches: 4 rows, 6 columns


def _explicit_coords(scheme, height, width):
    """(y, x) of token k = (k // W, k % W), written out, in the scheme's coordinate convention."""
    k = torch.arange(height * width)
    y, x = (k // width).float(), (k % width).float()
    if scheme.coord_mode == "normalized":
        y, x = (y + 0.5) / height, (x + 0.5) / width
    if scheme.coord_mode == "normalized_pm1":
        y, x = 2 * (y + 0.5) / height - 1, 2 * (x + 0.5) / width - 1
    return torch.stack([y, x], dim=1)


@pytest.mark.parametrize("name", ALL_SCHEMES)
def test_model_reads_the_grid_of_a_non_square_image_as_rows_by_columns(name):
    torch.manual_seed(0)
    model = tiny_vit(name, dynamic_img_size=True)
    seen = []
    original = model.position_context

    def spy(grid_size, device, *args):
        seen.append(tuple(grid_size))
        return original(grid_size, device, *args)

    model.position_context = spy
    model(torch.randn(1, 3, 8 * HEIGHT, 8 * WIDTH))
    assert seen == [(HEIGHT, WIDTH)]


@pytest.mark.parametrize("name", ROTARY)
def test_model_rotation_of_a_non_square_grid_equals_rotation_at_explicit_y_x(name):
    """The rotation the model applies to patch token k is the scheme's rotation at (y, x) = (k // W, k % W) (in eval
    mode: a scheme may draw its coordinates in training, as rope_dinov3 does)."""
    torch.manual_seed(0)
    model = perturb_(tiny_vit(name, dynamic_img_size=True)).eval()
    scheme, (state,) = model.pos_schemes[name], model.position_context((HEIGHT, WIDTH), torch.device("cpu")).rotary
    x = torch.randn(1, 2, 1 + HEIGHT * WIDTH, 16)
    in_model = scheme.apply(torch.stack([x, x]), state, 0)[0]
    explicit = scheme.rotate(x[:, :, 1:], _explicit_coords(scheme, HEIGHT, WIDTH))
    if isinstance(scheme, StringBase) and scheme.rotation_output_basis() is not None:
        # Circulant-STRING's model path leaves its output basis F on q and k (F^T F = I: the scores are the same)
        in_model = in_model @ scheme.rotation_output_basis()
    torch.testing.assert_close(in_model[:, :, 1:], explicit, rtol=1e-5, atol=1e-5)
    transposed = scheme.rotate(x[:, :, 1:], _explicit_coords(scheme, HEIGHT, WIDTH).flip(1))
    assert not torch.allclose(in_model[:, :, 1:], transposed, atol=1e-3)


def test_learned_table_resamples_to_rows_by_columns():
    """A 4 x 4 table resampled to 4 x 6 (dynamic input) and to 6 x 4 (set_input_size): rows stay rows."""
    torch.manual_seed(0)
    model = perturb_(tiny_vit("learned", dynamic_img_size=True))
    scheme = model.pos_schemes["learned"]
    table = scheme.pos_embed.detach()
    for grid in [(HEIGHT, WIDTH), (WIDTH, HEIGHT)]:
        expected = resample_abs_pos_embed(table, list(grid), old_size=[4, 4], num_prefix_tokens=1)
        swapped = resample_abs_pos_embed(table, list(grid[::-1]), old_size=[4, 4], num_prefix_tokens=1)
        swapped = swapped[:, 1:].unflatten(1, grid[::-1]).transpose(1, 2).flatten(1, 2)  # the x/y-swapped table
        torch.testing.assert_close(scheme.resampled(grid), expected)
        assert not torch.allclose(scheme.resampled(grid)[:, 1:], swapped, atol=1e-4)
    model.set_input_size(img_size=(8 * WIDTH, 8 * HEIGHT))
    torch.testing.assert_close(
        scheme.pos_embed, resample_abs_pos_embed(table, [WIDTH, HEIGHT], old_size=[4, 4], num_prefix_tokens=1)
    )


def test_alibi_distances_of_a_non_square_grid():
    scheme = visionpe.create_pos_embed("alibi2d", dim=32, num_heads=2)
    q = torch.randn(1, 2, 1 + HEIGHT * WIDTH, 16)
    bias = scheme.attn_bias(q, q, scheme.prepare((HEIGHT, WIDTH), 1), 0)[0, :, 1:, 1:]
    coords = _explicit_coords(scheme, HEIGHT, WIDTH)
    distance = (coords[:, None] - coords[None]).norm(dim=-1)
    torch.testing.assert_close(bias, -scheme.slopes[:, None, None] * distance)


# -- fractional temporal strides ---------------------------------------------------------------------------------

VIDEO_SEQ = torch.tensor([[0, 0] + [2] * 12 + [0, 0]])  # T T | (3, 4, 4) video: 3 frames of 2 x 2 | T T
VIDEO_GRID = torch.tensor([[3, 4, 4]])


@pytest.mark.parametrize(
    "scheme, kwargs, step",
    [
        ("mrope_interleaved", {"spatial_reset": True, "temporal_stride": 0.5}, 0.5),
        ("videorope", {"delta": 0.5}, 0.5),
        ("hope", {"temporal_scale": 0.75}, 0.75),
        ("mrope_abs_time", {"second_per_grid_ts": torch.tensor([0.25]), "fractional_time": True}, 0.5),
        ("mrope_abs_time", {"second_per_grid_ts": torch.tensor([0.5])}, 1.0),  # fps 4: 0, 1, 2, not 0, 0, 0
    ],
)
def test_fractional_temporal_strides_are_kept(scheme, kwargs, step):
    pos, _ = get_position_ids(scheme, VIDEO_SEQ, video_grid_thw=VIDEO_GRID, **kwargs)
    frames = pos[0, 0, 2:14].view(3, 4)  # the t row, frame by frame
    assert (frames == frames[:, :1]).all()  # one time per frame
    torch.testing.assert_close(frames[:, 0] - frames[0, 0], torch.tensor([0.0, step, 2 * step]), check_dtype=False)
    assert pos.dtype == (torch.long if float(step).is_integer() and scheme == "mrope_abs_time" else torch.float64)


# -- Qwen-VL through the Hugging Face adapter --------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    from ..integrations import test_hf

    return test_hf


def _generate(model, inputs, hf):
    with torch.no_grad():
        return model.generate(**inputs, **hf.GEN)


def _assert_same_generation(out, ref, rows=slice(None), atol=1e-5):
    """The tokens and logits ``ref`` generated equal those of ``out`` in ``rows`` (a row that stopped at EOS alone
    may run on inside a batch)."""
    steps = len(ref.logits)
    new = out.sequences[rows, -len(out.logits) :][:, :steps]
    assert torch.equal(new, ref.sequences[:, -steps:])
    for step_out, step_ref in zip(out.logits[:steps], ref.logits, strict=True):
        torch.testing.assert_close(step_out[rows], step_ref, rtol=0, atol=atol)


def _single_sample(inputs, b, images_before, image_count):
    """Sample b of a left-padded batch alone, without padding (its ids, types and images)."""
    keep = inputs["attention_mask"][b].bool()
    single = {k: inputs[k][b : b + 1, keep] for k in ("input_ids", "attention_mask", "mm_token_type_ids")}
    if image_count:
        grid = inputs["image_grid_thw"]
        patches = grid.prod(1)
        start = int(patches[:images_before].sum())
        stop = start + int(patches[images_before : images_before + image_count].sum())
        single["image_grid_thw"] = grid[images_before : images_before + image_count]
        single["pixel_values"] = inputs["pixel_values"][start:stop]
    return single


def _cached_step_and_full_forward(model, inputs):
    """Logits of one decoding step through the KV cache, at the position transformers derives from the stored
    rope_deltas (cumsum(attention_mask) - 1 + delta), and of one uncached forward over prompt + that token."""
    with torch.no_grad():
        prefill = model(**inputs, use_cache=True)
        token = prefill.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([inputs["attention_mask"], torch.ones_like(token)], 1)
        position = (mask.cumsum(-1)[:, -1:] - 1 + model.model.rope_deltas).expand(3, -1, -1)
        step = model(input_ids=token, attention_mask=mask, cache=prefill.cache, position_ids=position)
        step = step.logits[:, -1]
        grown = dict(inputs, input_ids=torch.cat([inputs["input_ids"], token], 1), attention_mask=mask)
        grown["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(token)], 1)
        full = model(**grown).logits[:, -1]
    return step, full


def _mixed_batch(hf):
    """Left-padded: two images, a text-only sample, one image."""
    blocks = [[(1, (1, 4, 4)), (1, (1, 4, 6))], [], [(1, (1, 4, 4))]]
    inputs = hf.batch(blocks)
    inputs["input_ids"][1, -12:] = torch.arange(10, 22)  # the text-only sample: 12 text tokens
    inputs["attention_mask"][1, -12:] = 1
    return blocks, inputs


@pytest.mark.parametrize("scheme", ["mrope", "v2pe"])
def test_left_padded_mixed_image_and_text_batch(scheme, hf):
    """Per-row rope_deltas under left padding: a cached decoding step equals the uncached forward, and generate
    gives, row by row, what each sample gives alone."""
    model = hf.apply_position_scheme(hf.tiny_model("qwen2_vl"), scheme)
    blocks, inputs = _mixed_batch(hf)
    step, full = _cached_step_and_full_forward(model, inputs)
    torch.testing.assert_close(step, full, rtol=0, atol=1e-4)
    batched = _generate(model, inputs, hf)
    images_before = 0
    for b, sample_blocks in enumerate(blocks):
        single = _single_sample(inputs, b, images_before, len(sample_blocks))
        images_before += len(sample_blocks)
        _assert_same_generation(batched, _generate(model, single, hf), rows=slice(b, b + 1), atol=1e-4)


@pytest.mark.parametrize("scheme", ["mrope", "videorope"])
def test_second_generate_call_does_not_reuse_stale_deltas(scheme, hf):
    """generate on one batch, then on another with a different layout and batch size: the second call equals a
    fresh model's (for mrope also the unpatched transformers model's)."""
    base = hf.tiny_model("qwen2_vl")
    model = hf.apply_position_scheme(copy.deepcopy(base), scheme)
    first = hf.batch([[(1, (1, 4, 6))], [(1, (1, 4, 4)), (1, (1, 4, 4))]], seed=1)
    second = hf.batch([[(1, (1, 4, 4))], [(1, (1, 8, 4))], [(1, (1, 4, 6)), (1, (1, 4, 4))]], seed=2)
    _generate(model, first, hf)
    out = _generate(model, second, hf)
    fresh = hf.apply_position_scheme(copy.deepcopy(base), scheme)
    _assert_same_generation(out, _generate(fresh, second, hf))
    if scheme == "mrope":
        _assert_same_generation(out, _generate(base, second, hf))
    # after generate, a cached decoding step on the second batch uses that batch's deltas
    _generate(model, first, hf)
    step, full = _cached_step_and_full_forward(model, second)
    torch.testing.assert_close(step, full, rtol=0, atol=1e-4)


def test_fractional_second_per_grid_reaches_the_generation_path(hf):
    """Qwen2.5-VL at fps 4 (second_per_grid_ts=0.5): generate (KV cache) equals one uncached forward over prompt +
    generated tokens, and differs from the collapsed timing an int cast would give (0)."""
    model = hf.apply_position_scheme(hf.tiny_model("qwen2_5_vl"), "mrope_abs_time")
    inputs = hf.batch([[(2, (4, 4, 4))], [(1, (1, 4, 4))]])
    inputs["second_per_grid_ts"] = torch.tensor([0.5])
    generated = _generate(model, inputs, hf)
    grown, new = hf._continue_batch(inputs, generated.sequences)
    model.model.rope_deltas = None
    with torch.no_grad():
        full = model(**grown).logits
        collapsed = model(**dict(grown, second_per_grid_ts=torch.tensor([0.0]))).logits
    prompt = inputs["input_ids"].shape[1]
    for step in range(new + 1):
        torch.testing.assert_close(generated.logits[step], full[:, prompt - 1 + step], rtol=0, atol=1e-4)
    assert (full[0] - collapsed[0]).abs().max() > 1e-4
