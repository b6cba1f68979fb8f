"""Packed (padding-free) training of tiny random Qwen-VL models patched with every visionpe scheme."""

import copy
import functools
import pickle

import pytest
import torch
import torch.nn.functional as F

from visionpe.multimodal import get_multimodal_scheme, get_position_ids, list_multimodal_schemes

from . import test_hf as hf

transformers = pytest.importorskip("transformers")
from visionpe.integrations.hf import apply_position_scheme  # noqa: E402
from visionpe.integrations.hf.packing import (  # noqa: E402
    QwenVLPackingCollator,
    check_packable,
    pack_qwen_vl_features,
)

# three samples of different lengths: two images, text only, one image
SAMPLES = [[(1, (1, 4, 4)), (1, (1, 4, 6))], [], [(1, (1, 4, 4))]]
VIDEO_SAMPLES = [[(2, (2, 4, 4))], [(1, (1, 4, 6))], [(1, (1, 4, 4)), (2, (2, 4, 6))]]


def _not_packable(scheme):
    """Why one packed position_ids tensor cannot express the scheme with its default options (registry entry
    attributes: a mask inside visual blocks, or ids per decoder layer), or None."""
    entry = get_multimodal_scheme(scheme)
    if getattr(entry, "block_mask", False):
        return "block_mask: the mask inside visual blocks needs a 4-D attention mask"
    layer_of = getattr(entry, "layer_of", None)
    if layer_of is not None and any(layer_of(layer, {}) for layer in range(TEXT_LAYERS)):
        return "layer_of: ids differ per decoder layer"
    return None


TEXT_LAYERS = hf.TEXT["num_hidden_layers"]
PACKABLE = [
    pytest.param(s, marks=pytest.mark.skip(reason=_not_packable(s))) if _not_packable(s) else s
    for s in list_multimodal_schemes()
]
NOT_PACKABLE = [s for s in list_multimodal_schemes() if _not_packable(s)]


def _features(inputs, blocks_per_sample):
    """The padded batch of ``hf.batch`` cut back into one feature dict per sample (padding dropped)."""
    features, used = [], {"image": [0, 0], "video": [0, 0]}  # [grids, patches] consumed so far
    for b, blocks in enumerate(blocks_per_sample):
        keep = inputs["attention_mask"][b].bool()
        feature = {name: inputs[name][b][keep] for name in ("input_ids", "mm_token_type_ids")}
        for kind, grid_key, pixel_key in (
            (1, "image_grid_thw", "pixel_values"),
            (2, "video_grid_thw", "pixel_values_videos"),
        ):
            count = sum(k == kind for k, _ in blocks)
            if not count:
                continue
            grids, patches = used["image" if kind == 1 else "video"]
            grid = inputs[grid_key][grids : grids + count]
            num = int(grid.prod(1).sum())
            feature[grid_key] = grid
            feature[pixel_key] = inputs[pixel_key][patches : patches + num]
            if kind == 2 and "second_per_grid_ts" in inputs:
                feature["second_per_grid_ts"] = inputs["second_per_grid_ts"][grids : grids + count]
            used["image" if kind == 1 else "video"] = [grids + count, patches + num]
        features.append(feature)
    return features


def _batch_labels(inputs):
    """Text tokens of the padded batch as targets; padding, visual tokens and each sample's first token ignored."""
    mask = inputs["attention_mask"]
    labels = inputs["input_ids"].masked_fill((mask == 0) | (inputs["mm_token_type_ids"] != 0), -100)
    labels[torch.arange(len(labels)), mask.argmax(1)] = -100  # left padding: argmax is the first token
    return labels


def _summed_loss(logits, labels):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum")


