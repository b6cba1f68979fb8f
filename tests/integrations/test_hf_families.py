"""The family table of the Hugging Face adapters, the shared steps, and patches that stay on one model instance."""

import ast
import copy
import importlib
from pathlib import Path

import pytest
import torch
from torch import nn

from visionpe.multimodal import apply_multimodal_rotary, get_position_ids, list_multimodal_schemes
from visionpe.multimodal.allocation import ALLOCATIONS

transformers = pytest.importorskip("transformers")
import visionpe  # noqa: E402
from visionpe.integrations import hf as hf_package  # noqa: E402
from visionpe.integrations.hf import (  # noqa: E402
    QWEN_MODELS,
    ROPE_1D_MODELS,
    SUPPORTED_MODELS,
    apply_position_scheme,
    llava,
    qwen,
    remove_position_scheme,
)
from visionpe.integrations.hf.adapter import (  # noqa: E402
    check_rotary_patch,
    patch_rotary_function,
    unpatch_rotary_function,
)
from visionpe.integrations.hf.audit import audit_position_ids  # noqa: E402
from visionpe.integrations.hf.compat import UnsupportedTransformersError, require_interface  # noqa: E402
from visionpe.integrations.hf.families import (  # noqa: E402
    ADAPTERS,
    FAMILIES,
    VLMFamily,
    find_family,
    find_model,
    outer_name,
)
from visionpe.integrations.hf.packing import QwenVLPackingCollator  # noqa: E402
from visionpe.integrations.hf.vision_tower import apply_vision_rope, remove_vision_rope, vision_tower  # noqa: E402

from . import test_hf as hf  # noqa: E402
from . import test_hf_llava as lv  # noqa: E402

HF_SOURCES = sorted(Path(hf_package.__file__).parent.glob("*.py"))
ALL_FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", *lv.FAMILIES]


def _tiny(family):
    return hf.tiny_model(family) if family.startswith("qwen") else lv.tiny_model(family)


def _inputs(family, model):
    if family.startswith("qwen"):
        inputs = hf.batch(hf.IMAGES)
        return inputs
    return lv.batch(family, model)


def _logits(model, inputs):
    if hasattr(model.model, "rope_deltas"):
        model.model.rope_deltas = None
    with torch.no_grad():
        return model(**inputs).logits


# --------------------------------------------------------------------------------------------------- the table
def test_the_family_table_is_every_supported_model_and_each_row_names_real_transformers_objects():
    assert set(FAMILIES) == set(SUPPORTED_MODELS) == set(QWEN_MODELS) | set(ROPE_1D_MODELS)
    assert not set(QWEN_MODELS) & set(ROPE_1D_MODELS)
    assert {
        "Qwen2VLModel",
        "Qwen2_5_VLModel",
        "Qwen3VLModel",
        "LlavaModel",
        "LlavaOnevisionModel",
        "InternVLModel",
    } <= set(FAMILIES)
    for adapter in (qwen, llava):  # each adapter runs exactly its rows, and replaces exactly the methods they name
        rows = [family for family in FAMILIES.values() if family.adapter == adapter.ADAPTER]
        assert set(adapter.SUPPORTED_MODELS) == {family.model for family in rows}
        for family in rows:
            assert set(adapter._ADAPTER.methods) == {name for _, name, _ in family.patched}
    for name, family in FAMILIES.items():
        assert family.model == name and family.adapter in ADAPTERS
        modeling = importlib.import_module(family.module)
        cls = family.model_class()
        assert cls is getattr(modeling, name) and cls.__module__ == family.module
        outer = getattr(modeling, family.outer)
        for on_outer, method, parameters in family.patched:  # the installed transformers has what the row patches
            require_interface(family.feature, outer if on_outer else cls, method, parameters)
        for function in family.functions:
            assert callable(getattr(modeling, function))
        assert family.own_scheme in list_multimodal_schemes()
        assert family.section_allocation is None or family.section_allocation in ALLOCATIONS


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_each_row_finds_the_models_language_model_rotary_attention_and_patched_methods(family):
    model = _tiny(family)
    vl_model, row = find_family(model)
    assert vl_model is model.model and row is FAMILIES[type(vl_model).__name__] and row.outer == type(model).__name__
    assert find_family(model.model)[0] is vl_model  # the inner model finds the same row
    config = vl_model.config
    language = row.language(vl_model)
    ids = torch.arange(5)[None]
    cos, sin = getattr(language, row.rotary)(
        torch.zeros(1, 5, 1), ids if row.adapter == "llava" else ids.expand(3, 1, 5)
    )
    text = config.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    assert cos.shape == sin.shape == (1, 5, head_dim)
    attentions = row.attentions(vl_model)
    assert len(attentions) == config.text_config.num_hidden_layers
    assert callable(getattr(importlib.import_module(type(attentions[0]).__module__), row.rotary_function))
    if row.merge_size is not None:
        assert int(getattr(config.vision_config, row.merge_size)) >= 1
    if row.deltas is not None:
        assert hasattr(vl_model, row.deltas)
    apply_position_scheme(model, "mhrope")  # replaces the ids' methods and the rotary application, per instance
    for obj, name in row.methods(model, vl_model):
        assert getattr(vars(obj)[name], "visionpe_patch", False), name
    for attention in attentions:
        assert vars(attention)["forward"].__self__ is attention
    remove_position_scheme(model)
    assert not any(name in vars(obj) for obj, name in row.methods(model, vl_model))
    assert not any("forward" in vars(attention) for attention in attentions)


