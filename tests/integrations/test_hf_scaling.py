"""The Qwen-VL adapter under the model's own RoPE scaling, and on models built for meta-device loading."""

import contextlib
import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
from visionpe.integrations.hf import apply_position_scheme, remove_position_scheme  # noqa: E402
from visionpe.multimodal.rotary import RopeScaling  # noqa: E402

from . import test_hf as hf  # noqa: E402

MAX_POSITIONS = 8  # shorter than the test prompts (ids up to 15), so that dynamic NTK scales them
ROPES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4, "beta_fast": 8.0},
}


def scaled_model(family, rope):
    """``hf.tiny_model(family)`` (same weights) with ``rope`` in its rope_parameters and 8 max positions."""
    config = hf.tiny_model(family).config
    text = config.text_config
    text.rope_parameters = {**text.rope_parameters, **rope}
    text.max_position_embeddings = MAX_POSITIONS
    torch.manual_seed(0)
    model_cls = {
        "qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
    }[family]
    return model_cls(config).eval()


@pytest.mark.parametrize("rope_type", list(ROPES))
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_mrope_reproduces_a_model_with_rope_scaling(family, rope_type):
    model = scaled_model(family, ROPES[rope_type])
    inputs = hf.batch(hf.IMAGES)
    scheme = "mrope_interleaved" if family == "qwen3_vl" else "mrope"
    patched = apply_position_scheme(copy.deepcopy(model), scheme)
    rotary = patched.model.language_model.rotary_emb.rotary
    assert rotary.rope_scaling.rope_type == rope_type
    assert rotary.attention_scaling == model.model.language_model.rotary_emb.attention_scaling
    with torch.no_grad():
        ref, out = model(**inputs).logits, patched(**inputs).logits
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
        if rope_type == "dynamic":  # the prompt is longer than max_position_embeddings: both grew their base
            assert model.model.language_model.rotary_emb.max_seq_len_cached > MAX_POSITIONS
            assert rotary._ntk_seq_len is not None and rotary._ntk_seq_len > MAX_POSITIONS
        # the scaling matters: the unscaled model (same weights) gives other logits
        unscaled = hf.tiny_model(family)
        assert (unscaled(**inputs).logits - ref).abs().max() > 1e-4
        # generate: one more position per step (dynamic NTK grows at each)
        gen_ref, gen_out = model.generate(**inputs, **hf.GEN), patched.generate(**inputs, **hf.GEN)
    assert torch.equal(gen_ref.sequences, gen_out.sequences)
    for step_ref, step_out in zip(gen_ref.logits, gen_out.logits, strict=True):
        torch.testing.assert_close(step_out, step_ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("rope_type", list(ROPES))
def test_other_schemes_run_under_the_models_scaling(rope_type):
    model = scaled_model("qwen2_5_vl", ROPES[rope_type])
    plain = hf.tiny_model("qwen2_5_vl")
    inputs = hf.batch([hf.IMAGES[0], [(2, (2, 4, 4))]])
    inputs["second_per_grid_ts"] = torch.tensor([1.0])
    rope = model.config.text_config.rope_parameters
    scaling = RopeScaling.from_rope_parameters(rope, MAX_POSITIONS)
    for scheme in ("mhrope", "v2pe"):  # int64 ids and head-wise tables; float64 ids (fp64 angles)
        patched = apply_position_scheme(copy.deepcopy(model), scheme)
        unscaled = apply_position_scheme(copy.deepcopy(plain), scheme)
        rotary = patched.model.language_model.rotary_emb.rotary
        logits = hf._logits(patched, inputs)
        assert torch.isfinite(logits).all()
        assert (logits - hf._logits(unscaled, inputs)).abs().max() > 1e-4
        seq_len = rotary._ntk_seq_len if rope_type == "dynamic" else None
        if rope_type == "dynamic":
            assert seq_len is not None and seq_len > MAX_POSITIONS
        assert torch.equal(rotary.inv_freq, scaling.inverse_frequencies(rope["rope_theta"], 16, seq_len=seq_len))
        assert rotary.attention_scaling == scaling.attention_scaling


def test_unsupported_rope_type_is_refused_before_patching():
    model = hf.tiny_model("qwen2_vl")
    text = model.config.text_config
    text.rope_parameters = {**text.rope_parameters, "rope_type": "llama3", "factor": 8.0}
    own = model.model.language_model.rotary_emb
    message = (
        r"apply_position_scheme: the model's text_config.rope_parameters are not supported: "
        r"rope_parameters\['rope_type'\] must be one of \('default', 'linear', 'dynamic', 'yarn'\).* got 'llama3'"
    )
    with pytest.raises(ValueError, match=message):
        apply_position_scheme(model, "mrope")
    assert model.model.language_model.rotary_emb is own and not hasattr(model, "visionpe_scheme")
    text.rope_parameters = {**text.rope_parameters, "rope_type": "yarn", "factor": 2.0, "truncate": "no"}
    with pytest.raises(TypeError, match="rope_parameters are not supported: truncate must be a bool, got str"):
        apply_position_scheme(model, "videorope")


@contextlib.contextmanager
def _parameters_on_meta():
    """What accelerate's ``init_empty_weights()`` does (include_buffers=False): parameters on the meta device,
    buffers computed where they are created. Written out here so that the test needs no accelerate."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            param_cls, kwargs = type(module._parameters[name]), dict(module._parameters[name].__dict__)
            kwargs["requires_grad"] = param.requires_grad
            module._parameters[name] = param_cls(module._parameters[name].to("meta"), **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(nn.Module, "register_parameter", register_on_meta)
        yield


def _accelerate_init_empty_weights():
    accelerate = pytest.importorskip("accelerate")
    return accelerate.init_empty_weights()


BUILDS = {
    "meta_device": lambda: torch.device("meta"),
    "parameters_on_meta": _parameters_on_meta,
    "accelerate": _accelerate_init_empty_weights,
}


def _init_rotaries_as_transformers(model):
    """transformers' own re-initialisation of non-persistent rotary buffers after meta-device loading
    (``from_pretrained`` runs ``_init_weights`` on every ``*RotaryEmbedding`` module, none of which is loaded)."""
    for module in model.modules():
        if "RotaryEmbedding" in type(module).__name__ and hasattr(module, "original_inv_freq"):
            model._init_weights(module)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize(
    "family, scheme, rope_type",
    [("qwen2_vl", "mrope", None), ("qwen2_5_vl", "videorope", "yarn"), ("qwen3_vl", "mhrope", "dynamic")],
)
def test_scheme_applied_to_an_empty_model_then_loaded_equals_one_applied_on_cpu(family, scheme, rope_type, build):
    model = scaled_model(family, ROPES[rope_type]) if rope_type else hf.tiny_model(family)
    inputs = hf.batch(hf.IMAGES)
    ref = apply_position_scheme(copy.deepcopy(model), scheme)
    with BUILDS[build]():
        empty = type(model)(model.config)
    assert next(empty.parameters()).is_meta
    assert apply_position_scheme(empty, scheme) is empty
    rotary = empty.model.language_model.rotary_emb.rotary
    assert rotary.inv_freq.is_meta == (build == "meta_device")
    empty.to_empty(device="cpu")  # uninitialised memory everywhere
    empty.load_state_dict(model.state_dict())  # the weights; no rotary table is in the state dict
    ref_rotary = ref.model.language_model.rotary_emb.rotary
    # visionpe's tables are back already: to_empty rebuilt them
    assert torch.equal(rotary.inv_freq, ref_rotary.inv_freq) and torch.equal(rotary.mix, ref_rotary.mix)
    _init_rotaries_as_transformers(empty)  # the model's own rotaries (vision tower, the kept text rotary)
    empty.eval()
    assert torch.equal(hf._logits(empty, inputs), hf._logits(ref, inputs))
    remove_position_scheme(empty)  # the model's own rotary, kept inside the patch, was re-initialised too
    assert torch.equal(hf._logits(empty, inputs), hf._logits(model, inputs))
