"""One attention module for all three kinds of position encoding, built on timm's Attention and Block.

A :class:`PositionContext` is built once per forward by the model: the rotary schemes' states (frequencies or
cos/sin tables) and the bias schemes' states (offset buckets, coordinates). Each block receives it, the way
timm's Eva passes ``rope``, and picks its own layer. Attention runs through ``scaled_dot_product_attention``
with the summed logit bias as ``attn_mask``; only schemes that add a value term (``needs_probs``) take the
explicit path. Relative camera schemes (multi-view models, :mod:`visionpe.camera`) wrap the attention call: their
transforms map q, k, v before it and the output after it.

With patch dropout (timm's ``patch_drop_rate``) each sample keeps its own subset of patches; the context then holds
``keep``, the kept tokens' indices in the full sequence (positions, rotations and biases are those of the full grid,
gathered with the kept indices: :mod:`visionpe.tokens`). Rotary schemes with cos/sin tables (RoPE, STRING) rotate
the kept q and k by the kept rows of their tables; the others rotate them placed back on the full grid (dropped rows
zero) and gather them again (:meth:`~visionpe.interfaces.rotary.LayerRotation.rotate_kept`). Bias schemes build the full
grid's bias (from q and k placed back likewise) and gather the kept rows and columns. Every scheme thus takes patch
dropout with the same rotations and biases as the full grid.

A dense bias is (B, heads, N, N): 400 MB in fp32 for ViT-S at 1024 px (N = 4097), per block, or (1, heads, N, N)
where every scheme's bias depends on the positions only (``batch_shared_bias``). When it would exceed
``PosAttention.bias_chunk_bytes`` and autograd does not record the attention (inference, or q and k that need no
gradient), attention runs in chunks of query rows: each scheme builds the bias of those rows only
(``attn_bias(..., rows=)``), and each chunk's softmax is over all keys, so the result is the same as the full
computation. A recorded attention keeps its whole bias for the backward in any case, so it runs in one piece.

A mixed-resolution batch (timm's NaFlex layout, :class:`~visionpe.grid.MixedGrid`) gives each sample its own grid,
valid tokens first and padding after (:func:`~visionpe.models.naflex.build_mixed_position_context`). Where every
scheme in attention rotates by per-token cos/sin tables, the context holds per-sample tables and ``attn_mask``, the
key-padding mask, and attention runs once over the padded batch. Otherwise it holds ``groups``, one
:class:`GridGroup` per distinct grid with the states built for that grid; attention then runs group by group on the
valid tokens of the group's samples, each group through the path above as an ordinary one-grid batch, and padding rows
get a zero output. Either way padding never enters a softmax, a bias or a rotation of a valid token, and every scheme,
whatever its positions depend on, sees exactly the grid it would see for the image alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from timm.layers import Attention
from timm.models.vision_transformer import Block
from torch import nn

from .base import PositionEncoding
from .checks import check_choice, check_instance
from .contract import UnsupportedSchemeError
from .interfaces.bias import BiasState, LayerBias, OffsetBias, SchemeBias, offset_score_mod
from .interfaces.fused_rotary import ROTARY_BACKENDS, fused_rotate_qkv
from .interfaces.rotary import ChainedRotation, IdentityRotation, LayerRotation, RotaryState, split_heads
from .registry import get_scheme_class, registered_schemes

__all__ = [
    "ATTENTION_BACKENDS",
    "ROTARY_BACKENDS",
    "GridGroup",
    "PositionContext",
    "PosAttention",
    "PosBlock",
    "flex_attention_available",
    "position_attention",
    "set_attention_backend",
    "set_rotary_backend",
]

ATTENTION_BACKENDS = ("sdpa", "flex")


def _check_no_mask(attn_mask: torch.Tensor | None, is_causal: bool) -> None:
    """A mixed-resolution batch takes its key mask from ``patch_valid``: ValueError for a given mask or causality."""
    if attn_mask is not None or is_causal:
        raise ValueError(
            "a mixed-resolution batch masks its padding from patch_valid; attn_mask and is_causal are not taken "
            f"with it, got attn_mask={'a tensor' if attn_mask is not None else None}, is_causal={is_causal}"
        )


@dataclass
class GridGroup:
    """The samples of a mixed-resolution batch that share one grid: ``grid_size``, their int64 ``index`` in the batch,
    ``length`` (prefix tokens + patches of the grid: the leading tokens of each of their rows that are valid) and the
    :class:`PositionContext` built for that grid."""

    grid_size: tuple[int, ...]
    index: torch.Tensor
    length: int
    context: PositionContext


@dataclass
class PositionContext:
    """Per-forward position state shared by all blocks: each rotary scheme's
    :class:`~visionpe.interfaces.rotary.RotaryState`, each bias scheme's :class:`~visionpe.interfaces.BiasState` (a
    ``(scheme, state)`` pair is taken as the :class:`~visionpe.interfaces.SchemeBias` of a
    :class:`~visionpe.base.BiasPositionEncoding`) and, in multi-view models, each relative camera scheme's
    (scheme, :class:`~visionpe.camera.CameraState`)."""

    rotary: list[RotaryState] = field(default_factory=list)
    bias: list[BiasState] = field(default_factory=list)
    # relative camera schemes of a multi-view model: (scheme, CameraState), applied around the attention itself
    camera: list[tuple[Any, Any]] = field(default_factory=list)
    # patch dropout: (B, K) int64 indices of the tokens each sample kept (prefix included) in the full sequence of
    # ``num_tokens`` tokens the states were built for; None when every token is there
    keep: torch.Tensor | None = None
    num_tokens: int = 0
    # mixed-resolution batch: one GridGroup per distinct grid, whose contexts hold the states; None for one grid
    groups: list[GridGroup] | None = None
    # mixed-resolution batch in one padded attention: (B, 1, 1, T) bool, True on the keys a token may attend to (the
    # prefix and each sample's valid patches); the rotary states then hold per-sample tables
    attn_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.bias = [SchemeBias(*state) if type(state) is tuple else state for state in self.bias]

    def bias_layers(self, layer: int, tokens: torch.Tensor | None = None) -> list[LayerBias]:
        """Every bias scheme's :class:`~visionpe.interfaces.LayerBias` of block ``layer``; ``tokens`` (B, T, C) is
        the block's normalised input (for biases computed from it), of the kept tokens under patch dropout."""
        return [state.layer(layer, tokens, self.keep, self.num_tokens) for state in self.bias]

    def keep_tokens(self, keep: torch.Tensor, num_prefix_tokens: int, num_tokens: int) -> None:
        """Record patch dropout's ``keep`` (B, K) indices of the kept patches (timm's ``PatchDropoutWithIndices``)
        as indices in the full sequence of ``num_tokens`` tokens, prefix tokens always kept."""
        prefix = torch.arange(num_prefix_tokens, device=keep.device).expand(keep.shape[0], -1)
        self.keep, self.num_tokens = torch.cat((prefix, keep + num_prefix_tokens), 1), num_tokens

    def rotation(self, layer: int) -> LayerRotation:
        """The rotation of q and k in block ``layer``: every rotary scheme's, in order (the identity without one)."""
        if not self.rotary:
            return IdentityRotation()
        if len(self.rotary) == 1:
            return self.rotary[0].layer(layer)
        return ChainedRotation([state.layer(layer) for state in self.rotary])