def test_family_rows_and_lookups_check_their_arguments():
    row = FAMILIES["LlavaModel"]
    with pytest.raises(ValueError, match="adapter must be one of"):
        VLMFamily("XModel", "x", adapter="nope", feature="x", own_scheme="rope_1d", patched=())
    with pytest.raises(ValueError, match="visual_layout must be one of"):
        VLMFamily("XModel", "x", adapter="llava", feature="x", own_scheme="rope_1d", patched=(), visual_layout="rows")
    with pytest.raises(ValueError, match="inner must be a class name ending in 'Model'"):
        outer_name("Llava")
    with pytest.raises(TypeError, match="inner must be"):
        outer_name(3)
    with pytest.raises(TypeError, match="table must be"):
        find_model(torch.nn.Linear(2, 2), ["LlavaModel"])
    with pytest.raises(ValueError, match="adapter must be one of"):
        find_family(torch.nn.Linear(2, 2), "nope")
    with pytest.raises(TypeError, match=r"supports LlavaModel \(or LlavaForConditionalGeneration\).*got Linear"):
        find_family(torch.nn.Linear(2, 2), "llava")
    assert row.outer == "LlavaForConditionalGeneration" and outer_name("Qwen2_5_VLModel").startswith("Qwen2_5_VLFor")
    assert find_model(torch.nn.Linear(2, 2)) is None


# ------------------------------------------------------------------------------------------- source properties
def _docstrings(tree):
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
    return {id(node.body[0].value) for node in nodes if ast.get_docstring(node) is not None}


