"""FP8 scaling in one place: roles, quantizers, the FP8 operand type, the scaling state and its fused update.

A recipe (recipe.py) picks a Quantizer class (QUANTIZER_FOR_RECIPE); a module builds a QuantizerSet over its roles and
casts each tensor with `qset[Role.X].cast(x, transpose=...)`, getting an FP8Operand that the GEMM helpers take.
"""
from .factory import QUANTIZER_FOR_RECIPE, QuantizerSet, quantizer_class
from .gemm_ops import gemm, gemm_accumulate, gemm_gelu_to_fp8
from .operand import FP8Operand
from .quantizer import CurrentScalingQuantizer, DelayedScalingQuantizer, Quantizer
from .roles import ATTENTION_ROLES, GEMM_ROLES, MLP_ROLES, Role
from .state import ScalingState

__all__ = ["ATTENTION_ROLES", "CurrentScalingQuantizer", "DelayedScalingQuantizer", "FP8Operand", "GEMM_ROLES",
           "MLP_ROLES", "QUANTIZER_FOR_RECIPE", "Quantizer", "QuantizerSet", "Role", "ScalingState", "gemm",
           "gemm_accumulate", "gemm_gelu_to_fp8", "quantizer_class"]
