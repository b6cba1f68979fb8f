"""Fully sharded data parallel training (FSDP) with one shard unit per transformer block.

:class:`BlockFSDPStrategy` is Lightning's :class:`~lightning.pytorch.strategies.FSDPStrategy` with what a config file
cannot spell given by name: the block classes (Lightning takes a set of classes) that become FSDP units and, when
asked, are activation-checkpointed. Two choices follow visionpe's position schemes:

- **Precision outside the blocks.** Position schemes compute their angles, tables and biases in fp32 with autocast
  off, from parameters and buffers they expect in fp32. Lightning's FSDP casts every parameter and buffer to the
  precision's dtype (bf16 for ``bf16-mixed``), which would round rotary frequencies and position tables. Here the
  blocks gather their parameters in the precision's dtype, as Lightning does, and the rest of the model (patch
  embedding, position schemes, prefix tokens, final norm, head: the root unit) stays in fp32 under autocast, as with
  DDP (``fp32_outside_blocks=False`` restores Lightning's behaviour).
- **One activation checkpointing.** Blocks are checkpointed by the strategy (a non-reentrant
  ``checkpoint_wrapper`` inside each block's FSDP unit, so that a recomputed block finds its parameters already
  gathered), never also by the model: a model with timm's ``set_grad_checkpointing()`` or Hugging Face's
  ``gradient_checkpointing_enable()`` switched on is refused, since each block would then run three times.

It also runs on the CPU over gloo (for tests: Lightning's FSDPStrategy refuses a CPU accelerator and torch's FSDP
needs the CPU named as its device), in full precision.

**FSDP2** (``torch.distributed.fsdp.fully_shard``, what Lightning's ``ModelParallelStrategy``, torchtitan and accelerate
use): :func:`shard_model` makes each transformer block a shard unit and the model the root unit, in a LightningModule's
``configure_model`` or a script of its own; :func:`materialize_model` turns a model built on the meta device and sharded
into one on a real device, from a full state dict or each module's ``reset_parameters``. The position schemes sit at
model level in every visionpe model (a per-layer parameter is one tensor over all blocks), so their parameters are in
the root unit, which keeps fp32 parameters whatever the blocks' ``MixedPrecisionPolicy``; the position context (rotary
tables, bias states) reaches the blocks as it was computed, in fp32, the blocks casting only the token stream.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn

from ..base import PositionEncoding
from ..checks import check_bool, check_choice, check_instance

__all__ = [
    "BlockFSDPStrategy",
    "DEFAULT_BLOCK_CLASSES",
    "materialize_model",
    "resolve_block_classes",
    "shard_model",
    "shard_units",
]

#: timm's transformer block: every ``visionpe_vit_*`` block (:class:`visionpe.attention.PosBlock`) is one, and so are
#: the blocks of timm's own ViTs.
DEFAULT_BLOCK_CLASSES = ("timm.models.vision_transformer.Block",)

_SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "NO_SHARD")
_SET_HERE = ("auto_wrap_policy", "activation_checkpointing", "activation_checkpointing_policy")


def _import_class(name: str) -> type:
    module_name, _, attribute = name.rpartition(".")
    if not module_name:
        raise ValueError(f"block_classes entries must be dotted names such as 'package.module.Class', got {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"block_classes entry {name!r}: cannot import {module_name!r} ({err})") from err
    if not hasattr(module, attribute):
        raise ValueError(f"block_classes entry {name!r}: module {module_name!r} has no attribute {attribute!r}")
    return getattr(module, attribute)


def resolve_block_classes(block_classes: Sequence[str | type[nn.Module]]) -> tuple[type[nn.Module], ...]:
    """The module classes named by ``block_classes``: dotted names (``"timm.models.vision_transformer.Block"``,
    ``"transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VLDecoderLayer"``) or the classes themselves.

    Raises:
        TypeError: ``block_classes`` is not a list or tuple, or an entry is neither a str nor a class.
        ValueError: it is empty, a name does not import, or an entry is not a ``torch.nn.Module`` subclass.

    Example:
        >>> resolve_block_classes(["visionpe.attention.PosBlock"])
        (<class 'visionpe.attention.PosBlock'>,)
    """
    check_instance(block_classes, "block_classes", (list, tuple), expected="a list of module classes or their names")
    if not block_classes:
        raise ValueError("block_classes must name at least one module class, got an empty list")
    classes = []
    for entry in block_classes:
        check_instance(entry, "block_classes entry", (str, type), expected="a dotted class name or a class")
        cls = _import_class(entry) if isinstance(entry, str) else entry
        if not isinstance(cls, type) or not issubclass(cls, nn.Module):
            raise ValueError(f"block_classes entry {entry!r} must be a torch.nn.Module subclass, got {cls!r}")
        classes.append(cls)
    return tuple(dict.fromkeys(classes))


class _NormClippingFSDPPrecision(FSDPPrecision):
    """Lightning's FSDP precision, with gradient clipping by norm (``gradient_clip_val``), which Lightning's refuses:
    the norm of all the shards together, by FSDP's ``clip_grad_norm_`` on the root unit."""

    root: nn.Module | None = None

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        if self.root is None:
            raise RuntimeError("gradients are clipped before BlockFSDPStrategy wrapped the model")
        self.root.clip_grad_norm_(clip_val)


