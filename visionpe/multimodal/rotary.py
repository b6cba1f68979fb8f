"""Multimodal rotary tables: position ids (3, B, L) -> cos/sin, through a frequency allocation.

Huang et al., "Revisiting Multimodal Positional Encoding in Vision-Language Models", ICLR 2026; layout as
Qwen2-VL in Hugging Face transformers ("half" layout: pair n is channels n and n + D/2).

phi_n = theta_n * sum_a mix[n, a] * p_a with theta_n = base^(-2n/D); cos = cos(cat(phi, phi)), (B, L, D),
or (B, H_kv, L, D) for head-wise allocations (MHRoPE), where head h reads sum_a mix[h, a] * p_a on every pair.
Angles are computed with autocast off, never in bf16/fp16: in fp32 for integer ids (exact below 2^24, the
transformers expression bit for bit) and in fp64 for float64 ids (fractional designs such as V2PE, whose steps of
2^-8 need fp64 above 2^16). Only the finished cos and sin are cast.

A language model's own context-extension scaling (:class:`RopeScaling`: linear position interpolation, dynamic NTK,
YaRN) changes the frequencies theta_n, whatever axis the allocation gives each pair, and YaRN multiplies cos and
sin; the expressions are transformers' (``modeling_rope_utils``), so that M-RoPE with scaling still reproduces a
Qwen-VL model's tables.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from ..checks import (
    check_bool,
    check_choice,
    check_float,
    check_instance,
    check_int,
    check_positive,
    check_tensor,
)
from .allocation import Allocation, _check_mix, build_allocation
from .registry import get_multimodal_scheme

__all__ = ["MultimodalRotary", "RopeScaling", "ROPE_TYPES", "apply_multimodal_rotary", "rotate_half"]

ROPE_TYPES = ("default", "linear", "dynamic", "yarn")
# the fields each rope_type reads (rope_type itself aside); the others must keep their defaults
_USED_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "max_position_embeddings"),
    "yarn": (
        "factor",
        "max_position_embeddings",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
}


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature sqrt(1/t) = 0.1 * mscale * ln(s) + 1 for a scale s > 1 (1 otherwise)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    """A language model's RoPE context-extension scaling, as transformers' ``config.rope_parameters`` name it.

    ``rope_type`` (one of :data:`ROPE_TYPES`):

    - ``"default"``: theta_n = base^(-2n/D), no scaling.
    - ``"linear"``: position interpolation, theta_n / ``factor`` (Chen, Wong, Chen, Tian, "Extending Context Window
      of Large Language Models via Positional Interpolation", arXiv 2306.15595, 2023).
    - ``"dynamic"``: dynamic NTK-aware scaling (bloc97 and emozilla, 2023; described in Peng et al., YaRN, section
      3.3): the base grows with the length s = max(position id) + 1 once s exceeds ``max_position_embeddings`` M,
      base' = base * (factor * s / M - (factor - 1))^(D / (D - 2)). As in transformers, the frequencies grow with
      the longest sequence seen so far and return to the unscaled ones when a call is shorter than M again.
    - ``"yarn"``: YaRN (Peng, Quesnelle, Fan, Shippole, "YaRN: Efficient Context Window Extension of Large Language
      Models", ICLR 2024, arXiv 2309.00071): pairs that turn fewer than ``beta_slow`` times over the
      ``original_max_position_embeddings`` L0 are interpolated (theta_n / factor), those that turn more than
      ``beta_fast`` times are kept, with a linear ramp between (by pair index, its ends rounded outwards when
      ``truncate``); cos and sin are multiplied by ``attention_factor``, by default 0.1 ln(factor) + 1 (or the
      ratio of that expression at ``mscale`` and ``mscale_all_dim`` when both are set). Without ``factor`` it is
      ``max_position_embeddings / original_max_position_embeddings``.

    Fields a ``rope_type`` does not read must keep their defaults. :meth:`from_rope_parameters` reads a transformers
    config's dict.

    Example:
        >>> RopeScaling("linear", factor=2.0).attention_scaling
        1.0
        >>> round(RopeScaling("yarn", factor=4.0, original_max_position_embeddings=4096).attention_scaling, 4)
        1.1386
    """

    rope_type: str = "default"
    factor: float | None = None
    max_position_embeddings: int | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        check_instance(self.rope_type, "rope_type", str, expected=f"a rope type name (str), one of {ROPE_TYPES}")
        check_choice(self.rope_type, "rope_type", ROPE_TYPES)
        used = _USED_FIELDS[self.rope_type]
        for field in fields(self):
            if field.name != "rope_type" and field.name not in used and getattr(self, field.name) != field.default:
                raise ValueError(
                    f"{field.name} does not apply to rope_type {self.rope_type!r} (it reads "
                    f"{', '.join(used) or 'no other field'}), got {getattr(self, field.name)!r}"
                )
        if self.rope_type in ("linear", "dynamic") or self.factor is not None:
            if self.factor is None:
                raise ValueError(f"rope_type {self.rope_type!r} needs a factor, got None")
            check_positive(self.factor, "factor", expected="positive and finite", type_expected="a number")
        if self.max_position_embeddings is not None or self.rope_type == "dynamic":
            check_int(self.max_position_embeddings, "max_position_embeddings", min=1)
        if self.rope_type == "yarn":
            check_int(self.original_max_position_embeddings, "original_max_position_embeddings", min=1)
            if self.factor is None and self.max_position_embeddings is None:
                raise ValueError(
                    "rope_type 'yarn' needs a factor, or max_position_embeddings to take it as "
                    "max_position_embeddings / original_max_position_embeddings; got neither"
                )
            for name in ("beta_fast", "beta_slow"):
                check_positive(getattr(self, name), name, expected="positive and finite", type_expected="a number")
            if self.attention_factor is not None:
                check_positive(self.attention_factor, "attention_factor", type_expected="a number")
            for name in ("mscale", "mscale_all_dim"):
                if getattr(self, name) is not None:
                    check_float(getattr(self, name), name, type_expected="a number or None")
            check_bool(self.truncate, "truncate")

    @classmethod
    def from_rope_parameters(
        cls, rope_parameters: Mapping[str, Any] | None, max_position_embeddings: int | None = None
    ) -> RopeScaling:
        """The scaling of a transformers config: ``config.rope_parameters`` and ``config.max_position_embeddings``.

        Reads ``rope_type`` (or the legacy ``type``; ``"default"`` when absent) and the keys that type uses, with
        transformers' defaults (YaRN: ``original_max_position_embeddings`` = ``max_position_embeddings``,
        ``beta_fast`` 32 and ``beta_slow`` 1 also for a 0 or None, ``truncate`` True); other keys (``rope_theta``,
        ``mrope_section``...) are not scaling and are ignored. A ``partial_rotary_factor`` other than 1 is refused.

        Raises:
            ValueError: for a rope type outside :data:`ROPE_TYPES` (named in the message) or bad values.
            TypeError: when ``rope_parameters`` is not a mapping.
        """
        if rope_parameters is None:
            return cls()
        check_instance(rope_parameters, "rope_parameters", Mapping, expected="a mapping (a config's rope_parameters)")
        rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_parameters['rope_type'] must be one of {ROPE_TYPES} (the RoPE scalings visionpe reproduces), "
                f"got {rope_type!r}"
            )
        partial = rope_parameters.get("partial_rotary_factor", 1.0)
        if partial not in (None, 1, 1.0):
            raise ValueError(
                f"rope_parameters['partial_rotary_factor'] must be 1 (every pair rotates), got {partial!r}"
            )
        kwargs: dict[str, Any] = {}
        if rope_type in ("linear", "dynamic", "yarn"):
            kwargs["factor"] = rope_parameters.get("factor")
        if rope_type in ("dynamic", "yarn"):
            kwargs["max_position_embeddings"] = max_position_embeddings
        if rope_type == "yarn":
            kwargs.update(
                original_max_position_embeddings=rope_parameters.get(
                    "original_max_position_embeddings", max_position_embeddings
                ),
                beta_fast=rope_parameters.get("beta_fast") or 32.0,
                beta_slow=rope_parameters.get("beta_slow") or 1.0,
                attention_factor=rope_parameters.get("attention_factor"),
                mscale=rope_parameters.get("mscale"),
                mscale_all_dim=rope_parameters.get("mscale_all_dim"),
                truncate=rope_parameters.get("truncate", True),
            )
        return cls(rope_type, **kwargs)

    @property
    def yarn_factor(self) -> float:
        """YaRN's scale: ``factor``, or ``max_position_embeddings / original_max_position_embeddings``."""
        if self.factor is not None:
            return float(self.factor)
        return self.max_position_embeddings / self.original_max_position_embeddings

    @property
    def attention_scaling(self) -> float:
        """The factor on cos and sin: YaRN's attention factor, 1 for the other types."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return float(
                _yarn_mscale(self.yarn_factor, self.mscale) / _yarn_mscale(self.yarn_factor, self.mscale_all_dim)
            )
        return _yarn_mscale(self.yarn_factor)

    def inverse_frequencies(
        self,
        base: float,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        seq_len: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """theta_n, (head_dim // 2,), of this scaling, in ``dtype`` on ``device``.

        ``seq_len`` (dynamic NTK only): the length s the base is grown for, a 0-d tensor; None for the initial,
        unscaled frequencies. The fp32 values are transformers' expressions, bit for bit.
        """
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(dtype) / head_dim
        kind = self.rope_type
        if kind == "default":
            return 1.0 / (base**exponent)
        if kind == "linear":
            inv_freq = 1.0 / (base**exponent)
            inv_freq /= self.factor
            return inv_freq
        if kind == "dynamic":
            limit, factor = self.max_position_embeddings, self.factor
            if seq_len is None:
                length: Any = limit
            else:
                length = torch.maximum(seq_len, torch.tensor(limit, dtype=seq_len.dtype, device=seq_len.device))
            grown = base * ((factor * length / limit) - (factor - 1)) ** (head_dim / (head_dim - 2))
            if isinstance(grown, torch.Tensor):
                grown = grown.to(device=exponent.device, dtype=torch.promote_types(grown.dtype, dtype))
            return 1.0 / (grown**exponent)
        # YaRN
        factor, original = self.yarn_factor, self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            # the pair index that turns `rotations` times over the original context
            return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # no zero-width ramp
        pos_freqs = base**exponent
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        ramp = torch.clamp((torch.arange(head_dim // 2, dtype=dtype, device=device) - low) / (high - low), 0, 1)
        keep = 1 - ramp  # 1: the pair keeps its frequency (extrapolates), 0: interpolated
        return interpolation * (1 - keep) + extrapolation * keep


def _table_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a buffer keeps after a move: its own if fp32 or wider, fp32 instead of a narrower one."""
    return dtype if dtype.is_floating_point and torch.finfo(dtype).bits >= 32 else torch.float32


def _compute_device() -> torch.device:
    """Where the tables are computed: the default device (as transformers computes its own), the CPU for meta."""
    device = torch.empty(0).device
    return torch.device("cpu") if device.type == "meta" else device


class MultimodalRotary(nn.Module):
    """cos/sin tables for multimodal position ids under a frequency allocation.

    Args:
        head_dim: D, the rotated channels per head (even).
        base: RoPE base theta (Qwen2-VL/2.5-VL checkpoints use 1e6, Qwen3-VL 5e6).
        allocation: an :class:`Allocation` or a name from ``ALLOCATIONS`` (``chunked``, ``interleaved``,
            ``lta``, ``hope``, ``vrope``, ``single_axis``, ``head``).
        num_kv_heads: number of KV heads, needed by head-wise allocations.
        attention_scaling: factor on cos and sin; None (default) takes the scaling's (YaRN's attention factor, 1
            otherwise). A YaRN scaling takes its own (``attention_factor`` overrides it), not this argument.
        rope_scaling: the language model's context-extension scaling, a :class:`RopeScaling` or a dict of its
            fields (``{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}``); None is
            ``"default"``. It changes theta_n for every allocation alike: pair n (or, for head-wise allocations,
            frequency n of every head) turns by the scaled theta_n times its mixed position.
        **allocation_kwargs: options of a named allocation, e.g. ``mrope_section=(16, 24, 24)``.

    The buffers ``inv_freq`` and ``mix`` are not persistent (they are no state-dict entries) and are recomputed from
    these arguments whenever the module is moved (``.to()``, ``.half()``, ``.to_empty()``): a rotary built on the
    meta device, then materialised with ``to_empty``, holds the right tables without a load step. Dynamic NTK keeps
    transformers' state (the longest length seen) across moves; :meth:`reset_parameters` starts it afresh.

    Example:
        >>> rot = MultimodalRotary(8, base=10000.0, allocation="chunked", mrope_section=(2, 1, 1))
        >>> cos, sin = rot(torch.zeros(3, 2, 5, dtype=torch.long))
        >>> tuple(cos.shape), bool((cos == 1).all())
        ((2, 5, 8), True)
    """

    def __init__(
        self,
        head_dim: int,
        *,
        base: float = 10000.0,
        allocation: str | Allocation = "chunked",
        num_kv_heads: int | None = None,
        attention_scaling: float | None = None,
        rope_scaling: RopeScaling | Mapping[str, Any] | None = None,
        **allocation_kwargs: Any,
    ) -> None:
        super().__init__()
        check_int(head_dim, "head_dim", min=2, expected="a positive even int")
        if head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int, got {head_dim!r}")
        check_float(base, "base", min=1, min_open=True)
        if rope_scaling is None:
            rope_scaling = RopeScaling()
        elif isinstance(rope_scaling, Mapping):
            unknown = sorted(set(rope_scaling) - {f.name for f in fields(RopeScaling)})
            if unknown:
                raise ValueError(
                    f"rope_scaling has unknown key(s) {unknown}; valid keys: {[f.name for f in fields(RopeScaling)]} "
                    "(RopeScaling.from_rope_parameters reads a transformers config's rope_parameters)"
                )
            rope_scaling = RopeScaling(**rope_scaling)
        check_instance(
            rope_scaling, "rope_scaling", RopeScaling, expected="a RopeScaling, a dict of its fields or None"
        )
        if rope_scaling.rope_type == "dynamic" and head_dim < 4:
            raise ValueError(
                f"dynamic NTK scaling grows the base by a power D / (D - 2): head_dim must be >= 4, got {head_dim}"
            )
        if attention_scaling is None:
            attention_scaling = rope_scaling.attention_scaling
        elif rope_scaling.rope_type == "yarn":
            raise ValueError(
                f"attention_scaling comes from the YaRN scaling ({rope_scaling.attention_scaling}); set "
                f"rope_scaling's attention_factor instead of attention_scaling={attention_scaling!r}"
            )
        check_positive(attention_scaling, "attention_scaling", expected="positive and finite", type_expected="a number")
        check_instance(allocation, "allocation", (str, Allocation), expected="a name or an Allocation")
        if isinstance(allocation, str):
            allocation = build_allocation(
                allocation, num_pairs=head_dim // 2, num_kv_heads=num_kv_heads, **allocation_kwargs
            )
        elif allocation_kwargs:
            raise ValueError(f"allocation_kwargs {list(allocation_kwargs)} apply to named allocations only")
        # Allocation checks its fields when it is built; again here, since its mix tensor can be changed in place.
        _check_mix(allocation.mix, "allocation.mix")
        check_bool(allocation.per_head, "allocation.per_head")
        if not allocation.per_head and allocation.mix.shape[0] != head_dim // 2:
            raise ValueError(
                f"allocation has {allocation.mix.shape[0]} pairs but head_dim={head_dim} has {head_dim // 2}"
            )
        self.head_dim, self.base, self.attention_scaling = head_dim, float(base), float(attention_scaling)
        self.rope_scaling = rope_scaling
        self.per_head = allocation.per_head
        # What the buffers are rebuilt from after a move (see _apply): fp32 tables held as plain attributes, the mix a
        # CPU copy (not the Allocation's tensor) and the frequencies computed where transformers computes its own.
        self._mix = allocation.mix.detach().to("cpu", torch.float32, copy=True)
        self._ntk_seq_len: torch.Tensor | None = None  # dynamic NTK: the longest length seen beyond the limit
        self._inv_freq_fp32 = self._frequencies(torch.float32, _compute_device())
        device = torch.empty(0).device  # the default device: the meta device inside `with torch.device("meta")`
        self.register_buffer("inv_freq", self._inv_freq_fp32.to(device), persistent=False)
        self.register_buffer("mix", self._mix.to(device), persistent=False)

    def _frequencies(self, dtype: torch.dtype, device) -> torch.Tensor:
        """theta_n under the scaling (dynamic NTK: for the longest length seen)."""
        return self.rope_scaling.inverse_frequencies(
            self.base, self.head_dim, dtype=dtype, device=device, seq_len=self._ntk_seq_len
        )

    def _rebuild_buffers(self) -> None:
        device = self.inv_freq.device
        inv_freq = self._inv_freq_fp32.to(device, _table_dtype(self.inv_freq.dtype))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("mix", self._mix.to(device, _table_dtype(self.mix.dtype)), persistent=False)

    def _apply(self, fn, *args, **kwargs):
        module = super()._apply(fn, *args, **kwargs)
        # Rebuilt after every move from the fp32 definitions: model.to(bfloat16) casts every floating buffer and the
        # tables stay fp32 (angles grow with position: bf16 inverse frequencies would cost radians at position 1e6,
        # as timm keeps its bands); to_empty() leaves uninitialised memory (meta-device loading), replaced here.
        # fp32 and wider tables keep the dtype they were moved to, as a cast of the fp32 values.
        self._rebuild_buffers()
        return module

    def reset_parameters(self) -> None:
        """Recompute the non-persistent buffers from the constructor's arguments, dynamic NTK back to its start.

        Moves already restore them (``to_empty`` included); this is the hook that meta-device initialisation
        (e.g. FSDP's, after ``to_empty``) calls on modules that hold buffers.
        """
        self._ntk_seq_len = None
        self._inv_freq_fp32 = self._frequencies(torch.float32, _compute_device())
        self._rebuild_buffers()

    def _update_dynamic(self, position_ids: torch.Tensor) -> None:
        """Dynamic NTK as transformers' ``dynamic_rope_update``: grow past the longest length seen, reset below M."""
        seq_len = position_ids.max() + 1
        limit = self.rope_scaling.max_position_embeddings
        grown = self._ntk_seq_len is not None
        if seq_len > (self._ntk_seq_len if grown else limit):
            self._ntk_seq_len = seq_len.detach()
            self._inv_freq_fp32 = self._frequencies(torch.float32, position_ids.device)
        elif grown and seq_len < limit:
            self._ntk_seq_len = None
            self._inv_freq_fp32 = self._frequencies(torch.float32, _compute_device())
        else:
            return
        self._rebuild_buffers()

    @staticmethod
    def _inv_freq(base: float, head_dim: int, dtype: torch.dtype = torch.float, device=None) -> torch.Tensor:
        # Same expression as transformers' default RoPE, so that the fp32 tables match it bit for bit.
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=dtype, device=device) / head_dim))

    @classmethod
    def from_scheme(cls, scheme: str, head_dim: int, *, base: float = 10000.0, **kwargs: Any) -> MultimodalRotary:
        """The rotary of a registered scheme, with its default allocation options (overridable in kwargs)."""
        entry = get_multimodal_scheme(scheme)
        options = {**entry.allocation_kwargs, **kwargs}
        return cls(head_dim, base=base, allocation=entry.allocation, **options)

    def angles(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Angles (B, L, D/2), or (B, H_kv, L, D/2) per head, from ids (3, B, L) or (B, L).

        fp64 for float64 ids (id * inv_freq with inv_freq computed in fp64: accurate at position 1e6 and exact for
        fractional steps of 2^-8 up to 2^44); fp32 for any other dtype (int64 ids are exact below 2^24). Under
        dynamic NTK scaling the frequencies first follow these ids' length (max id + 1), as transformers does.
        """
        position_ids = self._checked_ids(position_ids)
        if self.rope_scaling.rope_type == "dynamic":
            self._update_dynamic(position_ids)
        with torch.autocast(position_ids.device.type, enabled=False):
            if position_ids.dtype == torch.float64:
                # Fractional ids: positions, mix and frequencies in fp64 (V2PE's 2^-8 steps merge in fp32 above 2^16).
                inv_freq = self._frequencies(torch.float64, position_ids.device)
            else:
                inv_freq = self.inv_freq
            mixed = self._mixed_positions(position_ids)  # (B, L, P or H)
            if self.per_head:
                return mixed.transpose(1, 2).unsqueeze(-1) * inv_freq
            return mixed * inv_freq

    def _checked_ids(self, position_ids: torch.Tensor) -> torch.Tensor:
        """``position_ids`` as (R, B, L), R the rows the mix reads (3; 3K for K positions per token), after checking
        them: (B, L) ids stand on every row, and (3, B, L) ids for R = 3K on each axis's K rows (a token whose K
        positions are its own). ValueError for another shape, an empty one or non-finite floating ids."""
        check_tensor(position_ids, "position_ids", expected="a tensor")
        check_tensor(position_ids, "position_ids", dtype="real", expected="integer or floating point")
        rows = self.mix.shape[1]
        if position_ids.ndim == 2:
            position_ids = position_ids.unsqueeze(0).expand(rows, -1, -1)
        elif position_ids.ndim == 3 and position_ids.shape[0] == 3 and rows != 3:
            position_ids = position_ids.repeat_interleave(rows // 3, dim=0)  # t..t, h..h, w..w
        if position_ids.ndim != 3 or position_ids.shape[0] != rows or 0 in position_ids.shape:
            expected = "(3, B, L)" if rows == 3 else f"(3K, B, L) = ({rows}, B, L) for K = {rows // 3}, (3, B, L)"
            raise ValueError(f"position_ids must be {expected} or (B, L), non-empty, got {tuple(position_ids.shape)}")
        if (
            position_ids.is_floating_point()
            and not torch.compiler.is_compiling()  # no data-dependent branch in compiled or exported graphs
            and not torch.isfinite(position_ids).all()
        ):
            raise ValueError("position_ids must be finite, got NaN or inf")
        return position_ids

    def _mixed_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """(B, L, P or H): each pair's (or KV head's) position, the mix's weighted sum of the rows of checked ids
        (R, B, L); fp64 for float64 ids, else fp32."""
        if position_ids.dtype == torch.float64:
            pos, mix = position_ids.permute(1, 2, 0), self.mix.to(torch.float64)  # (B, L, R)
        else:
            pos, mix = position_ids.float().permute(1, 2, 0), self.mix
        # Elementwise product and sum rather than a matmul: exact for one-hot rows, no TF32.
        return (pos.unsqueeze(-2) * mix).sum(-1)

    def forward(
        self, position_ids: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (B, L, D) or (B, H_kv, L, D), fp32 unless ``dtype`` (a floating torch dtype) is given.

        The angles and tables are computed in fp32 (integer ids) or fp64 (float64 ids, see :meth:`angles`) whatever
        ``dtype`` is, with autocast off; only the finished cos and sin are cast (fp64 ones to fp32 when ``dtype``
        is None).
        """
        if dtype is not None:
            expected = "a floating point torch.dtype (e.g. torch.bfloat16) or None"
            check_instance(dtype, "dtype", torch.dtype, expected=expected)
            if not dtype.is_floating_point:
                raise ValueError(f"dtype must be a floating point torch.dtype or None, got {dtype}")
        phi = self.angles(position_ids)
        with torch.autocast(phi.device.type, enabled=False):
            emb = torch.cat((phi, phi), dim=-1)
            cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        if dtype is None and position_ids.dtype == torch.float64:
            dtype = torch.float32  # fp64 tables of float64 ids are an internal step: the default stays fp32
        if dtype is not None:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension, which must be even and non-empty."""
    check_tensor(x, "x", dtype="floating", expected="a floating point tensor")
    if x.ndim < 1 or x.shape[-1] < 2 or x.shape[-1] % 2:
        raise ValueError(
            f"x must have an even, non-zero last dimension (the two halves to rotate), got shape {tuple(x.shape)}"
        )
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_multimodal_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (B, H_q, L, D) and k (B, H_kv, L, D) by tables from :class:`MultimodalRotary`.

    Tables (B, L, D_r) apply to every head; per-head tables (B, H_kv, L, D_r) go to the KV heads directly
    and to query head g through KV head g // (H_q / H_kv). With D_r < D only the first D_r channels rotate.
    """
    for name, x in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_tensor(x, name, expected="a tensor")
        check_tensor(x, name, dtype="floating", expected="floating point")
    for name, x in (("q", q), ("k", k)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be (B, H, L, D), got {tuple(x.shape)}")
    if cos.shape != sin.shape or cos.ndim not in (3, 4):
        raise ValueError(
            f"cos and sin must share shape (B, L, D) or (B, H_kv, L, D), got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    batch, length, rotated = cos.shape[0], cos.shape[-2], cos.shape[-1]
    for name, x in (("q", q), ("k", k)):
        if x.shape[2] != length or batch not in (1, x.shape[0]) or rotated % 2 or rotated > x.shape[-1]:
            raise ValueError(
                f"{name} {tuple(x.shape)} does not fit tables {tuple(cos.shape)}: it needs L = {length} tokens, "
                f"batch {batch} (or tables of batch 1) and at least the {rotated} rotated channels (an even count)"
            )
    if cos.ndim == 3:
        cos_q = cos_k = cos.unsqueeze(1)
        sin_q = sin_k = sin.unsqueeze(1)
    else:
        if cos.shape[1] != k.shape[1] or q.shape[1] % k.shape[1]:
            raise ValueError(f"per-head tables have {cos.shape[1]} heads; k has {k.shape[1]} and q {q.shape[1]} heads")
        group = q.shape[1] // k.shape[1]
        cos_k, sin_k = cos, sin
        cos_q, sin_q = cos.repeat_interleave(group, dim=1), sin.repeat_interleave(group, dim=1)

    def rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        c, s = c.to(x.dtype), s.to(x.dtype)
        x_rot, x_pass = x[..., :rotated], x[..., rotated:]
        return torch.cat((x_rot * c + rotate_half(x_rot) * s, x_pass), dim=-1)

    return rotate(q, cos_q, sin_q), rotate(k, cos_k, sin_k)
