"""A visionpe rotary scheme in place of a diffusers transformer's own rotary, for fine-tuning
(``apply_position_scheme(transformer, "<scheme>", **options)``): every rotary scheme on a tiny random Flux, the
parameters it adds, the way back, HARoPE in Flux's setting and the positions read from the ids."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest

pytest.importorskip("diffusers")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from diffusers import FluxTransformer2DModel, WanTransformer3DModel, WanVACETransformer3DModel  # noqa: E402

import visionpe  # noqa: E402
from visionpe.contract import UnsupportedSchemeError, refusal  # noqa: E402
from visionpe.integrations.diffusers import (  # noqa: E402
    DIFFUSERS_FAMILIES,
    apply_position_scheme,
    remove_position_scheme,
)
from visionpe.integrations.diffusers.swap import (  # noqa: E402
    DIFFUSERS_SWAP_ENTRY,
    DIFFUSERS_VIDEO_SWAP_ENTRY,
    FluxSchemePositions,
    JointPositions,
    VisionPEFluxAttnProcessor,
    VisionPEWanAttnProcessor,
    swap_position_scheme,
    swapped_scheme,
)
from visionpe.integrations.timm_swap import SwapReport  # noqa: E402
from visionpe.multimodal import list_multimodal_schemes  # noqa: E402

ROTARY = visionpe.list_schemes("rotary")
HEADS, HEAD_DIM, CHANNELS, TEXT = 2, 16, 8, 3


def tiny_flux() -> FluxTransformer2DModel:
    """A random Flux transformer: one double-stream and one single-stream block, 2 heads of 16 channels."""
    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=CHANNELS,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        joint_attention_dim=CHANNELS,
        pooled_projection_dim=CHANNELS,
        axes_dims_rope=(4, 6, 6),
    ).eval()


def image_ids(height: int, width: int, index: int = 0) -> torch.Tensor:
    """(height * width, 3) ids of an image's tokens as Flux's pipelines make them: (index, row, column)."""
    ids = torch.zeros(height, width, 3)
    ids[..., 0] = index
    ids[..., 1] = torch.arange(height)[:, None]
    ids[..., 2] = torch.arange(width)[None]
    return ids.reshape(-1, 3)


def flux_inputs(height: int = 4, width: int = 4, *, batch: int = 1, seed: int = 1) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(batch, height * width, CHANNELS, generator=generator),
        encoder_hidden_states=torch.randn(batch, TEXT, CHANNELS, generator=generator),
        pooled_projections=torch.randn(batch, CHANNELS, generator=generator),
        timestep=torch.full((batch,), 0.6),
        img_ids=image_ids(height, width),
        txt_ids=torch.zeros(TEXT, 3),
        return_dict=False,
    )


def run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]


def position_free(scheme: torch.nn.Module, grid: tuple[int, int]) -> bool:
    """Whether the scheme turns q and k the same way at every position (then no output can depend on them)."""
    coords = scheme.model_coords(grid)
    x = torch.randn(1, HEADS, coords.shape[0], HEAD_DIM)
    with torch.no_grad():
        here = scheme.rotate(x, coords, 0, grid)
        there = scheme.rotate(x, coords.flip(0), 0, grid)
    return torch.allclose(here, there)


# -- every rotary scheme ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ROTARY)
def test_each_rotary_scheme_swaps_trains_only_its_parameters_and_comes_off_exactly(name):
    model = tiny_flux()
    inputs = flux_inputs(batch=2)
    reference = run(model, inputs)
    keys, processors, own = set(model.state_dict()), model.attn_processors, model.pos_embed
    reason = refusal(DIFFUSERS_SWAP_ENTRY, name)
    if reason is not None:  # refused through the contract, with the reason, and the model untouched
        with pytest.raises(UnsupportedSchemeError, match=name):
            apply_position_scheme(model, name)
        assert set(model.state_dict()) == keys and model.pos_embed is own
        return
    report = apply_position_scheme(model, name)
    assert isinstance(report, SwapReport) and swapped_scheme(model) == name
    new_keys = set(model.state_dict()) - keys
    assert report.added == sorted(new_keys) and not report.dropped and not report.copied and not report.permuted
    assert all(key.startswith(f"pos_schemes.{name}.") for key in report.added)
    assert all(isinstance(model.attn_processors[n], VisionPEFluxAttnProcessor) for n in processors)

    # fine-tuning the scheme alone: the model's own weights frozen, one training step's backward
    model.train()
    own_params = {n for n, _ in model.named_parameters() if not n.startswith("pos_schemes.")}
    for n, p in model.named_parameters():
        p.requires_grad_(n not in own_params)
    latents = inputs["hidden_states"].clone().requires_grad_(True)  # a backward also for schemes without parameters
    out = model(**dict(inputs, hidden_states=latents))[0]
    assert out.shape == reference.shape and torch.isfinite(out).all()
    out.square().mean().backward()
    assert latents.grad is not None and torch.isfinite(latents.grad).all()
    new_params = {n for n, _ in model.named_parameters()} - own_params
    assert new_params <= new_keys  # every new parameter is reported
    reached = {n for n, p in model.named_parameters() if p.grad is not None}
    assert reached == new_params
    assert all(torch.isfinite(p.grad).all() for n, p in model.named_parameters() if n in reached)
    if new_params:
        assert any(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n in reached)

    model.eval()
    assert remove_position_scheme(model) is model
    assert torch.equal(run(model, inputs), reference)
    assert set(model.state_dict()) == keys and model.pos_embed is own and swapped_scheme(model) is None
    assert all(model.attn_processors[n] is p for n, p in processors.items())


@pytest.mark.parametrize("name", ROTARY)
def test_outputs_follow_the_image_ids_not_the_token_order(name):
    """Permuting the image tokens together with their ids permutes the output alike (positions come from the ids);
    permuting the ids alone changes the output, unless the scheme is position-free."""
    if refusal(DIFFUSERS_SWAP_ENTRY, name) is not None:
        pytest.skip(refusal(DIFFUSERS_SWAP_ENTRY, name))
    model = tiny_flux()
    apply_position_scheme(model, name)
    inputs = flux_inputs(4, 3)
    out = run(model, inputs)
    order = torch.randperm(12, generator=torch.Generator().manual_seed(3))
    moved = dict(inputs, hidden_states=inputs["hidden_states"][:, order], img_ids=inputs["img_ids"][order])
    torch.testing.assert_close(run(model, moved), out[:, order], atol=1e-5, rtol=1e-5)
    relabelled = run(model, dict(inputs, img_ids=inputs["img_ids"][order]))
    if position_free(model.pos_schemes[name], (4, 3)):
        torch.testing.assert_close(relabelled, out, atol=1e-5, rtol=1e-5)
    else:
        assert (relabelled - out).abs().max() > 1e-6  # the same computation on other tables: exactly equal


def test_text_tokens_are_not_rotated_whatever_their_ids():
    """Text tokens are the scheme's prefix tokens: unrotated, i.e. at position (0, 0) for a rotation linear in the
    position, Flux's own text ids; other text ids change nothing."""
    model = tiny_flux()
    apply_position_scheme(model, "rope_axial", base=100.0)
    inputs = flux_inputs()
    out = run(model, inputs)
    torch.testing.assert_close(run(model, dict(inputs, txt_ids=torch.randint(0, 9, (TEXT, 3)).float())), out)
    seen = []
    model.pos_embed.register_forward_hook(lambda module, args, output: seen.append(output))
    run(model, inputs)
    positions = seen[0]
    assert isinstance(positions, JointPositions) and (positions.num_text, positions.num_image) == (TEXT, 16)
    qk = torch.randn(2, 1, HEADS, TEXT + 16, HEAD_DIM)
    rotated = positions.rotation(0, TEXT + 16).rotate(qk)
    assert torch.equal(rotated[..., :TEXT, :], qk[..., :TEXT, :])
    assert torch.equal(rotated[..., TEXT, :], qk[..., TEXT, :])  # the image token at (0, 0)
    assert not torch.allclose(rotated[..., TEXT + 1 :, :], qk[..., TEXT + 1 :, :])


