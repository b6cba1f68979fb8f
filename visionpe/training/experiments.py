"""Train schemes from a LightningCLI config and sweep them over test sizes (used by ``train/extrapolate.py``).

Each model is trained by Lightning exactly as ``train/classify.py fit --config CONFIG`` would, with the scheme,
seed and output folder overridden; then every model is evaluated at every size of the data module's
``eval_dataloader(size)`` and the results are written by :func:`visionpe.training.evaluate.write_report`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path

import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from ..rotary.scaling import Extrapolation, set_extrapolation
from .cli import run_cli
from .evaluate import sweep, write_report
from .module import Classifier

__all__ = ["REFERENCE_MODELS", "reference_args", "train_from_config", "run_sweep", "accepts_extrapolation"]

# timm's own models, trained the same way as the visionpe ones: the reference rows of a sweep, as (row label, timm
# model name, extra config overrides). timm's Eva scales its classifier head by 1e-3 and each block's output
# projections by 1 / sqrt(2 l) in block l at init, where timm's ViT (and so visionpe's) keeps the truncated normal of
# std 0.02; with the same small budget that init alone made the Eva rows learn at APE's pace (29.6 against 65.0 %
# at 32 px for RoPE-Axial), so they get the ViT init (README, "Extrapolation on the bundled digits").
REFERENCE_MODELS = {
    "timm_ape": ("timm APE ViT", "vit_tiny_patch16_224", []),
    "timm_rope_axial": ("timm Eva RoPE-Axial", "vit_small_patch16_rope_224", ["--model.weight_init=vit"]),
    "timm_rope_mixed": ("timm Eva RoPE-Mixed", "vit_small_patch16_rope_mixed_224", ["--model.weight_init=vit"]),
}
EXTRAPOLATION_MODES = ("none", "pi", "ntk", "yarn")


FINAL_CHECKPOINT = "final.ckpt"  # written by train_from_config once a run has finished training


def reference_args(name: str) -> list[str]:
    """The config overrides that build the reference model ``name`` of :data:`REFERENCE_MODELS`."""
    if name not in REFERENCE_MODELS:
        raise ValueError(f"unknown reference model {name!r}; valid: {sorted(REFERENCE_MODELS)}")
    _, model_name, overrides = REFERENCE_MODELS[name]
    return [f"--model.model_name={model_name}", *overrides]


def train_from_config(config: str | Path, overrides: Sequence[str], out_dir: str | Path, reuse: bool = False):
    """Fit a :class:`Classifier` from ``config`` plus CLI-style ``overrides``; return (model, datamodule).

    The trained model is saved as ``out_dir / FINAL_CHECKPOINT``. With ``reuse``, a run whose final checkpoint
    already exists is loaded instead of trained again (an interrupted sweep continues where it stopped; runs that
    had not finished are trained from the start).
    """
    out_dir = Path(out_dir)
    cli = run_cli(args=["--config", str(config), *overrides, f"--trainer.default_root_dir={out_dir}"], run=False)
    final = out_dir / FINAL_CHECKPOINT
    if reuse and final.is_file():
        cli.datamodule.setup("validate")
        return Classifier.load_from_checkpoint(final, map_location="cpu").eval(), cli.datamodule
    cli.trainer.loggers = [CSVLogger(out_dir, name="csv"), TensorBoardLogger(out_dir, name="tensorboard")]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    cli.trainer.save_checkpoint(final)
    return cli.model.eval(), cli.datamodule


def _check_runs(config: str | Path, runs: Sequence[Sequence[str]]) -> bool:
    """Build every run's model and data module once, before any training, so that an option a scheme does not
    take fails in seconds, not after the runs before it trained; returns whether the data module has a ``seed``
    argument (the digits do; an ImageFolder does not)."""
    datamodules = [run_cli(args=["--config", str(config), *args], run=False).datamodule for args in runs]
    return "seed" in inspect.signature(type(datamodules[0]).__init__).parameters


def _scalable(model: torch.nn.Module) -> list[Extrapolation]:
    """The schemes of ``model`` that :func:`~visionpe.set_extrapolation` switches (every rotary scheme)."""
    return [m for m in model.modules() if isinstance(m, Extrapolation)]


def accepts_extrapolation(model: torch.nn.Module, mode: str) -> bool:
    """Whether the sweep evaluates ``model`` under extrapolation ``mode``: always for ``none``; otherwise when it
    has rotary schemes and every one of them accepts the mode (LieRE has no frequencies for NTK or YaRN, and
    ComRoPE's test-grid positions already interpolate), so that one sweep can list every scheme and mode."""
    if mode == "none":
        return True
    schemes = _scalable(model)
    return bool(schemes) and all(mode in s.accepted_extrapolation() for s in schemes)


def run_sweep(
    config: str | Path,
    checkpoints: Sequence[str] = (),
    schemes: Sequence[str] = (),
    references: Sequence[str] = (),
    sizes: Sequence[int] | None = None,
    seeds: Sequence[int] = (0,),
    extrapolation: Sequence[str] = ("none",),
    max_epochs: int | None = None,
    overrides: Sequence[str] = (),
    out_dir: str | Path = "runs/extrapolate",
    title: str | None = None,
    reuse: bool = False,
) -> dict[str, Path]:
    """Train (or load) every model, evaluate it at every size, write table/CSV/plot under ``out_dir``.

    ``overrides`` are LightningCLI arguments applied to every training run and to the data module, e.g.
    ``["--data.init_args.train_subset=512"]``. With ``reuse``, runs that finished in an earlier call with the
    same ``out_dir`` (``<out_dir>/<model>/seed<k>/final.ckpt``) are loaded instead of trained again.
    """
    if not Path(config).is_file():
        raise ValueError(f"config must be an existing YAML file, got {str(config)!r}")
    unknown = [r for r in references if r not in REFERENCE_MODELS]
    if unknown:
        raise ValueError(f"unknown reference model(s) {unknown}; valid: {sorted(REFERENCE_MODELS)}")
    bad_modes = [m for m in extrapolation if m not in EXTRAPOLATION_MODES]
    if bad_modes:
        raise ValueError(f"extrapolation modes must be in {EXTRAPOLATION_MODES}, got {bad_modes}")
    replaced = [o for o in overrides if o.lstrip("-").split("=")[0] in ("model.pos_embed", "model.init_args.pos_embed")]
    if replaced and (schemes or references):
        raise ValueError(
            f"overrides {replaced} would replace the position encoding of every run (overrides come last); "
            "name the schemes with schemes=... instead"
        )
    out_dir = Path(out_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    common = list(overrides) + ([f"--trainer.max_epochs={max_epochs}"] if max_epochs is not None else [])
    runs = [(name, [f"--model.pos_embed={name}"]) for name in schemes]
    runs += [(REFERENCE_MODELS[r][0], reference_args(r)) for r in references]

    rows, datamodule = [], None
    data_seed = bool(runs) and _check_runs(config, [[*run_args, *common] for _, run_args in runs])
    for seed in seeds:
        models: dict[str, Classifier] = {}
        for label, run_args in runs:
            # the data module's seed (split, shuffle, augmentation) follows the run's seed: a seed is a whole
            # replicate, and Lightning refuses a module and a data module that log different 'seed' values
            seed_args = [f"--seed_everything={seed}", f"--model.seed={seed}"]
            seed_args += [f"--data.init_args.seed={seed}"] if data_seed else []
            run_dir = out_dir / label.replace(" ", "_") / f"seed{seed}"
            models[label], datamodule = train_from_config(config, [*run_args, *seed_args, *common], run_dir, reuse)
        if seed == seeds[0]:
            for path in checkpoints:
                model = Classifier.load_from_checkpoint(path, map_location="cpu").eval()
                models[f"{model.hparams.pos_embed} ({Path(path).name})"] = model
        if datamodule is None:  # checkpoints only: the config still provides the data
            cli = run_cli(args=["--config", str(config), *overrides], run=False)
            datamodule = cli.datamodule
            datamodule.setup("validate")
        test_sizes = list(sizes) if sizes else list(datamodule.eval_sizes)
        for mode in extrapolation:
            selected = {
                (label if mode == "none" else f"{label} [{mode}]"): model
                for label, model in models.items()
                if accepts_extrapolation(model.model, mode)
            }
            for model in selected.values():
                if _scalable(model.model):
                    set_extrapolation(model.model, mode)
            rows += sweep(selected, datamodule.eval_dataloader, test_sizes, seed=seed, device=device)
        for model in models.values():
            if _scalable(model.model):
                set_extrapolation(model.model, "none")
    title = title or f"Extrapolation sweep ({Path(config).stem})"
    return write_report(rows, out_dir, title, size_label=getattr(datamodule, "size_label", "px"))
