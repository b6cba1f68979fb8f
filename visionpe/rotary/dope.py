"""DoPE, training-free band removal: Xiong et al., "DoPE: Denoising Rotary Position Embedding", arXiv 2511.09146,
2025.

DoPE reads the rotary frequency bands whose attention contribution has a low truncated matrix entropy (near rank one,
which the paper links to attention sinks) as noise, and removes them at inference ("by-parts": those bands stop
rotating). The paper's exact entropy, its truncation rank and its threshold were not available, so this module is
the library's reading of the mechanism, for vision models with one linear rotary scheme (RoPE-Axial, RoPE-Mixed,
STRING, ...):

- The contribution of rotary pair j of head h in block l to the attention logits of an image is the T x T matrix
  C_j = Q_j K_j^T, with Q_j, K_j (T x 2) the pair's rotated queries and keys over the image's T tokens (prefix
  included). Its rank is at most 2, so the entropy truncated to the top r = 2 singular values is exact:
  p_i = sigma_i^2 / (sigma_1^2 + sigma_2^2) (the spectrum of C_j C_j^T normalised by its trace) and
  H_j = -(p_1 ln p_1 + p_2 ln p_2) / ln 2 in [0, 1]: 0 for a rank-one contribution, 1 for two equal singular
  values; 0 for a pair that contributes nothing. sigma_i^2 are the eigenvalues of the 2 x 2 product
  (Q_j^T Q_j)(K_j^T K_j), so no T x T matrix is formed.
- A band's score is H_j averaged over the images of a calibration batch at the test grid, under the extrapolation
  mode the model runs with; the scores are laid out like the frequency matrix, (depth, num_heads, ndim, P), each
  pair's score on every axis it reads (one axis per pair for an axial spectrum), NaN where it reads none.
- Bands scoring below ``threshold`` (default 0.1, the library's choice) are selected, and removed by a zero
  frequency multiplier: the scheme's ``band_multiplier`` buffer, which
  :meth:`~visionpe.rotary.scaling.Extrapolation.adjust_frequencies` applies to every table it builds. A selected
  pair then keeps q and k unrotated (angle 0) in that layer and head. The multiplier is an evaluation-time setting,
  not saved with the weights; :func:`clear_band_mask` removes it.

The paper's other variants (removing whole heads, "by-all", and the Gaussian reparameterisation) are not provided.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..attention import PosAttention
from ..base import RotaryPositionEncoding
from ..checks import check_float
from ..interfaces.rotary import split_heads
from .base import LinearRotary

__all__ = ["band_entropy", "band_scores", "select_bands", "set_band_mask", "clear_band_mask"]


def band_entropy(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Normalised entropy of each rotary pair's logit contribution Q_j K_j^T (see the module docstring).

    Args:
        q, k: (..., T, head_dim) rotated queries and keys (pairs interleaved: channels 2j, 2j + 1), e.g.
            (B, num_heads, T, head_dim).

    Returns:
        (..., head_dim // 2) float32 entropies in [0, 1].

    Example:
        >>> q = torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]])  # every query along one direction: rank one
        >>> band_entropy(q, torch.randn(3, 2))
        tensor([0.])
        >>> band_entropy(torch.eye(2), torch.eye(2))  # two equal singular values
        tensor([1.])
    """
    for name, value in (("q", q), ("k", k)):
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {getattr(value, 'dtype', type(value))}")
    if q.ndim < 2 or q.shape != k.shape or q.shape[-1] % 2:
        raise ValueError(
            f"q and k must have the same shape (..., T, head_dim) with an even head_dim, got {tuple(q.shape)} and "
            f"{tuple(k.shape)}"
        )
    with torch.autocast(q.device.type, enabled=False):
        pairs = q.shape[-1] // 2
        qp = q.double().unflatten(-1, (pairs, 2))
        kp = k.double().unflatten(-1, (pairs, 2))
        gram_q = torch.einsum("...tpi,...tpj->...pij", qp, qp)  # (..., P, 2, 2)
        gram_k = torch.einsum("...tpi,...tpj->...pij", kp, kp)
        product = gram_q @ gram_k  # its eigenvalues are the squared singular values of Q_j K_j^T
        trace = product.diagonal(dim1=-2, dim2=-1).sum(-1)
        det = torch.linalg.det(gram_q) * torch.linalg.det(gram_k)
        gap = (trace.square() / 4 - det).clamp_min(0).sqrt()
        eig = torch.stack((trace / 2 + gap, (trace / 2 - gap).clamp_min(0)), -1)
        p = eig / torch.where(trace > 0, trace, 1.0)[..., None]
        terms = torch.where(p > 0, -p * torch.log(torch.where(p > 0, p, 1.0)), 0.0)
        return (terms.sum(-1) / math.log(2)).clamp(0, 1).float()


