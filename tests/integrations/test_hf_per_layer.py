"""CCA's and PyPE's intra-block masks and per-layer ids (PyPE, Circle-RoPE's AGE) inside tiny Qwen-VL models."""

import copy

import pytest
import torch

from visionpe.multimodal import (
    cca_attention_mask,
    get_position_ids,
    pype_attention_mask,
)

from . import test_hf as hf

transformers = pytest.importorskip("transformers")
from visionpe.integrations.hf import apply_position_scheme, layers, qwen, remove_position_scheme  # noqa: E402

# 4 x 4 and 3 x 5 merged images (two rings each) in sample 0, a 6 x 6 one (three rings) in sample 1
RINGS = [[(1, (1, 8, 8)), (1, (1, 6, 10))], [(1, (1, 12, 12))]]


def model_with_layers(num_layers):
    torch.manual_seed(0)
    config = transformers.Qwen2VLConfig(
        text_config={
            **hf.TEXT,
            "num_hidden_layers": num_layers,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
        },
        vision_config={**hf.VISION, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2},
        **hf.TOKENS,
    )
    return transformers.Qwen2VLForConditionalGeneration(config).eval()


def logits(model, inputs):
    model.model.rope_deltas = None
    with torch.no_grad():
        return model(**inputs).logits


def record_attention(model):
    """Per decoder layer, the (cos, sin) and the mask its attention receives on the next call."""
    seen = {}
    handles = []
    for index, layer in enumerate(model.model.language_model.layers):

        def hook(module, args, kwargs, index=index):
            seen[index] = (kwargs["position_embeddings"], kwargs.get("attention_mask"))

        handles.append(layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True))
    return seen, handles


def single(inputs, b):
    """Sample ``b`` of a left-padded batch() as its own unpadded input."""
    keep = inputs["attention_mask"][b].bool()
    out = {k: inputs[k][b : b + 1, keep] for k in ("input_ids", "attention_mask", "mm_token_type_ids")}
    grids = inputs["image_grid_thw"]
    counts = [int((inputs["mm_token_type_ids"][i] == 1).sum()) for i in range(len(inputs["input_ids"]))]
    first, tokens = 0, 0
    while tokens < sum(counts[:b]):
        tokens += int(grids[first].prod()) // 4
        first += 1
    last, tokens = first, 0
    while tokens < counts[b]:
        tokens += int(grids[last].prod()) // 4
        last += 1
    patches = grids.prod(1)
    out["image_grid_thw"] = grids[first:last]
    out["pixel_values"] = inputs["pixel_values"][int(patches[:first].sum()) : int(patches[:last].sum())]
    return out


def test_cca_mask_reaches_attention_and_changes_logits():
    model = apply_position_scheme(hf.tiny_model("qwen2_vl"), "cca")
    inputs = hf.batch(RINGS)
    seen, handles = record_attention(model)
    out = logits(model, inputs)
    for handle in handles:
        handle.remove()
    expected = cca_attention_mask(
        inputs["mm_token_type_ids"], inputs["image_grid_thw"], attention_mask=inputs["attention_mask"]
    )
    for _, mask in seen.values():
        assert torch.equal(mask, expected)
    # the same ids with transformers' own causal mask: the plan taken off, get_rope_index still patched
    plain = copy.deepcopy(model)
    layers.uninstall(plain.model)
    causal = logits(plain, inputs)
    valid = inputs["attention_mask"].bool()
    assert (out - causal)[valid].abs().max() > 1e-4
    # eager attention takes the same additive mask
    model.set_attn_implementation("eager")
    torch.testing.assert_close(logits(model, inputs)[valid], out[valid], rtol=0, atol=1e-5)


