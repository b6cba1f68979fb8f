"""BAM in 2D: Bianchessi et al., "Bayesian Attention Mechanism: A Probabilistic Framework for Positional Encoding
and Context Length Extrapolation", 2025 (ArthurSBianchessi/BAM).

A generalized-Gaussian prior on where a query attends, with the parameters of the released ``AttentionPrior`` per
head: a shape beta_h, a log-scale sigma_h and a location l_h, read as mu_h = e^l_h - e^-l_h. Two forms:

- ``form="scale_outside"`` (default; the released ``models/bam.py``): b_h = -e^sigma_h (|d + mu_h| + 1e-5)^beta_h;
- ``form="scale_inside"`` (the released ``inference_models/bam.py``, the earlier training form):
  b_h = -(e^sigma_h |d + mu_h| + 1e-5)^beta_h.

They agree at beta = 1 and differ once beta is learned (the second makes the slope e^(beta sigma)). At init beta = 1,
e^sigma_h are the ALiBi slopes and mu_h = 0, so the bias is 2D ALiBi's up to a constant per row, which the softmax
cancels. As the released training script does, shape, scale and location are all learned by default, and one prior
serves every block (``per_layer=True`` gives each block its own, as the released ``global_positional_encoding=False``
does).

d is the distance of :mod:`~visionpe.bias.distance` (Euclidean by default). The released prior reads the signed
offset k - q of a causal language model, which is -d for every key it sees, so |k - q - mu| = |d + mu|: on a 1D grid
the causal half of this bias equals the released prior for any parameters (:meth:`BAM.load_released_prior` takes
its state dict). The 1e-5 keeps the gradient in beta finite at d = 0.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..base import check_layer
from ..checks import check_bool, check_choice, check_instance, check_positive
from ..registry import register_scheme
from .alibi2d import alibi_slopes
from .distance import DistanceKernelBias

__all__ = ["BAM", "BAM_FORMS"]

_EPS = 1e-5  # the released offset inside the power
#: where the scale enters: outside the power (the released default) or inside it (the released inference code)
BAM_FORMS = ("scale_outside", "scale_inside")
_PARAMETERS = ("shape", "scale", "loc")


@register_scheme("bam")
class BAM(DistanceKernelBias):
    """Generalized-Gaussian attention prior on 2D distances.

    Args:
        dim, num_heads, depth: model shape.
        distance: ``"euclidean"`` (default), ``"manhattan"`` or ``"axis"`` (see :mod:`visionpe.bias.distance`).
        form: ``"scale_outside"`` (default, the released training code) or ``"scale_inside"`` (the released
            inference code); see the module docstring.
        shape_init: beta at init (1: 2D ALiBi).
        learn_shape, learn_scale, learn_loc: which of beta, sigma and l are learned (all, as the released training
            script); the others are fixed buffers with their init values.
        per_layer: one prior per block instead of one for the model (the released default).

    The parameters ``shape``, ``scale`` (log scale) and ``loc`` have shape (layers, A, num_heads), layers = depth
    with ``per_layer`` else 1, A = 2 for ``distance="axis"`` else 1; they are in the state dict whether learned or
    not.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        distance: str = "euclidean",
        form: str = "scale_outside",
        shape_init: float = 1.0,
        learn_shape: bool = True,
        learn_scale: bool = True,
        learn_loc: bool = True,
        per_layer: bool = False,
    ) -> None:
        super().__init__(dim, num_heads, depth, distance)
        self.form = check_choice(form, "form", BAM_FORMS)
        self.shape_init = float(check_positive(shape_init, "shape_init"))
        self.per_layer = check_bool(per_layer, "per_layer")
        learn = {
            "shape": check_bool(learn_shape, "learn_shape"),
            "scale": check_bool(learn_scale, "learn_scale"),
            "loc": check_bool(learn_loc, "learn_loc"),
        }
        for name, value in self._initial_values().items():
            if learn[name]:
                setattr(self, name, nn.Parameter(value))
            else:  # persistent: a checkpoint loads whether the value was learned or not
                self.register_buffer(name, value)

    def _initial_values(self) -> dict[str, torch.Tensor]:
        shape = (self.depth if self.per_layer else 1, self.num_axes, self.num_heads)
        values = {"shape": self.shape_init, "scale": alibi_slopes(self.num_heads).log(), "loc": 0.0}
        return {name: torch.as_tensor(value).float().expand(shape).clone() for name, value in values.items()}

    def fixed_buffers(self) -> dict[str, torch.Tensor]:
        return {name: value for name, value in self._initial_values().items() if name in self._buffers}

    def layer_parameter(self, param: torch.Tensor, layer: int, dtype: torch.dtype) -> torch.Tensor:
        """(A, h, 1) values of block ``layer`` (the shared prior's unless ``per_layer``), in ``dtype``."""
        return super().layer_parameter(param.expand(self.depth, -1, -1), layer, dtype)

    def kernel(self, distances: torch.Tensor, layer: int) -> torch.Tensor:
        beta, sigma, loc = (self.layer_parameter(getattr(self, n), layer, distances.dtype) for n in _PARAMETERS)
        shifted = (distances + (loc.exp() - (-loc).exp())).abs()
        if self.form == "scale_outside":
            return -sigma.exp() * (shifted + _EPS) ** beta
        return -((sigma.exp() * shifted + _EPS) ** beta)

    @torch.no_grad()
    def load_released_prior(self, state_dict: Mapping[str, torch.Tensor], layer: int | None = None) -> None:
        """Copy the state dict of a released ``AttentionPrior`` (``shape``, ``scale``, ``loc``, each (1, h, 1, 1)) into
        this prior: the shared one (``layer=None``; every block's with ``per_layer``) or block ``layer``'s."""
        check_instance(state_dict, "state_dict", Mapping, expected="a mapping with 'shape', 'scale' and 'loc'")
        missing = [name for name in _PARAMETERS if name not in state_dict]
        if missing:
            raise ValueError(f"state_dict must hold {list(_PARAMETERS)}, missing {missing}")
        if layer is not None and not self.per_layer:
            raise ValueError(f"layer={layer} needs per_layer=True: this BAM has one prior for every block")
        rows = slice(None) if layer is None else slice(check_layer(layer, self.depth, "BAM"), layer + 1)
        values = {name: torch.as_tensor(state_dict[name]) for name in _PARAMETERS}
        for name, value in values.items():  # all checked before any is written
            if value.numel() != self.num_heads:
                raise ValueError(
                    f"state_dict[{name!r}] must hold one value per head ({self.num_heads}), got shape "
                    f"{tuple(value.shape)}"
                )
        for name, value in values.items():
            getattr(self, name)[rows] = value.reshape(1, 1, self.num_heads).to(getattr(self, name))
