"""Moved to transformer_fp8.quantization.compiled_backward (this name stays importable)."""
from ..quantization.compiled_backward import _FILED, file_backward_state, queue_backward_update  # noqa: F401
