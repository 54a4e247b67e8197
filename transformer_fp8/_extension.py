"""Loading the compiled extension `transformer_fp8._C`, with an error that says what went wrong.

Without this, a missing or broken build surfaces as Python's "cannot import name '_C' from partially initialized
module 'transformer_fp8' (most likely due to a circular import)", which names neither the cause nor the fix.
"""
import importlib
import os
import re
from types import ModuleType

# tools/setup.sh (and tools/build_wheel.sh) keep the output of the last build here.
BUILD_LOG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "tfp8_build.log")
_LOG_LINES = 25
_ERROR_LINE = re.compile(r"\berror\b|^FAILED", re.IGNORECASE)


def _last_build_errors() -> str:
    """The error lines (or, if none stand out, the last lines) of the last build's log; "" when there is none."""
    try:
        with open(BUILD_LOG, encoding="utf-8", errors="replace") as log:
            lines = log.read().splitlines()
    except OSError:
        return ""
    errors = [line for line in lines if _ERROR_LINE.search(line)]
    return "\n".join((errors or lines)[-_LOG_LINES:])


def load_extension() -> ModuleType:
    """Import and return `transformer_fp8._C` (which registers the op schemas and kernels).

    Returns:
        The extension module.

    Raises:
        ImportError: naming what failed (not built, or built against another torch), how to build it, and the last
            build's errors when a log of it exists.
    """
    try:
        return importlib.import_module("transformer_fp8._C")
    except ImportError as err:
        import torch

        reason = ("is not built" if isinstance(err, ModuleNotFoundError) and err.name == "transformer_fp8._C"
                  else f"failed to load ({err}); it may have been built against another torch than this one "
                       f"({torch.__version__})")
        message = (f"transformer_fp8's C++ extension {reason}. Build it with `bash tools/setup.sh` (or, with torch, "
                   f"setuptools, wheel and ninja installed: `pip install --no-build-isolation -e .`), or install a "
                   f"prebuilt wheel made for this torch.")
        errors = _last_build_errors()
        if errors:
            message += f"\nLast build's errors ({BUILD_LOG}):\n{errors}"
        raise ImportError(message) from err
