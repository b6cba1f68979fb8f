"""Checkpoints in the authors' layouts: each converter's model computes what the authors' code computes.

Every parity test writes a random state dict in the authors' layout, runs a reference forward written here from the
released code's behaviour (its own key names, its own position formula), and compares it with the logits of the
visionpe model that receives the converted state dict. Tiny models on a non-square grid (3 x 5 patches).
"""

from __future__ import annotations

import math
import re
from functools import partial
from itertools import groupby

import pytest
import torch
import torch.nn.functional as F
from timm.layers import Mlp
from torch import nn

from visionpe.models import (
    convert_irpe_state_dict,
    convert_liere_state_dict,
    convert_lookhere_state_dict,
    convert_rope_vit_state_dict,
    lookhere_scheme_kwargs,
)
from visionpe.models.vit import VisionPEViT

GRID, PATCH, DIM, CLASSES = (3, 5), 8, 32, 5
IMG = (GRID[0] * PATCH, GRID[1] * PATCH)


def _model(pos_embed, heads=2, depth=2, dim=DIM, **kwargs) -> VisionPEViT:
    torch.manual_seed(0)
    model = VisionPEViT(
        pos_embed=pos_embed,
        img_size=IMG,
        patch_size=PATCH,
        embed_dim=dim,
        depth=depth,
        num_heads=heads,
        num_classes=CLASSES,
        **kwargs,
    )
    return model.eval()


def _random_like(model: nn.Module, skip: str = "pos_schemes.") -> dict[str, torch.Tensor]:
    """Random tensors with the model's (timm) names and shapes, position schemes left out."""
    gen = torch.Generator().manual_seed(1)
    return {
        k: torch.randn(v.shape, generator=gen) * 0.3 + (1.0 if k.endswith("norm1.weight") else 0.0)
        for k, v in model.state_dict().items()
        if not k.startswith(skip)
    }


def _images(batch=2) -> torch.Tensor:
    return torch.randn(batch, 3, *IMG, generator=torch.Generator().manual_seed(2))


def _load(model, converted):
    state, report = converted
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected
    return report


# -- a reference DeiT forward, reading the authors' key names ----------------------------------------------------------
def _deit_reference(
    sd,
    images,
    heads,
    *,
    ls=("gamma_1", "gamma_2"),
    eps=1e-6,
    ape=None,
    rotate=None,
    bias=None,
    value=None,
    head="linear",
):
    """The DeiT III / timm-0.3 ViT forward of rope-vit, iRPE and LookHere: ``rotate(q_or_k, layer)`` rotates the
    patch tokens, ``bias(q_scaled, k, layer)`` is added to the logits, ``value(attn, layer)`` to the output."""
    x = F.conv2d(images, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=PATCH)
    x = x.flatten(2).transpose(1, 2)
    if ape == "patches":  # rope-vit + APE: the table is added before the class token is prepended
        x = x + sd["pos_embed"]
    x = torch.cat((sd["cls_token"].expand(len(x), -1, -1), x), 1)
    if ape == "with_cls":
        x = x + sd["pos_embed"]
    depth = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    batch, tokens, dim = x.shape
    hd = dim // heads
    for i in range(depth):
        p = f"blocks.{i}."
        h = F.layer_norm(x, (dim,), sd[p + "norm1.weight"], sd[p + "norm1.bias"], eps)
        qkv = F.linear(h, sd[p + "attn.qkv.weight"], sd.get(p + "attn.qkv.bias"))
        q, k, v = qkv.reshape(batch, tokens, 3, heads, hd).permute(2, 0, 3, 1, 4)
        if rotate is not None:
            q, k = rotate(q, i), rotate(k, i)
        q = q * hd**-0.5
        logits = q @ k.transpose(-1, -2)
        if bias is not None:
            logits = logits + bias(q, k, i)
        attn = logits.softmax(-1)
        out = attn @ v
        if value is not None:
            out = out + value(attn, i)
        out = F.linear(
            out.transpose(1, 2).reshape(batch, tokens, dim), sd[p + "attn.proj.weight"], sd[p + "attn.proj.bias"]
        )
        x = x + (sd[p + ls[0]] * out if ls else out)
        h = F.layer_norm(x, (dim,), sd[p + "norm2.weight"], sd[p + "norm2.bias"], eps)
        h = F.linear(
            F.gelu(F.linear(h, sd[p + "mlp.fc1.weight"], sd[p + "mlp.fc1.bias"])),
            sd[p + "mlp.fc2.weight"],
            sd[p + "mlp.fc2.bias"],
        )
        x = x + (sd[p + ls[1]] * h if ls else h)
    cls = F.layer_norm(x, (dim,), sd["norm.weight"], sd["norm.bias"], eps)[:, 0]
    if head == "linear":
        return F.linear(cls, sd["head.weight"], sd["head.bias"])
    return F.linear(
        torch.tanh(F.linear(cls, sd["head.fc1.weight"], sd["head.fc1.bias"])),
        sd["head.fc2.weight"],
        sd["head.fc2.bias"],
    )


