"""VLMPositionCollator: positions built in the data loader for every family, taken as given by the patched model."""

import copy
import dataclasses
import functools
import pickle

import pytest
import torch

from visionpe.multimodal import registry

from . import test_hf as hf
from . import test_hf_llava as hf_llava
from .test_hf_packing import SAMPLES, _features

transformers = pytest.importorskip("transformers")
from visionpe.integrations.hf import (  # noqa: E402
    QwenVLPackingCollator,
    VLMPositionCollator,
    apply_position_scheme,
)

# per family a plain design, and on Qwen2-VL a per-layer one (AGE), a block-mask one (CCA) and one with both (PyPE)
CASES = [
    ("qwen2_vl", "mrope", {}),
    ("qwen2_5_vl", "mrope_abs_time", {}),
    ("qwen3_vl", "mrope_interleaved", {}),
    ("qwen2_vl", "v2pe", {"delta": 0.25}),
    ("qwen2_vl", "circle_rope", {"age": True}),
    ("qwen2_vl", "cca", {}),
    ("qwen2_vl", "pype", {"interval": 1}),
    ("llava", "rope_1d", {}),
    ("llava", "cca", {}),
    ("llava_onevision", "v2pe", {"delta": 0.5}),
    ("internvl", "mrope", {}),
]
QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def _model(family):
    return hf.tiny_model(family) if family in QWEN else hf_llava.tiny_model(family)


def _inputs(family, model):
    return hf.batch(hf.IMAGES) if family in QWEN else hf_llava.batch(family, model)


@pytest.fixture
def design_calls(monkeypatch):
    """Counts every run of a position design: each registry entry's design is wrapped (before models are patched,
    so that the adapters' states hold the counting entries)."""
    calls = []
    for name, entry in list(registry.MULTIMODAL_SCHEMES.items()):

        @functools.wraps(entry.design)  # the same signature: the registry reads the options from it
        def counted(*args, _design=entry.design, **kwargs):
            calls.append(1)
            return _design(*args, **kwargs)

        monkeypatch.setitem(registry.MULTIMODAL_SCHEMES, name, dataclasses.replace(entry, design=counted))
    return calls


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("family, scheme, options", CASES, ids=[f"{f}-{s}" for f, s, _ in CASES])
def test_collated_positions_equal_the_forward_and_build_nothing_there(design_calls, family, scheme, options):
    model = apply_position_scheme(_model(family), scheme, **options)
    inputs = _inputs(family, model)
    collator = VLMPositionCollator.from_model(model)
    batch = collator(dict(inputs))
    entry = registry.MULTIMODAL_SCHEMES[scheme]
    assert ("layer_position_ids" in batch) == (entry.layer_of is not None)
    assert ("layer_attention_mask" in batch) == entry.block_mask
    assert batch["rope_deltas"].shape == (len(inputs["input_ids"]), 1)
    design_calls.clear()
    out = _logits(model, batch)
    assert not design_calls  # the forward ran no position design
    ref = _logits(model, inputs)
    assert design_calls  # the in-forward path does (the counter counts)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_samples_are_padded_as_the_processor_pads_them():
    model = apply_position_scheme(hf.tiny_model("qwen2_vl"), "videorope")
    inputs = hf.batch(SAMPLES)
    collator = VLMPositionCollator.from_model(model)
    from_samples, from_batch = collator(_features(inputs, SAMPLES)), collator(dict(inputs))
    clone = pickle.loads(pickle.dumps(collator))  # what DataLoader workers get
    assert all(torch.equal(v, from_batch[k]) for k, v in clone(dict(inputs)).items() if isinstance(v, torch.Tensor))
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "position_ids", "rope_deltas", "image_grid_thw"):
        assert torch.equal(from_samples[key], from_batch[key]), key
    right = VLMPositionCollator.from_model(model, padding_side="right")(_features(inputs, SAMPLES))
    assert (right["attention_mask"][:, 0] == 1).all()
    torch.testing.assert_close(
        _logits(model, right)[right["attention_mask"].bool()],
        _logits(model, from_samples)[from_samples["attention_mask"].bool()],
        rtol=0,
        atol=1e-5,
    )


