"""Frequency allocation: which rotary pair (or which attention head) reads which position row.

Huang et al., "Revisiting Multimodal Positional Encoding in Vision-Language Models", ICLR 2026: after the
position design has produced rows (t, h, w), an allocation decides what each frequency sees. Here an
allocation is a mixing matrix ``mix`` with one row per pair (or per KV head) and one column per position
row: pair n rotates by phi_n = theta_n * sum_a mix[n, a] * p_a, theta_n = base^(-2n/D).

- one-hot rows: the usual choice (M-RoPE chunks, MRoPE-I interleave, VideoRoPE LTA);
- zero rows: zero frequency, the identity (HoPE's temporal pairs, MHRoPE's unassigned heads);
- (-1, 1, 1): VRoPE's fourth diagonal variant, formed from the three rows it ships.

PPE's split allocation is the one multi-position allocation: its mix has 3K columns, one per row of ids
(3K, B, L) that carry K representatives' (t, h, w) (:class:`~visionpe.multimodal.ppe.PPERotary` reads them).

The tables are built on the CPU whatever the default device (also inside a meta-device context); the rotary that
reads them moves them with its other buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..checks import check_bool, check_instance, check_int, check_tensor, is_int

__all__ = [
    "Allocation",
    "ALLOCATIONS",
    "chunked_allocation",
    "interleaved_allocation",
    "lta_allocation",
    "hope_allocation",
    "vrope_allocation",
    "single_axis_allocation",
    "head_allocation",
    "ppe_split_allocation",
    "build_allocation",
]

# Allocations are small tables built on the CPU, whatever the default device: also inside `with torch.device("meta")`
# (a model built for meta-device loading), where their data-dependent steps (nonzero, repeat_interleave) cannot run.
_CPU = torch.device("cpu")


@dataclass(frozen=True)
class Allocation:
    """``mix`` (P, 3) per rotary pair, or (H_kv, 3) per KV head when ``per_head``; entries weight rows t, h, w.

    A multi-position allocation (PPE) has ``mix`` (P, 3K): its columns weight the rows (t_1..t_K, h_1..h_K,
    w_1..w_K) of ids that carry K positions per token.
    """

    mix: torch.Tensor
    per_head: bool = False

    def __post_init__(self) -> None:
        _check_mix(self.mix, multi_position=True)
        check_bool(self.per_head, "per_head")

    @property
    def positions_per_token(self) -> int:
        """K: the number of (t, h, w) positions each token carries (1 for every allocation but PPE's split)."""
        return self.mix.shape[1] // 3

    def axis_of(self) -> list[int]:
        """Row read by each pair (or head): its one-hot column, -1 for zero rows, -2 for mixed rows."""
        out = []
        for row in self.mix.tolist():
            nonzero = [a for a, w in enumerate(row) if w != 0]
            out.append(-1 if not nonzero else nonzero[0] if len(nonzero) == 1 and row[nonzero[0]] == 1 else -2)
        return out


def _check_mix(mix: torch.Tensor, name: str = "mix", multi_position: bool = False) -> None:
    """Raise unless ``mix`` is a real (P, 3) tensor, P >= 1, of finite weights: one row per pair (or head).

    ``multi_position``: also accept (P, 3K), K >= 1 (PPE's rows of K positions per token).
    """
    check_tensor(mix, name, expected="a (P, 3) tensor of finite weights")
    check_tensor(mix, name, dtype="real", expected="an integer or floating point tensor")
    columns_ok = mix.ndim == 2 and (
        mix.shape[1] % 3 == 0 and mix.shape[1] >= 3 if multi_position else mix.shape[1] == 3
    )
    if mix.ndim != 2 or mix.shape[0] < 1 or not columns_ok:
        allowed = " (or (P, 3K) for K positions per token)" if multi_position else ""
        hint = (
            "; an allocation of K > 1 positions per token (PPE's split) needs visionpe.multimodal.PPERotary"
            if not multi_position and mix.ndim == 2 and mix.shape[1] % 3 == 0 and mix.shape[1] > 3
            else ""
        )
        raise ValueError(
            f"{name} must be (P, 3), one row per pair (or (H_kv, 3), one per KV head) and at least one, with one "
            f"column per row t, h, w{allowed}; got {tuple(mix.shape)}{hint}"
        )
    if mix.is_floating_point() and mix.device.type != "meta" and not torch.isfinite(mix).all():
        raise ValueError(f"{name} must hold finite weights, got NaN or inf in rows {_bad_rows(mix)}")


def _bad_rows(mix: torch.Tensor) -> list[int]:
    return (~torch.isfinite(mix)).any(-1).nonzero()[:, 0].tolist()


def _check_section(section: Sequence[int], name: str = "mrope_section") -> tuple[int, int, int]:
    if not isinstance(section, (list, tuple)) or len(section) != 3 or not all(is_int(s) and s >= 0 for s in section):
        raise ValueError(f"{name} must be three non-negative ints (t, h, w), got {section!r}")
    return tuple(section)


def _check_pairs(num_pairs: int) -> None:
    check_int(num_pairs, "num_pairs", min=1)


def _one_hot(axes: torch.Tensor) -> torch.Tensor:
    """(P,) row index per pair, -1 for zero frequency -> (P, 3) mixing matrix."""
    mix = torch.zeros(len(axes), 3, device=_CPU)
    keep = axes >= 0
    mix[keep.nonzero()[:, 0], axes[keep]] = 1.0
    return mix


def chunked_allocation(num_pairs: int, mrope_section: Sequence[int] = (16, 24, 24)) -> Allocation:
    """Qwen2-VL M-RoPE: pairs [0, s_t) -> t, [s_t, s_t + s_h) -> h, the rest -> w (time gets the highest)."""
    _check_pairs(num_pairs)
    section = _check_section(mrope_section)
    if sum(section) != num_pairs:
        raise ValueError(f"mrope_section {section} must sum to num_pairs={num_pairs} (head_dim // 2)")
    axes = torch.repeat_interleave(torch.arange(3, device=_CPU), torch.tensor(section, device=_CPU))
    return Allocation(_one_hot(axes))


def interleaved_allocation(num_pairs: int, mrope_section: Sequence[int] = (24, 20, 20)) -> Allocation:
    """Qwen3-VL MRoPE-I: pair n -> h if n % 3 == 1 and n < 3 s_h; -> w if n % 3 == 2 and n < 3 s_w; else t."""
    _check_pairs(num_pairs)
    section = _check_section(mrope_section)
    if sum(section) != num_pairs:
        raise ValueError(f"mrope_section {section} must sum to num_pairs={num_pairs} (head_dim // 2)")
    # The h pairs are 1, 4, ..., 3 s_h - 2 and the w pairs 2, 5, ..., 3 s_w - 1: all of them exist (so that each
    # axis gets exactly its section) iff 3 s_h - 2 <= P - 1 and 3 s_w - 1 <= P - 1.
    max_h, max_w = (num_pairs + 1) // 3, num_pairs // 3
    if section[1] > max_h or section[2] > max_w:
        raise ValueError(
            f"mrope_section {section} does not fit the interleaved layout of num_pairs={num_pairs}: it needs "
            f"3 * s_h <= num_pairs + 1 and 3 * s_w <= num_pairs, i.e. s_h <= {max_h} and s_w <= {max_w}, "
            f"got s_h={section[1]}, s_w={section[2]}"
        )
    n = torch.arange(num_pairs, device=_CPU)
    axes = torch.zeros(num_pairs, dtype=torch.long, device=_CPU)
    axes[(n % 3 == 1) & (n < 3 * section[1])] = 1
    axes[(n % 3 == 2) & (n < 3 * section[2])] = 2
    return Allocation(_one_hot(axes))


def lta_allocation(num_pairs: int, mrope_section: Sequence[int] = (16, 24, 24)) -> Allocation:
    """VideoRoPE LTA: the first s_h + s_w pairs alternate h (even n) and w (odd n); the last s_t pairs -> t."""
    _check_pairs(num_pairs)
    section = _check_section(mrope_section)
    if sum(section) != num_pairs or section[1] != section[2]:
        raise ValueError(f"mrope_section {section} must sum to num_pairs={num_pairs} with s_h == s_w for LTA")
    spatial = section[1] + section[2]
    n = torch.arange(num_pairs, device=_CPU)
    axes = torch.where(n < spatial, 1 + n % 2, torch.zeros_like(n))
    return Allocation(_one_hot(axes))


def hope_allocation(num_pairs: int, mrope_section: Sequence[int] = (16, 24, 24)) -> Allocation:
    """HoPE: LTA with the temporal (lowest-frequency) pairs at zero frequency, the identity."""
    mix = lta_allocation(num_pairs, mrope_section).mix.clone()
    mix[:, 0] = 0.0
    return Allocation(mix)


def vrope_allocation(num_pairs: int) -> Allocation:
    """VRoPE: pair n reads diagonal variant n % 4; variants 0-2 are rows t, h, w and variant 3 is h + w - t."""
    _check_pairs(num_pairs)
    variants = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0], [-1.0, 1.0, 1.0]], device=_CPU)
    return Allocation(variants[torch.arange(num_pairs, device=_CPU) % 4])


