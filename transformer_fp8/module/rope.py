"""Moved to transformer_fp8.attention.rope. This former path is that module itself (sys.modules), so that imports
and monkeypatches through it reach the one module."""
import sys

from ..attention import rope as _moved

sys.modules[__name__] = _moved
