"""The checks of timm's model test suite (pytorch-image-models' tests/test_models.py) for the visionpe_vit_* image
models, written out here so that they run without timm's test file: default cfgs and what ``fixed_input_size``
makes the harness feed, forward and backward, the non-standard cfg checks timm runs for its ViTs,
``forward_intermediates`` and ``features_only``, and torch.fx tracing (timm's tracer settings and plain torch.fx /
torchvision) computing exactly what the eager model does. Tiny models at the cfg's 224 px input."""

import pytest
import timm
import torch
from timm.models import get_notrace_functions, get_notrace_modules
from timm.models._features import FeatureGetterNet
from timm.models._features_fx import FeatureGraphNet
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

NAME = "visionpe_vit_tiny_patch16_224"
SMALL = dict(embed_dim=32, depth=2, num_heads=2)  # the cfg's 224 px input and 16 px patches: a 14 x 14 grid
POS_EMBEDS = ["learned", "rope_mixed", "alibi2d"]  # the default, a rotary and a bias scheme
IMAGE_MODELS = timm.list_models("visionpe_vit_*")
TRACER_KWARGS = dict(  # as timm's test file traces its models
    leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions(), param_shapes_constant=True
)


def harness_input_size(cfg: dict, target: int | None) -> tuple[int, ...]:
    """The input size timm's test file feeds a model (its ``_get_input_size``): the cfg's when the cfg declares
    ``fixed_input_size``, else the cfg's capped at the test's target (96 px for features, 128 for backward and
    fx)."""
    input_size = cfg["input_size"]
    if cfg.get("fixed_input_size"):
        return input_size
    if cfg.get("min_input_size"):
        return cfg["min_input_size"] if target and max(input_size) > target else input_size
    return tuple(min(s, target) for s in input_size) if target and max(input_size) > target else input_size


