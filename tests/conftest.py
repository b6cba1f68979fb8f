"""Shared fixtures, and the scheme lists of the generic tests, read from the registry.

A scheme that is registered is covered by every generic test (forward/backward, shapes, dtypes, hostile input,
export, compile, determinism, checkpoints, numerics, properties, patch dropout, models) without editing them: the
lists below are derived from :func:`visionpe.list_schemes` and from attributes of the scheme classes when the test
modules are collected. Four test modules register a throwaway scheme of each kind a contributor adds, imported here
so that it is in its registry before any test module is collected (and removed when the run ends):
``tests/test_custom_scheme.py`` a rotary scheme, ``tests/test_custom_bias_scheme.py`` a bias scheme,
``tests/test_custom_camera_scheme.py`` a camera scheme and ``tests/test_custom_multimodal_design.py`` a multimodal
design. Each checks that every generic test of its kind collected in the run covers it
(:func:`uncovered_generic_tests`).

Capabilities a scheme class does not declare are kept as small exception lists here, each with the reason.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections import defaultdict

import pytest
import torch

import visionpe
from visionpe.registry import get_scheme_class
from visionpe.rotary.lie_base import LieBlockRotary

# the throwaway schemes, registered before collection
from . import test_custom_bias_scheme, test_custom_camera_scheme, test_custom_multimodal_design, test_custom_scheme

THROWAWAY_MODULES = [
    test_custom_scheme,
    test_custom_bias_scheme,
    test_custom_camera_scheme,
    test_custom_multimodal_design,
]

# pytest-xdist: each worker process gets its share of the cores for torch's intra-op threads. torch's default (every
# core in every worker) oversubscribes the machine: on 2 cores with 2 workers a run took about twice as long.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

ALL_SCHEMES = visionpe.list_schemes()
ABSOLUTE = visionpe.list_schemes("absolute")
ROTARY = visionpe.list_schemes("rotary")
BIAS = visionpe.list_schemes("bias")
# rotary and bias schemes: they act inside attention (patch dropout gathers their positions with the kept tokens)
IN_ATTENTION = ROTARY + BIAS


def scheme_class(name: str) -> type:
    """The registered class of ``name``."""
    return get_scheme_class(name)


def takes_option(name: str, option: str) -> bool:
    """Whether the constructor of ``name`` takes the keyword ``option`` (e.g. ``ndim``, ``grid_size``)."""
    return option in inspect.signature(scheme_class(name).__init__).parameters


def supported_extrapolation(name: str) -> tuple[str, ...]:
    """The extrapolation modes the scheme implements (``supported_extrapolation``, read from a small instance: LieRE's
    depends on its block size), ``("none",)`` for schemes without the extrapolation settings."""
    scheme = visionpe.create_pos_embed(name, dim=32, num_heads=2)
    return tuple(getattr(scheme, "supported_extrapolation", ("none",)))


# LieRE and ComRoPE: exp(sum p_a A_a) in small blocks (visionpe/rotary/expm.py); their squaring count is read from
# the generators, which compile, export and precision tests treat apart
LIE = [n for n in ROTARY if issubclass(scheme_class(n), LieBlockRotary)]
# rotary schemes that scale against the training grid ("pi", "ntk", "yarn"), and the options they need for it:
# ComRoPE normalises positions by the test grid by default (``pos_norm``), which already interpolates, so it
# extrapolates with positions normalised by the training grid
EXTRAPOLATING = [n for n in ROTARY if "pi" in supported_extrapolation(n)]
EXTRAPOLATION_OPTIONS = {n: {"pos_norm": "train_grid"} for n in EXTRAPOLATING if takes_option(n, "pos_norm")}
# schemes that take 3D (t, y, x) grids (``grid_ranks``; those with an ``ndim`` option are built with ``ndim=3``)
VIDEO = [n for n in ALL_SCHEMES if 3 in scheme_class(n).grid_ranks]
# schemes that read coordinates, so that a training-time ``coord_augment`` applies to them (``consumes_coords``)
COORD_CONSUMERS = [n for n in ALL_SCHEMES if scheme_class(n).consumes_coords]


def _family(name: str) -> str:
    """The implementation a scheme shares with others: the class that defines the method through which it enters the
    model (``prepare`` for rotary and bias schemes, ``forward`` for absolute ones), e.g. ``LinearRotary`` for every
    RoPE with a frequency matrix, ``DistanceKernelBias`` for the distance kernels, or the scheme's own class."""
    cls = scheme_class(name)
    method = "forward" if cls.kind == "absolute" else "prepare"
    owner = next(base for base in cls.__mro__ if method in vars(base))
    return f"{owner.__module__}.{owner.__qualname__}"


# one scheme per implementation family (the first by name): for the slowest whole-pipeline checks (torch.compile
# against eager, ONNX export through onnxruntime: 10-30 s a scheme), which exercise the code a family shares; every
# scheme's own numbers are checked by the faster generic tests
FAMILY_REPRESENTATIVES = sorted({_family(n): n for n in reversed(ALL_SCHEMES)}.values())

