"""LoRA on FP8 base weights, saved in PEFT's format.

    model = convert_llama(hf_model)                       # or convert_model / convert_linear_layers
    add_lora(model, r=16, alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                    "gate_proj", "up_proj", "down_proj"], fp8_weights=True)
    optimizer = torch.optim.AdamW(lora_parameters(model), lr=1e-4)
    with fp8_autocast(): loss = causal_lm_loss(model, batch)   # base GEMMs in FP8, adapters in BF16
    save_lora(model, "adapter")        # peft.PeftModel.from_pretrained(original_hf_model, "adapter") loads it
    load_lora(converted_model, "adapter");  merge_lora(model)  # fold the adapters into the base weights

While a (transformers) model has adapters, model.save_pretrained(dir) writes them in PEFT's format too, as PEFT's
PeftModel does: integrations.FP8Trainer trains and saves a LoRA model unchanged. A plain Hugging Face checkpoint of
the fine-tuned model: merge_lora(model), then model.save_pretrained(dir).
Adapters are named and targeted by Hugging Face module names (PEFT's LoraConfig). On our fused GEMMs (q|k|v in the
QKV LayerNormLinear, gate|up in the MLP's FC1) each adapter adds to its own rows of the output. Frozen base weights
get no weight gradient (no wgrad GEMM, no FP8 transpose of the GEMM input) and, with fp8_weights, are stored in FP8.
Their dgrad GEMMs read Wᵀ: one FP8 byte transpose per weight per backward, or none after the first with
add_lora(..., cache_weight_transpose=True), which keeps each transpose (one more byte per frozen parameter).
MoE models: the experts (GroupedLinear) take no adapters (target_modules naming an expert weight are refused,
"all-linear" leaves them out with a warning: find_expert_weights lists them); their frozen weights are stored in FP8
with fp8_weights like the others.
"""
from .adapter import LoraAdapter
from .layers import LoraLayerNormLinear, LoraLayerNormMLP, LoraLinear
from .model import (add_lora, cast_frozen_weights_to_fp8, lora_adapters, lora_parameters, merge_lora,
                    remove_lora)
from .peft_format import load_lora, lora_state_dict, read_lora_config, save_lora
from .targets import Projection, find_expert_weights, find_projections

__all__ = ["LoraAdapter", "LoraLayerNormLinear", "LoraLayerNormMLP", "LoraLinear", "Projection", "add_lora",
           "cast_frozen_weights_to_fp8", "find_expert_weights", "find_projections", "load_lora", "lora_adapters",
           "lora_parameters", "lora_state_dict", "merge_lora", "read_lora_config", "remove_lora", "save_lora"]
