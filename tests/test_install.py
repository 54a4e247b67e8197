"""Installation: a missing or broken build is reported as such on import, and the set-up's up-to-date check."""
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from transformer_fp8 import _extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _build_stamp_module():
    spec = importlib.util.spec_from_file_location("build_stamp", os.path.join(ROOT, "tools", "build_stamp.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_import_without_the_extension_says_it_is_not_built(tmp_path):
    """The package without its compiled _C: the import error names the cause and the fix, not a circular import."""
    shutil.copytree(os.path.join(ROOT, "transformer_fp8"), tmp_path / "transformer_fp8",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    # (without the editable install's import hook, which would find this checkout's package instead of the copy)
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', "
            "'')]; sys.path.insert(0, sys.argv[1]); import transformer_fp8")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    assert "transformer_fp8's C++ extension is not built" in result.stderr
    assert "tools/setup.sh" in result.stderr
    assert "circular import" not in result.stderr


def test_load_error_names_the_last_build_errors(tmp_path, monkeypatch):
    log = tmp_path / "tfp8_build.log"
    log.write_text("[1/3] c++ ... ok\ncsrc/autograd_linear.cpp:129: error: 'deleteNode' is not a member\nninja: "
                   "build stopped: subcommand failed.\n")
    monkeypatch.setattr(_extension, "BUILD_LOG", str(log))

    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(_extension.importlib, "import_module", missing)
    with pytest.raises(ImportError, match="is not built") as info:
        _extension.load_extension()
    assert "'deleteNode' is not a member" in str(info.value) and str(log) in str(info.value)


def test_load_error_of_a_stale_build_says_it_failed_to_load(tmp_path, monkeypatch):
    monkeypatch.setattr(_extension, "BUILD_LOG", str(tmp_path / "absent.log"))

    def stale(name):
        raise ImportError("_C.so: undefined symbol: _ZN5torch8autograd10deleteNodeEPNS0_4NodeE")

    monkeypatch.setattr(_extension.importlib, "import_module", stale)
    with pytest.raises(ImportError, match="failed to load .*undefined symbol.*built against another torch"):
        _extension.load_extension()


def test_build_fingerprint_follows_sources_and_settings(tmp_path, monkeypatch):
    """tools/setup.sh skips the build when the fingerprint is unchanged: it must change with any build input."""
    stamp = _build_stamp_module()
    shutil.copytree(os.path.join(ROOT, "csrc"), tmp_path / "csrc")
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    monkeypatch.delenv("TFP8_FORCE_CPU", raising=False)
    first = stamp.fingerprint(str(tmp_path))
    assert stamp.fingerprint(str(tmp_path)) == first
    with open(tmp_path / "csrc" / "ops.cpp", "a") as source:
        source.write("\n// changed\n")
    changed_source = stamp.fingerprint(str(tmp_path))
    assert changed_source != first
    monkeypatch.setenv("TFP8_FORCE_CPU", "1")
    assert stamp.fingerprint(str(tmp_path)) != changed_source
