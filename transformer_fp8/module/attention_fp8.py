"""Moved to transformer_fp8.attention.fp8. This former path is that module itself (sys.modules), so that imports
and monkeypatches through it reach the one module."""
import sys

from ..attention import fp8 as _moved

sys.modules[__name__] = _moved