def _rotate_pairs(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """rope-vit's apply_rotary_emb on the patch tokens: interleaved pairs times exp(i angle); the class token kept."""
    pairs = torch.view_as_complex(x[..., 1:, :].float().reshape(*x.shape[:-2], x.shape[-2] - 1, -1, 2).contiguous())
    rotated = torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten(-2)
    return torch.cat((x[..., :1, :], rotated), -2)


def _official_deit_state(model, gammas=True) -> dict[str, torch.Tensor]:
    """The model's body as a DeiT III checkpoint names it (layer scales as ``gamma_1`` / ``gamma_2``)."""
    sd = _random_like(model)
    if gammas:
        sd = {re.sub(r"\.ls([12])\.gamma$", r".gamma_\1", k): v for k, v in sd.items()}
    sd.pop("pos_embed", None)
    return sd


# -- rope-vit --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["mixed", "axial", "mixed_ape"])
def test_rope_vit_checkpoint_logits_match_the_reference_formula(variant):
    depth, heads, hd = 2, 2, DIM // 2
    rope = "rope_axial" if variant == "axial" else "rope_mixed"
    names = ["learned", rope] if variant.endswith("ape") else rope
    kwargs = {"no_embed_class": True} if variant.endswith("ape") else {}
    model = _model(
        names,
        init_values=1e-4,
        pos_embed_kwargs={"rope_axial": {"base": 100.0}} if variant == "axial" else None,
        **kwargs,
    )
    sd = _official_deit_state(model)
    gen = torch.Generator().manual_seed(3)
    n = GRID[0] * GRID[1]
    t = torch.arange(n, dtype=torch.float32)
    t_x, t_y = t % GRID[1], torch.div(t, GRID[1], rounding_mode="floor")  # rope-vit's init_t_xy
    if variant == "axial":
        theta = 1 / 100.0 ** (torch.arange(0, hd, 4)[: hd // 4].float() / hd)
        angles = torch.cat((torch.outer(t_x, theta), torch.outer(t_y, theta)), -1)  # (N, hd / 2)
        rotate = lambda x, i: _rotate_pairs(x, angles)  # noqa: E731
    else:
        sd["freqs"] = torch.randn(2, depth, heads * hd // 2, generator=gen)
        sd["freqs_t_x"], sd["freqs_t_y"] = t_x, t_y
        fx, fy = sd["freqs"].view(2, depth, heads, hd // 2)
        angle = t_x[None, None, :, None] * fx[:, :, None] + t_y[None, None, :, None] * fy[:, :, None]  # (L, h, N, j)
        rotate = lambda x, i: _rotate_pairs(x, angle[i])  # noqa: E731
    if variant.endswith("ape"):
        sd["pos_embed"] = torch.randn(1, n, DIM, generator=gen)
    report = _load(model, convert_rope_vit_state_dict({"model": sd}, model))
    assert report.added == []
    if variant != "axial":
        assert [d.split()[0] for d in report.dropped] == ["freqs_t_x", "freqs_t_y"]
    images = _images()
    expected = _deit_reference(sd, images, heads, ape="patches" if variant.endswith("ape") else None, rotate=rotate)
    with torch.no_grad():
        torch.testing.assert_close(model(images), expected, atol=2e-5, rtol=1e-4)
    # the class token's absolute row is zero (rope-vit adds none to it); a class row table works the same
    if variant.endswith("ape"):
        with_cls = _model(names, init_values=1e-4)
        _load(with_cls, convert_rope_vit_state_dict(sd, with_cls))
        assert not with_cls.pos_schemes["learned"].pos_embed[0, 0].any()
        with torch.no_grad():
            torch.testing.assert_close(with_cls(images), expected, atol=2e-5, rtol=1e-4)


def test_rope_vit_bad_checkpoints_name_the_key():
    model = _model("rope_mixed", init_values=1e-4)
    sd = _official_deit_state(model)
    with pytest.raises(ValueError, match=r"'freqs' is missing from the rope-vit state dict: expected .*\(2, 2, 16\)"):
        convert_rope_vit_state_dict(sd, model)
    sd["freqs"] = torch.zeros(2, 2, 12)
    with pytest.raises(
        ValueError, match=r"'freqs' in the rope-vit state dict has shape \(2, 2, 12\), expected \(2, 2, 16\)"
    ):
        convert_rope_vit_state_dict(sd, model)
    sd["freqs"] = torch.zeros(2, 2, 16)
    sd["blocks.0.attn.qkv.weight"] = torch.zeros(64, DIM)
    with pytest.raises(
        ValueError, match=r"'blocks.0.attn.qkv.weight' .* shape \(64, 32\), but the model's is \(96, 32\)"
    ):
        convert_rope_vit_state_dict(sd, model)
    axial = _model("rope_axial", init_values=1e-4, pos_embed_kwargs={"base": 100.0})
    with pytest.raises(ValueError, match="holds RoPE-Mixed's learned frequencies"):
        convert_rope_vit_state_dict({"freqs": torch.zeros(2, 2, 16)}, axial)
    with pytest.raises(ValueError, match=r"base=100, .* got ndim=2, base=10.0"):
        convert_rope_vit_state_dict({}, _model("rope_axial", pos_embed_kwargs={"base": 10.0}))
    with pytest.raises(ValueError, match="axis_order='xy' and no coord_offset: .* axis_order='yx'"):
        convert_rope_vit_state_dict({}, _model("rope_axial", pos_embed_kwargs={"axis_order": "yx"}))
    with pytest.raises(ValueError, match="build rope_mixed with coord_mode='index', got coord_mode='normalized'"):
        convert_rope_vit_state_dict(
            sd, _model("rope_mixed", init_values=1e-4, pos_embed_kwargs={"coord_mode": "normalized"})
        )
    with pytest.raises(
        ValueError,
        match=r"'pos_embed' .* the rope-vit checkpoint, .* '\+ APE' model, build it with pos_embed=\['learned'",
    ):
        convert_rope_vit_state_dict({"freqs": torch.zeros(2, 2, 16), "pos_embed": torch.zeros(1, 15, DIM)}, model)
    with pytest.raises(TypeError, match="model must be a visionpe VisionPEViT"):
        convert_rope_vit_state_dict({}, nn.Linear(2, 2))


# -- iRPE ------------------------------------------------------------------------------------------------------------
def _piecewise(rel: torch.Tensor, alpha: float, beta: float, gamma: float) -> torch.Tensor:
    """iRPE's piecewise index (its Eq. 18 as the released code computes it)."""
    rel = rel.float()
    far = torch.sign(rel) * (
        alpha + torch.log(rel.abs().clamp_min(1e-9) / alpha) / math.log(gamma / alpha) * (beta - alpha)
    ).round().clip(max=beta)
    return torch.where(rel.abs() <= alpha, rel.round(), far).long()


def _irpe_buckets(method: str, ratio: float) -> list[torch.Tensor]:
    """The released bucket ids, (P + N, P + N) with the class token's extra bucket; two maps (rows, cols) for cross."""
    alpha, beta, gamma = ratio, 2 * ratio, 8 * ratio
    beta_int = int(beta)
    rows, cols = torch.meshgrid(torch.arange(GRID[0]), torch.arange(GRID[1]), indexing="ij")
    pos = torch.stack((rows, cols), -1).view(-1, 2)
    diff = pos[:, None] - pos[None]
    if method == "cross":
        maps = [
            _piecewise(diff[..., 0], alpha, beta, gamma) + beta_int,
            _piecewise(diff[..., 1], alpha, beta, gamma) + beta_int,
        ]
        extra = 2 * beta_int + 1
    else:
        side = 2 * beta_int + 1
        maps = [
            (_piecewise(diff[..., 0], alpha, beta, gamma) + beta_int) * side
            + _piecewise(diff[..., 1], alpha, beta, gamma)
            + beta_int
        ]
        extra = side * side
    out = []
    for ids in maps:
        full = torch.full((len(ids) + 1, len(ids) + 1), extra, dtype=torch.long)
        full[1:, 1:] = ids
        out.append(full)
    return out


@pytest.mark.parametrize(
    "method, mode, on", [("cross", "contextual", "qkv"), ("product", "contextual", "k"), ("cross", "bias", "qk")]
)
def test_irpe_checkpoint_logits_match_the_reference_formula(method, mode, on):
    depth, heads, hd, ratio = 2, 2, DIM // 2, 1.9
    model = _model(
        ["learned", "irpe"],
        pos_embed_kwargs={"irpe": {"method": method, "mode": mode, "on": on, "ratio": ratio}},
        qkv_bias=True,
    )
    sd = _official_deit_state(model, gammas=False)
    gen = torch.Generator().manual_seed(4)
    sd["pos_embed"] = torch.randn(1, 1 + GRID[0] * GRID[1], DIM, generator=gen)
    maps = _irpe_buckets(method, ratio)
    nb = (2 * int(2 * ratio) + 1) + 1 if method == "cross" else (2 * int(2 * ratio) + 1) ** 2 + 1
    parts = ["rp_rows.", "rp_cols."] if method == "cross" else [""]
    param = "lookup_table_weight" if mode == "contextual" else "lookup_table_bias"
    for i in range(depth):
        for t in on:
            for part in parts:
                shape = (1, nb) if mode == "bias" else (1, nb, hd) if t == "v" else (1, hd, nb)
                sd[f"blocks.{i}.attn.rpe_{t}.{part}{param}"] = torch.randn(shape, generator=gen)

    def lookup(x, table, ids):  # the released transposed lookup: out[b, h, i, j] = (x_i . table)[ids[i, j]]
        if mode == "bias":
            return table[:, ids][None]
        z = x @ table  # (B, h, T, nb)
        return z.gather(-1, ids.expand(*z.shape[:2], -1, -1))

    def bias(q, k, i):
        out = 0
        for part, ids in zip(parts, maps, strict=True):
            if "k" in on:
                out = out + lookup(q, sd[f"blocks.{i}.attn.rpe_k.{part}{param}"], ids)
            if "q" in on:  # rpe_q(k * scale), transposed
                out = out + lookup(k * hd**-0.5, sd[f"blocks.{i}.attn.rpe_q.{part}{param}"], ids).transpose(-1, -2)
        return out

    def value(attn, i):
        out = 0
        for part, ids in zip(parts, maps, strict=True):
            weight = sd[f"blocks.{i}.attn.rpe_v.{part}lookup_table_weight"][0][ids]  # (T, T, d)
            out = out + torch.einsum("bhij,ijd->bhid", attn, weight)
        return out

    report = _load(model, convert_irpe_state_dict(sd, model))
    assert report.added == [] and report.dropped == []
    images = _images()
    expected = _deit_reference(
        sd, images, heads, ls=None, ape="with_cls", bias=bias, value=value if "v" in on else None
    )
    with torch.no_grad():
        torch.testing.assert_close(model(images), expected, atol=2e-5, rtol=1e-4)
    if method == "cross":  # the extra entry is the sum of the two tables' extra entries
        table = model.pos_schemes["irpe"].tables["k"][1]
        side = nb - 1
        rows, cols = sd[f"blocks.1.attn.rpe_k.rp_rows.{param}"], sd[f"blocks.1.attn.rpe_k.rp_cols.{param}"]
        torch.testing.assert_close(table[..., -1], rows[..., side] + cols[..., side])
        torch.testing.assert_close(table[..., :side], rows[..., :side])


def test_irpe_bad_checkpoints_name_the_key():
    model = _model(["learned", "irpe"], pos_embed_kwargs={"irpe": {"method": "cross", "on": "k"}})
    sd = _official_deit_state(model, gammas=False)
    with pytest.raises(
        ValueError, match=r"'blocks.0.attn.rpe_k.rp_rows.lookup_table_weight' is missing .* \(1, 16, 8\)"
    ):
        convert_irpe_state_dict(sd, model)
    for i in range(2):
        for part in ("rp_rows", "rp_cols"):
            sd[f"blocks.{i}.attn.rpe_k.{part}.lookup_table_weight"] = torch.zeros(1, 16, 8)
    sd["blocks.1.attn.rpe_k.rp_cols.lookup_table_weight"] = torch.zeros(1, 16, 7)
    with pytest.raises(
        ValueError,
        match=r"'blocks.1.attn.rpe_k.rp_cols.lookup_table_weight' .* shape \(1, 16, 7\), expected \(1, 16, 8\)",
    ):
        convert_irpe_state_dict(sd, model)
    sd["blocks.1.attn.rpe_k.rp_cols.lookup_table_weight"] = torch.zeros(1, 16, 8)
    sd["blocks.0.attn.rpe_q.rp_rows.lookup_table_weight"] = torch.zeros(1, 16, 8)
    with pytest.raises(ValueError, match=r"has tables on 'q', but the model's irpe scheme has on='k'"):
        convert_irpe_state_dict(sd, model)
    with pytest.raises(ValueError, match="needs a model with the 'irpe' position scheme"):
        convert_irpe_state_dict(sd, _model("learned"))


# -- LookHere --------------------------------------------------------------------------------------------------------
_GROUPS = {  # the released dir_short_hand, per head the masks it ORs
    "none": [[]] * 4,
    "halves": [["up"], ["down"], ["left"], ["right"]],
    "diagonals": [["diag_up_right"], ["diag_up_left"], ["diag_down_right"], ["diag_down_left"]],
    "corners": [["up", "left"], ["up", "right"], ["down", "left"], ["down", "right"]],
    "triangles": [["tri_up"], ["tri_down"], ["tri_left"], ["tri_right"]],
    "eighths1": [["tri_up", "left"], ["tri_down", "left"], ["tri_left", "up"], ["tri_right", "up"]],
    "eighths2": [["tri_up", "right"], ["tri_down", "right"], ["tri_left", "down"], ["tri_right", "down"]],
}


def _lookhere_reference_bias(config, heads, depth):
    """(depth, heads, P + N, P + N) bias of the released create_lh_bias_tensor for a 12-head 3-group config, in fp32."""
    names = config["head_directions"].split("-")
    owner = [n for n in names for _ in range(4)]
    per_head = [_GROUPS[n][h % 4] for n, h in zip(owner, list(range(4)) * 3, strict=True)]
    slopes = []
    for name, run in groupby(owner):
        count = len(list(run))
        if name == "none":
            slopes += [0.25, 0.0625, 0.015625, 0.00390625][:count]
        else:
            slopes += [2.0 ** -(k + 1) for k in range(count // 4) for _ in range(4)]
    y, x = torch.meshgrid(torch.arange(GRID[0]), torch.arange(GRID[1]), indexing="ij")
    y, x = y.flatten().float(), x.flatten().float()
    dy, dx = y[None] - y[:, None], x[None] - x[:, None]  # p_j - p_i
    masked = {"right": dx < 0, "left": dx > 0, "up": dy > 0, "down": dy < 0}
    cone = {"up": dx.abs() <= -dy, "down": dx.abs() <= dy, "left": dy.abs() <= -dx, "right": dy.abs() <= dx}
    for d in ("up", "down", "left", "right"):
        masked[f"tri_{d}"] = ~cone[d]
    for a in ("up", "down"):
        for b in ("left", "right"):
            masked[f"diag_{a}_{b}"] = masked[f"tri_{a}"] & masked[f"tri_{b}"]
    dist = (dy.square() + dx.square()).sqrt()
    lh = []
    for h in range(heads):
        mask = torch.zeros_like(dist, dtype=torch.bool)
        for d in per_head[h]:
            mask |= masked[d]
        lh.append(dist.masked_fill(mask, float("inf")) * slopes[h])
    lh = torch.stack(lh)
    layer = torch.linspace(*config["layer_slopes"], depth)
    bias = -config["global_slope"] * layer[:, None, None, None] * lh
    return F.pad(bias, (1, 0, 1, 0))  # the class token's row and column are 0


@pytest.mark.parametrize("directions", ["halves-diagonals-none", "triangles-corners-none", "eighths1-eighths2-none"])
def test_lookhere_checkpoint_matches_the_released_bias_and_logits(directions):
    heads, depth = 12, 2
    config = {"global_slope": 0.9, "layer_slopes": [1.5, 0.5], "head_directions": directions}
    kwargs = lookhere_scheme_kwargs(config, heads)
    model = VisionPEViT(
        pos_embed="lookhere",
        pos_embed_kwargs=kwargs,
        img_size=IMG,
        patch_size=PATCH,
        embed_dim=48,
        depth=depth,
        num_heads=heads,
        num_classes=CLASSES,
        init_values=1e-4,
        norm_layer=partial(nn.LayerNorm, eps=1e-5),
    ).eval()
    model.head = Mlp(48, 4 * 48, CLASSES, act_layer=nn.Tanh)
    sd = _random_like(model)
    reference = _lookhere_reference_bias(config, heads, depth)
    scheme = model.pos_schemes["lookhere"]
    state = scheme.prepare(GRID, 1)
    q = torch.zeros(1, heads, 16, 4)
    for layer in range(depth):
        torch.testing.assert_close(scheme.attn_bias(q, q, state, layer)[0], reference[layer])
    report = _load(model, convert_lookhere_state_dict({"weights": sd, "config": config}, model))
    assert report.added == [] and report.dropped == []
    images = _images()
    expected = _deit_reference(
        sd, images, heads, ls=("ls1.gamma", "ls2.gamma"), eps=1e-5, bias=lambda q, k, i: reference[i], head="mlp"
    )
    with torch.no_grad():
        torch.testing.assert_close(model(images), expected, atol=2e-5, rtol=1e-4)


def test_lookhere_configs_the_scheme_cannot_compute_are_refused():
    base = {"global_slope": 1.0, "layer_slopes": [1.5, 0.5]}
    kwargs = lookhere_scheme_kwargs({**base, "head_directions": "halves-none"}, 12)  # 8 halves: slopes 1/2 then 1/4
    assert kwargs["head_slopes"][:8] == [0.5] * 4 + [0.25] * 4 and kwargs["directions"][4:8] == [
        270.0,
        90.0,
        180.0,
        0.0,
    ]
    assert lookhere_scheme_kwargs({**base, "head_directions": ["corners-none"] * 3}, 6)["head_slopes"] == [0.5] * 4 + [
        0.25,
        0.0625,
    ]
    for config, heads, match in (
        ({**base, "head_directions": "halves-corners-none"}, 12, r"mixes fields of view \[90.0, 180.0\]"),
        ({**base, "head_directions": "zero-halves-none"}, 12, "group 'zero' is not one the lookhere scheme computes"),
        ({**base, "head_directions": "halves-none", "distance": "sqrt"}, 12, r"config\['distance'\] must be 'linear'"),
        ({**base, "head_directions": ["halves-none", "corners-none"]}, 12, "every layer the same layout"),
        ({**base, "head_directions": "halves-none"}, 10, "no released head layout for num_heads=10"),
        ({"global_slope": 1.0, "head_directions": "halves-none"}, 12, "config is missing 'layer_slopes'"),
    ):
        with pytest.raises(ValueError, match=match):
            lookhere_scheme_kwargs(config, heads)
    model = _model(
        "lookhere", heads=12, dim=48, pos_embed_kwargs={"variant": "90"}
    )  # the visionpe defaults, not the config's
    with pytest.raises(ValueError, match=r"the model's lookhere directions .* is not the checkpoint's"):
        convert_lookhere_state_dict({}, model, config={**base, "head_directions": "triangles-corners-none"})


# -- LieRE -----------------------------------------------------------------------------------------------------------
def _official_liere_state(model, raw) -> dict[str, torch.Tensor]:
    """The model's body in the LieRE repository's lucidrains-style names, under a Lightning module's ``model.``."""
    sd = _random_like(model)
    out = {"position_encoder.generator_raw_params": raw, "cls_token": sd["cls_token"]}
    out["pos_embedding"] = torch.zeros(1, 1 + GRID[0] * GRID[1], DIM)  # zero and frozen without absolute encodings
    w = sd["patch_embed.proj.weight"]  # (dim, c, p1, p2) -> Linear on (p1 p2 c)-flattened patches
    out["to_patch_embedding.1.weight"] = w.permute(0, 2, 3, 1).reshape(DIM, -1)
    out["to_patch_embedding.1.bias"] = sd["patch_embed.proj.bias"]
    for i in range(len(model.blocks)):
        for ours, theirs in (
            ("norm1", "0.norm"),
            ("attn.proj", "0.fn.to_out.0"),
            ("norm2", "1.norm"),
            ("mlp.fc1", "1.fn.net.0"),
            ("mlp.fc2", "1.fn.net.3"),
        ):
            for p in ("weight", "bias"):
                out[f"transformer.layers.{i}.{theirs}.{p}"] = sd[f"blocks.{i}.{ours}.{p}"]
        out[f"transformer.layers.{i}.0.fn.to_qkv.weight"] = sd[f"blocks.{i}.attn.qkv.weight"]
    for p in ("weight", "bias"):
        out[f"mlp_head.0.{p}"], out[f"mlp_head.1.{p}"] = sd[f"norm.{p}"], sd[f"head.{p}"]
    return {"state_dict": {f"model.{k}": v for k, v in out.items()}}


def _liere_reference(sd, images, heads, block):
    """The LieRE repository's forward (RoPEViT, liere, sequential positions) on its training grid."""
    sd = {k.removeprefix("model."): v for k, v in sd["state_dict"].items()}
    batch = len(images)
    patches = (
        images.view(batch, 3, GRID[0], PATCH, GRID[1], PATCH)
        .permute(0, 2, 4, 3, 5, 1)
        .reshape(batch, -1, PATCH * PATCH * 3)
    )
    x = F.linear(patches, sd["to_patch_embedding.1.weight"], sd["to_patch_embedding.1.bias"])
    x = torch.cat((sd["cls_token"].expand(batch, -1, -1), x), 1)
    positions = torch.cartesian_prod(torch.linspace(0, 1, GRID[0]), torch.linspace(0, 1, GRID[1]))  # (N, 2)
    raw = sd["position_encoder.generator_raw_params"]
    upper = torch.triu(raw, diagonal=1) - 0.5
    bases = upper - upper.transpose(-1, -2)  # (ndim, L, G, b, b)
    generator = (positions[:, :, None, None, None, None] * bases).sum(1)  # (N, L, G, b, b)
    generator = torch.cat((torch.zeros_like(generator[:1]), generator))  # the class token: identity
    transforms = torch.linalg.matrix_exp(generator)[None]  # (1, T, L, G, b, b)
    tokens, dim = x.shape[1:]
    hd = dim // heads
    for i in range(len({k.split(".")[2] for k in sd if k.startswith("transformer.layers.")})):
        if transforms.shape[2] > 1:  # the released loop: overwritten by layer 0's slice on the first layer
            transforms = transforms[:, :, i].unsqueeze(2)
        p = f"transformer.layers.{i}."
        h = F.layer_norm(x, (dim,), sd[p + "0.norm.weight"], sd[p + "0.norm.bias"])
        q, k, v = (
            t.reshape(batch, tokens, heads, hd).transpose(1, 2)
            for t in F.linear(h, sd[p + "0.fn.to_qkv.weight"]).chunk(3, -1)
        )
        rot = transforms[0, :, 0].reshape(tokens, -1, hd // block, block, block).transpose(0, 1)  # (h | 1, T, m, b, b)
        q, k = ((rot @ t.reshape(batch, heads, tokens, hd // block, block, 1)).flatten(-3) for t in (q, k))
        attn = (q @ k.transpose(-1, -2) * hd**-0.5).softmax(-1)
        out = (attn @ v).transpose(1, 2).reshape(batch, tokens, dim)
        x = x + F.linear(out, sd[p + "0.fn.to_out.0.weight"], sd[p + "0.fn.to_out.0.bias"])
        h = F.layer_norm(x, (dim,), sd[p + "1.norm.weight"], sd[p + "1.norm.bias"])
        x = x + F.linear(
            F.gelu(F.linear(h, sd[p + "1.fn.net.0.weight"], sd[p + "1.fn.net.0.bias"])),
            sd[p + "1.fn.net.3.weight"],
            sd[p + "1.fn.net.3.bias"],
        )
    cls = F.layer_norm(x[:, 0], (dim,), sd["mlp_head.0.weight"], sd["mlp_head.0.bias"])
    return F.linear(cls, sd["mlp_head.1.weight"], sd["mlp_head.1.bias"])


@pytest.mark.parametrize("per_layer, per_head", [(True, True), (False, False)])
def test_liere_checkpoint_logits_match_the_reference_which_keeps_layer_0(per_layer, per_head):
    depth, heads, block = 2, 2, 4
    m = DIM // heads // block
    model = _model(
        "liere",
        heads=heads,
        depth=depth,
        pos_embed_kwargs={"block_size": block},
        qkv_bias=False,
        mlp_ratio=2.0,
        norm_layer=partial(nn.LayerNorm, eps=1e-5),
    )
    gen = torch.Generator().manual_seed(5)
    raw = (
        torch.rand(2, depth if per_layer else 1, m * (heads if per_head else 1), block, block, generator=gen)
        * 2
        * math.pi
    )
    sd = _official_liere_state(model, raw)
    report = _load(model, convert_liere_state_dict(sd, model))
    assert report.added == [] and [d.split()[0] for d in report.dropped] == ["pos_embedding"]
    params = model.pos_schemes["liere"].generator_params
    torch.testing.assert_close(params[1], params[0])  # layer 0's generators in every layer
    images = _images()
    with torch.no_grad():
        torch.testing.assert_close(model(images), _liere_reference(sd, images, heads, block), atol=5e-5, rtol=1e-4)
    if per_layer:  # the later layers' own generators are not what the released code computes with
        sd["state_dict"]["model.position_encoder.generator_raw_params"][:, 1:] += 1.0
        _load(model, convert_liere_state_dict(sd, model))
        with torch.no_grad():
            torch.testing.assert_close(model(images), _liere_reference(sd, images, heads, block), atol=5e-5, rtol=1e-4)


def test_liere_bad_checkpoints_name_the_key():
    model = _model("liere", pos_embed_kwargs={"block_size": 4}, qkv_bias=False)
    with pytest.raises(
        ValueError, match=r"'position_encoder.generator_raw_params' is missing .* \(2, 1 or 2, 4 or 8, 4, 4\)"
    ):
        convert_liere_state_dict({"cls_token": torch.zeros(1, 1, DIM)}, model)
    with pytest.raises(ValueError, match=r"has shape \(2, 3, 4, 4, 4\), expected \(2, 1 or 2, 4 or 8, 4, 4\)"):
        convert_liere_state_dict({"position_encoder.generator_raw_params": torch.zeros(2, 3, 4, 4, 4)}, model)
    raw = torch.zeros(2, 1, 4, 4, 4)
    with pytest.raises(ValueError, match=r"'to_patch_embedding.1.weight' .* shape \(32, 100\), expected \(32, 192\)"):
        convert_liere_state_dict(
            {"position_encoder.generator_raw_params": raw, "to_patch_embedding.1.weight": torch.zeros(32, 100)}, model
        )