@functools.cache
def _model(family, attn):
    model = hf.tiny_model(family)
    model.set_attn_implementation(attn)
    return model


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _check_packed_equals_batch(model, inputs, packed, atol=1e-5):
    mask = inputs["attention_mask"].bool()
    out = model(**inputs).logits
    out_packed = model(**packed).logits
    starts = (packed["position_ids"][0, 0] == 0).nonzero().flatten().tolist() + [packed["input_ids"].shape[1]]
    assert len(starts) - 1 == len(mask)
    for b in range(len(mask)):
        torch.testing.assert_close(out_packed[0, starts[b] : starts[b + 1]], out[b, mask[b]], rtol=0, atol=atol)
    ref = _grads(model, _summed_loss(out, _batch_labels(inputs)))
    got = _grads(model, _summed_loss(out_packed, packed["labels"]))
    assert ref.keys() == got.keys() and len(ref) > 10
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("scheme", PACKABLE)
def test_packed_logits_and_gradients_equal_the_padded_batch(scheme, attn):
    model = apply_position_scheme(_model("qwen2_vl", attn), scheme)
    inputs = hf.batch(SAMPLES)
    packed = QwenVLPackingCollator.from_model(model)(_features(inputs, SAMPLES))
    _check_packed_equals_batch(model, inputs, packed)


@pytest.mark.parametrize("family, scheme", [("qwen2_5_vl", "mrope_abs_time"), ("qwen3_vl", "mrope_interleaved")])
def test_packed_videos_equal_the_padded_batch(family, scheme):
    """Qwen2.5-VL's absolute time (second_per_grid_ts per video) and Qwen3-VL's one block per frame; the collator
    takes the options given to apply_position_scheme, the rotary's mrope_section included."""
    options = {"mrope_section": (2, 3, 3) if family == "qwen2_5_vl" else (4, 2, 2)}
    model = apply_position_scheme(copy.deepcopy(_model(family, "sdpa")), scheme, **options)
    inputs = hf.batch(VIDEO_SAMPLES)
    if family == "qwen2_5_vl":
        inputs["second_per_grid_ts"] = torch.tensor([1.0, 0.5])
    collator = QwenVLPackingCollator.from_model(model, **options)
    assert collator.split_video_frames == (family == "qwen3_vl")
    _check_packed_equals_batch(model, inputs, collator(_features(inputs, VIDEO_SAMPLES)))


@pytest.mark.parametrize("change", ["three_rows", "use_cache", "attention_mask"])
def test_row_zero_without_cache_or_mask_is_what_keeps_the_samples_apart(change):
    """The same packed row with rows 1-3 only, with a cache (the config's use_cache=True) or with a 2-D mask of ones:
    transformers sees no packing and later samples attend to earlier ones."""
    model = apply_position_scheme(_model("qwen2_vl", "sdpa"), "mrope")
    inputs = hf.batch(SAMPLES)
    packed = QwenVLPackingCollator("mrope")(_features(inputs, SAMPLES))
    changed = {
        "three_rows": {"position_ids": packed["position_ids"][1:]},
        "use_cache": {"use_cache": True},
        "attention_mask": {"attention_mask": torch.ones_like(packed["input_ids"])},
    }[change]
    with torch.no_grad():
        good = model(**packed).logits
        mixed = model(**dict(packed, **changed)).logits
    first = int(inputs["attention_mask"][0].sum())
    torch.testing.assert_close(mixed[:, :first], good[:, :first], rtol=0, atol=1e-5)
    assert (mixed[:, first:] - good[:, first:]).abs().max() > 1e-3


def test_collated_batch_layout():
    inputs = hf.batch(SAMPLES)
    features = _features(inputs, SAMPLES)
    features[1]["labels"] = features[1]["input_ids"].clone()
    packed = pack_qwen_vl_features(features, "v2pe", delta=0.5)
    lengths = [len(f["input_ids"]) for f in features]
    cu = torch.tensor([0, *lengths]).cumsum(0)
    assert packed["attention_mask"] is None and packed["use_cache"] is False and "cu_seqlens" not in packed
    assert torch.equal(packed["input_ids"][0], torch.cat([f["input_ids"] for f in features]))
    assert torch.equal(packed["pixel_values"], inputs["pixel_values"])
    assert torch.equal(packed["image_grid_thw"], inputs["image_grid_thw"])
    ids, _ = get_position_ids("v2pe", packed["mm_token_type_ids"], inputs["image_grid_thw"], cu_seqlens=cu, delta=0.5)
    assert torch.equal(packed["position_ids"], ids) and ids.dtype == torch.float64
    labels = packed["labels"][0]
    types = packed["mm_token_type_ids"][0]
    assert (labels[cu[:-1]] == -100).all()  # every sample's first token
    assert (labels[types != 0] == -100).all()  # default labels skip the visual placeholders
    text = (types == 0) & ~torch.isin(torch.arange(len(labels)), cu[:-1])
    assert torch.equal(labels[text], packed["input_ids"][0][text])


