"""Train schemes from a LightningCLI config and sweep them over test sizes (``train/extrapolate.py``).

Each model is trained by Lightning exactly as ``train/classify.py fit --config CONFIG`` would, with the scheme,
seed and output folder overridden; then every model is evaluated at every size of the data module's
``eval_dataloader(size)`` and the results are written by :func:`visionpe.training.evaluate.write_report`.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from visionpe.rotary.scaling import EXTRAPOLATION_MODES, Extrapolation, set_extrapolation
from visionpe.training import Classifier
from visionpe.training.evaluate import sweep, write_report
from visionpe.training.sampling import _check_int, _check_int_tuple

from .cli import run_cli

__all__ = [
    "REFERENCE_MODELS",
    "accepts_extrapolation",
    "bench_results",
    "check_config",
    "quiet_lightning",
    "reference_args",
    "run_sweep",
    "train_from_config",
]

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


FINAL_CHECKPOINT = "final.ckpt"  # written by train_from_config once a run has finished training

ROOT = Path(__file__).resolve().parents[2]  # the repository: bench/ is a folder of it, next to train/


def bench_results():
    """The benchmarks' shared module ``bench/results.py`` (result files, where they go, the quick-mode notice)."""
    sys.path.insert(0, str(ROOT))
    try:
        import bench.results
    finally:
        sys.path.remove(str(ROOT))
    return bench.results


# Lightning's informational messages, repeated for every run of a sweep: "Seed set to 0", the accelerators found,
# a tip advertising a logging service, "Loading `train_dataloader` to estimate...", "`Trainer.fit` stopped".
# Its warnings go through the warnings module and stay.
_CHATTY_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.seed")


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Hide Lightning's per-run information messages (not its warnings or progress bars); restore after."""
    loggers = [logging.getLogger(name) for name in _CHATTY_LOGGERS]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.WARNING)
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def reference_args(name: str) -> list[str]:
    """The config overrides that build the reference model ``name`` of :data:`REFERENCE_MODELS`."""
    if name not in REFERENCE_MODELS:
        raise ValueError(f"unknown reference model {name!r}; valid: {sorted(REFERENCE_MODELS)}")
    _, model_name, overrides = REFERENCE_MODELS[name]
    # pos_embed null: the timm model keeps its own encoding (a scheme named in the config would replace it in place)
    return [f"--model.model_name={model_name}", "--model.pos_embed=null", *overrides]


def check_config(config: str | Path) -> Path:
    """``config`` as a Path if it names an existing file (the sweep's training config), else a ValueError."""
    if not Path(config).is_file():
        raise ValueError(f"config must be an existing YAML file, got {str(config)!r}")
    return Path(config)


def set_worker_threads(threads: int) -> None:
    """Initializer of a pool of training processes: ``threads`` torch threads in each."""
    torch.set_num_threads(threads)


def call_by_name(module: str, name: str, *args, **kwargs):
    """``module.name(*args, **kwargs)``, the module imported by name: how a pool worker runs a function of a script.

    A script's functions cannot be sent to a spawned process by reference when the script runs as ``__main__`` or
    was loaded from its path under another name; their module's name and their own can (``__main__`` in the worker
    is the script again)."""
    return getattr(importlib.import_module(module), name)(*args, **kwargs)


def train_from_config(
    config: str | Path, overrides: Sequence[str], out_dir: str | Path, reuse: bool = False, compact: bool = False
):
    """Fit a :class:`Classifier` from ``config`` plus CLI-style ``overrides``; return (model, datamodule).

    The trained model is saved as ``out_dir / FINAL_CHECKPOINT``. With ``reuse``, a run whose final checkpoint
    already exists is loaded instead of trained again (an interrupted sweep continues where it stopped; runs that
    had not finished are trained from the start). ``compact`` keeps the progress bar to one line of metrics.
    """
    out_dir = Path(out_dir)
    cli = run_cli(args=["--config", str(config), *overrides, f"--trainer.default_root_dir={out_dir}"], run=False)
    final = out_dir / FINAL_CHECKPOINT
    if reuse and final.is_file():
        cli.datamodule.setup("validate")
        return Classifier.load_from_checkpoint(final, map_location="cpu").eval(), cli.datamodule
    cli.trainer.loggers = [CSVLogger(out_dir, name="csv"), TensorBoardLogger(out_dir, name="tensorboard")]
    if compact and cli.trainer.progress_bar_callback is not None:
        _compact_metrics(cli.trainer.progress_bar_callback)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    cli.trainer.save_checkpoint(final, weights_only=False)  # the full checkpoint, said so (else Lightning logs it)
    return cli.model.eval(), cli.datamodule


