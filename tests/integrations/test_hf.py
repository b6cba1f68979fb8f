"""visionpe schemes inside real transformers Qwen-VL models, built from tiny random configs (no downloads)."""

import copy
import subprocess
import sys

import pytest
import torch

from visionpe.multimodal import get_multimodal_scheme, get_position_ids, list_multimodal_schemes
from visionpe.multimodal.allocation import interleaved_allocation

from ..multimodal.helpers import IMAGES_ONLY

transformers = pytest.importorskip("transformers")
from visionpe.integrations.hf import apply_position_scheme, remove_position_scheme  # noqa: E402

IMAGE, VIDEO, VSTART, VEND = 100, 101, 102, 103
TEXT = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
VISION = dict(depth=1, num_heads=2, patch_size=2, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND)
GEN = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)


def tiny_model(family: str, head_dim: int = 16, mrope_section=(4, 2, 2)):
    """A tiny random model; ``head_dim`` and ``mrope_section`` apply to Qwen3-VL (the others use 8 pairs)."""
    torch.manual_seed(0)
    rope = {"rope_type": "default", "rope_theta": 1e6}
    if family == "qwen2_vl":
        config = transformers.Qwen2VLConfig(
            text_config={**TEXT, "rope_parameters": {**rope, "mrope_section": [2, 3, 3]}},
            vision_config={**VISION, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2},
            **TOKENS,
        )
        return transformers.Qwen2VLForConditionalGeneration(config).eval()
    if family == "qwen2_5_vl":
        config = transformers.Qwen2_5_VLConfig(
            text_config={**TEXT, "rope_parameters": {**rope, "mrope_section": [2, 3, 3]}},
            vision_config={
                **VISION,
                "hidden_size": 32,
                "intermediate_size": 64,
                "out_hidden_size": 64,
                "window_size": 8,
                "fullatt_block_indexes": [0],
                "tokens_per_second": 2,
            },
            **TOKENS,
        )
        return transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    config = transformers.Qwen3VLConfig(
        text_config={**TEXT, "head_dim": head_dim, "rope_parameters": {**rope, "mrope_section": list(mrope_section)}},
        vision_config={
            **VISION,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        },
        **TOKENS,
    )
    return transformers.Qwen3VLForConditionalGeneration(config).eval()


def batch(blocks_per_sample, with_video=False, seed=0):
    """Left-padded ids with <vs> block <ve> spans; blocks are (kind, (t, h, w)) with kind 1 image, 2 video."""
    gen = torch.Generator().manual_seed(seed)
    rows, images, videos = [], [], []
    for blocks in blocks_per_sample:
        ids, types = torch.randint(4, 100, (3,), generator=gen).tolist(), [0, 0, 0]
        for kind, thw in blocks:
            n = thw[0] * thw[1] * thw[2] // 4
            ids += [VSTART] + [IMAGE if kind == 1 else VIDEO] * n + [VEND]
            types += [0] + [kind] * n + [0]
            (images if kind == 1 else videos).append(thw)
            ids += torch.randint(4, 100, (2,), generator=gen).tolist()
            types += [0, 0]
        rows.append((ids, types))
    length = max(len(r[0]) for r in rows)
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    types = torch.zeros_like(input_ids)
    mask = torch.zeros_like(input_ids)
    for b, (ids, tt) in enumerate(rows):
        input_ids[b, length - len(ids) :] = torch.tensor(ids)
        types[b, length - len(ids) :] = torch.tensor(tt)
        mask[b, length - len(ids) :] = 1
    out = dict(input_ids=input_ids, attention_mask=mask, mm_token_type_ids=types)
    patch_dim = 3 * 2 * 2 * 2
    if images:
        grid = torch.tensor(images)
        out.update(image_grid_thw=grid, pixel_values=torch.randn(int(grid.prod(1).sum()), patch_dim, generator=gen))
    if videos:
        grid = torch.tensor(videos)
        out.update(
            video_grid_thw=grid, pixel_values_videos=torch.randn(int(grid.prod(1).sum()), patch_dim, generator=gen)
        )
    return out


