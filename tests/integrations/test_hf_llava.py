"""visionpe schemes inside transformers VLMs with 1-D RoPE language models (LLaVA, LLaVA-OneVision, InternVL),
built from tiny random configs (no downloads)."""

import copy
import math

import pytest
import torch

from visionpe.multimodal import MultimodalRotary, get_multimodal_scheme, list_multimodal_schemes

transformers = pytest.importorskip("transformers")
from visionpe.integrations.hf import (  # noqa: E402
    SUPPORTED_MODELS,
    apply_position_scheme,
    remove_position_scheme,
)
from visionpe.integrations.hf.adapter import _HFRotary  # noqa: E402

from .test_hf import GEN, TEXT  # noqa: E402

IMAGE, VIDEO = 100, 101
FAMILIES = ["llava", "llava_onevision", "internvl"]
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
PINPOINTS = [[8, 8], [8, 16], [16, 8], [16, 16]]
# the tokens of one LLaVA image (4x4 patches of 2 px) and of one InternVL tile (8x8 patches, pixel-shuffled to 4x4)
LLAVA_TOKENS = INTERNVL_TILE = 16


def tiny_model(family):
    torch.manual_seed(0)
    if family == "llava":
        config = transformers.LlavaConfig(
            vision_config={**VISION, "model_type": "clip_vision_model", "image_size": 8, "patch_size": 2},
            text_config={**TEXT, "model_type": "llama"},
            image_token_index=IMAGE,
            vision_feature_layer=-1,
        )
        return transformers.LlavaForConditionalGeneration(config).eval()
    if family == "llava_onevision":
        config = transformers.LlavaOnevisionConfig(
            vision_config={**VISION, "model_type": "siglip_vision_model", "image_size": 8, "patch_size": 2},
            text_config={**TEXT, "model_type": "qwen2"},
            image_token_index=IMAGE,
            video_token_index=VIDEO,
            vision_feature_layer=-1,
            vision_feature_select_strategy="full",
            image_grid_pinpoints=PINPOINTS,
        )
        return transformers.LlavaOnevisionForConditionalGeneration(config).eval()
    config = transformers.InternVLConfig(
        vision_config={**VISION, "image_size": [16, 16], "patch_size": [2, 2]},
        text_config={**TEXT, "model_type": "qwen2"},
        image_token_id=IMAGE,
        vision_feature_layer=-1,
    )
    return transformers.InternVLForConditionalGeneration(config).eval()


def _left_pad(rows):
    length = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for b, ids in enumerate(rows):
        input_ids[b, length - len(ids) :] = torch.tensor(ids)
        mask[b, length - len(ids) :] = 1
    return input_ids, mask


def batch(family, model=None, seed=0):
    """Two left-padded samples: text, image runs separated by text, text; plus the family's visual inputs.

    LLaVA: sample 0 two adjacent images, sample 1 one; InternVL: one image of 3 tiles, then images of 1 and 2 tiles;
    LLaVA-OneVision: one anyres image each (10x18 and 12x8 px), token counts read from the model's own features.
    """
    gen = torch.Generator().manual_seed(seed)

    def text(n):
        return torch.randint(4, 100, (n,), generator=gen).tolist()

    extra = {}
    if family == "llava":
        runs = [[2 * LLAVA_TOKENS], [LLAVA_TOKENS]]  # sample 0: two images in one run
        extra["pixel_values"] = torch.randn(3, 3, 8, 8, generator=gen)
    elif family == "internvl":
        runs = [[3 * INTERNVL_TILE], [INTERNVL_TILE, 2 * INTERNVL_TILE]]
        extra["pixel_values"] = torch.randn(6, 3, 16, 16, generator=gen)
    else:
        sizes = torch.tensor([[10, 18], [12, 8]])
        pixel_values = torch.randn(2, 5, 3, 8, 8, generator=gen)
        with torch.no_grad():
            features = model.model.get_image_features(pixel_values, sizes).pooler_output
        runs = [[len(features[0])], [len(features[1])]]
        extra.update(pixel_values=pixel_values, image_sizes=sizes)
    rows = []
    for sample in runs:
        ids = text(3)
        for n in sample:
            ids += [IMAGE] * n + text(2)
        rows.append(ids)
    input_ids, mask = _left_pad(rows)
    return dict(input_ids=input_ids, attention_mask=mask, **extra)