def _compact_metrics(bar) -> None:
    """Show the step loss and the validation accuracy on ``bar``, without the logger version and epoch loss, so
    that the bar and its metrics fit on one line of a terminal."""
    full = bar.get_metrics

    def get_metrics(trainer, pl_module):
        metrics = full(trainer, pl_module)
        return {
            name.removeprefix("train/").removesuffix("_step"): value
            for name, value in metrics.items()
            if name != "v_num" and not name.endswith("_epoch")
        }

    bar.get_metrics = get_metrics


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


def _check_distinct(name: str, values: Sequence) -> list:
    """``values`` as a list; a value given twice would be counted twice (a repeated seed as a second replicate)."""
    values = list(values)
    repeated = sorted({str(v) for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"{name} must not repeat a value, got {values} (repeated: {repeated})")
    return values


def _check_sweep_args(seeds, sizes, max_epochs) -> None:
    _check_int_tuple("seeds", seeds, minimum=0)
    if sizes is not None:
        _check_int_tuple("sizes", sizes)
    if max_epochs is not None:
        _check_int("max_epochs", max_epochs)


def _checkpoint_label(hparams: dict) -> str:
    """What a checkpoint's model is: its scheme(s) for a visionpe model, the reference row's label (or the timm
    model name) for timm's own, whose ``pos_embed`` hyperparameter is unused."""
    model_name = hparams.get("model_name", "")
    if not model_name.startswith("visionpe_"):
        labels = [label for label, name, _ in REFERENCE_MODELS.values() if name == model_name]
        return labels[0] if labels else model_name
    pos_embed = hparams.get("pos_embed")
    return "+".join(pos_embed) if isinstance(pos_embed, (list, tuple)) else str(pos_embed)


def _is_class(class_path: object, cls: type) -> bool:
    """Whether the dotted ``class_path`` (as Lightning saves a data module's class) names ``cls``."""
    if not isinstance(class_path, str) or "." not in class_path:
        return False
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None) is cls
    except ImportError:
        return False


def _load_checkpoints(paths: Sequence[str], data_keys: Sequence[str], data_class: type):
    """Load every checkpoint as (row label, seed, model, data overrides).

    The row label names the model and the checkpoint's path relative to the folder all checkpoints share, so that
    ``runs/a/last.ckpt`` and ``runs/b/last.ckpt`` get rows of their own. The data overrides give the evaluation
    data module the split the checkpoint was trained with (its data module's ``seed`` and ``train_fraction``, when
    it is of the config's class): with the config's split, the held-out digits of one seed are largely the
    training digits of another.
    """
    resolved = [Path(p).resolve() for p in paths]
    for given, path in zip(paths, resolved, strict=True):
        if not path.is_file():
            raise ValueError(f"checkpoints must be existing files, got {given!r}")
    _check_distinct("checkpoints (resolved paths)", resolved)
    root = Path(os.path.commonpath([p.parent for p in resolved])) if resolved else None
    loaded = []
    for path in resolved:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        if "hyper_parameters" not in ckpt or "state_dict" not in ckpt:
            raise ValueError(f"checkpoints must be Lightning checkpoints of a Classifier, got {str(path)!r}")
        hparams, data_hparams = ckpt["hyper_parameters"], ckpt.get("datamodule_hyper_parameters") or {}
        same_data = _is_class(data_hparams.get("_class_path"), data_class)
        data = {k: data_hparams[k] for k in data_keys if same_data and k in data_hparams}
        seed = data.get("seed", hparams.get("seed", 0))
        model = Classifier.load_from_checkpoint(path, map_location="cpu").eval()
        label = f"{_checkpoint_label(hparams)} ({path.relative_to(root).as_posix()})"
        loaded.append((label, seed, model, [f"--data.init_args.{k}={v}" for k, v in data.items()]))
    return loaded


def _probe_samples(datamodule, sizes: Sequence[int]) -> dict[int, torch.Tensor]:
    """One evaluation sample (a batch of 1) per test size, loaded once for every model to be probed with."""
    samples = {}
    for size in sizes:
        try:
            samples[size] = next(iter(datamodule.eval_dataloader(size)))[0][:1]
        except (ValueError, RuntimeError) as err:
            raise ValueError(f"test size {size} does not work for the data module: {err}") from err
    return samples