# -- HARoPE in Flux's setting --------------------------------------------------------------------------------------


def test_harope_starts_as_the_axial_rope_it_extends():
    """At init M = (1 + 1e-6) I: HARoPE equals rope_axial(base=10000), at the training size and at 2x."""
    harope, axial = tiny_flux(), tiny_flux()
    apply_position_scheme(harope, "harope")
    apply_position_scheme(axial, "rope_axial", base=10000.0)
    for size in ((4, 4), (8, 8)):
        inputs = flux_inputs(*size)
        torch.testing.assert_close(run(harope, inputs), run(axial, inputs), atol=1e-5, rtol=0)
    scheme = harope.pos_schemes["harope"]
    assert scheme.A_u.shape == (2, HEADS, HEAD_DIM, HEAD_DIM)  # one map per attention layer and head
    with torch.no_grad():
        scheme.A_u.normal_()
    assert (run(harope, flux_inputs()) - run(axial, flux_inputs())).abs().max() > 1e-3


def _released_harope_attention(attn, tokens, text, a_u, a_v, sigma, rows, cols):
    """HARoPE's released attention written out on one Flux attention module: q and k projected and RMS-normalised
    per head, q @ M^T and k @ M_inv with M = U diag(s) V^T, M_inv = V diag(1 / s) U^T, then interleaved axial RoPE
    (base 10000, the first d / 4 pairs on the column, the rest on the row; text tokens unrotated)."""

    def heads(x):
        return x.unflatten(-1, (HEADS, HEAD_DIM)).transpose(1, 2)

    def skew(a):
        return 0.5 * (a - a.transpose(-1, -2))

    q, k, v = (heads(proj(tokens)) for proj in (attn.to_q, attn.to_k, attn.to_v))
    q, k = attn.norm_q(q), attn.norm_k(k)
    if text is not None:
        tq, tk, tv = (heads(proj(text)) for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        q = torch.cat([attn.norm_added_q(tq), q], 2)
        k = torch.cat([attn.norm_added_k(tk), k], 2)
        v = torch.cat([tv, v], 2)
    u, w = torch.matrix_exp(skew(a_u)), torch.matrix_exp(skew(a_v))
    s = F.softplus(sigma) + 1e-6
    m = u @ (s.unsqueeze(-1) * w.transpose(-1, -2))
    m_inv = w @ ((1.0 / s).unsqueeze(-1) * u.transpose(-1, -2))
    q, k = q @ m.transpose(-1, -2), k @ m_inv
    quarter = HEAD_DIM // 4
    freqs = 10000.0 ** (-torch.arange(quarter) * 4 / HEAD_DIM)
    angles = torch.cat([cols[:, None] * freqs, rows[:, None] * freqs], 1)  # (N, d / 2)
    angles = torch.cat([torch.zeros(q.shape[2] - len(rows), HEAD_DIM // 2), angles])
    cos, sin = angles.cos(), angles.sin()

    def rope(x):
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)

    out = F.scaled_dot_product_attention(rope(q), rope(k), v).transpose(1, 2).flatten(2)
    if text is None:
        return out
    n = text.shape[1]
    return attn.to_out[0](out[:, n:]), attn.to_add_out(out[:, :n])


def test_harope_maps_act_on_the_normalised_q_and_k_of_each_layer_as_released():
    """Flux normalises q and k per head, so M cannot fold into the projections: it acts on the normalised q and k,
    M on q and M^-T on k, per attention layer (double-stream block first), before the axial RoPE."""
    model = tiny_flux()
    apply_position_scheme(model, "harope")
    scheme = model.pos_schemes["harope"]
    with torch.no_grad():
        for p in (scheme.A_u, scheme.A_v, scheme.sigma):
            p.normal_(std=0.5)
    captured = {}

    def capture(key):
        def hook(module, args, kwargs, output):
            captured[key] = (module, kwargs, output)

        return hook

    for key, block in (("double", model.transformer_blocks[0]), ("single", model.single_transformer_blocks[0])):
        block.attn.register_forward_hook(capture(key), with_kwargs=True)
    inputs = flux_inputs(3, 4)
    run(model, inputs)
    rows, cols = inputs["img_ids"][:, 1], inputs["img_ids"][:, 2]
    with torch.no_grad():
        attn, kwargs, (image_out, text_out) = captured["double"]
        expected = _released_harope_attention(
            attn, kwargs["hidden_states"], kwargs["encoder_hidden_states"], scheme.A_u[0], scheme.A_v[0],
            scheme.sigma[0], rows, cols,
        )  # fmt: skip
        torch.testing.assert_close(image_out, expected[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(text_out, expected[1], atol=1e-5, rtol=1e-4)
        attn, kwargs, out = captured["single"]
        expected = _released_harope_attention(
            attn, kwargs["hidden_states"], None, scheme.A_u[1], scheme.A_v[1], scheme.sigma[1], rows, cols
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="no PosAttention"):
        visionpe.fold_harope_(model)


def test_harope_fine_tuning_reaches_only_its_maps_with_gradient_checkpointing():
    model = tiny_flux().train()
    report = apply_position_scheme(model, "harope")
    assert report.added == [f"pos_schemes.harope.{n}" for n in ("A_u", "A_v", "folded", "sigma")]
    model.requires_grad_(False)
    model.pos_schemes.requires_grad_(True)
    inputs = flux_inputs()
    model(**inputs)[0].square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert sorted(grads) == ["pos_schemes.harope.A_u", "pos_schemes.harope.A_v", "pos_schemes.harope.sigma"]
    model.zero_grad(set_to_none=True)
    model.enable_gradient_checkpointing()
    model(**inputs)[0].square().mean().backward()
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n])
        else:
            assert p.grad is None


# -- options, sizes, precision ---------------------------------------------------------------------------------


def test_options_and_the_training_grid_reach_the_scheme():
    model = tiny_flux()
    apply_position_scheme(model, "rope_axial", train_grid_size=(1, 4, 4), base=100.0, extrapolation="ntk")
    scheme = model.pos_schemes["rope_axial"]
    assert (scheme.base, scheme.train_grid_size, scheme.extrapolation) == (100.0, (4, 4), "ntk")
    # NTK scaling acts above the training grid only
    plain = copy.deepcopy(model)
    visionpe.set_extrapolation(plain, "none")
    torch.testing.assert_close(run(model, flux_inputs(4, 4)), run(plain, flux_inputs(4, 4)))
    assert (run(model, flux_inputs(8, 8)) - run(plain, flux_inputs(8, 8))).abs().max() > 1e-4
    remove_position_scheme(model)
    apply_position_scheme(model, "rope_axial")
    assert model.pos_schemes["rope_axial"].train_grid_size == (64, 64)  # Flux's released grid: 1024 px


def test_fused_projections_and_bfloat16():
    model = tiny_flux()
    apply_position_scheme(model, "harope")
    inputs = flux_inputs()
    out = run(model, inputs)
    model.fuse_qkv_projections()
    torch.testing.assert_close(run(model, inputs), out, atol=1e-5, rtol=1e-5)
    model.unfuse_qkv_projections()
    half = tiny_flux().to(torch.bfloat16)
    apply_position_scheme(half, "harope")
    assert half.pos_schemes["harope"].A_u.dtype == torch.bfloat16
    low = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items() if k != "return_dict"}
    result = run(half, dict(low, return_dict=False))
    assert result.dtype == torch.bfloat16
    torch.testing.assert_close(result.float(), out, atol=0.1, rtol=0.1)


# -- refusals --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", [visionpe.list_schemes(kind)[0] for kind in ("absolute", "bias", "camera")] + [list_multimodal_schemes()[0]]
)
def test_other_kinds_and_multimodal_designs_are_refused_with_where_they_go(name):
    model = tiny_flux()
    with pytest.raises(
        ValueError,
        match=rf"'{name}' (is a \w+ scheme and scheme here takes rotary|needs cameras|is a "
        "multimodal design)",
    ):
        apply_position_scheme(model, name)
    assert not hasattr(model, "pos_schemes") and swapped_scheme(model) is None


def test_bad_requests_are_refused_and_leave_the_model_as_it_was():
    model = tiny_flux()
    with pytest.raises(ValueError, match="unknown position scheme 'nope'.*valid names: .*harope"):
        apply_position_scheme(model, "nope")
    with pytest.raises(TypeError, match="scheme must be a scheme name"):
        apply_position_scheme(model, 3)
    with pytest.raises(ValueError, match=r"harope got unknown option\(s\) \['nope'\]"):
        apply_position_scheme(model, "harope", nope=1)
    with pytest.raises(ValueError, match="scheme=None .* takes no options"):
        apply_position_scheme(model, None, base=100.0)
    with pytest.raises(ValueError, match="train_grid_size"):
        apply_position_scheme(model, "harope", train_grid_size=(4, 4))
    assert not hasattr(model, "pos_schemes") and type(model.pos_embed).__name__ == "FluxPosEmbed"
    apply_position_scheme(model, "harope")
    for again in ("rope_axial", None):
        with pytest.raises(ValueError, match="already rotates by the visionpe scheme 'harope'"):
            apply_position_scheme(model, again)
    remove_position_scheme(model)
    with pytest.raises(ValueError, match="not patched by visionpe"):
        remove_position_scheme(model)


def test_foreign_processors_and_several_images_are_refused():
    model = tiny_flux()

    class Custom(type(model.transformer_blocks[0].attn.processor)):
        pass

    model.transformer_blocks[0].attn.set_processor(Custom())
    with pytest.raises(TypeError, match=r"transformer_blocks\.0\.attn\.processor is Custom"):
        apply_position_scheme(model, "harope")
    assert not hasattr(model, "pos_schemes")
    model = tiny_flux()
    apply_position_scheme(model, "harope")
    inputs = flux_inputs()
    reference = torch.cat([image_ids(4, 4), image_ids(2, 2, index=1)])  # a Kontext-like reference image
    inputs = dict(inputs, hidden_states=torch.randn(1, 20, CHANNELS), img_ids=reference)
    with pytest.raises(ValueError, match="one image"):
        run(model, inputs)
    with pytest.raises(ValueError, match="integer positions"):
        run(model, dict(flux_inputs(), img_ids=image_ids(4, 4) * 0.5))
    with pytest.raises(ValueError, match="number of text tokens"):
        FluxSchemePositions(model.pos_schemes["harope"])(torch.zeros(5, 3))
    with pytest.raises(ValueError, match="layer must be a non-negative int"):
        VisionPEFluxAttnProcessor(-1)
    assert math.isfinite(float(run(model, flux_inputs()).sum()))


def test_a_deep_copy_is_swapped_on_its_own():
    model = tiny_flux()
    apply_position_scheme(model, "harope")
    twin = copy.deepcopy(model)
    inputs = flux_inputs()
    torch.testing.assert_close(run(twin, inputs), run(model, inputs), atol=0, rtol=0)
    with torch.no_grad():
        twin.pos_schemes["harope"].A_u.normal_()
    remove_position_scheme(twin)
    assert swapped_scheme(model) == "harope" and type(model.pos_embed) is FluxSchemePositions
    assert (run(twin, inputs) - run(model, inputs)).abs().max() > 1e-4
    assert torch.equal(run(twin, inputs), run(tiny_flux(), inputs))


def test_a_family_without_a_swap_is_refused_naming_the_families_that_have_one():
    model = tiny_flux()
    other = replace(DIFFUSERS_FAMILIES["flux"], name="other")
    with pytest.raises(UnsupportedSchemeError, match=r"implemented for the families \[.*'flux'.*\], got 'other'"):
        swap_position_scheme(model, other, "harope")
    assert not hasattr(model, "pos_schemes")


# -- Wan -------------------------------------------------------------------------------------------------------

needs_wan = pytest.mark.skipif("wan" not in DIFFUSERS_FAMILIES, reason="the Wan family is not registered")
WAN_HEAD_DIM = 24  # 12 rotary pairs: 4 per axis of the (time, height, width) grid


def tiny_wan(vace: bool = False) -> WanTransformer3DModel:
    """A random Wan transformer, two blocks (VACE: and one VACE block), 2 heads of 24 channels."""
    torch.manual_seed(0)
    options = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=HEADS,
        attention_head_dim=WAN_HEAD_DIM,
        in_channels=4,
        out_channels=4,
        text_dim=CHANNELS,
        freq_dim=8,
        ffn_dim=16,
        num_layers=2,
        rope_max_seq_len=32,
    )
    if vace:
        return WanVACETransformer3DModel(**options, vace_layers=[0], vace_in_channels=4).eval()
    return WanTransformer3DModel(**options).eval()