def test_padded_features_lose_their_padding_and_the_collator_pickles():
    inputs = hf.batch(SAMPLES)
    features = _features(inputs, SAMPLES)
    padded = dict(features[1])
    padded["input_ids"] = torch.cat([torch.zeros(2, dtype=torch.long), padded["input_ids"]])[None]
    padded["mm_token_type_ids"] = torch.cat([torch.zeros(2, dtype=torch.long), padded["mm_token_type_ids"]])
    padded["attention_mask"] = torch.cat([torch.zeros(2), torch.ones(len(features[1]["input_ids"]))]).long().tolist()
    collator = pickle.loads(pickle.dumps(QwenVLPackingCollator("videorope", delta=3.0)))
    plain, with_padding = collator(features), collator([features[0], padded, features[2]])
    for key in ("input_ids", "position_ids", "labels", "pixel_values"):
        assert torch.equal(plain[key], with_padding[key])
    assert "delta=3.0" in repr(collator)


def test_packing_errors():
    inputs = hf.batch(SAMPLES)
    features = _features(inputs, SAMPLES)
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        pack_qwen_vl_features([{k: v for k, v in features[0].items() if k != "mm_token_type_ids"}])
    with pytest.raises(ValueError, match="features"):
        pack_qwen_vl_features([])
    with pytest.raises(ValueError, match="labels"):
        pack_qwen_vl_features([dict(features[0], labels=features[0]["input_ids"][:-1])])
    with pytest.raises(ValueError, match="4 rows"):
        pack_qwen_vl_features(features, "ppe", num_representatives=2)
    with pytest.raises(ValueError, match="delta"):
        QwenVLPackingCollator("v2pe", delta=-1.0)
    with pytest.raises(ValueError, match="unknown option"):
        QwenVLPackingCollator("mrope", delta=0.5)
    with pytest.raises(ValueError, match="apply_position_scheme"):
        QwenVLPackingCollator.from_model(hf.tiny_model("qwen2_vl"))


@pytest.mark.parametrize(
    "scheme", NOT_PACKABLE or [pytest.param(None, marks=pytest.mark.skip(reason="none registered"))]
)
def test_schemes_a_packed_row_cannot_express_are_refused(scheme):
    inputs = hf.batch(SAMPLES)
    options = {name: 1 for name in getattr(get_multimodal_scheme(scheme), "required_options", ())}
    with pytest.raises(ValueError, match=scheme):
        check_packable(scheme, options)
    with pytest.raises(ValueError, match=scheme):
        pack_qwen_vl_features(_features(inputs, SAMPLES), scheme, **options)


def test_circle_rope_ids_per_layer_are_refused_only_when_they_differ():
    if getattr(get_multimodal_scheme("circle_rope"), "layer_of", None) is None:
        pytest.skip("circle_rope has one set of ids for every layer here")
    check_packable("circle_rope", {"age": False})
    with pytest.raises(ValueError, match="layer 1"):
        check_packable("circle_rope", {"age": True})


def test_one_training_step_through_a_dataloader():
    """The collator as a DataLoader's collate_fn; the model's own loss is the mean over the labelled tokens."""
    model = apply_position_scheme(copy.deepcopy(_model("qwen2_vl", "sdpa")), "v2pe", delta=0.5)
    features = _features(hf.batch(SAMPLES), SAMPLES)
    loader = torch.utils.data.DataLoader(
        features, batch_size=3, collate_fn=QwenVLPackingCollator.from_model(model, delta=0.5)
    )
    batch = next(iter(loader))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    out = model(**batch)
    summed = _summed_loss(out.logits, batch["labels"])
    torch.testing.assert_close(out.loss, summed / (batch["labels"][:, 1:] != -100).sum(), rtol=1e-6, atol=0)
    out.loss.backward()
    before = model.lm_head.weight.detach().clone()
    optimizer.step()
    assert torch.isfinite(model.lm_head.weight).all() and not torch.equal(model.lm_head.weight, before)