def single_axis_allocation(num_pairs: int) -> Allocation:
    """1-D RoPE: every pair reads row t (the rows are equal for 1-D designs such as V2PE)."""
    _check_pairs(num_pairs)
    return Allocation(_one_hot(torch.zeros(num_pairs, dtype=torch.long, device=_CPU)))


def head_allocation(num_kv_heads: int, mrope_section: Sequence[int] | None = None) -> Allocation:
    """MHRoPE: ``mrope_section`` counts KV heads per axis; each head uses the full spectrum of its axis.

    The default splits the heads 1/4, 3/8, 3/8 ((2, 3, 3) for 8 heads); heads beyond the section sum get no
    rotation (NoPE).
    """
    check_int(num_kv_heads, "num_kv_heads", min=1)
    if mrope_section is None:
        temporal = num_kv_heads // 4
        height = (num_kv_heads - temporal) // 2
        mrope_section = (temporal, height, num_kv_heads - temporal - height)
    section = _check_section(mrope_section)
    if sum(section) > num_kv_heads:
        raise ValueError(f"mrope_section {section} assigns {sum(section)} heads but there are {num_kv_heads}")
    axes = torch.cat(
        [
            torch.repeat_interleave(torch.arange(3, device=_CPU), torch.tensor(section, device=_CPU)),
            torch.full((num_kv_heads - sum(section),), -1, device=_CPU),
        ]
    )
    return Allocation(_one_hot(axes), per_head=True)


