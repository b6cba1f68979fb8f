"""The Hugging Face adapters refuse a transformers they are not written for, before patching anything.

Older releases are simulated: the version string is monkeypatched, or a method the adapters replace is removed or
given its older signature (Qwen-VL's ``get_rope_index`` without ``mm_token_type_ids``, a vision rotary that takes a
length, a forward that takes ``past_key_values``), where the patched model would otherwise run with wrong ids.
"""

import re
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
from visionpe.integrations.hf import apply_position_scheme, apply_vision_rope, compat  # noqa: E402
from visionpe.integrations.hf.compat import (  # noqa: E402
    TRANSFORMERS_MIN,
    UnsupportedTransformersError,
    check_transformers,
)

from . import test_hf as qwen  # noqa: E402
from . import test_hf_llava as llava  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
QWEN = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
# The transformers module the checks read. Importing a modeling module of transformers 5.25 replaces
# sys.modules["transformers"] once, so the module this file imported can be another object when test modules that
# import one were collected before it: an older release is simulated on the module that the adapters check.
CHECKED = compat.transformers


def _install_hint(message: str) -> None:
    assert f"transformers>={TRANSFORMERS_MIN}" in message, message
    assert 'pip install -e ".[vlm]"' in message, message


def _untouched(model, rotary) -> None:
    assert model.model.language_model.rotary_emb is rotary
    assert not hasattr(model, "visionpe_scheme")
    assert "get_rope_index" not in model.model.__dict__ and "forward" not in model.model.__dict__


def test_the_floor_is_the_vlm_extras_floor_in_pyproject():
    extra = re.search(r"^vlm = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.MULTILINE)
    assert extra is not None, "pyproject.toml has no vlm extra on one line"
    assert re.findall(r'"transformers>=([\w.]+)"', extra.group(1)) == [TRANSFORMERS_MIN]


def test_the_installed_transformers_is_supported():
    check_transformers("the test suite")  # the suite runs the adapters on it


@pytest.mark.parametrize("version", ["4.57.1", "5.24.9", "5.25.0.dev0", "not-a-version"])
def test_version_check_names_installed_version_range_and_install_command(version):
    with pytest.raises(UnsupportedTransformersError, match=re.escape(f"transformers {version} is installed")) as err:
        check_transformers("the feature", version)
    _install_hint(str(err.value))
    assert str(err.value).startswith("the feature supports")


@pytest.mark.parametrize("family", QWEN + llava.FAMILIES)
def test_adapters_refuse_an_older_transformers_before_patching(family, monkeypatch):
    model = qwen.tiny_model(family) if family in QWEN else llava.tiny_model(family)
    rotary = model.model.language_model.rotary_emb
    monkeypatch.setattr(CHECKED, "__version__", "4.57.1")
    with pytest.raises(ImportError, match=r"transformers 4\.57\.1 is installed") as err:
        apply_position_scheme(model, "mrope")
    _install_hint(str(err.value))
    _untouched(model, rotary)


@pytest.mark.parametrize("family", QWEN)
def test_vision_rope_refuses_an_older_transformers(family, monkeypatch):
    model = qwen.tiny_model(family)
    own = model.model.visual.rotary_pos_emb
    monkeypatch.setattr(CHECKED, "__version__", "5.0.0")

    with pytest.raises(UnsupportedTransformersError, match=r"apply_vision_rope.*transformers 5\.0\.0 is installed"):
        apply_vision_rope(model, "rope_mixed")
    assert model.model.visual.rotary_pos_emb is own


def _get_rope_index_without_token_types(self, input_ids, image_grid_thw=None, video_grid_thw=None, attention_mask=None):
    raise AssertionError("never called: the adapter refuses this interface")


@pytest.mark.parametrize("family", QWEN)
def test_qwen_adapter_refuses_ids_read_from_input_ids(family, monkeypatch):
    # before mm_token_type_ids, transformers called get_rope_index(input_ids, image_grid_thw, ...) positionally:
    # the patched method would take the grids for the token types
    model = qwen.tiny_model(family)
    rotary = model.model.language_model.rotary_emb
    monkeypatch.setattr(type(model.model), "get_rope_index", _get_rope_index_without_token_types)
    with pytest.raises(UnsupportedTransformersError, match=r"get_rope_index without mm_token_type_ids") as err:
        apply_position_scheme(model, "videorope")
    _install_hint(str(err.value))
    _untouched(model, rotary)


@pytest.mark.parametrize(
    "on_outer, method", [(False, "compute_3d_position_ids"), (True, "_prepare_position_ids_for_generation")]
)
def test_qwen_adapter_refuses_a_model_without_a_method_it_patches(on_outer, method, monkeypatch):
    # forward and generate would never reach the patched ids: the model's own would be used silently
    model = qwen.tiny_model("qwen2_vl")
    rotary = model.model.language_model.rotary_emb
    monkeypatch.setattr(type(model) if on_outer else type(model.model), method, None)  # as if it did not exist
    with pytest.raises(UnsupportedTransformersError, match=rf"has no {method}"):
        apply_position_scheme(model, "mrope")
    _untouched(model, rotary)


def _forward_with_past_key_values(
    self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None, **kwargs
):
    raise AssertionError("never called: the adapter refuses this interface")


def test_rope_1d_adapter_refuses_a_forward_without_cache(monkeypatch):
    # the adapter passes the cache as cache=; a forward with **kwargs and past_key_values would drop it silently
    model = llava.tiny_model("llava")
    rotary = model.model.language_model.rotary_emb
    monkeypatch.setattr(type(model.model), "forward", _forward_with_past_key_values)
    with pytest.raises(UnsupportedTransformersError, match=r"forward without cache"):
        apply_position_scheme(model, "v2pe")
    _untouched(model, rotary)


def test_rope_1d_adapter_needs_onevisions_anyres_functions(monkeypatch):
    model = llava.tiny_model("llava_onevision")
    rotary = model.model.language_model.rotary_emb
    modeling = __import__(type(model.model).__module__, fromlist=["unpad_image"])
    monkeypatch.delattr(modeling, "unpad_image")
    with pytest.raises(UnsupportedTransformersError, match=r"has no unpad_image"):
        apply_position_scheme(model, "rope_1d")
    _untouched(model, rotary)


def test_vision_rope_refuses_a_rotary_that_takes_a_length(monkeypatch):
    # the older towers called rotary_pos_emb(max_grid_size) and indexed its table: no (h, w) positions to read
    model = qwen.tiny_model("qwen2_vl")
    own = model.model.visual.rotary_pos_emb
    monkeypatch.setattr(type(own), "forward", lambda self, seqlen: None)
    with pytest.raises(UnsupportedTransformersError, match=r"forward without position_ids"):
        apply_vision_rope(model, "rope_axial")
    assert model.model.visual.rotary_pos_emb is own
