import pytest
import torch


def fp8_gpu_available():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def pytest_collection_modifyitems(config, items):
    if fp8_gpu_available():
        import transformer_fp8

        if transformer_fp8.cuda_kernels_available(any):
            return
        reason = "transformer_fp8 was built without its CUDA kernels"
    else:
        reason = "needs a CUDA GPU with FP8 support (sm_89+)"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture(autouse=True)
def _fp8_at_every_size(monkeypatch):
    """The FP8 modules take their FP8 path at every GEMM size in tests (no small-shape automatic path); tests of that
    path set the threshold themselves."""
    monkeypatch.setattr("transformer_fp8.module.base.FP8_MIN_GEMM_SIZE", 0)