IMAGES = [[(1, (1, 4, 4)), (1, (1, 4, 6))], [(1, (1, 4, 4))]]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_mrope_reproduces_model_in_forward_and_generate(family):
    model = tiny_model(family)
    inputs = batch(IMAGES)
    scheme = "mrope_interleaved" if family == "qwen3_vl" else "mrope"
    patched = apply_position_scheme(copy.deepcopy(model), scheme)
    with torch.no_grad():
        ref, out = model(**inputs).logits, patched(**inputs).logits
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
        gen_ref, gen_out = model.generate(**inputs, **GEN), patched.generate(**inputs, **GEN)
    assert torch.equal(gen_ref.sequences, gen_out.sequences)
    for step_ref, step_out in zip(gen_ref.logits, gen_out.logits, strict=True):
        torch.testing.assert_close(step_out, step_ref, rtol=0, atol=1e-5)


def _continue_batch(inputs, sequences):
    """The prompt plus all generated tokens but the last, as one uncached forward input."""
    new = sequences.shape[1] - inputs["input_ids"].shape[1] - 1
    grown = dict(inputs, input_ids=sequences[:, :-1])
    grown["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(sequences[:, :new])], 1)
    grown["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(sequences[:, :new])], 1)
    return grown, new


# schemes with required options (PyPE's interval) cannot be applied without them; test_hf_per_layer.py runs them
@pytest.mark.parametrize(
    "scheme", [s for s in list_multimodal_schemes() if s != "mrope" and not get_multimodal_scheme(s).required_options]
)
def test_every_scheme_runs_changes_logits_and_decodes_consistently(scheme):
    model = tiny_model("qwen2_5_vl")
    with_video = scheme not in IMAGES_ONLY
    blocks = [IMAGES[0], [(2, (2, 4, 4))] if with_video else IMAGES[1]]
    inputs = batch(blocks)
    if with_video:
        inputs["second_per_grid_ts"] = torch.tensor([2.0])
    patched = apply_position_scheme(copy.deepcopy(model), scheme)
    with torch.no_grad():
        ref = model(**inputs).logits
        out = patched(**inputs).logits
        assert torch.isfinite(out).all() and (out - ref).abs().max() > 1e-4
        generated = patched.generate(**inputs, **GEN)
        # KV-cached decoding == one uncached forward over prompt + generated tokens (rope_deltas are consistent).
        grown, new = _continue_batch(inputs, generated.sequences)
        patched.model.rope_deltas = None
        full = patched(**grown).logits
    for step in range(new + 1):
        torch.testing.assert_close(
            generated.logits[step], full[:, inputs["input_ids"].shape[1] - 1 + step], rtol=0, atol=1e-4
        )


def test_adapter_ids_are_visionpe_ids():
    model = apply_position_scheme(tiny_model("qwen2_vl"), "v2pe", delta=0.5)
    inputs = batch(IMAGES)
    pos, delta = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"], None, inputs["attention_mask"]
    )
    ref, ref_delta = get_position_ids(
        "v2pe",
        inputs["mm_token_type_ids"],
        inputs["image_grid_thw"],
        None,
        inputs["attention_mask"],
        delta=0.5,
        pad_value=0,
    )
    assert torch.equal(pos, ref) and torch.equal(delta, ref_delta)
    assert pos.dtype == delta.dtype == torch.float64  # fractional ids stay float64


class _SeenTokens:
    """A stand-in for a KV cache that only reports how many tokens it holds."""

    def __init__(self, length):
        self.length = length

    def get_seq_length(self, *_):
        return self.length


def test_v2pe_one_256th_steps_stay_distinct_through_the_adapter_on_a_long_prompt():
    """70,000 text tokens then an image, V2PE delta = 1/256 (beyond 2^16, where fp32 would merge the steps): the
    patched get_rope_index, transformers' generation and decoding arithmetic and the patched rotary keep float64
    ids, distinct per visual token, and every visual token gets its own rotation, accurate to a float64 reference."""
    long, n_visual, delta = 70_000, 16, 1 / 256
    model = apply_position_scheme(tiny_model("qwen2_vl"), "v2pe", delta=delta)
    types = torch.zeros(1, long + n_visual + 4, dtype=torch.long)
    types[0, long : long + n_visual] = 1
    input_ids = torch.where(types == 1, IMAGE, 5)
    mask = torch.ones_like(types)
    grid = torch.tensor([[1, 8, 8]])
    pos, rope_deltas = model.model.get_rope_index(input_ids, types, grid, None, mask)
    assert pos.dtype == rope_deltas.dtype == torch.float64
    visual = pos[0, 0, long : long + n_visual]
    assert (visual[1:] - visual[:-1] == delta).all() and visual.min() > 2**16
    assert not (visual.float()[1:] > visual.float()[:-1]).all()  # what float32 ids would have done
    # generate: transformers concatenates its int64 text row with the adapter's ids (4, B, L): float64 survives
    kwargs = dict(attention_mask=mask, mm_token_type_ids=types, image_grid_thw=grid)
    prepared = model._prepare_position_ids_for_generation(input_ids, dict(kwargs, input_ids=input_ids))
    assert prepared.dtype == torch.float64 and torch.equal(prepared[1:], pos)
    assert torch.equal(prepared[0, 0], torch.arange(types.shape[1], dtype=torch.float64))
    # a cached decoding step: transformers adds the stored float64 rope_deltas to cumsum(mask) - 1
    model.model.rope_deltas = rope_deltas
    step = model.model.compute_3d_position_ids(
        input_ids=input_ids[:, :1],
        inputs_embeds=torch.zeros(1, 1, TEXT["hidden_size"]),
        attention_mask=torch.ones(1, types.shape[1] + 1, dtype=torch.long),
        cache=_SeenTokens(types.shape[1]),
    )
    assert step.dtype == torch.float64 and (step[..., -1] == pos.amax() + 1).all()  # the new token's ids
    # the patched rotary on the visual tokens and the text after them, as the language model calls it
    window = pos[:, :, long - 1 :]
    rotary = model.model.language_model.rotary_emb
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = rotary(torch.zeros(1, 1, dtype=dtype), window)
        assert cos.dtype == sin.dtype == dtype
    cos, sin = rotary(torch.zeros(1, 1), window)
    assert (cos[0, 1:] != cos[0, :-1]).any(-1).all()  # every token gets its own rotation
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    phi = (window.permute(1, 2, 0) @ rotary.rotary.mix.double().T) * inv_freq
    phi = torch.cat((phi, phi), dim=-1)
    torch.testing.assert_close(cos, phi.cos().float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, phi.sin().float(), rtol=0, atol=1e-6)
    # and a forward of those tokens at those positions (the ids passed through, as generate passes them)
    seen = []
    handle = rotary.register_forward_hook(lambda module, args, out: seen.append((args[1].dtype, out[0])))
    with torch.no_grad():
        logits = model(input_ids=input_ids[:, long - 1 :], position_ids=window).logits
    handle.remove()
    assert torch.isfinite(logits).all()
    assert seen[0][0] == torch.float64 and torch.equal(seen[0][1], cos)


def test_unsupported_model_and_bad_options():
    with pytest.raises(TypeError, match="supports Qwen2VLModel.*Qwen2_5_VLModel.*got Linear"):
        apply_position_scheme(torch.nn.Linear(2, 2), "mrope")
    model = tiny_model("qwen2_vl")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['gamma'\]"):
        apply_position_scheme(model, "videorope", gamma=1.0)
    with pytest.raises(ValueError, match="unknown multimodal scheme"):
        apply_position_scheme(model, "rope2000")
    with pytest.raises(ValueError, match="per-call input"):
        apply_position_scheme(model, "mrope_abs_time", second_per_grid_ts=[1.0])


@pytest.mark.parametrize(
    "frames, fps",
    [
        (4, 4),  # spg 0.5: the float interval that must not collapse
        (26, 25),  # spg float32(0.08): frame 25 is t = 4 in transformers' float32 product (3 in float64)
        (6, 2 / 0.7),  # spg 0.7: every 5th frame
    ],
)
def test_abs_time_with_transformers_continuation_reproduces_qwen25_on_video(frames, fps):
    model = tiny_model("qwen2_5_vl")
    inputs = batch([IMAGES[0], [(2, (frames, 4, 4))]])
    inputs["second_per_grid_ts"] = torch.tensor([2 / fps])  # float32, as the processor returns it
    patched = apply_position_scheme(copy.deepcopy(model), "mrope_abs_time", continuation="spatial_extent")
    legacy = apply_position_scheme(copy.deepcopy(model), "mrope_abs_time")
    with torch.no_grad():
        ref = model(**inputs).logits
        torch.testing.assert_close(patched(**inputs).logits, ref, rtol=0, atol=1e-5)
        assert (legacy(**inputs).logits - ref).abs().max() > 1e-4  # the original rule differs after a video


def _logits(model, inputs):
    model.model.rope_deltas = None
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize(
    "first, second",
    [
        (("mrope", {}), ("videorope", {})),
        (("mhrope", {}), ("mrope", {})),
        (("v2pe", {"delta": 0.5}), ("v2pe", {})),
        (("videorope", {"delta": 1.0}), ("mrope_abs_time", {"continuation": "spatial_extent"})),
    ],
    ids=lambda pair: pair[0],
)
def test_reapplying_a_scheme_equals_applying_it_to_a_fresh_model(first, second):
    model = tiny_model("qwen2_5_vl")
    inputs = batch([IMAGES[0], [(2, (4, 4, 4))]])
    inputs["second_per_grid_ts"] = torch.tensor([0.5])
    fresh = apply_position_scheme(copy.deepcopy(model), second[0], **second[1])
    twice = apply_position_scheme(copy.deepcopy(model), first[0], **first[1])
    first_logits = _logits(twice, inputs)
    assert apply_position_scheme(twice, second[0], **second[1]) is twice
    assert twice.visionpe_scheme == second[0]
    assert torch.equal(_logits(twice, inputs), _logits(fresh, inputs))
    if first != second:
        assert not torch.equal(first_logits, _logits(fresh, inputs))


@pytest.mark.parametrize("family, scheme", [("qwen2_vl", "videorope"), ("qwen2_5_vl", "mhrope"), ("qwen3_vl", "v2pe")])
def test_remove_position_scheme_restores_the_model(family, scheme):
    model = tiny_model(family)
    # (Qwen3-VL videos need timestamp text between the frames, which batch() does not write)
    inputs = batch(IMAGES if family == "qwen3_vl" else [IMAGES[0], [(2, (4, 4, 4))]])
    if family == "qwen2_5_vl":
        inputs["second_per_grid_ts"] = torch.tensor([0.5])
    ref = _logits(model, inputs)
    patched = copy.deepcopy(model)
    own_rotary = patched.model.language_model.rotary_emb
    keys = set(patched.state_dict())
    apply_position_scheme(patched, "mrope")
    apply_position_scheme(patched, scheme)
    assert set(patched.state_dict()) == keys
    assert not torch.equal(_logits(patched, inputs), ref)
    assert remove_position_scheme(patched) is patched
    assert patched.model.language_model.rotary_emb is own_rotary
    assert "get_rope_index" not in vars(patched.model) and not hasattr(patched, "visionpe_scheme")
    assert "compute_3d_position_ids" not in vars(patched.model)
    assert "_prepare_position_ids_for_generation" not in vars(patched)
    assert torch.equal(_logits(patched, inputs), ref)
    with torch.no_grad():  # generate too (cached decoding, fresh rope_deltas)
        gen_ref, gen_out = model.generate(**inputs, **GEN), patched.generate(**inputs, **GEN)
    assert torch.equal(gen_ref.sequences, gen_out.sequences)
    for step_ref, step_out in zip(gen_ref.logits, gen_out.logits, strict=True):
        assert torch.equal(step_out, step_ref)
    assert remove_position_scheme(patched) is patched  # a no-op on an unpatched model
    assert torch.equal(_logits(patched, inputs), ref)
    apply_position_scheme(patched, scheme)  # and it can be patched again
    assert patched.visionpe_scheme == scheme


def test_removed_scheme_follows_dtype_moves():
    # The model's own rotary is kept inside the patch, so .to() after patching reaches it.
    model = tiny_model("qwen2_vl")
    inputs = batch(IMAGES)
    patched = apply_position_scheme(copy.deepcopy(model), "videorope").double()
    remove_position_scheme(patched)
    assert torch.equal(_logits(patched, inputs), _logits(model.double(), inputs))


BAD_OPTIONS = [
    ("mrope", {"continuation": "bogus"}, ValueError, r"continuation must be one of \('max_plus_one', .*got 'bogus'"),
    ("mrope_abs_time", {"continuation": 3}, ValueError, "continuation must be one of .*got 3"),
    ("v2pe", {"delta": -1.0}, ValueError, r"delta must be positive and finite, got \[-1.0\]"),
    ("v2pe", {"delta": "x"}, TypeError, r"delta must be a number, a \(B,\) or a \(B, K\) tensor, got str"),
    ("videorope", {"delta": float("nan")}, ValueError, "delta must be positive and finite"),
    ("hope", {"temporal_scale": 0}, ValueError, "temporal_scale must be positive and finite"),
    ("mrope_abs_time", {"tokens_per_second": 0}, ValueError, "tokens_per_second must be positive and finite, got 0"),
    ("mrope_abs_time", {"tokens_per_second": "2"}, TypeError, "tokens_per_second must be a number, got str"),
    ("mrope_abs_time", {"fractional_time": 1}, TypeError, "fractional_time must be a bool, got int"),
    ("mrope_interleaved", {"spatial_reset": "yes"}, TypeError, "spatial_reset must be a bool, got str"),
    ("circle_rope", {"alpha": 2.0}, ValueError, r"alpha must be a number in \[0, 1\], got 2.0"),
    ("mrope", {"mrope_section": 5}, TypeError, r"mrope_section must be a list or tuple of three .*got int \(5\)"),
    ("mrope", {"mrope_section": (2, 3, 4)}, ValueError, r"mrope_section \(2, 3, 4\) must sum to num_pairs=8"),
    ("mrope", {"mrope_section": (1, 2)}, ValueError, "mrope_section must be three non-negative ints"),
    ("v2pe", {"mrope_section": (2, 3, 3)}, ValueError, "'single_axis' allocation, which takes no mrope_section"),
]
BAD_OPTION_IDS = [f"{scheme}-{k}={v!r}" for scheme, options, *_ in BAD_OPTIONS for k, v in options.items()]


@pytest.mark.parametrize("patched_before", [False, True])
@pytest.mark.parametrize("scheme, options, error, message", BAD_OPTIONS, ids=BAD_OPTION_IDS)
def test_bad_option_values_fail_before_patching(scheme, options, error, message, patched_before):
    model = tiny_model("qwen2_vl")
    inputs = batch(IMAGES)
    ref = _logits(model, inputs)
    if patched_before:
        apply_position_scheme(model, "videorope")
    before = _logits(model, inputs)
    rotary = model.model.language_model.rotary_emb
    with pytest.raises(error, match=message):
        apply_position_scheme(model, scheme, **options)
    assert model.model.language_model.rotary_emb is rotary
    assert getattr(model, "visionpe_scheme", None) == ("videorope" if patched_before else None)
    assert torch.equal(_logits(model, inputs), before)
    apply_position_scheme(model, "mrope")  # a later valid call works: M-RoPE reproduces Qwen2-VL on images
    torch.testing.assert_close(_logits(model, inputs), ref, rtol=0, atol=1e-5)


def test_per_sample_option_tensor_is_still_accepted():
    model = apply_position_scheme(tiny_model("qwen2_vl"), "v2pe", delta=torch.tensor([0.5, 0.25]))
    assert torch.isfinite(_logits(model, batch(IMAGES))).all()


def test_import_without_transformers():
    # the core and the multimodal schemes import without transformers; this module says which extra it needs
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'transformers':\n"
        "            raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import visionpe, visionpe.multimodal\n"
        "try:\n"
        "    import visionpe.integrations.hf\n"
        "except ImportError as err:\n"
        "    assert 'pip install -e \".[vlm]\"' in str(err), err\n"
        "    print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr


@pytest.mark.parametrize("family, scheme", [("qwen2_vl", "videorope"), ("qwen2_5_vl", "v2pe"), ("qwen3_vl", "hope")])
def test_missing_token_types_is_an_error_not_all_text_ids(family, scheme):
    # the layout cannot be read from the ids (nor from inputs_embeds), so the adapter takes token types and
    # must not fall back to all-text (1-D) positions for a batch with visual tokens when they are missing.
    model = apply_position_scheme(tiny_model(family), scheme)
    inputs = batch(IMAGES)
    ids, grid, mask = inputs["input_ids"], inputs["image_grid_thw"], inputs["attention_mask"]
    with pytest.raises(ValueError, match=rf"visionpe scheme '{scheme}' needs mm_token_type_ids"):
        model.model.get_rope_index(ids, None, grid, None, mask)
    with pytest.raises(ValueError, match=rf"visionpe scheme '{scheme}' needs mm_token_type_ids"):
        model.model.get_rope_index(input_ids=ids, image_grid_thw=grid, attention_mask=mask)
    pos, _ = model.model.get_rope_index(ids, inputs["mm_token_type_ids"], grid, None, mask)
    all_text, _ = model.model.get_rope_index(ids, torch.zeros_like(ids), None, None, mask)
    assert not torch.equal(pos, all_text)  # with the types, the image tokens get their own positions


FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


@pytest.mark.parametrize("path", ["forward", "generate", "inputs_embeds"])
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_has_no_silent_all_text_fallback(family, path):
    # transformers 5.x never calls get_rope_index without mm_token_type_ids (or, in forward, without
    # input_ids) and falls back to 1-D text positions (Qwen2.5-VL's forward does not even check); with visual inputs,
    # the patched model raises instead, in forward, in generate and for an inputs_embeds-only forward.
    model = apply_position_scheme(tiny_model(family), "videorope")
    inputs = batch(IMAGES)
    del inputs["mm_token_type_ids"]
    if path == "inputs_embeds":  # without pixel_values: the grids alone are visual inputs
        del inputs["pixel_values"]
        inputs["inputs_embeds"] = model.model.get_input_embeddings()(inputs.pop("input_ids"))
    model.model.rope_deltas = None
    message = r"visionpe scheme 'videorope' needs mm_token_type_ids .*image_grid_thw came without them"
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        model.generate(**inputs, **GEN) if path == "generate" else model(**inputs)


@pytest.mark.parametrize("family", FAMILIES)
def test_inputs_embeds_with_token_types_get_the_input_ids_positions(family):
    # With the token types the layout is known without input_ids: forward and generate from inputs_embeds use the
    # scheme's ids (transformers would use 1-D text positions: logits ~3e-3 off on these tiny models).
    model = apply_position_scheme(tiny_model(family), "videorope")
    inputs = batch(IMAGES)
    embeds = model.model.get_input_embeddings()(inputs["input_ids"])
    from_embeds = {k: v for k, v in inputs.items() if k != "input_ids"}
    from_embeds["inputs_embeds"] = embeds
    torch.testing.assert_close(_logits(model, from_embeds), _logits(model, inputs), rtol=0, atol=1e-5)
    with torch.no_grad():
        model.model.rope_deltas = None
        ref = model.generate(**inputs, **GEN)
        model.model.rope_deltas = None
        out = model.generate(**from_embeds, **GEN)
    assert torch.equal(out.sequences, ref.sequences[:, inputs["input_ids"].shape[1] :])
    for step_ref, step_out in zip(ref.logits, out.logits, strict=True):
        torch.testing.assert_close(step_out, step_ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_text_only_calls_need_no_token_types(family):
    # All-text ids are right without visual inputs: the patched model equals the unpatched one on text (VideoRoPE's
    # three rows are equal there), in forward, with inputs_embeds and in generate.
    model = tiny_model(family)
    patched = apply_position_scheme(copy.deepcopy(model), "videorope")
    inputs = {k: v[:, -6:] for k, v in batch([[], []], seed=1).items()}
    inputs["attention_mask"][1, 0] = 0
    del inputs["mm_token_type_ids"]
    embeds = {"inputs_embeds": model.model.get_input_embeddings()(inputs["input_ids"]), **inputs}
    del embeds["input_ids"]
    for call in (inputs, embeds):
        torch.testing.assert_close(_logits(patched, call), _logits(model, call), rtol=0, atol=1e-5)
    with torch.no_grad():
        ref, out = model.generate(**inputs, **GEN), patched.generate(**inputs, **GEN)
    assert torch.equal(out.sequences, ref.sequences)
    for step_ref, step_out in zip(ref.logits, out.logits, strict=True):
        torch.testing.assert_close(step_out, step_ref, rtol=0, atol=1e-5)


def test_patched_methods_follow_deepcopy_and_removal_through_the_inner_model():
    model = tiny_model("qwen2_vl")
    inputs = batch(IMAGES)
    no_types = {k: v for k, v in inputs.items() if k != "mm_token_type_ids"}
    patched = apply_position_scheme(copy.deepcopy(model), "videorope")
    clone = copy.deepcopy(patched)  # the per-instance methods are bound to the copy, not to the original
    assert clone._prepare_position_ids_for_generation.__self__ is clone
    assert clone.model.compute_3d_position_ids.__self__ is clone.model
    with torch.no_grad(), pytest.raises(ValueError, match="mm_token_type_ids"):
        clone.generate(**no_types, **GEN)
    # Removed through the inner model, the outer model's generate is the unpatched one again (its method defers).
    remove_position_scheme(clone.model)
    assert "compute_3d_position_ids" not in vars(clone.model) and "get_rope_index" not in vars(clone.model)
    with torch.no_grad():
        ref, out = model.generate(**inputs, **GEN), clone.generate(**inputs, **GEN)
    assert torch.equal(out.sequences, ref.sequences)
    remove_position_scheme(clone)  # and removing through the outer model cleans the rest up
    assert "_prepare_position_ids_for_generation" not in vars(clone)


def test_default_interleaved_section_fits_every_head_size():
    # the interleaved allocation: pair n -> h if n % 3 == 1 and n < 3 s_h, -> w if n % 3 == 2 and n < 3 s_w, so
    # the default section (for a model whose own mrope_section does not fit its head size) must keep 3 s_h <= P + 1
    # and 3 s_w <= P.
    inputs = batch(IMAGES)
    del inputs["mm_token_type_ids"], inputs["pixel_values"], inputs["image_grid_thw"]  # text only: runs for any P
    sections = {}
    for pairs in range(1, 41):
        model = apply_position_scheme(
            tiny_model("qwen3_vl", head_dim=2 * pairs, mrope_section=(pairs + 1, 0, 0)), "mrope_interleaved"
        )
        rotary = model.model.language_model.rotary_emb.rotary
        s_t, s_h, s_w = (int(n) for n in rotary.mix.sum(0).tolist())
        sections[pairs] = (s_t, s_h, s_w)
        assert s_t + s_h + s_w == pairs and 3 * s_h <= pairs + 1 and 3 * s_w <= pairs, (pairs, sections[pairs])
        assert torch.equal(rotary.mix, interleaved_allocation(pairs, sections[pairs]).mix)
        ideal = [pairs * share / 64 for share in (24, 20, 20)]  # Qwen3-VL's proportions (24, 20, 20)
        assert all(abs(s - i) <= 1 for s, i in zip(sections[pairs], ideal, strict=True)), (pairs, sections[pairs])
        spatial = round(pairs * 20 / 64)
        if 3 * spatial <= pairs:  # where the layout allows it, h == w as before
            assert sections[pairs] == (pairs - 2 * spatial, spatial, spatial)
        if pairs in (2, 5):
            assert torch.isfinite(_logits(model, inputs)).all()
    assert sections[2] == (1, 1, 0) and sections[5] == (2, 2, 1) and sections[32] == (12, 10, 10)