def _probe(model: torch.nn.Module, samples: dict[int, torch.Tensor], name: str) -> None:
    """Run the sample of every test size through ``model`` (random weights are fine), so that a size the model
    refuses (e.g. not a multiple of the patch) fails before any run trains."""
    model.eval()
    for size, inputs in samples.items():
        try:
            with torch.no_grad():
                model(inputs)
        except (ValueError, RuntimeError, AssertionError) as err:
            raise ValueError(f"test size {size} does not work for {name}: {err}") from err


def _evaluate(models, datamodule, sizes, modes, seed, device) -> list[dict]:
    """Rows of every model at every size under every extrapolation mode it accepts (then back to ``none``)."""
    rows = []
    test_sizes = list(sizes) if sizes else list(datamodule.eval_sizes)
    for mode in modes:
        selected = {
            (label if mode == "none" else f"{label} [{mode}]"): model
            for label, model in models.items()
            if accepts_extrapolation(model.model, mode)
        }
        for model in selected.values():
            if _scalable(model.model):
                set_extrapolation(model.model, mode)
        if selected:
            rows += sweep(selected, datamodule.eval_dataloader, test_sizes, seed=seed, device=device)
    for model in models.values():
        if _scalable(model.model):
            set_extrapolation(model.model, "none")
    return rows


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
    verbose: bool = True,
) -> dict[str, Path]:
    """Train (or load) every model, evaluate it at every size, write table/CSV/plot under ``out_dir``.

    ``schemes`` and ``references`` are trained from ``config`` once per seed of ``seeds``; ``checkpoints`` are
    evaluated as they are, each on the data split and under the seed it was trained with (read from the
    checkpoint). ``overrides`` are LightningCLI arguments applied to every training run and to the data module,
    e.g. ``["--data.init_args.train_subset=512"]``. With ``reuse``, runs that finished in an earlier call with the
    same ``out_dir`` (``<out_dir>/<model>/seed<k>/final.ckpt``) are loaded instead of trained again.

    Everything that can be checked without training is checked first: repeated values, the sizes (one sample of
    each through every model) and that each extrapolation mode is accepted by at least one model.

    Prints one line per trained (or reused) model: its wall time, parameters and accuracy at the training size.
    ``verbose=False`` leaves out Lightning's information messages (:func:`quiet_lightning`) and its model summary
    table for every run; the progress bars and warnings stay.
    """
    with contextlib.nullcontext() if verbose else quiet_lightning():
        return _run_sweep(
            config,
            checkpoints,
            schemes,
            references,
            sizes,
            seeds,
            extrapolation,
            max_epochs,
            overrides,
            out_dir,
            title,
            reuse,
            verbose,
        )


def _format_seconds(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds:02d} s" if minutes else f"{seconds} s"


def _trained_line(model: Classifier, datamodule, started: float, reused: Path | None) -> str:
    """What a finished run reports: wall time, parameters and the last validation accuracy (at the training size)."""
    params = sum(p.numel() for p in model.parameters())
    if reused is not None:
        return f"loaded {reused} ({params / 1e3:.0f}k parameters)"
    trainer = getattr(model, "_trainer", None)  # still attached after fit; None when a test stubs the training
    acc = trainer.callback_metrics.get("val/acc") if trainer is not None else None
    frames = getattr(datamodule, "size_label", "px") == "frames"
    size = getattr(datamodule, "num_frames" if frames else "img_size", None)
    where = f"{size} {getattr(datamodule, 'size_label', 'px')}" if size else "the training size"
    score = f"{100 * float(acc):.1f} % at {where}" if acc is not None else "no validation accuracy"
    return f"{score}, trained in {_format_seconds(time.perf_counter() - started)} ({params / 1e3:.0f}k parameters)"