def wan_inputs(frames: int = 3, height: int = 8, width: int = 6, seed: int = 1) -> dict:
    """A latent video of frames x (height / 2) x (width / 2) tokens, a timestep and 5 text tokens."""
    generator = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, 4, frames, height, width, generator=generator),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 5, CHANNELS, generator=generator),
        return_dict=False,
    )


@needs_wan
@pytest.mark.parametrize("name", ROTARY)
def test_wan_each_rotary_scheme_swaps_trains_only_its_parameters_or_is_refused(name):
    model = tiny_wan()
    inputs = wan_inputs()
    reference = run(model, inputs)
    keys, processors = set(model.state_dict()), model.attn_processors
    reason = refusal(DIFFUSERS_VIDEO_SWAP_ENTRY, name)
    if reason is not None:  # a 2D-only scheme: refused with the contract's reason
        assert "2D" in reason
        with pytest.raises(UnsupportedSchemeError, match=f"cannot use scheme='{name}'.*supports 2D grids"):
            apply_position_scheme(model, name)
        assert set(model.state_dict()) == keys and type(model.rope).__name__ == "WanRotaryPosEmbed"
        return
    report = apply_position_scheme(model, name)
    assert report.added == sorted(set(model.state_dict()) - keys)
    for n, p in processors.items():  # self-attention rotates, cross-attention keeps its processor
        assert isinstance(model.attn_processors[n], VisionPEWanAttnProcessor) == n.endswith("attn1.processor")
        assert n.endswith("attn1.processor") or model.attn_processors[n] is p
    model.requires_grad_(False)
    model.pos_schemes.requires_grad_(True)
    latents = inputs["hidden_states"].clone().requires_grad_(True)
    out = model(**dict(inputs, hidden_states=latents))[0]
    assert out.shape == reference.shape and torch.isfinite(out).all()
    out.square().mean().backward()
    reached = {n for n, p in model.named_parameters() if p.grad is not None}
    assert reached == {n for n, _ in model.pos_schemes.named_parameters(prefix="pos_schemes")} and reached <= set(
        report.added
    )
    remove_position_scheme(model)
    assert torch.equal(run(model, inputs), reference) and set(model.state_dict()) == keys