def _linear_rotary(model: nn.Module) -> LinearRotary:
    """The one rotary scheme of ``model`` (or ``model`` itself), which must be a :class:`LinearRotary`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    schemes = [m for m in model.modules() if isinstance(m, RotaryPositionEncoding)]
    if len(schemes) != 1:
        raise ValueError(
            f"DoPE needs a model with exactly one rotary scheme (its bands are scored and masked), "
            f"got {len(schemes)}: {[type(s).__name__ for s in schemes]}"
        )
    scheme = schemes[0]
    if not isinstance(scheme, LinearRotary):
        raise ValueError(
            f"DoPE masks rotary frequency bands, which {type(scheme).__name__} does not have (it needs a scheme "
            "whose angle is linear in position: a LinearRotary such as rope_axial, rope_mixed or string_*)"
        )
    return scheme


@torch.no_grad()
def band_scores(model: nn.Module, images: torch.Tensor, **forward_kwargs) -> torch.Tensor:
    """Mean entropy (:func:`band_entropy`) of every (layer, head, axis, band) on the calibration batch ``images``.

    The model runs once on ``images`` (at the test grid, in eval mode, without any band mask set), and each
    :class:`~visionpe.attention.PosAttention` block's rotated queries and keys are scored on the way.

    Args:
        model: a visionpe model (ViT or video ViT) with one :class:`~visionpe.rotary.base.LinearRotary` scheme.
        images: the batch the model takes, e.g. (B, C, H, W).
        **forward_kwargs: passed to ``model(images, ...)`` (e.g. ``depth=`` for RGB-D STRING).

    Returns:
        (depth, num_heads, ndim, head_dim // 2) float32 scores in [0, 1], laid out like the scheme's frequency
        matrix; NaN where a pair does not read the axis (and for blocks the forward did not reach).
    """
    scheme = _linear_rotary(model)
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"images must be a tensor batch, got {type(images).__name__}")
    blocks = [m for m in model.modules() if isinstance(m, PosAttention)]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no PosAttention block to score (build it with visionpe)")
    pairs = scheme.head_dim // 2
    sums = torch.zeros(scheme.depth, scheme.num_heads, pairs, dtype=torch.float64)
    counts = torch.zeros(scheme.depth, dtype=torch.float64)

    def score(module: PosAttention, args: tuple, kwargs: dict) -> None:
        x, pos = args[0] if args else kwargs["x"], kwargs.get("pos")
        if pos is None or not pos.rotary:
            return
        batch = x.shape[0]
        q, k, _ = split_heads(module.qkv(x), batch, module.num_heads).unbind(0)
        q, k = pos.rotation(module.layer).rotate(torch.stack((module.q_norm(q), module.k_norm(k)))).unbind(0)
        sums[module.layer] += band_entropy(q, k).double().sum(0).cpu()
        counts[module.layer] += batch

    multiplier, training = scheme.band_multiplier, model.training
    scheme.band_multiplier = None  # the bands as they are, not as a previous selection left them
    handles = [block.register_forward_pre_hook(score, with_kwargs=True) for block in blocks]
    try:
        model.eval()
        model(images, **forward_kwargs)
    finally:
        for handle in handles:
            handle.remove()
        scheme.band_multiplier = multiplier
        model.train(training)
    means = (sums / counts.clamp_min(1)[:, None, None]).float()
    means[counts == 0] = float("nan")
    freqs = scheme.frequencies().detach().cpu().expand(scheme.depth, scheme.num_heads, -1, -1)
    scores = means[:, :, None, :].expand_as(freqs)
    return torch.where(freqs != 0, scores, float("nan"))


def select_bands(
    model: nn.Module, images: torch.Tensor, threshold: float = 0.1, *, apply: bool = True, **forward_kwargs
) -> torch.Tensor:
    """DoPE by-parts: the bands whose mean contribution entropy (:func:`band_scores`) is below ``threshold``.

    Args:
        model: a visionpe model with one linear rotary scheme (see :func:`band_scores`).
        images: the calibration batch, at the test resolution.
        threshold: entropy bound in [0, 1] (the library's default 0.1; 0 selects nothing).
        apply: set the mask on the model (:func:`set_band_mask`); otherwise only return it.
        **forward_kwargs: passed to the model's forward.

    Returns:
        (depth, num_heads, ndim, head_dim // 2) bool mask, True for a removed (frequency 0) band.
    """
    threshold = check_float(threshold, "threshold", min=0, max=1)
    if not isinstance(apply, bool):
        raise TypeError(f"apply must be a bool, got {type(apply).__name__} ({apply!r})")
    mask = band_scores(model, images, **forward_kwargs) < threshold  # NaN compares False
    if apply:
        set_band_mask(model, mask)
    return mask


def set_band_mask(model: nn.Module, mask: torch.Tensor) -> None:
    """Remove the bands ``mask`` selects from the model's rotary scheme: their frequency multiplier is 0.

    ``mask``: bool, broadcastable to (depth, num_heads, ndim, head_dim // 2) (e.g. from :func:`select_bands`). A mask
    that selects nothing clears the multiplier, so that the model is exactly as before.
    """
    scheme = _linear_rotary(model)
    shape = (scheme.depth, scheme.num_heads, scheme.ndim, scheme.head_dim // 2)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor of shape {shape}, got {getattr(mask, 'dtype', type(mask))}")
    if mask.ndim != 4 or any(m not in (1, s) for m, s in zip(mask.shape, shape, strict=True)):
        raise ValueError(f"mask must broadcast to (depth, num_heads, ndim, pairs) = {shape}, got {tuple(mask.shape)}")
    if not bool(mask.any()):
        clear_band_mask(scheme)
        return
    device = scheme.frequencies().device
    scheme.band_multiplier = (~mask).to(device=device, dtype=torch.float32).expand(shape).contiguous()


def clear_band_mask(model: nn.Module) -> None:
    """Remove any band mask from the model's rotary scheme (its frequencies as trained)."""
    _linear_rotary(model).band_multiplier = None