class BlockFSDPStrategy(FSDPStrategy):
    """Lightning's FSDP with one FSDP unit per transformer block, for LightningCLI configs and Python alike.

    Args:
        block_classes: the classes (or their dotted names) whose instances become FSDP units (``isinstance``:
            subclasses count); default timm's ``Block``, which every ``visionpe_vit_*`` block is. Whatever lies
            outside them (embeddings, position schemes, norms, head) is the root unit.
        activation_checkpointing: recompute each block in the backward pass instead of keeping its activations
            (non-reentrant ``checkpoint_wrapper`` inside the block's unit). The model's own checkpointing must be off.
        fp32_outside_blocks: keep the root unit's parameters and buffers in fp32 (the position schemes' tables and
            frequencies among them), the blocks alone gathering theirs in the precision's dtype; False casts the
            whole model as Lightning's FSDPStrategy does. Ignored when ``mixed_precision`` is given.
        sharding_strategy: ``FULL_SHARD`` (parameters, gradients and optimizer state sharded over every process),
            ``SHARD_GRAD_OP`` (parameters kept gathered between forward and backward), ``HYBRID_SHARD`` (full
            sharding within a node, replicas across nodes: with ``device_mesh=(nodes, gpus_per_node)`` or the
            default intra-node groups), ``_HYBRID_SHARD_ZERO2`` or ``NO_SHARD`` (DDP-like).
        state_dict_type: ``"full"`` (a checkpoint gathered on rank 0 into one ``.ckpt`` file, loadable without FSDP)
            or ``"sharded"`` (a folder with each process's shards, written in parallel; resumed with FSDP, or merged
            into a single file with ``python -m lightning.pytorch.utilities.consolidate_checkpoint <folder>``).
        device_mesh: ``(replicas, shards)`` for ``HYBRID_SHARD``, e.g. ``(num_nodes, gpus_per_node)``.
        **kwargs: the other arguments of Lightning's ``FSDPStrategy`` (``cpu_offload``, ``mixed_precision``,
            ``process_group_backend``, ``timeout``...) and torch's FSDP (``limit_all_gathers``,
            ``forward_prefetch``...).
            The wrap and checkpointing policies are set here from ``block_classes`` and cannot be given.

    Example (a LightningCLI override file, composed after a training config)::

        trainer:
          strategy:
            class_path: visionpe.training.fsdp.BlockFSDPStrategy
            init_args:
              block_classes: [timm.models.vision_transformer.Block]
              activation_checkpointing: true
              sharding_strategy: FULL_SHARD
    """

    def __init__(
        self,
        block_classes: Sequence[str | type[nn.Module]] = DEFAULT_BLOCK_CLASSES,
        activation_checkpointing: bool = True,
        fp32_outside_blocks: bool = True,
        sharding_strategy: str = "FULL_SHARD",
        state_dict_type: Literal["full", "sharded"] = "full",
        device_mesh: tuple[int, int] | None = None,
        **kwargs: Any,
    ) -> None:
        classes = resolve_block_classes(block_classes)
        check_bool(activation_checkpointing, "activation_checkpointing")
        check_bool(fp32_outside_blocks, "fp32_outside_blocks")
        check_instance(sharding_strategy, "sharding_strategy", str, expected="a sharding strategy name")
        check_choice(sharding_strategy.upper(), "sharding_strategy", _SHARDING)
        check_choice(state_dict_type, "state_dict_type", ("full", "sharded"))
        if device_mesh is not None:
            check_instance(device_mesh, "device_mesh", (tuple, list), expected="None or (replicas, shards)")
            if len(device_mesh) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) for n in device_mesh):
                raise ValueError(f"device_mesh must be None or two ints (replicas, shards), got {device_mesh!r}")
            if min(device_mesh) < 1:
                raise ValueError(f"device_mesh sizes must be >= 1, got {device_mesh!r}")
            device_mesh = tuple(device_mesh)
        given = sorted(set(_SET_HERE) & set(kwargs))
        if given:
            raise ValueError(
                f"{given} are set by BlockFSDPStrategy from block_classes and activation_checkpointing; "
                "use Lightning's FSDPStrategy to give policies of your own"
            )
        self.block_classes = classes
        self.fp32_outside_blocks = fp32_outside_blocks
        super().__init__(
            auto_wrap_policy=set(classes),
            activation_checkpointing_policy=set(classes) if activation_checkpointing else None,
            sharding_strategy=sharding_strategy.upper(),
            state_dict_type=state_dict_type,
            device_mesh=device_mesh,
            **kwargs,
        )

    @property
    def precision_plugin(self) -> FSDPPrecision:
        plugin = FSDPStrategy.precision_plugin.fget(self)
        if type(plugin) is FSDPPrecision:  # Lightning's (the Trainer's precision): the same, clipping by norm too
            plugin = _NormClippingFSDPPrecision(plugin.precision, plugin.scaler)
            FSDPStrategy.precision_plugin.fset(self, plugin)
        return plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: FSDPPrecision | None) -> None:
        FSDPStrategy.precision_plugin.fset(self, plugin)

    @property
    def activation_checkpointing(self) -> bool:
        """Whether the strategy checkpoints the blocks."""
        return bool(self._activation_checkpointing_kwargs)

    def _check_model(self, model: nn.Module) -> None:
        names = [cls.__qualname__ for cls in self.block_classes]
        if not any(isinstance(module, self.block_classes) for module in model.modules()):
            found = sorted({type(m).__qualname__ for m in model.modules()})
            raise ValueError(
                f"block_classes {names} match no module of the model, which would be one FSDP unit unsharded in "
                f"every forward; its module classes are {found}"
            )
        if not self.activation_checkpointing:
            return
        for name, module in model.named_modules():
            for flag in ("grad_checkpointing", "gradient_checkpointing"):
                if getattr(module, flag, False) is True:
                    raise ValueError(
                        f"module {name or type(model).__name__!r} checkpoints its blocks itself ({flag}=True) while "
                        "the strategy checkpoints them too (activation_checkpointing=True), so each block would run "
                        "three times: switch one off (timm: model.set_grad_checkpointing(False); Hugging Face: "
                        "model.gradient_checkpointing_disable(); or activation_checkpointing: false)"
                    )

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import CustomPolicy

        root = getattr(self, "_root", None)
        if root is not None and root.module is model:
            # A later stage (test after fit) hands Lightning's module again, whose blocks are still units: the root
            # unit holds the shards of everything else, so it is the one that runs (moved back, as Lightning's
            # teardown moved the module to the CPU).
            return root.to(self.root_device)
        if any(isinstance(module, FullyShardedDataParallel) for module in model.modules()):
            model = super()._setup_model(model)  # wrapped by the user: Lightning's handling (no policy applied)
            self._set_clipping_root(model)
            return model
        self._check_model(model)
        on_cpu = self.root_device.type == "cpu"
        precision = self.precision_plugin.precision
        if on_cpu and precision != "32-true":
            raise ValueError(
                f"BlockFSDPStrategy runs on the CPU in full precision only (Lightning's FSDP autocasts on CUDA), "
                f"got precision={precision!r}: use precision '32-true' on the CPU"
            )
        block_precision = self.mixed_precision_config
        root_precision = block_precision
        if self.mixed_precision is None and self.fp32_outside_blocks and precision != "32-true":
            root_precision = None  # full precision: autocast computes in the low dtype, as with DDP
        classes = self.block_classes

        def policy(module: nn.Module) -> bool | dict[str, Any]:
            if not isinstance(module, classes):
                return False
            return {"mixed_precision": block_precision} if root_precision is not block_precision else True

        wrap_kwargs = {key: value for key, value in self.kwargs.items() if key != "auto_wrap_policy"}
        wrapped = FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=root_precision,
            sharding_strategy=self.sharding_strategy,
            # torch's FSDP reads device_id=None (what Lightning passes for a CPU device) as "use the accelerator"
            device_id=self.root_device if on_cpu else self.root_device.index,
            auto_wrap_policy=CustomPolicy(policy),
            **wrap_kwargs,
        )
        # Lightning's part for a wrapped model: metrics to the device, then checkpoint wrappers inside the units
        kwargs, self.kwargs = self.kwargs, wrap_kwargs
        try:
            wrapped = super()._setup_model(wrapped)
        finally:
            self.kwargs = kwargs
        self._set_clipping_root(wrapped)
        self._root = wrapped
        return wrapped

    def _set_clipping_root(self, root: nn.Module) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        plugin = self.precision_plugin
        if isinstance(plugin, _NormClippingFSDPPrecision) and isinstance(root, FullyShardedDataParallel):
            plugin.root = root


