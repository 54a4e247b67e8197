"""FP8Trainer: a converted Hugging Face model trains under transformers.Trainer (its own loop, activation
checkpointing, evaluation, save_model) with every forward inside fp8_autocast. CPU, tiny random-init Llama, no
download: the FP8 GEMMs run on the CPU reference kernels."""
import dataclasses
import math
import subprocess
import sys

import pytest
import torch

import transformer_fp8 as te
from transformer_fp8 import recipe
from transformer_fp8.integrations import convert_linear_layers, convert_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # (Trainer needs it)
safetensors_torch = pytest.importorskip("safetensors.torch")

from transformer_fp8.integrations import FP8Trainer, FP8TrainerMixin  # noqa: E402  (after the skips)
from transformer_fp8.integrations.trainer import use_fp8_checkpoint  # noqa: E402
from tests.utils import checkout_env  # noqa: E402

VOCAB, SEQ, SEQUENCES = 128, 32, 8
TRAINING_FIELDS = {field.name for field in dataclasses.fields(transformers.TrainingArguments)}
# transformers >= 5.2x names it activation_checkpointing; older versions gradient_checkpointing
CHECKPOINTING = next(name for name in ("activation_checkpointing", "gradient_checkpointing") if name in TRAINING_FIELDS)


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      use_cache=False)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


class TokenWindows(torch.utils.data.Dataset):
    """A few fixed random sequences (a model can learn them in a few steps, so the loss falls)."""

    def __init__(self, n=SEQUENCES, seed=1):
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def training_args(out, checkpointing=False, **overrides):
    kwargs = dict(output_dir=str(out), use_cpu=True, max_steps=6, per_device_train_batch_size=4,
                  per_device_eval_batch_size=4, learning_rate=3e-3, lr_scheduler_type="constant", warmup_steps=0,
                  logging_steps=1, save_strategy="no", report_to=[], seed=0, data_seed=0, disable_tqdm=True,
                  dataloader_num_workers=0)
    kwargs[CHECKPOINTING] = checkpointing
    kwargs.update(overrides)
    return transformers.TrainingArguments(**kwargs)


def logged_losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


class FP8Spy:
    """Forward hooks on the model's transformer_fp8 modules that record whether FP8 was enabled at each call."""

    def __init__(self, model):
        self.enabled = []
        self.handles = [m.register_forward_pre_hook(lambda *_: self.enabled.append(te.is_fp8_enabled()))
                        for m in model.modules() if isinstance(m, (te.TransformerLayer, te.Linear))]
        assert self.handles, "no transformer_fp8 module in the model"


def train(model, out, fp8_enabled=True, checkpointing=False, **overrides):
    trainer = FP8Trainer(model=model, args=training_args(out, checkpointing, **overrides),
                         train_dataset=TokenWindows(), eval_dataset=TokenWindows(n=4, seed=2),
                         fp8_recipe=recipe.DelayedScaling(amax_history_len=4), fp8_enabled=fp8_enabled)
    trainer.train()
    return trainer


def fp8_gemm_modules_ran_fp8(model):
    """True when every FP8 GEMM module of the model has recorded amaxes: its FP8 path ran (the high-precision path,
    e.g. the small-shape one on a GPU, leaves the scaling state untouched)."""
    modules = [m for m in model.modules() if isinstance(m, (te.Linear, te.LayerNormLinear, te.LayerNormMLP))]
    return bool(modules) and all(m.fp8_fwd is not None and m.fp8_fwd.amax_history.abs().sum() > 0 for m in modules)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_converted_llama_trains_checkpointed_in_fp8_and_its_saved_weights_reload(tmp_path, device, monkeypatch):
    if device == "cuda":  # the tiny GEMMs would take the small-shape high-precision path: make them run FP8
        monkeypatch.setattr(te.module.base, "FP8_MIN_GEMM_SIZE", 0)
    model = convert_llama(tiny_llama().to(device))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    spy = FP8Spy(model)
    trainer = train(model, tmp_path / "run", checkpointing=True, use_cpu=device == "cpu")

    layers = [m for m in model.modules() if type(m).__name__ == "LlamaTransformerLayer"]
    assert len(layers) == 2 and all(layer.gradient_checkpointing for layer in layers)
    assert next(model.parameters()).device.type == device
    losses = logged_losses(trainer)
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.1, losses  # the fixed sequences are being learnt
    # every forward of the decoder layers (and their recomputes) ran with FP8 enabled, through the FP8 path
    assert len(spy.enabled) >= 6 * 2 and all(spy.enabled)
    assert fp8_gemm_modules_ran_fp8(model)
    changed = [name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])]
    assert len(changed) == len(before), sorted(set(before) - set(changed))

    spy.enabled.clear()
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"]) and spy.enabled and all(spy.enabled)  # evaluation in FP8 too

    trainer.save_model(str(tmp_path / "saved"))
    batch = TokenWindows(n=2, seed=3).ids.to(device)
    model.eval()
    with torch.no_grad():
        trained_logits = model(input_ids=batch).logits
    assert_reloads(tmp_path / "saved", batch, trained_logits)