def ppe_split_allocation(
    num_pairs: int, mrope_section: Sequence[int] = (16, 24, 24), num_representatives: int = 8
) -> Allocation:
    """PPE (Huang et al., ICLR 2026): each M-RoPE section is cut into K sub-bands, sub-band k of axis a reading
    row a K + k of ids (3K, B, L) ordered (t_1..t_K, h_1..h_K, w_1..w_K).

    (16, 24, 24), K = 8 gives sections [2] * 8 + [3] * 8 + [3] * 8: pair n < 16 reads t of representative n // 2,
    n < 40 h of (n - 16) // 3, the rest w of (n - 40) // 3. When K does not divide every section the released code
    falls back to sections of one pair each, pair n reading row n mod 3K (for 64 pairs and K = 32: t and h of the
    32 representatives, no w at all); this is reproduced. K = 1 is M-RoPE's chunked allocation.
    """
    _check_pairs(num_pairs)
    section = _check_section(mrope_section)
    check_int(num_representatives, "num_representatives", min=1)
    if sum(section) != num_pairs:
        raise ValueError(f"mrope_section {section} must sum to num_pairs={num_pairs} (head_dim // 2)")
    k = num_representatives
    if all(s % k == 0 for s in section):
        # section i of the sub-band list reads row i; sub-band k of axis a is the a K + k-th section
        widths = torch.tensor([s // k for s in section for _ in range(k)], device=_CPU)
        rows = torch.repeat_interleave(torch.arange(3 * k, device=_CPU), widths)
    else:
        rows = torch.arange(num_pairs, device=_CPU) % (3 * k)
    mix = torch.zeros(num_pairs, 3 * k, device=_CPU)
    mix[torch.arange(num_pairs, device=_CPU), rows] = 1.0
    return Allocation(mix)


ALLOCATIONS: dict[str, Callable[..., Allocation]] = {
    "chunked": chunked_allocation,
    "interleaved": interleaved_allocation,
    "lta": lta_allocation,
    "hope": hope_allocation,
    "vrope": vrope_allocation,
    "single_axis": single_axis_allocation,
    "head": head_allocation,
    "ppe_split": ppe_split_allocation,
}


def build_allocation(name: str, *, num_pairs: int, num_kv_heads: int | None = None, **kwargs) -> Allocation:
    """Allocation ``name`` from :data:`ALLOCATIONS` for ``num_pairs`` pairs (``head`` needs ``num_kv_heads``)."""
    check_instance(name, "name", str, expected=f"an allocation name (str), one of {', '.join(ALLOCATIONS)}")
    if name not in ALLOCATIONS:
        raise ValueError(f"unknown allocation {name!r}; valid names: {', '.join(ALLOCATIONS)}")
    if name == "head":
        if num_kv_heads is None:
            raise ValueError("allocation 'head' (MHRoPE) needs num_kv_heads")
        return head_allocation(num_kv_heads, **kwargs)
    return ALLOCATIONS[name](num_pairs, **kwargs)