# -- FSDP2 ----------------------------------------------------------------------------------------------------------


def shard_units(model: nn.Module, block_classes: Sequence[str | type[nn.Module]] = DEFAULT_BLOCK_CLASSES) -> list[str]:
    """The names of the modules of ``model`` that :func:`shard_model` makes shard units: the outermost instances of
    ``block_classes`` (default timm's ``Block``: the blocks of every ``visionpe_vit_*``, of the video and multi-view
    ViTs and of the open_clip tower), in model order. Everything else (patch embedding, prefix tokens, position
    schemes, norms, head) belongs to the root unit.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
        ValueError: no module of ``model`` is an instance of ``block_classes`` (or those as in
            :func:`resolve_block_classes`).

    Example:
        >>> import timm
        >>> model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="rope_mixed", depth=2)
        >>> shard_units(model)
        ['blocks.0', 'blocks.1']
    """
    check_instance(model, "model", nn.Module, expected="a torch.nn.Module")
    classes = resolve_block_classes(block_classes)
    units: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, classes) and not any(name.startswith(f"{unit}.") for unit in units):
            units.append(name)
    if not units:
        found = sorted({type(m).__qualname__ for m in model.modules()})
        raise ValueError(
            f"block_classes {[c.__qualname__ for c in classes]} match no module of the model, which would be one "
            f"shard unit gathered whole in every forward; its module classes are {found}"
        )
    return units