def _string_comparisons(source, names):
    """(line, name) of every comparison (==, !=, in, not in) of something with a string literal in ``names``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for operand in (node.left, *node.comparators):
            literals = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            for literal in literals:
                if isinstance(literal, ast.Constant) and literal.value in names:
                    found.append((node.lineno, literal.value))
    return found


def test_the_source_check_finds_a_scheme_name_compared_as_a_string():
    names = set(list_multimodal_schemes())
    assert _string_comparisons('if scheme == "ppe":\n    pass\n', names) == [(1, "ppe")]
    assert _string_comparisons('ok = "mrope" != name or name in ("v2pe", "x")\n', names) == [(1, "mrope"), (1, "v2pe")]
    assert _string_comparisons('if allocation == "chunked":\n    pass\n', names) == []


def test_no_adapter_compares_a_scheme_name_as_a_string():
    # the multimodal designs and the vision schemes ("none" aside: also the extrapolation mode that scales nothing)
    names = (set(list_multimodal_schemes()) | set(visionpe.list_schemes())) - {"none"}
    found = {path.name: _string_comparisons(path.read_text(encoding="utf-8"), names) for path in HF_SOURCES}
    assert not any(found.values()), found


def test_model_defaults_and_find_model_are_written_once():
    definitions, literals = [], []
    for path in HF_SOURCES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        definitions += [
            path.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "find_model"
        ]
        docstrings = _docstrings(tree)
        literals += [
            (path.name, node.lineno)
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value == "tokens_per_second" and id(node) not in docstrings
        ]
    assert definitions == ["families.py"]
    assert not literals, f"tokens_per_second is the scheme's model default (visionpe.multimodal.mrope): {literals}"


def test_the_adapter_the_collator_and_the_audit_read_the_same_model_default():
    model = hf.tiny_model("qwen2_5_vl")
    model.config.vision_config.tokens_per_second = 4
    inputs = hf.batch([[(2, (4, 4, 4))]])
    spg = torch.tensor([0.5])
    audit = audit_position_ids(model.model, dict(inputs, second_per_grid_ts=spg))  # the forward path
    assert audit.equal and audit.options["tokens_per_second"] == 4.0
    apply_position_scheme(model, "mrope_abs_time")
    args = (inputs["mm_token_type_ids"], None, inputs["video_grid_thw"], inputs["attention_mask"])
    ids, _ = model.model.get_rope_index(inputs["input_ids"], *args, second_per_grid_ts=spg)
    four, _ = get_position_ids("mrope_abs_time", *args, second_per_grid_ts=spg, tokens_per_second=4, pad_value=0)
    two, _ = get_position_ids("mrope_abs_time", *args, second_per_grid_ts=spg, tokens_per_second=2, pad_value=0)
    assert torch.equal(ids, four) and not torch.equal(ids, two)
    assert QwenVLPackingCollator.from_model(model).scheme_options == {"tokens_per_second": 4.0}
    assert QwenVLPackingCollator.from_model(model, tokens_per_second=1.0).scheme_options == {"tokens_per_second": 1.0}


# ------------------------------------------------------------------------------------- per-instance patching
def _old_process_wide_apply(original):
    """What the adapters installed in the modeling module before: per-head tables to visionpe, the rest to it."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if cos.ndim == 4:
            return apply_multimodal_rotary(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    return apply_rotary_pos_emb


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "llava"])
def test_a_head_wise_scheme_patches_its_model_only(family, monkeypatch):
    """Two models of one family in one process, one patched with MHRoPE: the other computes transformers' own
    outputs bit for bit and calls transformers' own function, which stays in its module."""
    patched, other = _tiny(family), _tiny(family)
    inputs = _inputs(family, other)
    attention = other.model.language_model.layers[0].self_attn
    modeling = importlib.import_module(type(attention).__module__)
    own_function = modeling.apply_rotary_pos_emb
    ref = _logits(other, inputs)
    assert torch.equal(_logits(patched, inputs), ref)  # same weights
    apply_position_scheme(patched, "mhrope")
    out = _logits(patched, inputs)
    assert not torch.equal(out, ref)
    assert torch.equal(_logits(other, inputs), ref)  # bit for bit, after the patched model ran
    assert modeling.apply_rotary_pos_emb is own_function
    layers = other.model.language_model.layers
    assert not any("forward" in vars(layer.self_attn) for layer in layers)
    # the unpatched model calls the module's function with its own (B, L, D) tables; the patched one never does
    seen = []

    def spy(q, k, cos, sin, **kwargs):
        seen.append(cos.ndim)
        return own_function(q, k, cos, sin, **kwargs)

    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", spy)
    assert torch.equal(_logits(other, inputs), ref) and seen == [3] * len(layers)
    seen.clear()
    assert torch.equal(_logits(patched, inputs), out) and seen == []
    # the same numbers as the process-wide replacement the adapters installed before
    before = copy.deepcopy(patched)
    for layer in before.model.language_model.layers:
        unpatch_rotary_function(layer.self_attn)
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", _old_process_wide_apply(own_function))
    assert torch.equal(_logits(before, inputs), out)
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", own_function)
    # a copy keeps its own patch; removal gives the model back, bit for bit
    clone = copy.deepcopy(patched)
    clone_attention = clone.model.language_model.layers[0].self_attn
    assert vars(clone_attention)["forward"].__self__ is clone_attention
    assert torch.equal(_logits(clone, inputs), out)
    remove_position_scheme(patched)
    assert not any("forward" in vars(layer.self_attn) for layer in patched.model.language_model.layers)
    assert torch.equal(_logits(patched, inputs), ref)
    apply_position_scheme(clone, "mrope")  # a scheme whose heads share their tables takes the patch off too
    assert not any("forward" in vars(layer.self_attn) for layer in clone.model.language_model.layers)