# - ONNX export: schemes whose model does not export to ONNX, as the classes declare it (``onnx_refusal``, the reason;
#   torch.export works for all). The export tests run them as strict xfails, so a declaration that is wrong either way
#   fails: a fix shows.
ONNX_FAILS = {name: scheme_class(name).onnx_refusal for name in ALL_SCHEMES if scheme_class(name).onnx_refusal}

# Not declared by the classes:
# - patch dropout: schemes whose bias of a pair reads tokens other than the two of the pair. The dropped patches'
#   content never reaches the patch-dropped model, so its kept tokens cannot equal the full grid's with the dropped
#   keys masked (which still read it).
PATCH_DROP_DIFFERS = {
    "cable": "Cable sums the steps read from every patch between the pair, dropped patches included",
}
# - torch.compile with dynamic shapes: schemes that recompile (cleanly) for every new grid instead of running all
#   grids on one graph. iRPE caches its per-grid state in a dict keyed by the grid, CPE's convolution
#   specialises on it, every bias scheme builds Python index ranges over the tokens of its per-offset tables, and
#   AOTAutograd fixes the token count of sincos and fourier tables added to tokens that require grad (their
#   inference graph is dynamic), and LOOPE walks its Gilbert curve in Python for each grid.
RECOMPILE_PER_GRID = {"cpe", "sincos", "fourier", "loope", *BIAS}
# - options a scheme needs in the small models of the generic tests (none so far: every scheme builds from the
#   model's dim, num_heads and depth alone)
MODEL_OPTIONS: dict[str, dict] = {}


# every test collected in this run, before ``-k`` / ``-m`` deselect some (tests/test_custom_scheme.py reads it)
COLLECTED: list[pytest.Item] = []


def pytest_itemcollected(item):
    COLLECTED.append(item)


def _own(names) -> set[str]:
    """The names among ``names`` that visionpe itself registers (its class or design defined in the package), not
    those a program (a test) registers for a while."""
    from visionpe.multimodal import MULTIMODAL_SCHEMES

    def module(name):
        if name in MULTIMODAL_SCHEMES:
            return MULTIMODAL_SCHEMES[name].design.__module__
        return scheme_class(name).__module__

    return {n for n in names if module(n).startswith("visionpe.")}


def uncovered_generic_tests(name: str) -> list[str]:
    """The test functions collected in this run whose parameters include every scheme of ``name``'s kind that visionpe
    registers (a generic test of that kind), but not ``name``: a list written out by hand, or one that leaves out
    schemes defined outside the package. ``name``: a registered scheme or multimodal design."""
    from visionpe.multimodal import list_multimodal_schemes
    from visionpe.registry import registered_schemes

    if name in list_multimodal_schemes():
        same_kind = _own(list_multimodal_schemes())
    else:
        same_kind = _own(n for n in registered_schemes() if scheme_class(n).kind == scheme_class(name).kind)
    params: dict[str, set] = defaultdict(set)
    for item in COLLECTED:
        callspec = getattr(item, "callspec", None)
        if callspec is None:
            continue
        values = [v for p in callspec.params.values() for v in (p if isinstance(p, (list, tuple)) else [p])]
        key = f"{item.module.__name__}::{item.originalname}"
        params[key] |= {v for v in values if isinstance(v, str)} | set(callspec.id.split("-"))
    return sorted(key for key, names in params.items() if same_kind <= names and name not in names)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# - schemes whose training forward is random by design declare the options that make it deterministic
#   (``deterministic_options``: SeqPE's dropout in its PE network and its shift augmentation). The generic tests
#   compare forwards of a scheme in training mode without reseeding (compiled with eager, patch dropout with the
#   full grid, autocast with fp32), so a generic test of such a scheme (one parametrized by its name) builds it with
#   those options by default; the scheme's own tests cover the random parts.
DETERMINISTIC_OPTIONS = {
    name: dict(scheme_class(name).deterministic_options)
    for name in ALL_SCHEMES
    if getattr(scheme_class(name), "deterministic_options", None)
}


@pytest.fixture(autouse=True)
def _deterministic_training(request, monkeypatch):
    params = getattr(getattr(request.node, "callspec", None), "params", {}).values()
    values = [n for v in params for n in (v if isinstance(v, (list, tuple)) else [v])]
    names = {n for n in values if isinstance(n, str)}
    for name in names & DETERMINISTIC_OPTIONS.keys():
        cls = scheme_class(name)
        monkeypatch.setattr(cls, "__init__", _with_defaults(cls.__init__, DETERMINISTIC_OPTIONS[name]))


def _with_defaults(init, defaults: dict):
    """``init`` with ``defaults`` as keyword defaults (explicit keywords still win); the signature is ``init``'s."""

    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        init(self, *args, **{**defaults, **kwargs})

    return wrapped


def pytest_unconfigure(config):
    """The throwaway schemes leave their registries with the test run."""
    for module in THROWAWAY_MODULES:
        module.unregister()
