"""Checkpoints in the authors' own layouts, converted for a visionpe :class:`~visionpe.models.vit.VisionPEViT`.

Each converter takes a state dict as the authors' code saves it and the visionpe model that should receive it, and
returns ``(state_dict, report)`` as :func:`~visionpe.models.convert.convert_timm_state_dict` does: the position
parameters are rewritten into the layout of the visionpe scheme, the other weights go through the timm conversion
under their timm names. The model must be built with the checkpoint's architecture (width, depth, heads, patch,
biases, LayerNorm eps, layer scale); a position entry that is missing or has the wrong shape, or a weight whose
shape the model does not have (the classifier ``head`` aside), raises ValueError naming the key, the shape expected
and the shape given.

- :func:`convert_rope_vit_state_dict`: Heo et al., "Rotary Position Embedding for Vision Transformer", ECCV 2024
  (naver-ai/rope-vit): RoPE-Mixed's ``freqs`` (2, depth, heads * head_dim / 2) and RoPE-Axial (nothing learned),
  with or without the absolute table of the "+ APE" models, DeiT III blocks (``gamma_1``, ``gamma_2``).
- :func:`convert_irpe_state_dict`: Wu et al., "Rethinking and Improving Relative Position Encoding for Vision
  Transformer", ICCV 2021 (microsoft/Cream, iRPE): one ``lookup_table_weight`` / ``lookup_table_bias`` per block
  and target; the cross method's two tables (rows, columns) become visionpe's one table.
- :func:`lookhere_scheme_kwargs`, :func:`convert_lookhere_state_dict`: Fuller et al., "LookHere: Vision Transformers
  with Directed Attention Generalize and Extrapolate", NeurIPS 2024 (GreenCUBIC/lookhere): the released config's
  head layout and slopes as options of the ``lookhere`` scheme; nothing is learned.
- :func:`convert_liere_state_dict`: Ostmeier et al., "LieRE: Lie Rotational Positional Encodings", ICML 2025
  (StanfordMIMI/LieRE): ``generator_raw_params`` and the lucidrains-style ViT around it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from itertools import groupby
from typing import Any

import torch
from torch import nn

from .convert import LoadReport, convert_timm_state_dict, tensors_by_name

__all__ = [
    "convert_rope_vit_state_dict",
    "convert_irpe_state_dict",
    "lookhere_scheme_kwargs",
    "convert_lookhere_state_dict",
    "convert_liere_state_dict",
]


# -- shared checks --------------------------------------------------------------------------------------------------
def _state_dict(state_dict: Any, model: nn.Module, wrappers: Sequence[str] = ("model", "state_dict")) -> dict:
    """The tensors of ``state_dict`` (unwrapped from a checkpoint's ``wrappers`` entry, ``module.`` removed)."""
    if not hasattr(model, "pos_schemes") or not isinstance(model, nn.Module):
        raise TypeError(f"model must be a visionpe VisionPEViT, got {type(model).__name__}")
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    for wrapper in wrappers:
        inner = state_dict.get(wrapper)
        if isinstance(inner, Mapping) and not isinstance(inner, torch.Tensor):
            state_dict = inner
            break
    return tensors_by_name(state_dict)


def _scheme(model: nn.Module, name: str, layout: str) -> nn.Module:
    if name not in model.pos_schemes:
        raise ValueError(
            f"a {layout} checkpoint needs a model with the {name!r} position scheme, got pos_embed="
            f"{list(model.pos_schemes)}"
        )
    return model.pos_schemes[name]


def _take(state: dict, key: str, shape: tuple[int, ...], layout: str) -> torch.Tensor:
    """Remove ``key`` from ``state`` and return it; ValueError when it is missing or not of ``shape``."""
    if key not in state:
        raise ValueError(f"{key!r} is missing from the {layout} state dict: expected a tensor of shape {shape}")
    value = state.pop(key)
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{key!r} in the {layout} state dict has shape {tuple(value.shape)}, expected {shape}")
    return value


def _shape(model: nn.Module) -> tuple[int, int, int]:
    """(depth, num_heads, head_dim) of a VisionPEViT."""
    heads = model.blocks[0].attn.num_heads
    return len(model.blocks), heads, model.embed_dim // heads


def _finish(
    positions: dict[str, torch.Tensor], rest: dict[str, torch.Tensor], model: nn.Module, layout: str
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """The timm conversion of ``rest`` plus the converted ``positions``; a weight whose shape the model does not
    have (the classifier head aside, which may be replaced on purpose) raises ValueError."""
    target = model.state_dict()
    for key, value in rest.items():
        if key in target and tuple(target[key].shape) != tuple(value.shape) and not key.startswith("head."):
            raise ValueError(
                f"{key!r} in the {layout} state dict has shape {tuple(value.shape)}, but the model's is "
                f"{tuple(target[key].shape)}: build the model with the checkpoint's architecture"
            )
    out, report = convert_timm_state_dict(rest, model)
    for key, value in positions.items():
        if key not in target:
            raise ValueError(f"the model has no {key!r} to receive the converted {layout} position parameters")
        if tuple(target[key].shape) != tuple(value.shape):
            raise ValueError(
                f"the converted {key!r} has shape {tuple(value.shape)}, but the model's is {tuple(target[key].shape)}"
            )
        out[key] = value.to(target[key].dtype)
    report.added = [k for k in target if k not in out]
    return out, report


def _learned_table(state: dict, model: nn.Module, key: str, prefix_rows: int, layout: str, rebuild: str) -> None:
    """The checkpoint's absolute table ``state[key]`` (1, prefix_rows + N, C) as the model's ``learned`` table.

    Prefix rows the model's table has and the checkpoint's lacks are zero (nothing added to those tokens, as in
    the reference); on the model's grid the table is written as it is (any grid shape), otherwise it goes through
    timm's conversion as ``pos_embed`` (a square source grid, resampled). Without a ``learned`` scheme in the model,
    ValueError (the table would be lost): ``rebuild`` says how to build the model.
    """
    table = state.pop(key)
    if "learned" not in model.pos_schemes:
        raise ValueError(
            f"{key!r} (shape {tuple(table.shape)}) is the absolute table of the {layout} checkpoint, but the model has "
            f"no 'learned' scheme: {rebuild}"
        )
    learned = model.pos_schemes["learned"]
    if table.ndim != 3 or table.shape[0] != 1 or table.shape[2] != model.embed_dim or table.shape[1] <= prefix_rows:
        raise ValueError(
            f"{key!r} in the {layout} state dict has shape {tuple(table.shape)}, expected (1, {prefix_rows} + N, "
            f"{model.embed_dim})"
        )
    prefix, patches = table[:, :prefix_rows], table[:, prefix_rows:]
    wanted = learned.num_embed_prefix
    prefix = prefix[:, :wanted]
    if prefix.shape[1] < wanted:
        prefix = torch.cat((prefix, table.new_zeros(1, wanted - prefix.shape[1], table.shape[2])), dim=1)
    full = torch.cat((prefix, patches), dim=1)
    if patches.shape[1] == math.prod(learned.grid_size):
        state["pos_schemes.learned.pos_embed"] = full
    else:
        state["pos_embed"] = full


# -- naver-ai/rope-vit ----------------------------------------------------------------------------------------------
def convert_rope_vit_state_dict(
    state_dict: Mapping[str, torch.Tensor], model: nn.Module
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """A rope-vit checkpoint (naver-ai/rope-vit's DeiT III models) for a visionpe ViT with ``rope_mixed`` or
    ``rope_axial`` (and ``learned`` for the "+ APE" models).

    Layout of the released files (``checkpoint["model"]``, unwrapped here): ``freqs`` (2, depth, heads *
    head_dim / 2), the x component then the y component of every layer's and head's frequencies (RoPE-Mixed only;
    RoPE-Axial learns nothing and needs ``base=100`` and the default axis split), the coordinate buffers
    ``freqs_t_x``, ``freqs_t_y`` (dropped: visionpe computes the grid), ``pos_embed`` (1, N, C) without a class
    row for "+ APE" (the class token gets no absolute embedding there: a zero row here), DeiT III blocks whose
    layer scales ``gamma_1`` / ``gamma_2`` become timm's ``ls1.gamma`` / ``ls2.gamma``; the rest has timm's names.

    Build the model as the checkpoint's: e.g. ``timm.create_model("visionpe_vit_small_patch16_224",
    pos_embed="rope_mixed", init_values=1e-4)`` (or ``pos_embed=["learned", "rope_axial"]``). Both rotate the
    patch tokens only, on integer (row, column) positions, in interleaved pairs, as the reference does.

    Returns:
        (state dict for ``model``, :class:`~visionpe.models.convert.LoadReport`).
    """
    layout = "rope-vit"
    state = _state_dict(state_dict, model)
    depth, heads, head_dim = _shape(model)
    rope = [name for name in ("rope_mixed", "rope_axial") if name in model.pos_schemes]
    if len(rope) != 1:
        raise ValueError(
            f"a rope-vit checkpoint needs a model with one of 'rope_mixed', 'rope_axial', got pos_embed="
            f"{list(model.pos_schemes)}"
        )
    positions: dict[str, torch.Tensor] = {}
    if rope == ["rope_mixed"]:
        scheme = model.pos_schemes["rope_mixed"]
        if scheme.ndim != 2:
            raise ValueError(f"rope-vit's RoPE-Mixed is 2D: build rope_mixed with ndim=2, got ndim={scheme.ndim}")
        freqs = _take(state, "freqs", (2, depth, heads * head_dim // 2), layout)
        positions["pos_schemes.rope_mixed.freqs"] = freqs.reshape(2, depth, heads, head_dim // 2)
    else:
        if "freqs" in state:
            raise ValueError(
                f"'freqs' (shape {tuple(state['freqs'].shape)}) holds RoPE-Mixed's learned frequencies: build the "
                "model with pos_embed='rope_mixed', not 'rope_axial'"
            )
        scheme = model.pos_schemes["rope_axial"]
        expected = (head_dim // 4, head_dim // 4)
        order, offset = getattr(scheme, "axis_order", "xy"), getattr(scheme, "coord_offset", 0.0)
        if scheme.ndim != 2 or scheme.base != 100.0 or tuple(scheme.axis_pairs) != expected or order != "xy" or offset:
            raise ValueError(
                f"rope-vit's RoPE-Axial is 2D with base=100, axis_pairs={expected}, axis_order='xy' and no "
                f"coord_offset: got ndim={scheme.ndim}, base={scheme.base}, axis_pairs={tuple(scheme.axis_pairs)}, "
                f"axis_order={order!r}, coord_offset={offset!r}"
            )
    if scheme.coord_mode != "index":
        raise ValueError(
            f"rope-vit rotates by integer patch positions: build {rope[0]} with coord_mode='index', got "
            f"coord_mode={scheme.coord_mode!r}"
        )
    dropped = [key for key in ("freqs_t_x", "freqs_t_y") if state.pop(key, None) is not None]
    if "pos_embed" in state:
        rebuild = f"a '+ APE' model, build it with pos_embed=['learned', {rope[0]!r}]"
        _learned_table(state, model, "pos_embed", 0, layout, rebuild)
    elif "learned" in model.pos_schemes:
        raise ValueError(
            "'pos_embed' is missing from the rope-vit state dict, but the model has a 'learned' table: expected "
            f"a tensor of shape (1, {math.prod(model.pos_schemes['learned'].grid_size)}, {model.embed_dim}) "
            "(a '+ APE' checkpoint), or build the model without 'learned'"
        )
    rest = {}
    for key, value in state.items():
        match = re.fullmatch(r"(blocks\.\d+)\.gamma_([12])", key)
        rest[f"{match[1]}.ls{match[2]}.gamma" if match else key] = value
    out, report = _finish(positions, rest, model, layout)
    report.dropped += [f"{key} (rope-vit's patch coordinates; visionpe computes them from the grid)" for key in dropped]
    return out, report


# -- microsoft/Cream iRPE -------------------------------------------------------------------------------------------
def convert_irpe_state_dict(
    state_dict: Mapping[str, torch.Tensor], model: nn.Module
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """An iRPE checkpoint (microsoft/Cream, ``DeiT-with-iRPE``) for a visionpe ViT with ``irpe`` (and ``learned``:
    the released DeiT models keep their absolute table).

    Layout of the released files: per block ``i`` and target ``t`` in q, k, v,
    ``blocks.{i}.attn.rpe_{t}.lookup_table_weight`` (contextual mode: (h', head_dim, n_b) for q and k,
    (h', n_b, head_dim) for v) or ``lookup_table_bias`` (bias mode, q and k: (h', n_b)), h' = 1 with shared heads,
    n_b counting the extra bucket of the class token. The cross method holds two such tables per target,
    ``rp_rows`` and ``rp_cols``, S + 1 buckets each (S = 2 floor(2 r) + 1). visionpe's cross table is one: the
    row buckets [0, S), the column buckets [S, 2S) and one extra bucket, which a prefix pair reads once, so its
    entry is the sum of the two extra entries (the reference adds the rows' and the columns' lookups, and a prefix
    pair finds the extra bucket in both). The rest of the checkpoint has timm's names (``pos_embed`` with a class
    row goes to the ``learned`` table).

    The model must be built with the checkpoint's options: ``method``, ``mode``, ``on``, ``ratio``,
    ``shared_heads`` and one prefix token (the class token, the reference's ``skip=1``); e.g. ``deit_small_patch16_
    224_ctx_product_50_shared_k`` is ``timm.create_model("visionpe_vit_small_patch16_224", pos_embed=["learned",
    "irpe"], pos_embed_kwargs={"irpe": {"method": "product", "on": "k"}})``.
    """
    layout = "iRPE"
    state = _state_dict(state_dict, model)
    scheme = _scheme(model, "irpe", layout)
    depth, heads, head_dim = _shape(model)
    table_heads = 1 if scheme.shared_heads else heads
    param = "lookup_table_weight" if scheme.mode == "contextual" else "lookup_table_bias"
    extra = 1 if scheme.num_prefix_tokens > 0 else 0
    side = 2 * math.floor(2 * scheme.ratio) + 1

    def shape(target: str, buckets: int) -> tuple[int, ...]:
        if scheme.mode == "bias":
            return (table_heads, buckets)
        return (table_heads, buckets, head_dim) if target == "v" else (table_heads, head_dim, buckets)

    positions = {}
    for target in "qkv":
        prefix = [f"blocks.{i}.attn.rpe_{target}." for i in range(depth)]
        if target not in scheme.on:
            found = [k for k in state if any(k.startswith(p) for p in prefix)]
            if found:
                raise ValueError(
                    f"{found[0]!r}: the iRPE checkpoint has tables on {target!r}, but the model's irpe scheme has "
                    f"on={scheme.on!r}: build it with the checkpoint's targets"
                )
            continue
        tables = []
        for i in range(depth):
            if scheme.method != "cross":
                tables.append(_take(state, f"{prefix[i]}{param}", shape(target, scheme.num_buckets), layout))
                continue
            rows = _take(state, f"{prefix[i]}rp_rows.{param}", shape(target, side + extra), layout)
            cols = _take(state, f"{prefix[i]}rp_cols.{param}", shape(target, side + extra), layout)
            dim = -2 if target == "v" and scheme.mode == "contextual" else -1
            parts = [rows.narrow(dim, 0, side), cols.narrow(dim, 0, side)]
            if extra:
                parts.append(rows.narrow(dim, side, 1) + cols.narrow(dim, side, 1))
            tables.append(torch.cat(parts, dim=dim))
        positions[f"pos_schemes.irpe.tables.{target}"] = torch.stack(tables)
    if "pos_embed" in state:
        rebuild = "build it with pos_embed=['learned', 'irpe'] as the released DeiT models, or drop the table"
        _learned_table(state, model, "pos_embed", 1, layout, rebuild)
    left = [k for k in state if ".attn.rpe_" in k]
    if left:
        raise ValueError(
            f"{left[0]!r} is not an iRPE table of this model ({scheme.method} method, {scheme.mode} mode, on="
            f"{scheme.on!r}, depth {depth}): expected blocks.<i>.attn.rpe_<t>.{param} for i < {depth}"
        )
    return _finish(positions, state, model, layout)


# -- GreenCUBIC/lookhere --------------------------------------------------------------------------------------------
# The released code's head groups: name -> per head, the directed view (degrees, x right, y down) or None
# (undirected), and the field of view of the group. "halves" look up, down, left, right (half-planes);
# "diagonals" up-right, up-left, down-right, down-left (half-planes between them); "corners" the four quadrants
# (up-left, up-right, down-left, down-right); "triangles" the 90-degree cones up, down, left, right; "eighths1" and
# "eighths2" each a cone cut in two by an axis (octants).
_LOOKHERE_GROUPS: dict[str, tuple[tuple[float | None, ...], float | None]] = {
    "none": ((None, None, None, None), None),
    "halves": ((270.0, 90.0, 180.0, 0.0), 180.0),
    "diagonals": ((315.0, 225.0, 45.0, 135.0), 180.0),
    "corners": ((225.0, 315.0, 135.0, 45.0), 90.0),
    "triangles": ((270.0, 90.0, 180.0, 0.0), 90.0),
    "eighths1": ((247.5, 112.5, 202.5, -22.5), 45.0),
    "eighths2": ((292.5, 67.5, 157.5, 22.5), 45.0),
}
_LOOKHERE_UNDIRECTED = (0.25, 0.0625, 0.015625, 0.00390625)  # the released code's slopes of undirected heads


def _lookhere_group_sizes(names: list[str], num_heads: int) -> list[int]:
    """Heads per group of the released code's ``head_directions`` string, for ``num_heads`` heads."""
    layouts = {
        (1, None): [num_heads],
        (2, 12): [8, 4],
        (2, 16): [8, 8],
        (3, 12): [4, 4, 4],
        (3, 16): [8, 4, 4],
        (4, 16): [4, 4, 4, 4],
    }
    if num_heads == 6 and len(names) == 2:
        return [4, 2]
    sizes = layouts.get((len(names), None if len(names) == 1 else num_heads))
    if sizes is None or (len(names) == 1 and num_heads % 4):
        raise ValueError(
            f"head_directions {'-'.join(names)!r} has no released head layout for num_heads={num_heads}: the "
            "released code splits 12 or 16 heads into 2-4 groups, 6 heads into 4 + 2, one group over 4k heads"
        )
    return sizes


def _lookhere_slopes(name: str, count: int) -> list[float]:
    """The released code's slopes of a run of ``count`` heads of group ``name``: directed groups take 1/2, 1/4,
    ... each for four heads; undirected ones (1/4, 1/16, 1/64, 1/256), each for count // 4 heads (the first two for
    two heads)."""
    if name == "none":
        if count == 2:
            return list(_LOOKHERE_UNDIRECTED[:2])
        slopes = (
            list(_LOOKHERE_UNDIRECTED) if count == 4 else [s for s in _LOOKHERE_UNDIRECTED for _ in range(count // 4)]
        )
    else:
        slopes = [2.0 ** -(k + 1) for k in range(math.ceil(count / 4)) for _ in range(4)]
    if len(slopes) != count:
        raise ValueError(
            f"the released code gives {len(slopes)} slopes to a run of {count} {name!r} heads, which it cannot "
            "apply; no checkpoint has this head layout"
        )
    return slopes


def lookhere_scheme_kwargs(config: Mapping[str, Any], num_heads: int) -> dict[str, Any]:
    """Options of the ``lookhere`` scheme for a released LookHere config (``checkpoint["config"]``).

    The config names its head layout as groups of four heads, ``head_directions`` (e.g. ``"halves-diagonals-none"``:
    the eight LH-180 half-planes and four undirected heads; ``"triangles-corners-none"`` the LH-90 quadrants,
    ``"eighths1-eighths2-none"`` the LH-45 octants), with its slopes:
    ``global_slope`` s_g, ``layer_slopes`` (first, last) of s_l = linspace(first, last, depth). Each head's view
    and slope s_h follow the released code: a directed group's heads take s_h = 1/2 (the next four of a run of
    the same group 1/4, ...), undirected heads 1/4, 1/16, 1/64, 1/256. Returns ``variant`` (the directed heads'
    field of view), ``directions`` and ``head_slopes`` per head, ``layer_slopes`` and ``global_slope``.

    Only what the scheme computes is accepted: linear distances (``distance`` "linear", the default), masked views
    (``fill_with`` "inf", the default), one field of view for every directed head, one layout for every layer.
    The released code rounds its bias maps to bfloat16 and fills masked entries with -3.4e38 (bf16's lowest
    value) rather than -inf; visionpe keeps them in fp32 and -inf, the same attention up to that rounding.

    Example:
        >>> kwargs = lookhere_scheme_kwargs(
        ...     {"global_slope": 1.0, "layer_slopes": [1.5, 0.5], "head_directions": "halves-diagonals-none"}, 12
        ... )
        >>> directions, slopes = kwargs["directions"], kwargs["head_slopes"]
        >>> kwargs["variant"], directions[:4], slopes[8:]
        ('180', [270.0, 90.0, 180.0, 0.0], [0.25, 0.0625, 0.015625, 0.00390625])
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be the released LookHere config (a mapping), got {type(config).__name__}")
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    for key in ("global_slope", "layer_slopes", "head_directions"):
        if key not in config:
            raise ValueError(
                f"config is missing {key!r}: expected the released LookHere config, got keys {list(config)}"
            )
    for key, default in (("distance", "linear"), ("fill_with", "inf")):
        if config.get(key, default) != default:
            raise ValueError(
                f"config[{key!r}] must be {default!r} (what the lookhere scheme computes), got {config[key]!r}"
            )
    directions = config["head_directions"]
    if isinstance(directions, (list, tuple)):
        if not directions or any(d != directions[0] for d in directions):
            raise ValueError(
                f"config['head_directions'] must give every layer the same layout (one per scheme), got {directions!r}"
            )
        directions = directions[0]
    if not isinstance(directions, str):
        raise ValueError(f"config['head_directions'] must be a string like 'halves-diagonals-none', got {directions!r}")
    names = directions.split("-")
    for name in names:
        if name not in _LOOKHERE_GROUPS:
            raise ValueError(
                f"config['head_directions'] group {name!r} is not one the lookhere scheme computes: expected one of "
                f"{sorted(_LOOKHERE_GROUPS)} (the released 'zero', 'center' and 'zero*' groups have no visionpe form)"
            )
    sizes = _lookhere_group_sizes(names, num_heads)
    heads: list[float | None] = []
    fovs = set()
    for name, size in zip(names, sizes, strict=True):
        views, fov = _LOOKHERE_GROUPS[name]
        heads += [views[h % 4] for h in range(size)]
        if fov is not None:
            fovs.add(fov)
    if len(fovs) > 1:
        raise ValueError(
            f"config['head_directions'] {directions!r} mixes fields of view {sorted(fovs)}: the lookhere scheme has "
            "one field of view for all directed heads"
        )
    # runs of consecutive heads of the same group share one slope sequence (e.g. "halves-halves-none")
    owner = [name for name, size in zip(names, sizes, strict=True) for _ in range(size)]
    slopes = [s for name, run in groupby(owner) for s in _lookhere_slopes(name, len(list(run)))]
    layer_slopes = config["layer_slopes"]
    if not isinstance(layer_slopes, (list, tuple)) or len(layer_slopes) != 2:
        raise ValueError(f"config['layer_slopes'] must be a (first, last) pair, got {layer_slopes!r}")
    fov = fovs.pop() if fovs else 180.0
    return {
        "variant": {180.0: "180", 90.0: "90", 45.0: "45"}[fov],
        "directions": heads,
        "head_slopes": slopes,
        "layer_slopes": (float(layer_slopes[0]), float(layer_slopes[1])),
        "global_slope": float(config["global_slope"]),
    }


def convert_lookhere_state_dict(
    state_dict: Mapping[str, Any], model: nn.Module, config: Mapping[str, Any] | None = None
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """A released LookHere checkpoint (``{"weights": ..., "config": ...}``, or the weights and ``config``) for a
    visionpe ViT with ``lookhere``.

    Nothing of the position encoding is learned: the config decides it (:func:`lookhere_scheme_kwargs`, which
    gives the ``pos_embed_kwargs`` to build the model with), and this checks that the model's scheme has that
    layout, then converts the weights, which have timm's names already (DeiT III blocks with ``ls1`` / ``ls2``, no
    absolute table). Build the model with ``norm_layer=partial(nn.LayerNorm, eps=1e-5)`` (the released LayerNorms'
    eps) and ``init_values`` set; the released classifier is an MLP with a tanh (``head.fc1``, ``head.fc2``): to
    keep it, set ``model.head = timm.layers.Mlp(dim, 4 * dim, num_classes, act_layer=nn.Tanh)`` before
    converting, else the report lists both as dropped.
    """
    layout = "LookHere"
    if isinstance(state_dict, Mapping) and "config" in state_dict and "weights" in state_dict:
        if config is not None:
            raise ValueError("config is given twice: in the checkpoint (its 'config' entry) and as config=")
        config = state_dict["config"]
    state = _state_dict(state_dict, model, wrappers=("weights", "model", "state_dict"))
    scheme = _scheme(model, "lookhere", layout)
    if config is not None:
        depth, heads, _ = _shape(model)
        kwargs = lookhere_scheme_kwargs(config, heads)
        expected = {
            "directions": kwargs["directions"],
            "head_slopes": kwargs["head_slopes"],
            "layer_slopes": torch.linspace(*kwargs["layer_slopes"], depth).tolist(),
            "global_slope": kwargs["global_slope"],
            "fov": {"180": 180.0, "90": 90.0, "45": 45.0}[kwargs["variant"]],
        }
        got = {
            "directions": list(scheme.directions),
            "head_slopes": scheme.head_slopes.tolist(),
            "layer_slopes": scheme.layer_slopes.tolist(),
            "global_slope": scheme.global_slope,
            "fov": scheme.fov,
        }
        for key, value in expected.items():
            same = (
                got[key] == value
                if key == "directions"
                else torch.allclose(
                    torch.tensor(got[key], dtype=torch.float64), torch.tensor(value, dtype=torch.float64)
                )
            )
            if not same:
                raise ValueError(
                    f"the model's lookhere {key} {got[key]} is not the checkpoint's {value}: build the model with "
                    "pos_embed_kwargs=lookhere_scheme_kwargs(config, num_heads)"
                )
    return _finish({}, state, model, layout)


# -- StanfordMIMI/LieRE ---------------------------------------------------------------------------------------------
_LIERE_BODY = (  # lucidrains-style ViT of the LieRE repository -> timm names
    (r"to_patch_embedding\.1\.(weight|bias)", r"patch_embed.proj.\1"),
    (r"transformer\.layers\.(\d+)\.0\.norm\.(weight|bias)", r"blocks.\1.norm1.\2"),
    (r"transformer\.layers\.(\d+)\.0\.fn\.to_qkv\.(weight|bias)", r"blocks.\1.attn.qkv.\2"),
    (r"transformer\.layers\.(\d+)\.0\.fn\.to_out\.0\.(weight|bias)", r"blocks.\1.attn.proj.\2"),
    (r"transformer\.layers\.(\d+)\.1\.norm\.(weight|bias)", r"blocks.\1.norm2.\2"),
    (r"transformer\.layers\.(\d+)\.1\.fn\.net\.0\.(weight|bias)", r"blocks.\1.mlp.fc1.\2"),
    (r"transformer\.layers\.(\d+)\.1\.fn\.net\.3\.(weight|bias)", r"blocks.\1.mlp.fc2.\2"),
    (r"mlp_head\.0\.(weight|bias)", r"norm.\1"),
    (r"mlp_head\.1\.(weight|bias)", r"head.\1"),
)


def convert_liere_state_dict(
    state_dict: Mapping[str, torch.Tensor], model: nn.Module
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """A LieRE checkpoint (StanfordMIMI/LieRE, ``RoPEViT`` with ``positional_encoding_type="liere"``) for a
    visionpe ViT with ``liere``.

    The generators: ``position_encoder.generator_raw_params`` (ndim, L, G, b, b), L = depth with
    ``rotary_embedding_per_layer`` (else 1), G = heads * head_dim / b with ``rotary_embedding_per_head`` (head
    major; else head_dim / b, shared by the heads); only the strict upper triangle is used (A = U - U^T, U =
    triu(raw, 1)). The reference's transformer loop keeps layer 0's rotations for every layer (it overwrites the
    per-layer transforms with layer 0's slice on the first layer), so layer 0's generators are what a trained
    checkpoint computes with: they are copied to every layer. Its positions are i / (n - 1) per axis on the
    training grid (``linspace(0, 1, n)``), visionpe's integer indices, so each axis' generators are divided by
    n_a - 1 (the scheme's training grid): the rotations are the same on the training grid. On another grid of n
    patches per axis the reference's positions are i n / (n0 (n - 1)), visionpe's integer steps i / (n0 - 1) in
    those units (the paper's extrapolation), so the two agree on the training grid only.

    The rest, when present (the lucidrains-style ViT of the repository), maps to timm's names:
    ``to_patch_embedding.1`` (a Linear on (p1 p2 c)-flattened patches) -> ``patch_embed.proj`` (reshaped to the
    Conv2d kernel), ``transformer.layers.i.0`` / ``.1`` -> ``blocks.i.norm1`` + ``attn.qkv`` + ``attn.proj`` /
    ``blocks.i.norm2`` + ``mlp.fc1`` + ``mlp.fc2``, ``mlp_head.0`` (LayerNorm of the pooled class token) -> ``norm``
    (the same on the class token), ``mlp_head.1`` -> ``head``; ``pos_embedding`` (zero and frozen unless the run
    forced absolute encodings) is dropped when zero, else goes to a ``learned`` table. A Lightning checkpoint
    (``state_dict``, keys under ``model.``) is unwrapped. Build the model with ``qkv_bias=False``,
    ``norm_layer=partial(nn.LayerNorm, eps=1e-5)``, ``mlp_ratio = mlp_dim / dim`` and ``block_size`` = the run's
    ``generator_dim``.
    """
    layout = "LieRE"
    state = _state_dict(state_dict, model)
    if state and all(k.startswith("model.") for k in state):
        state = {k.removeprefix("model."): v for k, v in state.items()}
    scheme = _scheme(model, "liere", layout)
    depth, heads, head_dim = _shape(model)
    b, ndim, m = scheme.block_size, scheme.ndim, scheme.num_blocks
    key = "position_encoder.generator_raw_params"
    if key not in state:
        raise ValueError(
            f"{key!r} is missing from the LieRE state dict: expected a tensor of shape ({ndim}, 1 or {depth}, "
            f"{m} or {heads * m}, {b}, {b})"
        )
    raw = state.pop(key)
    if (
        raw.ndim != 5
        or raw.shape[0] != ndim
        or raw.shape[1] not in (1, depth)
        or raw.shape[2] not in (m, heads * m)
        or tuple(raw.shape[3:]) != (b, b)
    ):
        raise ValueError(
            f"{key!r} in the LieRE state dict has shape {tuple(raw.shape)}, expected ({ndim}, 1 or {depth}, "
            f"{m} or {heads * m}, {b}, {b}) for ndim={ndim}, depth={depth}, {heads} heads, block_size={b}"
        )
    grid = scheme.train_grid_size
    if grid is None:
        raise ValueError("the model's liere scheme needs its training grid (grid_size) to rescale the positions")
    layer0 = raw[:, 0].reshape(ndim, -1, m, b, b).expand(ndim, heads, m, b, b).float()  # (ndim, h, m, b, b)
    rows, cols = torch.triu_indices(b, b, 1, device=raw.device)
    entries = layer0[..., rows, cols]  # (ndim, h, m, b (b - 1) / 2)
    steps = torch.tensor([max(n - 1, 1) for n in grid], dtype=torch.float32, device=raw.device)
    entries = entries / steps[:, None, None, None]
    params = entries.permute(1, 2, 0, 3).unsqueeze(0).expand(depth, -1, -1, -1, -1).contiguous()
    positions = {"pos_schemes.liere.generator_params": params}
    rest: dict[str, torch.Tensor] = {}
    zero_table = False
    for name, value in state.items():
        new = name
        for pattern, replacement in _LIERE_BODY:
            if re.fullmatch(pattern, name):
                new = re.sub(pattern, replacement, name)
                break
        if new == "patch_embed.proj.weight" and value.ndim == 2:
            kernel = model.patch_embed.proj.weight  # (dim, c, p1, p2), or (dim, c, p1, p2, p3) for video
            out_dim, channels, *patch = kernel.shape
            size = channels * math.prod(patch)
            if tuple(value.shape) != (out_dim, size):
                raise ValueError(
                    f"{name!r} in the LieRE state dict has shape {tuple(value.shape)}, expected ({out_dim}, {size}) "
                    f"for the model's {'x'.join(map(str, patch))} patches of {channels} channels"
                )
            # a Linear on (p1 p2 [p3] c)-flattened patches -> the Conv kernel (c, p1, p2 [, p3])
            value = value.reshape(out_dim, *patch, channels).movedim(-1, 1)
        elif name == "pos_embedding":
            if not value.any():  # the zero, frozen table of a run without absolute encodings
                zero_table = True
                continue
            table = {"pos_embedding": value}
            rebuild = "the run forced absolute encodings, build the model with pos_embed=['learned', 'liere']"
            _learned_table(table, model, "pos_embedding", 1, layout, rebuild)
            rest.update(table)
            continue
        rest[new] = value
    out, report = _finish(positions, rest, model, layout)
    if zero_table:
        report.dropped.append("pos_embedding (all zeros: the run used no absolute encoding)")
    return out, report
