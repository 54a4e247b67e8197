"""Print a fingerprint of everything the compiled extension depends on, for tools/setup.sh's up-to-date check.

Covers the C++/CUDA sources, the build scripts, the torch, Python, CUDA toolkit, cuDNN frontend and CUTLASS
versions, and the environment variables that change the build. Same fingerprint as at the last successful build ->
nothing to rebuild.
"""
import glob
import hashlib
import os
import subprocess
import sys
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_INPUTS = ("csrc/*", "setup.py", "pyproject.toml")
BUILD_ENV = ("TFP8_FORCE_CPU", "TFP8_ONLY", "TORCH_CUDA_ARCH_LIST", "CUDA_HOME", "TFP8_WHEEL")


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "absent"


def _nvcc_version() -> str:
    try:
        return subprocess.run(["nvcc", "--version"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return "absent"


def fingerprint(root: str = ROOT) -> str:
    """Args:
        root: the checkout whose build inputs are hashed.

    Returns:
        A hex digest that changes whenever a build input, a relevant version or a build setting changes.
    """
    import torch

    digest = hashlib.sha256()
    for pattern in BUILD_INPUTS:
        for path in sorted(glob.glob(os.path.join(root, pattern))):
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as source:
                digest.update(source.read())
    facts = [sys.version, torch.__version__, str(torch.version.cuda), _nvcc_version(),
             _version("nvidia-cudnn-frontend"), _version("nvidia-cudnn-cu13"),
             _version("nvidia-cutlass")]
    facts += [f"{name}={os.environ.get(name, '')}" for name in BUILD_ENV]
    digest.update("\n".join(facts).encode())
    return digest.hexdigest()


if __name__ == "__main__":
    print(fingerprint())