def assert_reloads(folder, batch, trained_logits):
    """The saved folder gives the trained model back: a checkpoint under Hugging Face names loads with plain
    transformers (BF16 tolerance: other kernels) and, converted again, gives the trained logits exactly; one under
    our names loads into a freshly converted model."""
    state = safetensors_torch.load_file(str(folder / "model.safetensors"))
    if not any(".layer.self_attention." in key for key in state):  # a checkpoint under Hugging Face names
        reloaded = transformers.LlamaForCausalLM.from_pretrained(str(folder)).to(batch.device).eval()
        with torch.no_grad():
            torch.testing.assert_close(reloaded(input_ids=batch).logits, trained_logits, rtol=0.05, atol=0.05)
        convert_llama(reloaded)
    else:  # our converted model's own names
        reloaded = convert_llama(tiny_llama(seed=123).to(batch.device)).eval()  # all weights must come from the file
        missing, unexpected = reloaded.load_state_dict(state, strict=False)
        assert not unexpected and all(key.endswith("_extra_state") for key in missing), (missing, unexpected)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=batch).logits, trained_logits, rtol=0, atol=0)


def test_fp8_tracks_the_high_precision_run_of_the_same_trainer(tmp_path):
    """Same init, same batches: the FP8 run's losses stay within 2% of the fp8_enabled=False run's, and differ
    from them (FP8 really ran)."""
    runs = {}
    for fp8_enabled in (False, True):
        trainer = train(convert_llama(tiny_llama()), tmp_path / str(fp8_enabled), fp8_enabled=fp8_enabled)
        runs[fp8_enabled] = logged_losses(trainer)
    assert runs[True] != runs[False]
    for high, fp8 in zip(runs[False], runs[True]):
        assert abs(fp8 - high) < 0.02 * high, (runs[False], runs[True])


def test_linear_converted_model_recomputes_with_the_fp8_checkpoint(tmp_path):
    """After convert_linear_layers, transformers' own decoder layers are checkpointed: without the trainer's switch
    to transformer_fp8.checkpoint our Linear layers would refuse torch.utils.checkpoint's high-precision recompute."""
    model = convert_linear_layers(tiny_llama(), exclude=["lm_head"])
    spy = FP8Spy(model)
    trainer = train(model, tmp_path / "run", checkpointing=True, max_steps=3)
    hf_layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    assert hf_layers and all(layer._gradient_checkpointing_func is te.checkpoint for layer in hf_layers)
    losses = logged_losses(trainer)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    # forward + recompute of each Linear (7 per layer, 2 layers) in each of the 3 steps, all in FP8
    assert len(spy.enabled) == 3 * 2 * 7 * 2 and all(spy.enabled)


def test_use_fp8_checkpoint_only_touches_checkpointed_layers():
    model = tiny_llama()
    assert use_fp8_checkpoint(model) == 0  # checkpointing off: nothing replaced
    # transformers' switch under its current name (activation_checkpointing_enable from 5.2x)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    assert use_fp8_checkpoint(model) >= 2


@pytest.mark.parametrize("option, value", [("offload", True), ("every_n_layers", 2)])
def test_checkpointing_options_we_cannot_honour_are_refused(tmp_path, option, value):
    args = training_args(tmp_path, checkpointing=True, **{f"{CHECKPOINTING}_kwargs": {option: value}})
    with pytest.raises(NotImplementedError, match=f"activation_checkpointing_kwargs\\['{option}'\\]"):
        FP8Trainer(model=convert_llama(tiny_llama()), args=args, train_dataset=TokenWindows())


def test_bad_fp8_arguments_are_refused(tmp_path):
    with pytest.raises(TypeError, match="fp8_recipe: expected"):
        FP8Trainer(model=tiny_llama(), args=training_args(tmp_path), fp8_recipe="hybrid")
    with pytest.raises(TypeError, match="fp8_enabled: expected a bool"):
        FP8Trainer(model=tiny_llama(), args=training_args(tmp_path), fp8_enabled=1)


def test_the_mixin_combines_with_another_trainer_subclass(tmp_path):
    class LoggingTrainer(transformers.Trainer):
        calls = 0

        def compute_loss(self, *args, **kwargs):
            LoggingTrainer.calls += 1
            return super().compute_loss(*args, **kwargs)

    class MyTrainer(FP8TrainerMixin, LoggingTrainer):
        pass

    model = convert_llama(tiny_llama())
    spy = FP8Spy(model)
    MyTrainer(model=model, args=training_args(tmp_path, max_steps=2), train_dataset=TokenWindows()).train()
    assert LoggingTrainer.calls == 2 and spy.enabled and all(spy.enabled)


def test_importing_the_integrations_does_not_import_the_trainer():
    code = ("import sys, transformer_fp8.integrations as i; assert 'transformers.trainer' not in sys.modules; "
            "i.FP8Trainer; assert 'transformers.trainer' in sys.modules; assert i.FP8Trainer is i.FP8Trainer")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, env=checkout_env())
