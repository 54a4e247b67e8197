"""Train a converted model with Hugging Face's `transformers.Trainer`, its forward inside `fp8_autocast`.

    from transformer_fp8.integrations import FP8Trainer, convert_llama
    model = convert_llama(LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
    trainer = FP8Trainer(model=model, args=TrainingArguments(..., activation_checkpointing=True),
                         train_dataset=dataset, fp8_recipe=recipe.DelayedScaling())
    trainer.train()
    trainer.save_model(out)

Why a Trainer subclass (and not a callback or a model wrapper): the FP8 context has to surround each forward and
nothing else, and Trainer has an extension point made for exactly that, `compute_loss_context_manager()`, which both
its training step and its evaluation step enter around the forward (the backward runs after it, as fp8_autocast
expects). A TrainerCallback cannot do it: callbacks run between steps, not around the forward. A wrapper module would
do it, but it changes the model's class and its state-dict names, so `save_model`, `activation_checkpointing_enable`,
PEFT and `generate` would see something other than the Hugging Face model they know. The subclass leaves the model
untouched. `FP8TrainerMixin` carries the behaviour for users who already subclass Trainer (e.g. TRL's SFTTrainer):
`class MyTrainer(FP8TrainerMixin, SFTTrainer)`.

Activation checkpointing: `TrainingArguments(activation_checkpointing=True)` (`gradient_checkpointing=True` before
transformers 5.2x) works. Layers from `convert_llama` checkpoint themselves with `transformer_fp8.checkpoint`; for
other models (e.g. after `convert_linear_layers`) the trainer sets `transformer_fp8.checkpoint` as the layers'
checkpoint function when training starts, so FP8 modules recompute in FP8 with the forward's scales. The checkpointing
options `offload` and `every_n_layers` (other than 1) are refused: our checkpoint function does not offload, and
converted layers do not count themselves in `every_n_layers`.

Gradient accumulation: every micro-batch's forward is its own fp8_autocast, so delayed scales update after each one
(as when fp8_autocast wraps each forward by hand); the FP8 weights are cast again for every micro-batch.

Importing this module does not import transformers; `FP8Trainer` is built on first access.
"""
import contextlib
from typing import Any

from ..autocast import fp8_autocast
from ..checkpoint import checkpoint
from ..recipe import DelayedScaling, Float8CurrentScaling

UNSUPPORTED_CHECKPOINTING_OPTIONS = {"offload": False, "every_n_layers": 1}  # option -> the only value we take


class FP8TrainerMixin:
    """Mix into a `transformers.Trainer` class (before it in the bases) to run every forward of training and
    evaluation inside `fp8_autocast(enabled=fp8_enabled, fp8_recipe=fp8_recipe, fp8_group=fp8_group)`.

    Args:
        *args: passed to the Trainer class.
        fp8_recipe: a `recipe.DelayedScaling` or `recipe.Float8CurrentScaling` (None: `DelayedScaling()`).
        fp8_enabled: False runs the same loop in high precision (a BF16 baseline with the same trainer).
        fp8_group: process group whose ranks share amaxes (fp8_autocast's argument; None: the default group when
            torch.distributed is initialised, as in fp8_autocast).
        **kwargs: passed to the Trainer class.

    Raises:
        TypeError: fp8_recipe or fp8_enabled of the wrong type.
        NotImplementedError: activation checkpointing options we cannot honour (`offload`, `every_n_layers` > 1).
    """

    def __init__(self, *args: Any, fp8_recipe: Any = None, fp8_enabled: bool = True, fp8_group: Any = None,
                 **kwargs: Any) -> None:
        if fp8_recipe is not None and not isinstance(fp8_recipe, (DelayedScaling, Float8CurrentScaling)):
            raise TypeError(f"fp8_recipe: expected None, recipe.DelayedScaling or recipe.Float8CurrentScaling, got "
                            f"{fp8_recipe!r}")
        if not isinstance(fp8_enabled, bool):
            raise TypeError(f"fp8_enabled: expected a bool, got {fp8_enabled!r}")
        self.fp8_recipe, self.fp8_enabled, self.fp8_group = fp8_recipe, fp8_enabled, fp8_group
        super().__init__(*args, **kwargs)
        _check_checkpointing_options(self.args)
        self.add_callback(_fp8_checkpoint_callback())

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        """Trainer's context around each forward (training and evaluation), with fp8_autocast entered last.

        Returns:
            An ExitStack holding the Trainer's own context and `fp8_autocast(...)`, both entered.
        """
        stack = contextlib.ExitStack()  # (older transformers return a plain context manager, newer an ExitStack)
        stack.enter_context(super().compute_loss_context_manager())
        stack.enter_context(fp8_autocast(enabled=self.fp8_enabled, fp8_recipe=self.fp8_recipe,
                                         fp8_group=self.fp8_group))
        return stack


def _check_checkpointing_options(args: Any) -> None:
    """Refuse activation checkpointing options that transformer_fp8.checkpoint would silently drop."""
    enabled = getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False)
    if not enabled:
        return
    options = getattr(args, "activation_checkpointing_kwargs", None) or \
        getattr(args, "gradient_checkpointing_kwargs", None) or {}
    for name, supported in UNSUPPORTED_CHECKPOINTING_OPTIONS.items():
        if name in options and options[name] != supported:
            raise NotImplementedError(f"activation_checkpointing_kwargs[{name!r}] = {options[name]!r}: not supported "
                                      f"by FP8Trainer (transformer_fp8.checkpoint recomputes every checkpointed layer "
                                      f"in FP8 and keeps its inputs on the device); use {supported!r}")


def use_fp8_checkpoint(model: Any) -> int:
    """Make every layer that transformers checkpoints call transformer_fp8.checkpoint (FP8 recompute with the
    forward's scales) instead of torch.utils.checkpoint.

    Args:
        model: a model after transformers' activation_checkpointing_enable().

    Returns:
        The number of layers whose checkpoint function was replaced.
    """
    replaced = 0
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = checkpoint
            replaced += 1
    return replaced


def _fp8_checkpoint_callback() -> Any:
    """A TrainerCallback that calls use_fp8_checkpoint on the model when training begins (after Trainer has enabled
    activation checkpointing)."""
    from transformers import TrainerCallback

    class UseFP8Checkpoint(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if model is not None:
                use_fp8_checkpoint(model)

    return UseFP8Checkpoint()


def _build_fp8_trainer() -> type:
    from transformers import Trainer

    class FP8Trainer(FP8TrainerMixin, Trainer):
        """`transformers.Trainer` with every forward inside fp8_autocast: see FP8TrainerMixin for the arguments
        (fp8_recipe, fp8_enabled, fp8_group) and the module docstring for why a subclass."""

    FP8Trainer.__module__ = __name__
    return FP8Trainer


def __getattr__(name: str) -> Any:
    """FP8Trainer subclasses transformers.Trainer, so it is built (importing transformers) on first access."""
    if name == "FP8Trainer":
        if "FP8Trainer" not in globals():
            globals()["FP8Trainer"] = _build_fp8_trainer()
        return globals()["FP8Trainer"]
    raise AttributeError(f"transformer_fp8.integrations has no attribute {name!r}")