def _cast_tokens(dtype: torch.dtype):
    """A forward pre-hook giving a block its token input (the first argument, or ``x``) in ``dtype``."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            args = (args[0].to(dtype), *args[1:])
        elif isinstance(kwargs.get("x"), torch.Tensor) and kwargs["x"].is_floating_point():
            kwargs = {**kwargs, "x": kwargs["x"].to(dtype)}
        return args, kwargs

    return hook


def shard_model(
    model: nn.Module,
    mesh: Any = None,
    mp_policy: Any = None,
    reshard_after_forward: bool | None = None,
    offload_policy: Any = None,
    block_classes: Sequence[str | type[nn.Module]] = DEFAULT_BLOCK_CLASSES,
) -> nn.Module:
    """Shard ``model`` with FSDP2 (``torch.distributed.fsdp.fully_shard``): each block (:func:`shard_units`) one
    unit, then the model the root unit; returns ``model`` (sharded in place).

    Call it on a model built on the meta device (then :func:`materialize_model`) or on a real one, in a
    LightningModule's ``configure_model`` under Lightning's ``ModelParallelStrategy`` (``mesh``:
    ``self.device_mesh["data_parallel"]``) or in a script after ``torch.distributed.init_process_group``.

    Precision: the blocks gather their parameters in ``mp_policy.param_dtype`` and reduce gradients in its
    ``reduce_dtype``; the root unit (patch embedding, prefix tokens, the position schemes with their learnable
    frequencies and tables, norms, head) keeps its parameters in their own dtype (fp32) and reduces in
    ``reduce_dtype``. Each block casts its token input to ``param_dtype`` itself, so that the position context it
    is given (rotary cos/sin tables, bias states, computed in fp32 by the root) is not cast with it as FSDP2's
    ``cast_forward_inputs`` would, and returns its tokens in the root's dtype (fp32). ``mp_policy.output_dtype``
    applies to the model's output.

    Args:
        model: a ``torch.nn.Module`` with transformer blocks (``visionpe_vit_*``, the video and multi-view ViTs, the
            open_clip tower, or any model whose blocks are ``block_classes``).
        mesh: a 1D ``DeviceMesh`` over the processes that shard (None: every process, on the default device type).
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` or None (full precision).
        reshard_after_forward: as ``fully_shard``'s; None (default): the blocks free their gathered parameters after
            forward, the root keeps them until backward (so the schemes' auxiliary losses, computed after the forward,
            read them gathered).
        offload_policy: a ``torch.distributed.fsdp.CPUOffloadPolicy`` or None.
        block_classes: the classes (or dotted names) of the blocks, as in :func:`resolve_block_classes`.

    Raises:
        TypeError: ``model``, ``mp_policy`` or ``reshard_after_forward`` has the wrong type.
        ValueError: no block matches ``block_classes``; the model is already sharded; or a position scheme sits
            inside a block (its parameters would be gathered in the blocks' low precision) while ``mp_policy``
            lowers the parameters' precision.

    Example (a LightningModule under ``ModelParallelStrategy``)::

        def configure_model(self):
            shard_model(self.model, mesh=self.device_mesh["data_parallel"],
                        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    check_instance(model, "model", nn.Module, expected="a torch.nn.Module")
    if mp_policy is not None:
        check_instance(mp_policy, "mp_policy", MixedPrecisionPolicy, expected="a MixedPrecisionPolicy or None")
    if reshard_after_forward is not None:
        check_bool(reshard_after_forward, "reshard_after_forward")
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("model is already sharded (it holds FSDP2 modules): shard_model shards a model once")
    units = shard_units(model, block_classes)
    policy = mp_policy or MixedPrecisionPolicy()
    param_dtype = policy.param_dtype
    lowers = param_dtype is not None and any(
        p.is_floating_point() and torch.finfo(p.dtype).bits > torch.finfo(param_dtype).bits for p in model.parameters()
    )
    if lowers:
        for unit in units:
            inner = [n for n, m in model.get_submodule(unit).named_modules() if isinstance(m, PositionEncoding)]
            if inner:
                raise ValueError(
                    f"position scheme(s) {[f'{unit}.{n}' for n in inner]} sit inside block {unit!r}, whose parameters "
                    f"are gathered in {param_dtype}: their angles would be computed from {param_dtype} parameters; "
                    "keep the schemes at model level or shard without lowering param_dtype"
                )
    common: dict[str, Any] = {"mesh": mesh}
    if offload_policy is not None:
        common["offload_policy"] = offload_policy
    root_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    block_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype,
        reduce_dtype=policy.reduce_dtype,
        output_dtype=root_dtype if param_dtype is not None else None,
        cast_forward_inputs=False,
    )
    root_policy = MixedPrecisionPolicy(
        reduce_dtype=policy.reduce_dtype, output_dtype=policy.output_dtype, cast_forward_inputs=True
    )
    block_reshard = True if reshard_after_forward is None else reshard_after_forward
    for unit in units:
        block = model.get_submodule(unit)
        fully_shard(block, mp_policy=block_policy, reshard_after_forward=block_reshard, **common)
        if param_dtype is not None:
            block.register_forward_pre_hook(_cast_tokens(param_dtype), with_kwargs=True)
    root_kwargs = {} if reshard_after_forward is None else {"reshard_after_forward": reshard_after_forward}
    fully_shard(model, mp_policy=root_policy, **root_kwargs, **common)
    return model


def materialize_model(
    model: nn.Module, device: torch.device | str, state_dict: Mapping[str, torch.Tensor] | None = None
) -> nn.Module:
    """Give a model built on the meta device (and sharded by :func:`shard_model`, or not) storage on ``device``,
    then its values; returns ``model``.

    ``to_empty`` allocates every parameter and buffer (each process its shards) and rebuilds the position schemes'
    fixed tables in fp32 (:class:`~visionpe.base.PositionEncoding`). Then, with ``state_dict`` (a full, unsharded
    state dict, e.g. the single-process model's, the same on every process), every process loads its shards of it
    (``torch.distributed.checkpoint.state_dict.set_model_state_dict``); without, the model's ``init_weights()`` when
    it has one (timm's models: timm's initialisation, which calls each scheme's
    :meth:`~visionpe.base.PositionEncoding.reset_parameters`), else every module's ``reset_parameters``, inner modules
    before the modules that hold them, so that a scheme's own initialisation is the one kept. Without a state dict the
    random draws of a sharded model are each process's own: load a state dict where runs must be reproducible.

    Raises:
        TypeError: ``model`` is not a module or ``state_dict`` not a mapping.
        ValueError: ``device`` is not a device, or the model holds no meta tensor (nothing to materialise).
    """
    check_instance(model, "model", nn.Module, expected="a torch.nn.Module")
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as err:
        raise ValueError(f"device must be a torch.device or its name, got {device!r}") from err
    if state_dict is not None:
        check_instance(state_dict, "state_dict", Mapping, expected="a mapping of names to tensors or None")
    tensors = [*model.parameters(), *model.buffers()]
    if not any(t.is_meta or getattr(getattr(t, "_local_tensor", None), "is_meta", False) for t in tensors):
        raise ValueError("model holds no meta-device tensor: materialize_model materialises a model built on 'meta'")
    model.to_empty(device=device)
    if state_dict is not None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, dict(state_dict), options=StateDictOptions(full_state_dict=True, strict=True))
        return model
    init_weights = getattr(model, "init_weights", None)
    if callable(init_weights):  # timm's models: their own initialisation, which calls the schemes' reset_parameters
        init_weights()
        return model
    for module in reversed(list(model.modules())):  # inner modules first
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
    return model
