"""What the registry entries declare for model adapters: per-call inputs, model-config defaults, positions per token
and advance tokens (the adapters read these instead of testing scheme names)."""

from types import SimpleNamespace

import pytest
import torch

from visionpe.multimodal import MULTIMODAL_SCHEMES, get_multimodal_scheme, get_position_ids
from visionpe.multimodal.bipe import BIPE_SEPARATOR_IDS, bipe_advance_tokens
from visionpe.multimodal.mrope import TOKENS_PER_SECOND, mrope_abs_time_model_defaults

# design options that describe one batch's tokens (a model adapter takes them per call)
BATCH_OPTIONS = ("input_ids", "clusters", "weights", "second_per_grid_ts")


@pytest.mark.parametrize("name", sorted(MULTIMODAL_SCHEMES))
def test_every_declaration_names_options_of_the_design(name):
    entry = get_multimodal_scheme(name)
    options = entry.design_options()
    assert set(entry.call_inputs) <= set(options), entry.call_inputs
    assert set(entry.required_options) <= set(options)
    assert entry.representatives_option is None or entry.representatives_option in options
    # every option that describes one batch is declared as a call input (the adapters refuse it once per model)
    assert {o for o in options if o in BATCH_OPTIONS} == set(entry.call_inputs)
    if entry.model_defaults is not None:
        defaults = entry.model_defaults(SimpleNamespace())
        assert defaults and set(defaults) <= set(options) and not set(defaults) & set(entry.call_inputs)
    if entry.advance_tokens is not None:
        tokens = entry.advance_tokens({})
        assert isinstance(tokens, tuple) and all(isinstance(t, int) for t in tokens)


def test_mrope_abs_time_reads_tokens_per_second_from_the_vision_config():
    entry = get_multimodal_scheme("mrope_abs_time")
    config = SimpleNamespace(vision_config=SimpleNamespace(tokens_per_second=4))
    assert entry.with_model_defaults({}, config) == {"tokens_per_second": 4.0}
    assert entry.with_model_defaults({"continuation": "spatial_extent"}, config) == {
        "continuation": "spatial_extent",
        "tokens_per_second": 4.0,
    }
    assert entry.with_model_defaults({"tokens_per_second": 1.5}, config) == {"tokens_per_second": 1.5}  # given wins
    assert mrope_abs_time_model_defaults(SimpleNamespace(vision_config=SimpleNamespace())) == {
        "tokens_per_second": float(TOKENS_PER_SECOND)
    }
    # the default is the design's own default, so a model without the setting gets the design's ids
    types = torch.tensor([[0] + [2] * 8 + [0]])
    video = torch.tensor([[2, 4, 4]])
    spg = torch.tensor([0.5])
    plain, _ = get_position_ids("mrope_abs_time", types, None, video, second_per_grid_ts=spg)
    defaulted = entry.with_model_defaults({}, SimpleNamespace())
    assert torch.equal(
        get_position_ids("mrope_abs_time", types, None, video, second_per_grid_ts=spg, **defaulted)[0], plain
    )


def test_schemes_without_model_defaults_keep_the_options_and_arguments_are_checked():
    entry = get_multimodal_scheme("v2pe")
    options = {"delta": 0.5}
    resolved = entry.with_model_defaults(options, SimpleNamespace(vision_config=SimpleNamespace(tokens_per_second=4)))
    assert resolved == options and resolved is not options
    with pytest.raises(TypeError, match="options must be a dict"):
        entry.with_model_defaults([("delta", 0.5)], None)
    with pytest.raises(TypeError, match="options must be a dict"):
        entry.representatives(None)


def test_positions_per_token_and_advance_tokens():
    ppe = get_multimodal_scheme("ppe")
    assert ppe.representatives({}) == 1 and ppe.representatives({"num_representatives": 3}) == 3
    assert get_multimodal_scheme("mrope").representatives({"num_representatives": 3}) == 1  # not its option
    bipe = get_multimodal_scheme("bipe")
    assert bipe.advance_tokens is bipe_advance_tokens
    assert bipe_advance_tokens({}) == BIPE_SEPARATOR_IDS
    assert bipe_advance_tokens({"separator_ids": [4, 6]}) == (4, 6)
    assert bipe_advance_tokens({"separator_ids": torch.tensor([[4], [6]])}) == (4, 6)
    with pytest.raises(TypeError, match="options must be a dict"):
        bipe_advance_tokens((4, 6))
    assert all(get_multimodal_scheme(n).advance_tokens is None for n in ("mrope", "v2pe", "rope_1d"))