def test_cca_text_only_is_the_unpatched_model():
    model = hf.tiny_model("qwen2_vl")
    patched = apply_position_scheme(copy.deepcopy(model), "cca")
    inputs = {k: v[:, -6:] for k, v in hf.batch([[], []], seed=1).items()}
    inputs["attention_mask"][1, 0] = 0
    torch.testing.assert_close(logits(patched, inputs), logits(model, inputs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("scheme, options", [("cca", {}), ("pype", {"interval": 1})])
def test_left_padded_batch_equals_per_sample_runs(scheme, options):
    model = apply_position_scheme(hf.tiny_model("qwen2_vl"), scheme, **options)
    inputs = hf.batch(RINGS)
    out = logits(model, inputs)
    for b in range(2):
        keep = inputs["attention_mask"][b].bool()
        torch.testing.assert_close(out[b, keep], logits(model, single(inputs, b))[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "family, scheme, options",
    [
        ("qwen2_vl", "cca", {}),
        ("qwen2_5_vl", "pype", {"interval": 1}),
        ("qwen3_vl", "pype", {"interval": 1}),
        ("qwen2_vl", "circle_rope", {"age": True}),
    ],
)
def test_generate_cached_decoding_equals_one_shot_prefill(family, scheme, options):
    model = hf.tiny_model(family)
    inputs = hf.batch(RINGS)
    patched = apply_position_scheme(copy.deepcopy(model), scheme, **options)
    with torch.no_grad():
        assert (logits(patched, inputs) - logits(model, inputs)).abs().max() > 1e-4
        generated = patched.generate(**inputs, **hf.GEN)
        grown, new = hf._continue_batch(inputs, generated.sequences)
        full = logits(patched, grown)
    for step in range(new + 1):
        torch.testing.assert_close(
            generated.logits[step], full[:, inputs["input_ids"].shape[1] - 1 + step], rtol=0, atol=1e-4
        )


def tables(scheme, inputs, model, **options):
    pos, _ = get_position_ids(
        scheme,
        inputs["mm_token_type_ids"],
        inputs["image_grid_thw"],
        attention_mask=inputs["attention_mask"],
        pad_value=0,
        **options,
    )
    rotary = model.model.language_model.rotary_emb
    return rotary(torch.zeros(1, dtype=torch.float32), pos)


def test_pype_layers_get_their_own_ids_and_masks():
    model = apply_position_scheme(model_with_layers(4), "pype", interval=1)
    inputs = hf.batch(RINGS)
    seen, handles = record_attention(model)
    logits(model, inputs)
    for handle in handles:
        handle.remove()
    grids, types, mask = inputs["image_grid_thw"], inputs["mm_token_type_ids"], inputs["attention_mask"]
    for layer in range(4):  # K = 2, 1, 1, 1 for the small images; 3, 2, 1, 1 for the 6 x 6 one
        cos, sin = tables("pype", inputs, model, interval=1, layer=layer)
        assert torch.equal(seen[layer][0][0], cos) and torch.equal(seen[layer][0][1], sin)
        expected = pype_attention_mask(types, grids, attention_mask=mask, layer=layer, interval=1)
        assert torch.equal(seen[layer][1], expected)
    assert not torch.equal(seen[0][0][0], seen[1][0][0]) and not torch.equal(seen[1][1], seen[2][1])
    assert seen[2][0][0] is seen[3][0][0] and seen[2][1] is seen[3][1]  # layers with equal ids share tables and mask


def test_circle_rope_age_even_layers_circle_odd_layers_mrope():
    model = apply_position_scheme(model_with_layers(4), "circle_rope", age=True)
    inputs = hf.batch(RINGS)
    seen, handles = record_attention(model)
    logits(model, inputs)
    for handle in handles:
        handle.remove()
    circle = tables("circle_rope", inputs, model)
    mrope = tables("mrope", inputs, model)
    for layer in range(4):
        cos, sin = mrope if layer % 2 else circle
        torch.testing.assert_close(seen[layer][0][0], cos, rtol=0, atol=1e-5)
        torch.testing.assert_close(seen[layer][0][1], sin, rtol=0, atol=1e-5)
    assert (circle[0] - mrope[0]).abs().max() > 1e-2
    plain = apply_position_scheme(model_with_layers(4), "circle_rope")  # without AGE: no per-layer forwards
    assert "forward" not in vars(plain.model.language_model.layers[1])


def test_flash_attention_is_refused_when_applied_and_when_called():
    model = hf.tiny_model("qwen2_vl")
    config = model.model.language_model.config
    config._attn_implementation = "flash_attention_2"
    for scheme, options in (("cca", {}), ("pype", {"interval": 2})):
        with pytest.raises(ValueError, match=rf"'{scheme}' changes the attention mask .*'flash_attention_2'"):
            apply_position_scheme(model, scheme, **options)
    assert not hasattr(model, "visionpe_scheme")
    apply_position_scheme(model, "circle_rope", age=True)  # per-layer ids alone take any attention
    config._attn_implementation = "sdpa"
    apply_position_scheme(model, "cca")
    config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2' cannot take"):
        logits(model, hf.batch(RINGS))


def test_bad_options_and_visual_tokens_after_the_cache():
    model = hf.tiny_model("qwen2_vl")
    with pytest.raises(ValueError, match=r"apply_position_scheme\('pype'\) needs interval="):
        apply_position_scheme(model, "pype")
    with pytest.raises(ValueError, match="interval must be a positive int"):
        apply_position_scheme(model, "pype", interval=0)
    with pytest.raises(ValueError, match="layer is set per decoder layer by the adapter, got layer=1"):
        apply_position_scheme(model, "pype", interval=2, layer=1)
    with pytest.raises(TypeError, match="age must be a bool"):
        apply_position_scheme(model, "circle_rope", age="yes")
    assert not hasattr(model, "visionpe_scheme")
    apply_position_scheme(model, "cca")
    inputs = hf.batch(RINGS)
    with torch.no_grad():
        out = model(**inputs, use_cache=True)
        more = {k: inputs[k][:, -3:] for k in ("input_ids", "mm_token_type_ids")}
        more["mm_token_type_ids"][:, -1] = 1
        mask = torch.cat([inputs["attention_mask"], torch.ones_like(more["input_ids"])], 1)
        with pytest.raises(ValueError, match="visual tokens after .* cached tokens are not supported"):
            model(**more, attention_mask=mask, cache=out.cache, image_grid_thw=inputs["image_grid_thw"])


def test_remove_reapply_and_deepcopy():
    model = hf.tiny_model("qwen2_vl")
    inputs = hf.batch(RINGS)
    ref = logits(model, inputs)
    patched = apply_position_scheme(copy.deepcopy(model), "pype", interval=1)
    pype = logits(patched, inputs)
    clone = copy.deepcopy(patched)  # its forwards and plan belong to the copy
    assert clone.model.forward.__self__ is clone.model
    assert clone.model.language_model.layers[1].visionpe_plan is clone.model.visionpe_plan
    assert clone.model.visionpe_plan is not patched.model.visionpe_plan
    assert torch.equal(logits(clone, inputs), pype)
    apply_position_scheme(patched, "cca")  # replaces the per-layer forwards
    assert torch.equal(logits(patched, inputs), logits(apply_position_scheme(copy.deepcopy(model), "cca"), inputs))
    apply_position_scheme(patched, "v2pe")  # a scheme without a plan removes it (the model keeps the adapter's forward)
    assert "visionpe_plan" not in vars(patched.model) and "forward" not in vars(patched.model.language_model.layers[0])
    assert vars(patched.model)["forward"].__func__ is qwen._forward
    apply_position_scheme(patched, "pype", interval=1)
    remove_position_scheme(patched)
    for module in (patched.model, patched.model.language_model.rotary_emb, *patched.model.language_model.layers):
        assert not any(name.startswith("visionpe") or name == "forward" for name in vars(module))
    assert torch.equal(logits(patched, inputs), ref)


def test_generate_with_several_sequences_per_prompt_keeps_each_sample_mask():
    # generate encodes the images and drops the grids before the prefill, then repeats every sample: the patched model
    # takes the grids it kept, repeated per sample, so each copy gets its own sample's ids and masks
    model = apply_position_scheme(hf.tiny_model("qwen2_vl"), "pype", interval=1)
    inputs = hf.batch(RINGS)
    with torch.no_grad():
        one = model.generate(**inputs, **hf.GEN)
        sampled = {**hf.GEN, "do_sample": True, "top_k": 1}  # greedy, through the sampling path that repeats
        two = model.generate(**inputs, **sampled, num_return_sequences=2)
    assert torch.equal(two.sequences, one.sequences.repeat_interleave(2, 0))
    for step_one, step_two in zip(one.logits, two.logits, strict=True):
        torch.testing.assert_close(step_two, step_one.repeat_interleave(2, 0), rtol=0, atol=1e-5)
