"""PPE with K > 1 representatives through the Qwen-VL adapter: PPERotary in the language model, (3K, B, L) ids."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from visionpe.integrations.hf import apply_position_scheme, remove_position_scheme  # noqa: E402
from visionpe.multimodal import PPERotary, get_position_ids  # noqa: E402

from . import test_hf as hf  # noqa: E402
from .test_hf_scaling import ROPES, _init_rotaries_as_transformers, scaled_model  # noqa: E402

SECTION = (4, 2, 2)  # K = 2 divides every section: sub-band k of axis a reads representative k of a


def _clusters(inputs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 3, inputs["mm_token_type_ids"].shape, generator=gen)


def _rotary_ids(model, inputs, **kwargs):
    """The ids the language model's rotary receives in one forward."""
    seen = []
    handle = model.model.language_model.rotary_emb.register_forward_pre_hook(lambda m, a: seen.append(a[1]))
    model.model.rope_deltas = None
    with torch.no_grad():
        logits = model(**inputs, **kwargs).logits
    handle.remove()
    return seen[0], logits


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_ppe_with_equal_representatives_is_mrope_and_clusters_reach_the_rotary(family):
    model = hf.tiny_model(family)
    inputs = hf.batch(hf.IMAGES)
    ppe = apply_position_scheme(copy.deepcopy(model), "ppe", num_representatives=2, mrope_section=SECTION)
    mrope = apply_position_scheme(copy.deepcopy(model), "mrope", mrope_section=SECTION)
    rotary = ppe.model.language_model.rotary_emb.rotary
    assert isinstance(rotary, PPERotary) and rotary.num_representatives == 2
    # without clusters every token is its own cluster: its two representatives are itself, the tables M-RoPE's
    ids, logits = _rotary_ids(ppe, inputs)
    assert ids.shape == (6, 2, inputs["input_ids"].shape[1])
    torch.testing.assert_close(logits, hf._logits(mrope, inputs), rtol=0, atol=1e-5)
    # clusters: get_rope_index gives get_position_ids' ids, which forward passes to the rotary as they are
    clusters = _clusters(inputs)
    args = (inputs["mm_token_type_ids"], inputs["image_grid_thw"], None, inputs["attention_mask"])
    pos, delta = ppe.model.get_rope_index(inputs["input_ids"], *args, clusters=clusters)
    ref, ref_delta = get_position_ids(
        "ppe", *args, clusters=clusters, num_representatives=2, pad_value=0, delta_convention="valid"
    )
    assert torch.equal(pos, ref) and torch.equal(delta, ref_delta) and not torch.equal(pos, ids)
    seen, clustered = _rotary_ids(ppe, inputs, position_ids=pos)
    assert torch.equal(seen, pos) and (clustered - logits).abs().max() > 0


def test_ppe_decodes_with_a_cache_as_one_forward():
    """generate puts a text row in front of the 3K rows and cached steps build 3 rows: both reach PPERotary."""
    model = apply_position_scheme(hf.tiny_model("qwen2_vl"), "ppe", num_representatives=2, mrope_section=SECTION)
    inputs = hf.batch(hf.IMAGES)
    with torch.no_grad():
        generated = model.generate(**inputs, **hf.GEN)
    grown, new = hf._continue_batch(inputs, generated.sequences)
    full = hf._logits(model, grown)
    for step in range(new + 1):
        torch.testing.assert_close(
            generated.logits[step], full[:, inputs["input_ids"].shape[1] - 1 + step], rtol=0, atol=1e-4
        )
    remove_position_scheme(model)
    assert type(model.model.language_model.rotary_emb).__name__ == "Qwen2VLRotaryEmbedding"


@pytest.mark.parametrize("rope_type", list(ROPES))
def test_ppe_takes_the_models_rope_scaling(rope_type):
    model = scaled_model("qwen2_vl", ROPES[rope_type])
    inputs = hf.batch(hf.IMAGES)
    ppe = apply_position_scheme(copy.deepcopy(model), "ppe", num_representatives=2, mrope_section=SECTION)
    mrope = apply_position_scheme(copy.deepcopy(model), "mrope", mrope_section=SECTION)
    rotary = ppe.model.language_model.rotary_emb.rotary
    assert rotary.rope_scaling.rope_type == rope_type
    assert rotary.attention_scaling == mrope.model.language_model.rotary_emb.rotary.attention_scaling
    torch.testing.assert_close(hf._logits(ppe, inputs), hf._logits(mrope, inputs), rtol=0, atol=1e-5)


def test_ppe_rotary_reads_three_rows_as_equal_representatives():
    rotary = PPERotary(16, base=1e4, num_representatives=2, mrope_section=SECTION)
    ids = torch.randint(0, 50, (3, 2, 7))
    for dtype in (torch.long, torch.float64):
        expanded = ids.to(dtype).repeat_interleave(2, dim=0)  # rows t t h h w w
        for got, want in zip(rotary(ids.to(dtype)), rotary(expanded), strict=True):
            assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"position_ids must be \(3K, B, L\) = \(6, B, L\) for K = 2.*got \(4, 2, 7\)"):
        rotary(torch.zeros(4, 2, 7, dtype=torch.long))


def test_ppe_per_batch_inputs_are_refused_where_they_do_not_belong():
    model = hf.tiny_model("qwen2_vl")
    inputs = hf.batch(hf.IMAGES)
    with pytest.raises(ValueError, match="clusters describe one batch's tokens.*get_rope_index"):
        apply_position_scheme(copy.deepcopy(model), "ppe", clusters=_clusters(inputs))
    patched = apply_position_scheme(copy.deepcopy(model), "mrope")
    with pytest.raises(ValueError, match="clusters are PPE's per-batch inputs; the model runs 'mrope'"):
        patched.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"], clusters=_clusters(inputs)
        )


def test_ppe_applied_on_the_meta_device_then_loaded_equals_one_applied_on_cpu():
    model = hf.tiny_model("qwen2_vl")
    ref = apply_position_scheme(copy.deepcopy(model), "ppe", num_representatives=2, mrope_section=SECTION)
    with torch.device("meta"):
        empty = type(model)(model.config)
    apply_position_scheme(empty, "ppe", num_representatives=2, mrope_section=SECTION)
    rotary = empty.model.language_model.rotary_emb.rotary
    assert rotary.inv_freq.is_meta and rotary.mix.is_meta
    empty.to_empty(device="cpu")
    empty.load_state_dict(model.state_dict())
    ref_rotary = ref.model.language_model.rotary_emb.rotary
    assert torch.equal(rotary.inv_freq, ref_rotary.inv_freq) and torch.equal(rotary.mix, ref_rotary.mix)
    _init_rotaries_as_transformers(empty)
    inputs = hf.batch(hf.IMAGES)
    assert torch.equal(hf._logits(empty.eval(), inputs), hf._logits(ref, inputs))