def _run_sweep(
    config,
    checkpoints,
    schemes,
    references,
    sizes,
    seeds,
    extrapolation,
    max_epochs,
    overrides,
    out_dir,
    title,
    reuse,
    verbose,
) -> dict[str, Path]:
    check_config(config)
    unknown = [r for r in references if r not in REFERENCE_MODELS]
    if unknown:
        raise ValueError(f"unknown reference model(s) {unknown}; valid: {sorted(REFERENCE_MODELS)}")
    bad_modes = [m for m in extrapolation if m not in EXTRAPOLATION_MODES]
    if bad_modes:
        raise ValueError(f"extrapolation modes must be in {EXTRAPOLATION_MODES}, got {bad_modes}")
    for name, values in (("schemes", schemes), ("references", references)):  # checkpoints: by resolved path
        _check_distinct(name, values)
    seeds, extrapolation = _check_distinct("seeds", seeds), _check_distinct("extrapolation", extrapolation)
    sizes = _check_distinct("sizes", sizes) if sizes is not None else None
    _check_sweep_args(seeds, sizes, max_epochs)
    replaced = [o for o in overrides if o.lstrip("-").split("=")[0] in ("model.pos_embed", "model.init_args.pos_embed")]
    if replaced and (schemes or references):
        raise ValueError(
            f"overrides {replaced} would replace the position encoding of every run (overrides come last); "
            "name the schemes with schemes=... instead"
        )
    out_dir = Path(out_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    common = list(overrides) + ([f"--trainer.max_epochs={max_epochs}"] if max_epochs is not None else [])
    if not verbose:  # the model summary table of every run; the per-run line below gives the parameters
        common = ["--trainer.enable_model_summary=false", *common]
    runs = [(name, [f"--model.pos_embed={name}"]) for name in schemes]
    runs += [(REFERENCE_MODELS[r][0], reference_args(r)) for r in references]

    # Build every run's model and data module once before any training, so that an option a scheme does not take
    # or a size a model refuses fails in seconds, not after the runs before it trained.
    clis = [run_cli(args=["--config", str(config), *run_args, *common], run=False) for _, run_args in runs]
    config_data = (
        clis[0].datamodule if clis else run_cli(args=["--config", str(config), *overrides], run=False).datamodule
    )
    data_class = type(config_data)
    split_keys = [k for k in ("seed", "train_fraction") if k in inspect.signature(data_class.__init__).parameters]
    loaded = _load_checkpoints(checkpoints, split_keys, data_class)
    config_data.setup("validate")
    probes = [(label, cli.model) for (label, _), cli in zip(runs, clis, strict=True)]
    probes += [(label, model) for label, _, model, _ in loaded]
    samples = _probe_samples(config_data, sizes or config_data.eval_sizes)
    for label, model in probes:
        _probe(model, samples, label)
    for mode in extrapolation:
        if not any(accepts_extrapolation(model.model, mode) for _, model in probes):
            raise ValueError(
                f"extrapolation mode {mode!r} is accepted by none of the models {[label for label, _ in probes]}"
            )

    rows, datamodule = [], config_data
    total, done = len(runs) * len(seeds), 0
    if total:
        test_sizes = " ".join(str(s) for s in (sizes or config_data.eval_sizes))
        unit, modes = getattr(config_data, "size_label", "px"), " ".join(extrapolation)
        print(
            f"Training {len(runs)} model(s) x {len(seeds)} seed(s) from {config}, then evaluating at {test_sizes} "
            f"{unit} (extrapolation: {modes}); output in {out_dir}",
            flush=True,
        )
    for seed in seeds:
        models: dict[str, Classifier] = {}
        for label, run_args in runs:
            # the data module's seed (split, shuffle, augmentation) follows the run's seed: a seed is a whole
            # replicate, and Lightning refuses a module and a data module that log different 'seed' values
            seed_args = [f"--seed_everything={seed}", f"--model.seed={seed}"]
            seed_args += [f"--data.init_args.seed={seed}"] if "seed" in split_keys else []
            run_dir = out_dir / label.replace(" ", "_") / f"seed{seed}"
            reused = run_dir / FINAL_CHECKPOINT if reuse and (run_dir / FINAL_CHECKPOINT).is_file() else None
            started = time.perf_counter()
            run = [*run_args, *seed_args, *common]
            models[label], datamodule = train_from_config(config, run, run_dir, reuse, not verbose)
            done += 1
            line = _trained_line(models[label], datamodule, started, reused)
            print(f"[{done}/{total}] {label}, seed {seed}: {line}", flush=True)
        if models:
            started = time.perf_counter()
            rows += _evaluate(models, datamodule, sizes, extrapolation, seed, device)
            print(f"evaluated seed {seed} in {_format_seconds(time.perf_counter() - started)}", flush=True)
    for label, seed, model, data_args in loaded:
        if data_args:
            datamodule = run_cli(args=["--config", str(config), *overrides, *data_args], run=False).datamodule
            datamodule.setup("validate")
        else:
            datamodule = config_data
        rows += _evaluate({label: model}, datamodule, sizes, extrapolation, seed, device)
    title = title or f"Extrapolation sweep ({Path(config).stem})"
    return write_report(rows, out_dir, title, size_label=getattr(datamodule, "size_label", "px"))