@needs_wan
def test_wan_harope_starts_as_axial_rope_and_acts_on_each_normalised_self_attention():
    harope, axial = tiny_wan(vace=True), tiny_wan(vace=True)
    apply_position_scheme(harope, "harope")
    apply_position_scheme(axial, "rope_axial", base=10000.0)
    inputs = dict(wan_inputs(), control_hidden_states=torch.randn(1, 4, 3, 8, 6))
    torch.testing.assert_close(run(harope, inputs), run(axial, inputs), atol=1e-5, rtol=0)
    scheme = harope.pos_schemes["harope"]
    assert scheme.A_u.shape == (3, HEADS, WAN_HEAD_DIM, WAN_HEAD_DIM)  # two blocks and the VACE block
    with torch.no_grad():
        for p in (scheme.A_u, scheme.A_v, scheme.sigma):
            p.normal_(std=0.5)
    seen = {}
    for i, block in enumerate(harope.blocks):
        block.attn1.register_forward_hook(lambda m, args, out, i=i: seen.update({i: (m, args[0], out)}))
    run(harope, inputs)
    coords = scheme.model_coords((3, 4, 3))
    with torch.no_grad():
        for layer, (attn, tokens, out) in seen.items():
            q, k, v = (proj(tokens) for proj in (attn.to_q, attn.to_k, attn.to_v))
            q, k = attn.norm_q(q), attn.norm_k(k)  # RMSNorm across the heads, then M and M^-T
            q, k, v = (t.unflatten(2, (HEADS, -1)).transpose(1, 2) for t in (q, k, v))
            q = scheme.rotate(q, coords, layer)
            k = scheme.rotate(k, coords, layer, key=True)
            expected = attn.to_out[0](F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
