"""Use transformer_fp8 with existing models (Hugging Face transformers and plain PyTorch) without importing them."""
from .block_fp8_checkpoint import load_block_fp8_pretrained
from .causal_lm import causal_lm_loss
from .convert import convert_linear_layers, microbatch
from .gradient_checkpointing import gradient_checkpointing_enable
from .linear_cross_entropy import linear_cross_entropy
from .convert_model import Conversion, convert_model
from .graphed_decode import GreedyDecoder, greedy_generate
from .hf_export import save_hf_pretrained, to_hf_state_dict
from .hf_mapping import FusedWeight, WeightPart, layer_weight_map
from .llama import LlamaTransformerLayer, convert_llama
from .moe_decoder import MoETransformerLayer
from .trainer import FP8TrainerMixin, __getattr__  # noqa: F401  (FP8Trainer: built on first use, imports transformers)

__all__ = ["Conversion", "FusedWeight", "GreedyDecoder", "LlamaTransformerLayer", "MoETransformerLayer", "WeightPart",
           "convert_model", "greedy_generate", "layer_weight_map", "save_hf_pretrained", "to_hf_state_dict",
           "causal_lm_loss", "convert_linear_layers", "convert_llama", "gradient_checkpointing_enable",
           "linear_cross_entropy", "microbatch", "load_block_fp8_pretrained"]