def create(pos_embed: str, **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(NAME, pos_embed=pos_embed, **SMALL, **kwargs)


def eager_vs(model: torch.nn.Module, traced, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        out = traced(x)
        return model(x), (next(iter(out.values())) if isinstance(out, dict) else out)


# -- default cfgs -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_image_cfgs_declare_a_fixed_input_size_as_timm_vits(name):
    cfg = timm.get_pretrained_cfg(name).to_dict()
    vit = timm.get_pretrained_cfg("vit_small_patch16_224").to_dict()
    for key in ("input_size", "fixed_input_size", "first_conv", "classifier", "num_classes", "mean", "std"):
        assert cfg[key] == vit[key], key
    assert cfg["fixed_input_size"] is True and cfg["pool_size"] is None
    # so timm's harness feeds the cfg's size to every test, never its 96 or 128 px targets
    for target in (None, 96, 128, 384):
        assert harness_input_size(cfg, target) == (3, 224, 224)


@pytest.mark.parametrize("name", timm.list_models("visionpe_video_vit_*") + timm.list_models("visionpe_mvvit_*"))
def test_video_and_multiview_cfgs_stay_dynamic(name):
    # these models take any size by default (dynamic_img_size=True), so their cfgs do not fix it
    assert timm.get_pretrained_cfg(name).fixed_input_size is False


def test_fixed_input_size_is_what_the_model_takes():
    model = create("learned").eval()
    cfg = model.pretrained_cfg
    assert cfg["fixed_input_size"] and tuple(model.patch_embed.img_size) == cfg["input_size"][1:]
    for size in (96, 128):  # what the harness would feed without fixed_input_size
        with pytest.raises(ValueError, match="does not match the model's img_size"):
            model(torch.randn(1, 3, size, size))
    dynamic = create("learned", dynamic_img_size=True).eval()  # the model for other sizes
    unfixed = {**cfg, "fixed_input_size": False}
    for target in (96, 128):
        size = harness_input_size(unfixed, target)
        assert size == (3, target, target)
        with torch.no_grad():
            assert dynamic(torch.randn(1, *size)).shape == (1, 1000)


# -- forward, backward and the non-standard cfg checks ----------------------------------------------------------
@pytest.mark.parametrize("pos_embed", POS_EMBEDS)
def test_forward_and_non_std_cfg_checks(pos_embed):
    model = create(pos_embed).eval()
    x = torch.randn(1, *harness_input_size(model.pretrained_cfg, 384))
    with torch.no_grad():
        out = model(x)
        features = model.forward_features(x)
        pre_logits = model.forward_head(features, pre_logits=True)
        model.set_grad_checkpointing()
        assert torch.allclose(model(x), out, rtol=1e-4, atol=1e-5)
    assert out.shape == (1, 1000) and not out.isnan().any()
    assert features.shape == (1, 1 + 14 * 14, model.num_features) and pre_logits.shape == (1, model.head_hidden_size)
    model.reset_classifier(0)
    with torch.no_grad():
        assert torch.equal(model(x), pre_logits)
        headless = create(pos_embed, num_classes=0).eval()(x)
    assert headless.shape == (1, model.num_features)
    state = model.state_dict()
    cfg = model.pretrained_cfg
    assert f"{cfg['first_conv']}.weight" in state
    assert f"{cfg['classifier']}.weight" in create(pos_embed).state_dict()


@pytest.mark.parametrize("pos_embed", POS_EMBEDS)
def test_backward_reaches_every_parameter(pos_embed):
    model = create(pos_embed, num_classes=42).train()
    x = torch.randn(2, *harness_input_size(model.pretrained_cfg, 128))
    out = model(x)
    out.mean().backward()
    assert out.shape == (2, 42) and not out.isnan().any()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


# -- forward_intermediates and features_only --------------------------------------------------------------------
@pytest.mark.parametrize("pos_embed", POS_EMBEDS)
def test_forward_intermediates_and_features_only(pos_embed):
    model = create(pos_embed).eval()
    x = torch.randn(1, *harness_input_size(model.pretrained_cfg, 96))
    with torch.no_grad():
        final, intermediates = model.forward_intermediates(x, output_fmt="NCHW")
        assert torch.allclose(final, model.forward_features(x))
        tokens = model.forward_intermediates(x, output_fmt="NLC", return_prefix_tokens=True, intermediates_only=True)
        # features_only's wrappers (they prune the model they wrap): copies with the same weights (same seed)
        getter = FeatureGetterNet(create(pos_embed).eval(), out_indices=(0, 1))(x)
        graph = FeatureGraphNet(create(pos_embed).eval(), out_indices=(0, 1))(x)  # feature_cls="fx"
    assert [(i["num_chs"], i["reduction"]) for i in model.feature_info] == [(32, 16)] * 2  # one per block
    assert [tuple(f.shape) for f in intermediates] == [(1, 32, 14, 14)] * 2
    for feat, ref, (spatial, prefix), block_out in zip(getter, intermediates, tokens, graph, strict=True):
        assert torch.equal(feat, ref)
        assert torch.equal(ref, spatial.transpose(1, 2).reshape(1, 32, 14, 14))
        assert torch.equal(block_out, torch.cat((prefix, spatial), 1))  # fx: the blocks' (B, 1 + N, C) outputs
    fx_features = create(pos_embed, features_only=True, feature_cls="fx", out_indices=(0, 1)).eval()
    assert [tuple(f.shape) for f in fx_features(x)] == [(1, 197, 32)] * 2


# -- torch.fx ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pos_embed", POS_EMBEDS)
def test_fx_feature_extractor_equals_eager(pos_embed):
    model = create(pos_embed).eval()
    x = torch.randn(1, *harness_input_size(model.pretrained_cfg, 128))
    # timm's test: the last node of the traced graph, with timm's tracer settings
    train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=TRACER_KWARGS)
    fx_model = create_feature_extractor(
        model, train_return_nodes=[train_nodes[-1]], eval_return_nodes=[eval_nodes[-1]], tracer_kwargs=TRACER_KWARGS
    )
    eager, traced = eager_vs(model, fx_model, x)
    assert torch.equal(traced, eager)
    # plain torch.fx and torchvision without timm's settings, and a block's output
    eager, traced = eager_vs(model, torch.fx.symbolic_trace(model), x)
    assert torch.equal(traced, eager)
    blocks = create_feature_extractor(model, return_nodes={"blocks.0": "b0"})
    with torch.inference_mode():
        first = model.forward_intermediates(x, indices=[0], output_fmt="NLC", return_prefix_tokens=True)[1][0]
        assert torch.equal(blocks(x)["b0"], torch.cat((first[1], first[0]), 1))


@pytest.mark.parametrize("pos_embed", POS_EMBEDS)
def test_fx_backward_reaches_every_parameter(pos_embed):
    model = create(pos_embed, num_classes=42).train()
    num_params = sum(p.numel() for p in model.parameters())
    train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=TRACER_KWARGS)
    fx_model = create_feature_extractor(
        model, train_return_nodes=[train_nodes[-1]], eval_return_nodes=[eval_nodes[-1]], tracer_kwargs=TRACER_KWARGS
    )
    out = next(iter(fx_model(torch.randn(2, *harness_input_size(model.pretrained_cfg, 128))).values()))
    out.mean().backward()
    assert out.shape == (2, 42) and not out.isnan().any()
    assert [n for n, p in fx_model.named_parameters() if p.grad is None] == []
    assert sum(p.grad.numel() for p in fx_model.parameters()) == num_params


def test_traced_model_checks_its_inputs():
    traced = torch.fx.symbolic_trace(create("rope_mixed").eval())
    with pytest.raises(ValueError, match="does not match the model's img_size"):
        traced(torch.randn(1, 3, 128, 128))
    with pytest.raises(ValueError, match="traced without attn_mask"):
        traced(torch.randn(1, 3, 224, 224), attn_mask=torch.ones(197, 197, dtype=torch.bool))
    with pytest.raises(ValueError, match="trace a model created without dynamic_img_size"):
        torch.fx.symbolic_trace(create("rope_mixed", dynamic_img_size=True))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_torchscript_is_not_supported():
    # the blocks run from a generator and position states are per-scheme Python objects (docs/timm.md); timm's
    # harness is run with these models left out of its TorchScript tests, as it leaves out its non-scriptable ones
    with pytest.raises(Exception):  # noqa: B017 - TorchScript raises several error types
        torch.jit.script(create("learned").eval())