def test_packed_rows_carry_their_boundaries_and_equal_the_packing_collator():
    model = apply_position_scheme(hf.tiny_model("qwen2_vl"), "mrope")
    features = _features(hf.batch(SAMPLES), SAMPLES)
    packed = VLMPositionCollator.from_model(model, packed=True)(features)
    reference = QwenVLPackingCollator.from_model(model)(features)
    lengths = [len(f["input_ids"]) for f in features]
    assert packed["cu_seqlens"].tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert packed["max_seqlen"] == max(lengths)
    assert torch.equal(packed["position_ids"], reference["position_ids"])
    torch.testing.assert_close(_logits(model, packed), _logits(model, reference), rtol=0, atol=0)


def test_what_a_family_or_design_cannot_take_is_refused():
    llava = apply_position_scheme(hf_llava.tiny_model("llava"), "rope_1d")
    config = llava.config
    with pytest.raises(ValueError, match="gives decoder layers their own ids"):
        VLMPositionCollator("pype", config, "LlavaModel", interval=1)
    with pytest.raises(ValueError, match="num_representatives must be 1"):
        VLMPositionCollator("ppe", config, "LlavaModel", num_representatives=2)
    with pytest.raises(ValueError, match="cannot take packed rows"):
        VLMPositionCollator.from_model(llava, packed=True)
    qwen = hf.tiny_model("qwen2_vl")
    with pytest.raises(ValueError, match="changes the causal mask inside visual blocks"):
        VLMPositionCollator("cca", qwen.config, "Qwen2VLModel", packed=True)
    with pytest.raises(ValueError, match="needs interval="):
        VLMPositionCollator("pype", qwen.config, "Qwen2VLModel")
    with pytest.raises(ValueError, match="no visionpe scheme"):
        VLMPositionCollator.from_model(qwen)
    with pytest.raises(ValueError, match="family must be an inner model class name"):
        VLMPositionCollator("mrope", qwen.config, "Qwen2Model")
    # a batch built for a per-layer design, fed to a model patched with another scheme
    batch = VLMPositionCollator("pype", qwen.config, "Qwen2VLModel", interval=1)(hf.batch(hf.IMAGES))
    apply_position_scheme(qwen, "v2pe")
    with pytest.raises(ValueError, match="layer_position_ids, layer_rope_deltas, layer_attention_mask are for"):
        _logits(qwen, batch)


@pytest.mark.parametrize("family, scheme", [("qwen2_vl", "v2pe"), ("llava", "v2pe")])
def test_decoding_continues_from_the_batch_own_deltas(family, scheme):
    """Two generate calls of different batch sizes, then a collated prompt of a third size and a cached step without
    ids: each equals a fresh model's output for the same inputs."""
    base = _model(family)
    model = apply_position_scheme(copy.deepcopy(base), scheme)
    gen = dict(max_new_tokens=3, do_sample=False)
    if family in QWEN:
        big, small = hf.batch([*hf.IMAGES, []], seed=1), hf.batch([[(1, (1, 4, 6))]], seed=2)
    else:
        big = hf_llava.batch(family, model, seed=1)
        small = {k: v[1:] for k, v in hf_llava.batch(family, model, seed=2).items()}
        small["pixel_values"] = hf_llava.batch(family, model, seed=2)["pixel_values"][2:]
    with torch.no_grad():
        model.generate(**big, **gen)
        second = model.generate(**small, **gen)
        fresh = apply_position_scheme(copy.deepcopy(base), scheme)
        assert torch.equal(second, fresh.generate(**small, **gen))

        def prefill_then_step(m, prompt):
            out = m(**prompt, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            # one unpadded prompt: no mask (transformers' Qwen-VL reads a full-length mask's positions as new ones)
            step = dict(input_ids=token, cache=out.cache, use_cache=True)
            if family in QWEN:
                step["mm_token_type_ids"] = torch.cat([prompt["mm_token_type_ids"], torch.zeros_like(token)], 1)
            return m(**step).logits

        collated = VLMPositionCollator.from_model(model)(dict(small))
        fresh = apply_position_scheme(copy.deepcopy(base), scheme)
        torch.testing.assert_close(
            prefill_then_step(model, collated), prefill_then_step(fresh, small), rtol=0, atol=1e-5
        )