def _grown(inputs, sequences):
    """The prompt plus all generated tokens but the last, as one uncached forward input."""
    new = sequences.shape[1] - inputs["input_ids"].shape[1] - 1
    grown = dict(inputs, input_ids=sequences[:, :-1])
    grown["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(sequences[:, :new])], 1)
    return grown, new


def _check_cached_decoding(model, inputs, generated):
    """generate's KV-cached step logits == one uncached forward over the prompt and the generated tokens."""
    grown, new = _grown(inputs, generated.sequences)
    with torch.no_grad():
        full = model(**grown).logits
    start = inputs["input_ids"].shape[1] - 1
    for step in range(new + 1):
        torch.testing.assert_close(generated.logits[step], full[:, start + step], rtol=0, atol=1e-4)


def _capture_ids(model):
    """A list that receives the position_ids of every language-model call of ``model``."""
    seen = []
    model.model.language_model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw["position_ids"].clone()), with_kwargs=True
    )
    return seen


@pytest.fixture(scope="module")
def models():
    return {family: tiny_model(family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_own_scheme_reproduces_the_model_in_forward_and_generate(models, family):
    model = models[family]
    inputs = batch(family, model)
    patched = apply_position_scheme(copy.deepcopy(model), "rope_1d")
    assert patched.visionpe_scheme == "rope_1d"
    valid = inputs["attention_mask"].bool()
    with torch.no_grad():
        ref, out = model(**inputs).logits, patched(**inputs).logits
        # the model counts left padding in its positions, rope_1d does not: RoPE is shift invariant, so the
        # logits of every real token agree
        torch.testing.assert_close(out[valid], ref[valid], rtol=0, atol=1e-5)
        gen_ref, gen_out = model.generate(**inputs, **GEN), patched.generate(**inputs, **GEN)
    assert torch.equal(gen_ref.sequences, gen_out.sequences)
    for step_ref, step_out in zip(gen_ref.logits, gen_out.logits, strict=True):
        torch.testing.assert_close(step_out, step_ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheme", ["v2pe", "mrope"])
def test_schemes_change_logits_and_cached_decoding_matches_one_shot(models, family, scheme):
    model = models[family]
    inputs = batch(family, model)
    patched = apply_position_scheme(copy.deepcopy(model), scheme)
    rotary = patched.model.language_model.rotary_emb
    assert isinstance(rotary, _HFRotary) and isinstance(rotary.rotary, MultimodalRotary)
    valid = inputs["attention_mask"].bool()
    with torch.no_grad():
        ref, out = model(**inputs).logits, patched(**inputs).logits
        assert torch.isfinite(out).all() and (out[valid] - ref[valid]).abs().max() > 1e-4
        generated = patched.generate(**inputs, **GEN)
    _check_cached_decoding(patched, inputs, generated)


def _naive_v2pe(kinds, delta):
    """V2PE by its rule, token by token: text +1, a visual run of N tokens at last + delta * k, k = 1..N, then
    the next text at ceil(last + delta * N) + 1. ``kinds``: the valid tokens' kinds, 'T' or a block index."""
    ids, last, previous = [], -1.0, None
    for kind in kinds:
        if kind == "T":
            if previous is not None:
                last = math.ceil(last + delta * previous[1] - 1e-9)
                previous = None
            last += 1
            ids.append(last)
        else:
            if previous is None or previous[0] != kind:
                if previous is not None:
                    last = math.ceil(last + delta * previous[1] - 1e-9)
                previous = [kind, 0]
            previous[1] += 1
            ids.append(last + delta * previous[1])
    return ids


@pytest.mark.parametrize("family", ["llava", "internvl"])
def test_v2pe_ids_follow_the_rule_per_image(models, family):
    """LLaVA: each image of a run is its own block; InternVL: all tiles of an image are one block (V2PE's count)."""
    model = apply_position_scheme(copy.deepcopy(models[family]), "v2pe", delta=0.5)
    seen = _capture_ids(model)
    inputs = batch(family, model)
    with torch.no_grad():
        model(**inputs)
    ids = seen[0]
    assert ids.shape == inputs["input_ids"].shape and ids.dtype == torch.float64
    per = LLAVA_TOKENS if family == "llava" else None
    for b in range(2):
        valid = inputs["attention_mask"][b].bool()
        tokens = inputs["input_ids"][b][valid].tolist()
        kinds, block, run = [], 0, 0
        for i, token in enumerate(tokens):
            if token != IMAGE:
                kinds.append("T")
                continue
            if i == 0 or tokens[i - 1] != IMAGE or (per is not None and run == per):
                block, run = block + 1, 0
            run += 1
            kinds.append(block)
        assert ids[b][valid].tolist() == _naive_v2pe(kinds, 0.5)
        assert (ids[b][~valid] == 0).all()


def test_internvl_tiles_are_the_grid_that_rope_dhr_reads(models):
    """An InternVL image of 2 x 1 tiles and its thumbnail (3 tiles of 4 x 4 tokens): tile tokens take the ids of
    the thumbnail tokens over the same region (RoPE-DHR's released rule with its 1e-6 shrink), the image uses 16 ids."""
    model = apply_position_scheme(copy.deepcopy(models["internvl"]), "rope_dhr", tile_grid=torch.tensor([[2, 1]]))
    seen = _capture_ids(model)
    inputs = dict(
        input_ids=torch.tensor([[5, 6, 7] + [IMAGE] * 3 * INTERNVL_TILE + [8, 9]]),
        pixel_values=torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(2)),
    )
    with torch.no_grad():
        model(**inputs)

    def floor_linspace(start, stop, k, num=4):  # numpy.linspace(start, stop, num)[k], floored
        return math.floor(stop if k == num - 1 else start + k * (stop - start) / (num - 1))

    p, w, h = 3, 4 / 2 - 1e-6, 4 / 1 - 1e-6
    expected = [0, 1, 2]
    for tile in range(2):
        for r in range(4):
            for c in range(4):
                x = floor_linspace(tile * w, (tile + 1) * w, c)
                expected.append(p + 4 * floor_linspace(0, h, r) + x)
    expected += [p + 4 * r + c for r in range(4) for c in range(4)] + [p + 16, p + 17]
    assert seen[0][0].tolist() == expected
    assert expected[3:7] == [3, 3, 4, 4] and expected[19:23] == [4, 5, 6, 6]  # tile 1 starts one column early


def test_onevision_mrope_ids_lay_out_base_view_and_newline_grid(models):
    """Each anyres image: base view 4x4 then the unpadded view of R x C with a newline closing each row, as two
    M-RoPE grids (1, 4, 4) and (1, R, C + 1); R, C come from image_sizes (10x18 px: 4x8, 12x8 px: 6x4)."""
    model = apply_position_scheme(copy.deepcopy(models["llava_onevision"]), "mrope")
    seen = _capture_ids(model)
    inputs = batch("llava_onevision", model)
    with torch.no_grad():
        model(**inputs)
    ids = seen[0]
    assert ids.shape == (3, *inputs["input_ids"].shape)
    for b, (rows, cols) in enumerate([(4, 8), (6, 4)]):
        expected, cursor = [], 0
        for kind in ["T"] * 3 + [(4, 4), (rows, cols + 1)] + ["T"] * 2:
            if kind == "T":
                expected.append((cursor, cursor, cursor))
                cursor += 1
                continue
            height, width = kind
            expected += [(cursor, cursor + i, cursor + j) for i in range(height) for j in range(width)]
            cursor += max(height, width)
        valid = inputs["attention_mask"][b].bool()
        assert ids[:, b][:, valid].T.tolist() == [list(e) for e in expected]


def test_onevision_multi_image_and_video_newlines_take_text_positions(models):
    """batch_num_images > 1: base views only, each followed by a newline; a video: F frames of 2x2 pooled tokens
    and a newline. The newlines sit where a text token would."""
    model = models["llava_onevision"]
    gen = torch.Generator().manual_seed(1)
    inputs = dict(
        input_ids=torch.tensor([[5, 6] + [IMAGE] * 17 + [7] + [IMAGE] * 17 + [VIDEO] * 9 + [8, 9]]),
        pixel_values=torch.randn(2, 1, 3, 8, 8, generator=gen),
        image_sizes=torch.tensor([[8, 8], [8, 8]]),
        batch_num_images=torch.tensor([2]),
        pixel_values_videos=torch.randn(1, 2, 3, 8, 8, generator=gen),
    )
    patched = apply_position_scheme(copy.deepcopy(model), "mrope")
    seen = _capture_ids(patched)
    with torch.no_grad():
        out = patched(**inputs).logits
    assert torch.isfinite(out).all()
    grid = [(i, j) for i in range(4) for j in range(4)]
    expected = [(0, 0, 0), (1, 1, 1)]
    expected += [(2, 2 + i, 2 + j) for i, j in grid] + [(6, 6, 6), (7, 7, 7)]
    expected += [(8, 8 + i, 8 + j) for i, j in grid] + [(12, 12, 12)]
    expected += [(13 + t, 13 + i, 13 + j) for t in range(2) for i in range(2) for j in range(2)] + [(15, 15, 15)]
    expected += [(16, 16, 16), (17, 17, 17)]
    assert seen[0][:, 0].T.tolist() == [list(e) for e in expected]


def test_every_registered_scheme_runs_or_is_refused_on_llava(models):
    """Schemes with one set of ids run in forward and generate (CCA with its prefill mask), and decoding from the
    cache equals a one-shot forward; only schemes whose ids differ per decoder layer are refused."""
    model = models["llava"]
    inputs = batch("llava", model)
    for scheme in list_multimodal_schemes():
        options = {"separator_ids": tuple(range(0, 128, 2))} if scheme == "bipe" else {}
        try:
            patched = apply_position_scheme(copy.deepcopy(model), scheme, **options)
        except ValueError as err:
            assert getattr(get_multimodal_scheme(scheme), "layer_of", None) is not None, scheme
            assert "gives decoder layers their own ids" in str(err), scheme
            continue
        with torch.no_grad():
            out = patched(**inputs).logits
            generated = patched.generate(**inputs, **GEN)
        assert torch.isfinite(out).all(), scheme
        _check_cached_decoding(patched, inputs, generated)


def test_cca_prefill_uses_the_concentric_mask(models):
    """The patched model equals the model given CCA's ids and its 4-D mask by hand, not the causal mask."""
    if "cca" not in list_multimodal_schemes():
        pytest.skip("no block-mask scheme registered")
    from visionpe.multimodal import get_position_ids
    from visionpe.multimodal.cca import cca_attention_mask

    model = models["llava"]
    inputs = batch("llava", model)
    types = (inputs["input_ids"] == IMAGE).long()
    grid = torch.tensor([[1, 4, 4]] * 3)
    mask = inputs["attention_mask"]
    pos, _ = get_position_ids("cca", types, grid, None, mask, spatial_merge_size=1, pad_value=0)
    concentric = cca_attention_mask(types, grid, None, mask, spatial_merge_size=1)
    patched = apply_position_scheme(copy.deepcopy(model), "cca")
    with torch.no_grad():
        out = patched(**inputs).logits
        ref = model(**dict(inputs, attention_mask=concentric, position_ids=pos[0])).logits
        causal = model(**dict(inputs, position_ids=pos[0])).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    valid = mask.bool()
    assert (out[valid] - causal[valid]).abs().max() > 1e-4


def test_bipe_generate_advances_only_after_separators(models):
    """Generated tokens take bipe's ids: the previous id, plus one after a separator (here every even token)."""
    separators = tuple(range(0, 128, 2))
    model = apply_position_scheme(copy.deepcopy(models["llava"]), "bipe", separator_ids=separators)
    seen = _capture_ids(model)
    inputs = batch("llava", model)
    with torch.no_grad():
        generated = model.generate(**inputs, **{**GEN, "max_new_tokens": 6})
    prompt = inputs["input_ids"].shape[1]
    ids = torch.cat([seen[0]] + seen[1:], 1)  # the prompt's ids, then one per step
    tokens = generated.sequences
    for step in range(prompt, ids.shape[1]):
        previous = tokens[:, step - 1]
        closes = torch.isin(previous, torch.tensor(separators)).long()
        assert torch.equal(ids[:, step], ids[:, step - 1] + closes)


def test_remove_restores_the_model_exactly(models):
    model = models["internvl"]
    inputs = batch("internvl", model)
    patched = copy.deepcopy(model)
    own_rotary = patched.model.language_model.rotary_emb
    apply_position_scheme(patched, "v2pe")
    apply_position_scheme(patched, "mrope")  # replaces the first scheme
    assert patched.model.language_model.rotary_emb.original is own_rotary
    remove_position_scheme(patched)
    assert patched.model.language_model.rotary_emb is own_rotary
    assert not hasattr(patched, "visionpe_scheme") and "forward" not in patched.model.__dict__
    assert "_prepare_position_ids_for_generation" not in patched.__dict__
    with torch.no_grad():
        assert torch.equal(patched(**inputs).logits, model(**inputs).logits)
    assert remove_position_scheme(patched) is patched  # not patched: unchanged


def test_rope_1d_keeps_the_models_rotary(models):
    patched = apply_position_scheme(copy.deepcopy(models["llava"]), "rope_1d")
    assert not isinstance(patched.model.language_model.rotary_emb, _HFRotary)


def test_inputs_embeds_call_needs_token_types_and_then_matches_the_ids_call(models):
    model = apply_position_scheme(copy.deepcopy(models["llava"]), "v2pe", delta=0.25)
    inputs = batch("llava", model)
    embeds = model.get_input_embeddings()(inputs["input_ids"])
    types = (inputs["input_ids"] == IMAGE).long()
    rest = {k: v for k, v in inputs.items() if k != "input_ids"}
    with torch.no_grad():
        ref = model(**inputs).logits
        out = model(inputs_embeds=embeds, mm_token_type_ids=types, **rest).logits
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
        with pytest.raises(ValueError, match="needs mm_token_type_ids .* pixel_values"):
            model(inputs_embeds=embeds, **rest)
        with pytest.raises(ValueError, match=r"mm_token_type_ids must hold 0 \(text\) or 1 \(image\)"):
            model(inputs_embeds=embeds, mm_token_type_ids=types * 2, **rest)
        gen_ids = model.generate(**inputs, **GEN)
        gen_embeds = model.generate(inputs_embeds=embeds, mm_token_type_ids=types, **rest, **GEN)
        with pytest.raises(ValueError, match="needs mm_token_type_ids"):
            model.generate(inputs_embeds=embeds, **rest, **GEN)
    assert torch.equal(gen_embeds.sequences, gen_ids.sequences[:, inputs["input_ids"].shape[1] :])


def test_no_mask_gives_the_explicit_all_ones_mask(models):
    """Without an attention mask and without a cache, transformers would take non-arange ids for packed sequences."""
    model = apply_position_scheme(copy.deepcopy(models["llava"]), "v2pe", delta=0.25)
    inputs = batch("llava", model)
    one = {k: v[:1] for k, v in inputs.items() if k != "attention_mask"}
    one["input_ids"] = one["input_ids"][:, inputs["attention_mask"][0].argmax() :]
    one["pixel_values"] = inputs["pixel_values"][:2]
    with torch.no_grad():
        ref = model(**one, attention_mask=torch.ones_like(one["input_ids"]), use_cache=False).logits
        out = model(**one, use_cache=False).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_cached_forward_without_ids_continues_the_scheme(models):
    model = apply_position_scheme(copy.deepcopy(models["llava"]), "mrope")
    inputs = batch("llava", model)
    nxt = torch.tensor([[7], [9]])
    with torch.no_grad():
        prefill = model(**inputs, use_cache=True)
        mask = torch.cat([inputs["attention_mask"], torch.ones_like(nxt)], 1)
        step = model(input_ids=nxt, attention_mask=mask, cache=prefill.cache).logits[:, -1]
        full = model(**dict(inputs, input_ids=torch.cat([inputs["input_ids"], nxt], 1), attention_mask=mask)).logits
    torch.testing.assert_close(step, full[:, -1], rtol=0, atol=1e-5)


def test_bad_inputs_raise_naming_the_argument(models):
    model = copy.deepcopy(models["llava"])
    with pytest.raises(
        TypeError, match="supports Qwen2VLModel.*LlavaModel.*LlavaOnevisionModel.*InternVLModel.*Linear"
    ):
        apply_position_scheme(torch.nn.Linear(2, 2), "v2pe")
    with pytest.raises(TypeError, match="InternVLForConditionalGeneration.*got Linear"):
        remove_position_scheme(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown multimodal scheme 'nope'"):
        apply_position_scheme(model, "nope")
    with pytest.raises(ValueError, match=r"v2pe got unknown option\(s\) \['stride'\]"):
        apply_position_scheme(model, "v2pe", stride=64)
    with pytest.raises(ValueError, match=r"\['input_ids'\] describe one batch"):
        apply_position_scheme(model, "bipe", input_ids=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="single_axis' allocation, which takes no mrope_section"):
        apply_position_scheme(model, "v2pe", mrope_section=(2, 3, 3))
    with pytest.raises(ValueError, match="delta must be positive"):
        apply_position_scheme(model, "v2pe", delta=-1.0)
    assert not hasattr(model, "visionpe_scheme")  # nothing patched after the errors
    scaled = copy.deepcopy(model)
    scaled.config.text_config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="supports rope_type 'default'.*uses rope_type 'linear'"):
        apply_position_scheme(scaled, "mrope")
    assert apply_position_scheme(scaled, "rope_1d").visionpe_scheme == "rope_1d"  # keeps the model's own rotary
    apply_position_scheme(model, "v2pe", delta=0.3)  # a block of 16 ends at 4.8: the next text is not last + 1
    inputs = batch("llava", model)
    with torch.no_grad():
        short = dict(inputs, input_ids=inputs["input_ids"][:, :-2], attention_mask=inputs["attention_mask"][:, :-2])
        with pytest.raises(ValueError, match="ends with a visual token"):
            model.generate(**short, **GEN)
        right = dict(inputs, attention_mask=inputs["attention_mask"].flip(1))
        with pytest.raises(ValueError, match="needs left padding: sample 1 of attention_mask"):
            model.generate(**right, **GEN)
        odd = dict(inputs, input_ids=inputs["input_ids"].clone())
        odd["input_ids"][0, -1] = IMAGE
        with pytest.raises(ValueError, match="not a whole number of images of 4x4 = 16 tokens"):
            model(**odd)
        with pytest.raises(ValueError, match=r"position_ids of the one-row scheme 'v2pe' must be \(B, L\)"):
            model(**inputs, position_ids=torch.zeros(3, *inputs["input_ids"].shape))
    onevision = apply_position_scheme(copy.deepcopy(models["llava_onevision"]), "mrope")
    ov_inputs = batch("llava_onevision", onevision)
    ov_inputs.pop("image_sizes")
    with pytest.raises(ValueError, match="need image_sizes"), torch.no_grad():
        onevision(**ov_inputs)
    model.model.language_model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="sdpa or eager attention.*flash_attention_2"):
        model(**inputs)


def test_dispatch_table_lists_both_families():
    assert {"Qwen2VLModel", "LlavaModel", "LlavaOnevisionModel", "InternVLModel"} <= set(SUPPORTED_MODELS)
