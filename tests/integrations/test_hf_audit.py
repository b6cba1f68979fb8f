"""audit_position_ids: transformers' own Qwen-VL position ids against visionpe's reference ids."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel  # noqa: E402

import visionpe.integrations.hf as hf_adapters  # noqa: E402
from visionpe.integrations.hf import apply_position_scheme  # noqa: E402
from visionpe.integrations.hf.audit import PositionIdsAudit, audit_position_ids  # noqa: E402
from visionpe.multimodal import get_position_ids  # noqa: E402

from . import test_hf as hf  # noqa: E402

VIDEO_BLOCKS = [hf.IMAGES[0], [(2, (4, 4, 4))]]  # a video with T = 4 > its spatial extent 2: the rules differ after it


def frames_batch(blocks_per_sample, seed=0):
    """Like ``hf.batch`` (left padding), with each video written as Qwen3-VL writes it: every frame its own
    <vs> frame <ve> span after two timestamp text tokens; ``video_grid_thw`` keeps one (T, H, W) row per video."""
    gen = torch.Generator().manual_seed(seed)
    rows, images, videos = [], [], []
    for blocks in blocks_per_sample:
        ids, types = torch.randint(4, 100, (3,), generator=gen).tolist(), [0, 0, 0]
        for kind, (t, h, w) in blocks:
            frames = 1 if kind == 1 else t
            for _ in range(frames):
                if kind == 2:  # the frame's timestamp
                    ids += torch.randint(4, 100, (2,), generator=gen).tolist()
                    types += [0, 0]
                n = h * w // 4
                ids += [hf.VSTART] + [hf.IMAGE if kind == 1 else hf.VIDEO] * n + [hf.VEND]
                types += [0] + [kind] * n + [0]
            (images if kind == 1 else videos).append((t, h, w))
            ids += torch.randint(4, 100, (2,), generator=gen).tolist()
            types += [0, 0]
        rows.append((ids, types))
    length = max(len(ids) for ids, _ in rows)
    out = {name: torch.zeros(len(rows), length, dtype=torch.long) for name in ("input_ids", "mm_token_type_ids")}
    out["attention_mask"] = torch.zeros(len(rows), length, dtype=torch.long)
    for b, (ids, types) in enumerate(rows):
        out["input_ids"][b, length - len(ids) :] = torch.tensor(ids)
        out["mm_token_type_ids"][b, length - len(ids) :] = torch.tensor(types)
        out["attention_mask"][b, length - len(ids) :] = 1
    if images:
        out["image_grid_thw"] = torch.tensor(images)
    if videos:
        out["video_grid_thw"] = torch.tensor(videos)
    return out


def _cases(family):
    """(name, inputs): images, and videos (Qwen2.5-VL: one temporal id per grid, second_per_grid_ts 0.5 at 2 ids/s)."""
    if family == "qwen3_vl":
        return [("images", frames_batch(hf.IMAGES)), ("video", frames_batch([hf.IMAGES[1], [(2, (3, 4, 4))]]))]
    video = hf.batch(VIDEO_BLOCKS)
    if family == "qwen2_5_vl":
        video["second_per_grid_ts"] = torch.tensor([0.5])
    return [("images", hf.batch(hf.IMAGES)), ("video", video)]


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_transformers_ids_equal_the_reference_on_images_and_videos(family):
    model = hf.tiny_model(family)
    for name, inputs in _cases(family):
        assert inputs["input_ids"].shape[0] == 2 and (inputs["attention_mask"][:, 0] == 0).any()  # left padding
        audit = audit_position_ids(model, inputs, decode_steps=2)
        assert isinstance(audit, PositionIdsAudit)
        assert audit.equal, (name, str(audit))
        assert audit.paths == ("forward", "generate") and audit.decode_steps == 2
        valid = int(inputs["attention_mask"].sum())
        assert audit.compared == 2 * 3 * (valid + 2 * 2)
        assert audit.path is audit.sample is audit.row is audit.token is None
        text = str(audit)
        assert text.startswith("equal: ") and "forward and generate paths" in text and "2 decoding step(s)" in text
        assert f"transformers {transformers.__version__}" in text and "continuation='spatial_extent'" in text
    # the inner model has the forward path only
    assert audit_position_ids(model.model, inputs).paths == ("forward",)


def test_qwen2vl_video_audit_uses_the_5x_continuation():
    # after a video longer than its spatial extent, the original Qwen2-VL rule (visionpe's "mrope" default) and
    # transformers 5.x's differ: the audit's reference is the 5.x one, and the original rule would not match.
    model = hf.tiny_model("qwen2_vl")
    inputs = hf.batch(VIDEO_BLOCKS)
    audit = audit_position_ids(model, inputs)
    assert audit.equal and audit.scheme == "mrope" and audit.options == {"continuation": "spatial_extent"}
    original_rule, _ = get_position_ids(
        "mrope",
        inputs["mm_token_type_ids"],
        inputs.get("image_grid_thw"),
        inputs["video_grid_thw"],
        inputs["attention_mask"],
        pad_value=0,
    )
    theirs, _ = model.model.get_rope_index(
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        inputs.get("image_grid_thw"),
        inputs["video_grid_thw"],
        inputs["attention_mask"],
    )
    assert not torch.equal(original_rule, theirs)


def test_qwen25_video_whose_time_ids_pass_the_text_is_found_on_the_generate_path():
    # Without second_per_grid_ts transformers spaces a video's frames by tokens_per_second * 1 = 2 ids, past the
    # text continuation (block start + spatial extent). A cached forward then decodes at the largest id + 1 (its
    # rope_deltas, visionpe's reference), while generate continues from the last prompt token, + 1 on each row. The
    # audit's prompt ids equal (the reference spaces frames by 2 too); its first difference is generate's first step,
    # checked here against an independent reading of transformers' ids.
    model = hf.tiny_model("qwen2_5_vl")
    inputs = hf.batch(VIDEO_BLOCKS)
    pos, deltas = model.model.get_rope_index(
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        inputs["image_grid_thw"],
        inputs["video_grid_thw"],
        None,
        inputs["attention_mask"],
    )
    cached_next = inputs["attention_mask"].sum(1) + deltas[:, 0]  # what a cached forward decodes at, every row
    generate_next = pos[:, :, -1] + 1  # (3, B): the last prompt token's ids + 1
    differ = (generate_next != cached_next).T.nonzero()  # (sample, row)
    assert differ.numel()  # the case this test is about
    sample, row = (int(i) for i in differ[0])
    audit = audit_position_ids(model, inputs)
    assert not audit.equal and audit.options["tokens_per_second"] == 2.0
    length = inputs["input_ids"].shape[1]
    assert (audit.path, audit.sample, audit.row, audit.token) == ("generate", sample, row, length)
    assert audit.transformers_value == generate_next[row, sample] and audit.visionpe_value == cached_next[sample]
    assert audit_position_ids(model.model, inputs).equal  # the forward path (prompt and cached step) agrees


def test_a_shifted_id_in_get_rope_index_is_found(monkeypatch):
    model = hf.tiny_model("qwen2_vl")
    inputs = hf.batch(hf.IMAGES)
    token = int((inputs["mm_token_type_ids"][1] == 1).nonzero()[2])  # the third image token of sample 1
    original = Qwen2VLModel.get_rope_index

    def shifted(self, *args, **kwargs):  # a transformers release whose rule moved one id
        pos, delta = original(self, *args, **kwargs)
        pos = pos.clone()
        pos[1, 1, token] += 1
        return pos, delta

    expected, _ = original(
        model.model,
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        inputs["image_grid_thw"],
        None,
        inputs["attention_mask"],
    )
    monkeypatch.setattr(Qwen2VLModel, "get_rope_index", shifted)
    model.model.rope_deltas = sentinel = torch.tensor([[7], [7]])
    audit = audit_position_ids(model, inputs)
    assert not audit.equal
    assert (audit.path, audit.sample, audit.row, audit.token) == ("forward", 1, 1, token)
    assert audit.visionpe_value == expected[1, 1, token] and audit.transformers_value == audit.visionpe_value + 1
    assert f"first difference on the forward path, sample 1, row h (1), token {token}: " in str(audit)
    assert str(audit).startswith("DIFFERENT: ")
    assert model.model.rope_deltas is sentinel  # the model is left as it was


def test_a_changed_decoding_step_of_generate_is_found(monkeypatch):
    # only the generate path's next ids move (row w of sample 0): the forward path stays equal
    model = hf.tiny_model("qwen2_5_vl")
    inputs = hf.batch(hf.IMAGES)
    cls = type(model)
    update = cls._update_model_kwargs_for_generation

    def moved(self, outputs, model_kwargs, *args, **kwargs):
        out = update(self, outputs, model_kwargs, *args, **kwargs)
        out["position_ids"] = out["position_ids"].clone()
        out["position_ids"][3, 0, -1] += 2
        return out

    monkeypatch.setattr(cls, "_update_model_kwargs_for_generation", moved)
    length = inputs["input_ids"].shape[1]
    audit = audit_position_ids(model, inputs, decode_steps=2)
    assert (audit.path, audit.sample, audit.row, audit.token) == ("generate", 0, 2, length)
    assert audit.transformers_value == audit.visionpe_value + 2
    assert f"token {length} (decoding step 0)" in str(audit)
    assert audit_position_ids(model.model, inputs, decode_steps=2).equal  # forward only


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda m, i: (torch.nn.Linear(2, 2), i), TypeError, "model must be a Qwen2-VL, Qwen2.5-VL or Qwen3-VL model"),
        (lambda m, i: (m, list(i.items())), TypeError, "inputs must be a mapping of model inputs"),
        (
            lambda m, i: (m, {k: v for k, v in i.items() if k != "input_ids"}),
            ValueError,
            r"inputs\['input_ids'\] is required",
        ),
        (
            lambda m, i: (m, dict(i, input_ids=i["input_ids"].float())),
            TypeError,
            r"inputs\['input_ids'\] must be a \(B, L\) integer tensor",
        ),
        (
            lambda m, i: (m, dict(i, input_ids=i["input_ids"][0])),
            ValueError,
            r"inputs\['input_ids'\] must be a non-empty \(B, L\) tensor",
        ),
        (
            lambda m, i: (m, {k: v for k, v in i.items() if k != "mm_token_type_ids"}),
            ValueError,
            r"inputs\['mm_token_type_ids'\] is required",
        ),
        (
            lambda m, i: (m, dict(i, mm_token_type_ids=i["mm_token_type_ids"][:, 1:])),
            ValueError,
            r"inputs\['mm_token_type_ids'\] must have the shape of input_ids",
        ),
        (
            lambda m, i: (m, dict(i, mm_token_type_ids=i["mm_token_type_ids"] + 3)),
            ValueError,
            r"inputs\['mm_token_type_ids'\] must hold only \(0, 1, 2\), got \[3, 4\]",
        ),
        (
            lambda m, i: (m, dict(i, attention_mask=i["attention_mask"].float())),
            TypeError,
            r"inputs\['attention_mask'\] must be an integer tensor of shape",
        ),
        (
            lambda m, i: (m, dict(i, attention_mask=i["attention_mask"] * 3)),
            ValueError,
            r"inputs\['attention_mask'\] must hold only \(0, 1\), got \[0, 3\]",
        ),
        (
            lambda m, i: (m, {k: v for k, v in i.items() if k != "image_grid_thw"}),
            ValueError,
            r"inputs\['image_grid_thw'\] or inputs\['video_grid_thw'\] is required",
        ),
        (
            lambda m, i: (m, dict(i, image_grid_thw=i["image_grid_thw"][:, :2])),
            ValueError,
            r"inputs\['image_grid_thw'\] must be \(N, 3\) rows",
        ),
    ],
)
def test_bad_inputs_are_errors_naming_the_argument(change, error, message):
    model = hf.tiny_model("qwen2_vl")
    bad_model, bad_inputs = change(model, hf.batch(hf.IMAGES))
    with pytest.raises(error, match=message):
        audit_position_ids(bad_model, bad_inputs)


def test_bad_decode_steps_and_patched_models_are_refused():
    model = hf.tiny_model("qwen2_vl")
    inputs = hf.batch(hf.IMAGES)
    for bad, error in ((0, ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="decode_steps must be a positive int"):
            audit_position_ids(model, inputs, decode_steps=bad)
    apply_position_scheme(model, "videorope")
    with pytest.raises(ValueError, match="model is patched \\(visionpe scheme 'videorope'\\): the audit compares"):
        audit_position_ids(model, inputs)


def test_the_audit_is_exported_with_the_adapters():
    assert hf_adapters.audit_position_ids is audit_position_ids
    assert hf_adapters.PositionIdsAudit is PositionIdsAudit
    assert {"audit_position_ids", "PositionIdsAudit"} <= set(hf_adapters.__all__)