def test_a_head_wise_scheme_refuses_an_attention_with_a_forward_of_its_own():
    model = hf.tiny_model("qwen2_vl")
    attention = model.model.language_model.layers[1].self_attn
    wrapped = attention.forward
    attention.forward = lambda *args, **kwargs: wrapped(*args, **kwargs)  # as a hook that wraps forward would
    rotary = model.model.language_model.rotary_emb
    with pytest.raises(ValueError, match="Qwen2VLAttention has a forward of its own"):
        apply_position_scheme(model, "mhrope")
    assert model.model.language_model.rotary_emb is rotary and not hasattr(model, "visionpe_scheme")
    assert "get_rope_index" not in vars(model.model)
    assert "forward" not in vars(model.model.language_model.layers[0].self_attn)
    apply_position_scheme(model, "videorope")  # heads that share their tables need no forward of the attention
    assert model.visionpe_scheme == "videorope"


def _twice(x):
    return 2 * x


class _Doubler(nn.Module):
    def forward(self, x):
        return _twice(x) + 1


class _Plain(nn.Module):
    def forward(self, x):
        return x


def test_patch_rotary_function_binds_the_global_for_one_instance():
    first, second = _Doubler(), _Doubler()
    x = torch.ones(2)

    def triple(value):
        return 3 * value

    patch_rotary_function(first, "_twice", triple)
    assert torch.equal(first(x), 4 * x) and torch.equal(second(x), 3 * x)
    assert _Doubler.forward.__globals__["_twice"] is _twice
    patch_rotary_function(first, "_twice", triple)  # again: replaces its own patch
    unpatch_rotary_function(first)
    assert torch.equal(first(x), 3 * x) and "forward" not in vars(first)
    unpatch_rotary_function(second)  # not patched: nothing to do
    with pytest.raises(UnsupportedTransformersError, match=r"_Plain.forward does not call the module's _twice"):
        patch_rotary_function(_Plain(), "_twice", triple)
    with pytest.raises(TypeError, match="function must be callable, got int"):
        check_rotary_patch(second, "_twice", 3)
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        patch_rotary_function("module", "_twice", triple)
    with pytest.raises(TypeError, match="name must be a global name"):
        patch_rotary_function(second, None, triple)


def test_a_per_head_vision_scheme_patches_its_tower_only():
    patched, other = hf.tiny_model("qwen2_vl"), hf.tiny_model("qwen2_vl")
    inputs = hf.batch(hf.IMAGES)
    blocks = vision_tower(other).blocks
    modeling = importlib.import_module(type(blocks[0].attn).__module__)
    own_function = modeling.apply_rotary_pos_emb_vision
    ref = _logits(other, inputs)
    apply_vision_rope(patched, "rope_mixed")  # per-head frequencies: (N, heads, d) tables
    assert vision_tower(patched).rotary_pos_emb.scheme.frequencies().shape[1] > 1
    out = _logits(patched, inputs)
    assert not torch.equal(out, ref)
    assert torch.equal(_logits(other, inputs), ref) and modeling.apply_rotary_pos_emb_vision is own_function
    assert not any("forward" in vars(block.attn) for block in blocks)
    assert all("forward" in vars(block.attn) for block in vision_tower(patched).blocks)
    remove_vision_rope(patched)
    assert not any("forward" in vars(block.attn) for block in vision_tower(patched).blocks)
    assert torch.equal(_logits(patched, inputs), ref)