class PosAttention(Attention):
    """timm ``Attention`` that rotates q/k and adds logit biases from a :class:`PositionContext`."""

    # bias schemes: query rows per chunk are chosen so that one chunk's (B, heads, rows, N) fp32 bias stays
    # within this many bytes; attention that fits (e.g. ViT-S at 224 px, batch 8: 7.5 MB) runs in one piece.
    # 16 MB, not more: at 1024 px 32 MB chunks still left the forward's peak at 1.5-2x the plain ViT's (on
    # CPU, freed blocks of that size stay resident), 16 MB about 1.1x
    bias_chunk_bytes: ClassVar[int] = 16 * 2**20
    #: "sdpa" (default) or "flex": see :func:`set_attention_backend`
    attn_backend: str = "sdpa"
    # "fused": q and k rotated by one compiled kernel where the rotation has cos/sin tables (set_rotary_backend)
    rotary_backend: str = "eager"

    def __init__(self, *args, layer: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.layer = layer

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        pos: PositionContext | None = None,
    ) -> torch.Tensor:
        if pos is not None and pos.groups is not None:
            return self._forward_groups(x, attn_mask, is_causal, pos.groups)
        if pos is not None and pos.attn_mask is not None:
            attn_mask = self._padding_mask(attn_mask, is_causal, pos.attn_mask)
        if pos is None or not (pos.rotary or pos.bias or pos.camera):
            return super().forward(x, attn_mask=attn_mask, is_causal=is_causal)
        B, N, _ = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        rotation = pos.rotation(self.layer)
        if isinstance(self.q_norm, nn.Identity) and isinstance(self.k_norm, nn.Identity):
            # a basis P that the rotation starts with (STRING) goes into the projection weights for this forward;
            # the rest rotates q and k inside the projection output, so q, k, v stay views of one buffer as in timm
            basis = rotation.basis if type(self.qkv) is nn.Linear else None
            if basis is not None:
                rotation = rotation.without_basis()
            qkv = self.project_qkv(x.reshape(B * N, -1), basis)
            fused = None
            if self.rotary_backend == "fused":  # one compiled kernel for q and k where the rotation has tables
                fused = fused_rotate_qkv(rotation, qkv, self.num_heads, pos.keep)
            q, k, v = rotation.rotate_qkv(qkv, B, self.num_heads, pos.keep) if fused is None else fused
        else:  # q/k normalised after the projection: the rotation (P included) acts on the normalised q and k
            q, k, v = split_heads(self.qkv(x), B, self.num_heads).unbind(0)
            q, k = rotation.rotate_tokens(torch.stack((self.q_norm(q), self.k_norm(k))), pos.keep).unbind(0)
        v = rotation.rotate_values(v, pos.keep)
        layers = pos.bias_layers(self.layer, x)
        for layer in layers:
            q, k = layer.augment_qk(q, k)
        if pos.camera:
            x = self._attend_cameras(q, k, v, pos, layers, attn_mask, is_causal, x)
        else:
            x = self._attend_chunked(q, k, v, pos, layers, attn_mask, is_causal)
        x = rotation.unrotate_output(x, pos.keep)
        x = x.transpose(1, 2).reshape(B, N, self.attn_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))

    @staticmethod
    def _padding_mask(attn_mask: torch.Tensor | None, is_causal: bool, padding: torch.Tensor) -> torch.Tensor:
        """The key-padding mask of a mixed-resolution batch, which replaces ``attn_mask`` (none may be given)."""
        _check_no_mask(attn_mask, is_causal)
        return padding

    def _forward_groups(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool, groups: list[GridGroup]
    ) -> torch.Tensor:
        """Attention of a mixed-resolution batch: each group's valid tokens through :meth:`forward` with the group's
        context, written back at their rows; padding rows are zero (see the module docstring)."""
        _check_no_mask(attn_mask, is_causal)
        B, N, _ = x.shape
        if len(groups) == 1 and groups[0].length == N and groups[0].index.numel() == B:
            return self.forward(x, pos=groups[0].context)
        out = x.new_zeros(B, N, self.proj.out_features)
        for group in groups:
            rows = self.forward(x[group.index, : group.length], pos=group.context)
            tokens = torch.arange(group.length, device=x.device)[:, None]
            out = out.index_put((group.index, tokens), rows.transpose(0, 1))
        return out

    def _attend_chunked(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pos: PositionContext,
        layers: list[LayerBias],
        attn_mask: torch.Tensor | None,
        is_causal: bool,
    ) -> torch.Tensor:
        """:meth:`_attend` of all queries with this block's bias ``layers``, in chunks of query rows where a dense
        bias would be large and autograd does not record the attention (see the module docstring)."""
        B, N = q.shape[0], q.shape[2]
        # chunks only where autograd does not record the attention: when it does, each chunk's bias is kept for
        # attention's backward, so the chunks keep what the full bias would and only multiply the kernels
        # (ViT-S training at batch 128 on an H200: alibi2d 0.43x -> 0.86x of timm, with a lower peak)
        recorded = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
        # a symbolic token count (export at any image size) runs in one piece: a graph cannot loop over a number of
        # chunks known only when it runs, and comparing chunk and N would fix the traced image size
        symbolic = isinstance(N, torch.SymInt)
        chunking = bool(layers) and not is_causal and pos.keep is None and not recorded and not symbolic
        # biases of the positions only are (1, heads, rows, N), shared by the batch: chunks sized for one sample
        shared = chunking and all(layer.batch_shared for layer in layers)
        shared = shared and (attn_mask is None or attn_mask.ndim < 4 or attn_mask.shape[0] == 1)
        chunk = self.query_chunk_rows(1 if shared else B, N) if chunking else N
        terms = self._fused_terms(q, k, pos, attn_mask, is_causal, symbolic, layers)
        if terms is not None:
            return _flex_attention(q, k, v, offset_score_mod(terms), self.scale)
        if chunk >= N:
            return self._attend(q, k, v, layers, attn_mask, is_causal, None)
        # a mask with one row per query is cut like the bias; a broadcast row is shared by every chunk
        per_row = attn_mask is not None and attn_mask.ndim >= 2 and attn_mask.shape[-2] == N
        return torch.cat(
            [
                self._attend(
                    q[:, :, start : start + chunk],
                    k,
                    v,
                    layers,
                    attn_mask[..., start : start + chunk, :] if per_row else attn_mask,
                    False,
                    slice(start, start + chunk),
                )
                for start in range(0, N, chunk)
            ],
            dim=2,
        )

    def _fused_terms(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        pos: PositionContext,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
        symbolic: bool,
        layers: list[LayerBias] | None = None,
    ) -> list[OffsetBias] | None:
        """Every bias layer's per-offset terms (``layers``, default this block's of ``pos``) where this block runs
        FlexAttention (``attn_backend="flex"``), else None: the dense path then runs (see
        :func:`set_attention_backend` for when it does)."""
        layers = pos.bias_layers(self.layer) if layers is None else layers
        if self.attn_backend != "flex" or not layers or pos.camera or symbolic:
            return None
        if attn_mask is not None or is_causal or (self.training and self.attn_drop.p > 0):
            return None
        recorded = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
        if recorded and q.device.type == "cpu":  # FlexAttention has no CPU backward
            return None
        terms = []
        for layer in layers:
            layer_terms = layer.fused_terms(q, k)
            if layer_terms is None:  # not a function of the grid offset (or patch dropout): the dense path
                return None
            terms += layer_terms
        return terms

    def _attend_cameras(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pos: PositionContext,
        layers: list[LayerBias],
        attn_mask: torch.Tensor | None,
        is_causal: bool,
        block_input: torch.Tensor,
    ) -> torch.Tensor:
        """Attention through every relative camera scheme's transform of this block (the first scheme outermost):
        each maps q, k, v before the attention and the output after it (:mod:`visionpe.camera.base`); the block's
        input goes to every transform (those that read no tokens ignore it)."""
        if pos.keep is not None:
            raise ValueError("camera schemes take every token of every view; patch dropout (keep) is not supported")

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self._attend_chunked(q, k, v, pos, layers, attn_mask, is_causal)

        for _, state in reversed(pos.camera):
            attend = partial(state.layer(self.layer, tokens=block_input).attend, attend=attend)
        return attend(q, k, v)

    def project_qkv(self, x: torch.Tensor, basis: torch.Tensor | None = None) -> torch.Tensor:
        """``self.qkv(x)``, with q and k of every head multiplied by ``basis`` when given
        (:meth:`fold_qk_basis`, once per forward).

        A (heads, head_dim, head_dim) @ (2, heads, head_dim, dim) product and its backward cost a fraction of
        multiplying the (2, B, heads, N, head_dim) activations, and nothing of activation size is kept for it.
        """
        if basis is None:
            return self.qkv(x)
        return F.linear(x, *self.fold_qk_basis(basis))

    def fold_qk_basis(self, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) of the qkv projection with the q and k rows of every head multiplied by ``basis``
        (num_heads | 1, head_dim, head_dim), or (2, num_heads | 1, head_dim, head_dim) with one P for q and one for k:
        P W_q, P W_k and P b, in the weights' dtype without autocast; the v rows unchanged. Differentiable in P and
        the weights; :func:`~visionpe.fold_string_` writes it back."""
        weight, bias, qk_rows = self.qkv.weight, self.qkv.bias, 2 * self.num_heads * self.head_dim
        with torch.autocast(weight.device.type, enabled=False):
            basis = basis.to(weight.dtype)
            qk_weight = basis @ weight[:qk_rows].unflatten(0, (2, self.num_heads, self.head_dim))
            weight = torch.cat((qk_weight.flatten(0, 2), weight[qk_rows:]))
            if bias is not None:
                qk_bias = basis @ bias[:qk_rows].view(2, self.num_heads, self.head_dim, 1)
                bias = torch.cat((qk_bias.flatten(), bias[qk_rows:]))
        return weight, bias

    def query_chunk_rows(self, batch: int, num_tokens: int) -> int:
        """Query rows per chunk so that a (batch, heads, rows, num_tokens) fp32 bias fits ``bias_chunk_bytes``."""
        return max(1, self.bias_chunk_bytes // (batch * self.num_heads * num_tokens * 4))

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layers: list[LayerBias],
        attn_mask: torch.Tensor | None,
        is_causal: bool,
        rows: slice | None,
    ) -> torch.Tensor:
        """Attention of the queries ``q`` (all of them, or the query ``rows``) over every key, with this block's bias
        ``layers``: (B, h, R, head_dim).

        ``attn_mask`` follows ``scaled_dot_product_attention``: a boolean mask (True: may attend) or a float mask
        added to the logits. Bias terms are added to it, so a boolean mask becomes 0 / -inf first.
        """
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=q.dtype, device=q.device).masked_fill_(~bias, float("-inf"))
        for layer in layers:
            term = layer.logits(q, k, rows)
            if term is not None:
                bias = term if bias is None else bias + term
        if bias is not None:
            bias = bias.to(q.dtype)
            if is_causal:  # SDPA takes a mask or is_causal, not both: the causal mask joins the bias
                n, m = q.shape[-2], k.shape[-2]
                future = torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1)
                bias, is_causal = bias.masked_fill(future, float("-inf")), False

        if self.fused_attn and not any(layer.needs_probs for layer in layers):
            width = v.shape[-1]
            if q.shape[-1] != width:
                # q and k with appended channels (PaPE): the fused kernels (flash on the CPU and on CUDA) take one
                # head width for q, k and v, so v gets zero channels, which add nothing to the output, cut off after
                v = F.pad(v, (0, q.shape[-1] - width))
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=bias,
                dropout_p=self.attn_drop.p if self.training else 0.0,
                is_causal=is_causal,
                # q and k with appended channels keep the scale of the original heads
                scale=self.scale if q.shape[-1] != width else None,
            )
            return out if out.shape[-1] == width else out[..., :width]
        attn = (q * self.scale) @ k.transpose(-2, -1)
        if bias is not None:
            attn = attn + bias
        if is_causal:
            n = q.shape[-2]
            attn = attn.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        attn = self.attn_drop(attn.softmax(dim=-1))
        x = attn @ v
        for layer in layers:
            term = layer.value_term(attn, rows)
            if term is not None:
                x = x + term
        return x


class PosBlock(Block):
    """timm ``Block`` whose attention is :class:`PosAttention` and that forwards the position context."""

    def __init__(self, *args, depth: int = 0, **kwargs) -> None:
        kwargs["attn_layer"] = PosAttention
        super().__init__(*args, depth=depth, **kwargs)
        self.attn.layer = depth

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        pos: PositionContext | None = None,
    ) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(position_attention(self.attn, self.norm1(x), attn_mask, is_causal, pos)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


@torch.fx.wrap
def position_attention(
    attn: PosAttention,
    x: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    pos: PositionContext | None = None,
) -> torch.Tensor:
    """``attn(x, attn_mask=attn_mask, is_causal=is_causal, pos=pos)``, one leaf call of a ``torch.fx`` graph.

    ``torch.fx.wrap`` (as timm wraps its position-embedding functions) makes symbolic tracing record this call,
    with the attention module and the position context as values, instead of tracing into it: each scheme applies
    its state with Python control flow (per-layer tables, query chunks, patch dropout) that fx cannot trace. So
    torchvision's ``create_feature_extractor`` and timm's ``features_only`` fx path work with every scheme, with
    or without timm's tracer settings, and compute what the eager model does.
    """
    return attn(x, attn_mask=attn_mask, is_causal=is_causal, pos=pos)


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    # static shapes: one kernel per (batch, heads, tokens) shape, reused by every forward and every closure over new
    # values (the values are inputs of the compiled graph, not constants)
    return torch.compile(flex_attention, dynamic=False)


def _flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod, scale: float) -> torch.Tensor:
    """FlexAttention with ``score_mod``: compiled once per process, or inlined into a graph being compiled."""
    if torch.compiler.is_compiling():
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, score_mod=score_mod, scale=scale)
    return _compiled_flex_attention()(q, k, v, score_mod=score_mod, scale=scale)


def flex_attention_available() -> bool:
    """Whether this PyTorch has FlexAttention (``torch.nn.attention.flex_attention``, PyTorch >= 2.5)."""
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def set_attention_backend(model: nn.Module, backend: str) -> nn.Module:
    """Run the bias schemes of ``model`` through FlexAttention (``"flex"``) or the dense SDPA path (``"sdpa"``).

    With ``"flex"``, a block whose bias schemes all give their bias per grid offset
    (:meth:`~visionpe.base.BiasPositionEncoding.fused_bias`: ``alibi2d``, ``lookhere``, ``kerple_log``,
    ``kerple_power``, ``bam`` and ``irpe`` on q and k) adds it inside the attention kernel, pair by pair, through a
    ``score_mod`` that reads a table of O(H W) values: no (B, heads, N, N) bias is built, at any image size, and no
    query chunks are needed. The result equals the SDPA path's to float rounding. FlexAttention is compiled with
    ``torch.compile`` on first use (once per shape; tens of seconds on a CPU).

    The dense path runs instead, block by block, where FlexAttention cannot: a scheme without per-offset terms (FIRE,
    Cable, a training-time ``coord_augment``, iRPE on v), patch dropout, an attention mask, attention dropout in
    training, camera schemes, export with a dynamic image size, and, on the CPU, attention that autograd records
    (FlexAttention has no CPU backward: training on a CPU keeps SDPA; inference uses the kernel).

    Args:
        model: any module; every :class:`PosAttention` in it is switched.
        backend: ``"flex"`` or ``"sdpa"`` (the default of every model).

    Returns:
        The same model.

    Example:
        >>> import timm, visionpe
        >>> model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="alibi2d")
        >>> _ = visionpe.set_attention_backend(model, "flex")
    """
    check_instance(model, "model", nn.Module, expected="a torch.nn.Module")
    check_choice(backend, "backend", ATTENTION_BACKENDS)
    if backend == "flex" and not flex_attention_available():
        raise RuntimeError(
            "backend='flex' needs torch.nn.attention.flex_attention (PyTorch >= 2.5); "
            f"this is PyTorch {torch.__version__}"
        )
    return _switch_attention(model, "attn_backend", backend, "attention_backends")


def set_rotary_backend(model: nn.Module, backend: str) -> nn.Module:
    """Rotate q and k of the rotary schemes of ``model`` by one compiled kernel (``"fused"``) or by the reference
    eager operations (``"eager"``, the default of every model).

    With ``"fused"``, a block whose rotation is by cos/sin tables (``rope_axial``, ``rope_mixed``,
    ``string_cayley`` and ``string_circulant`` with their basis P folded into the projection, and the other schemes
    built on :class:`~visionpe.rotary.base.LinearRotary`) rotates q and k inside the q/k/v projection output with
    :func:`~visionpe.interfaces.fused_rotary.rotate_qkv_tables` compiled by ``torch.compile``: one kernel (Triton on a
    GPU, C++ on a CPU) for q and k of every head, products in fp32 with the fp32 tables, the result rounded once to the
    activations' dtype. The result equals the eager path's to that rounding (bf16: about 1e-2 relative), forward
    and gradients. The function is compiled on first use (seconds; again once when shapes first change, then with
    dynamic shapes). Inside a model compiled with ``torch.compile`` the plain function is traced into the model's
    graph instead (no nested compilation, no graph break).

    The eager path runs instead, block by block, where there are no tables to fuse: Lie-group and ComRoPE rotations,
    several rotary schemes in one model, q/k normalisation (``qk_norm``: the rotation then follows the norm), and
    tracing for TorchScript or ONNX export. Patch dropout is fused: the kept tokens' rows of the tables are gathered
    first. Rotary value embeddings rotate v and the output as in the eager path.

    Args:
        model: any module; every :class:`PosAttention` in it is switched.
        backend: ``"fused"`` or ``"eager"`` (the default of every model).

    Returns:
        The same model.

    Example:
        >>> import timm, visionpe
        >>> model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="rope_axial")
        >>> _ = visionpe.set_rotary_backend(model, "fused")
    """
    check_instance(model, "model", nn.Module, expected="a torch.nn.Module")
    check_choice(backend, "backend", ROTARY_BACKENDS)
    return _switch_attention(model, "rotary_backend", backend, "rotary_backends")


def _switch_attention(model: nn.Module, attribute: str, value: str, capability: str) -> nn.Module:
    """Set ``attribute`` to ``value`` on every :class:`PosAttention` of ``model``; return ``model``.

    A backend other than the default needs a scheme of ``model`` that declares it in ``capability``
    (``rotary_backends``, ``attention_backends``): :class:`~visionpe.contract.UnsupportedSchemeError` otherwise, since
    the switch would change nothing."""
    attentions = [m for m in model.modules() if isinstance(m, PosAttention)]
    default = getattr(PosAttention, attribute)
    if value != default:
        schemes = [m for m in model.modules() if isinstance(m, PositionEncoding)]
        if not attentions or not any(value in getattr(s, capability, ()) for s in schemes):
            takers = sorted(n for n in registered_schemes() if value in getattr(get_scheme_class(n), capability, ()))
            names = sorted({getattr(s, "scheme_name", type(s).__name__) for s in schemes})
            raise UnsupportedSchemeError(
                f"backend={value!r} acts on the schemes {takers}; {type(model).__name__} has "
                f"{names or 'no position scheme in visionpe attention'}, so the switch would change nothing"
            )
    for module in attentions:
        setattr(module, attribute, value)
    return model
