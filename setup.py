"""Build transformer_fp8's C++/CUDA extension.

With nvcc (CUDA_HOME) present the CUDA kernels are built (default arch 9.0a, override with TORCH_CUDA_ARCH_LIST);
without it only the op schemas are built and the package runs on its CPU reference kernels.
TFP8_ONLY=quantize,gemm restricts the CUDA build to those op families (a quick partial build while developing).
The attention family (cuDNN graph API) needs the header-only cudnn-frontend (pip package nvidia-cudnn-frontend,
installed by tools/setup.sh); without it that family is left out, with a message.
"""
import glob
import os
import sys
import sysconfig

from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
# Built in every configuration: the schemas, the composite ops, the C++ autograd nodes and the Python module.
BASE_SOURCES = ["csrc/ops.cpp", "csrc/composite.cpp", "csrc/autograd_linear.cpp", "csrc/autograd_attention.cpp",
                "csrc/linear_inference.cpp", "csrc/python_module.cpp", "csrc/delayed_update_queue.cpp"]
FAMILIES = ("quantize", "gemm", "norm", "activation", "scaling", "rope", "loss", "attention", "moe", "grouped",
            "optim")


def cuda_families():
    only = [f for f in os.environ.get("TFP8_ONLY", "").split(",") if f]
    unknown = set(only) - set(FAMILIES)
    if unknown:
        sys.exit(f"TFP8_ONLY: unknown op families {sorted(unknown)}; expected some of {FAMILIES}")
    families = only or list(FAMILIES)
    if "attention" in families and not (cudnn_frontend_include() and cudnn_dirs()[0]):
        why = ("the attention family needs the cudnn-frontend headers (pip install --no-deps nvidia-cudnn-frontend) "
               "and the nvidia-cudnn pip package torch loads")
        if only:
            sys.exit(f"TFP8_ONLY: {why}")
        print(f"transformer_fp8: building without the attention family: {why} (DotProductAttention keeps its "
              f"PyTorch backend)")
        families.remove("attention")
    if "grouped" in families and not cutlass_include():
        why = ("the grouped family (our CUTLASS grouped FP8 GEMM) needs the CUTLASS headers (pip install --no-deps "
               "nvidia-cutlass, or TFP8_CUTLASS_INCLUDE=<cutlass>/include)")
        if only:
            sys.exit(f"TFP8_ONLY: {why}")
        print(f"transformer_fp8: building without the grouped family: {why} (GroupedLinear keeps torch's kernel)")
        families.remove("grouped")
    return families


def cuda_sources(families):
    sources = []
    for family in families:
        sources += sorted(glob.glob(os.path.join("csrc", f"{family}*.cu")))
        sources += sorted(glob.glob(os.path.join("csrc", f"{family}*.cpp")))
    return sources


def cudnn_dirs():
    """Headers and library of the cuDNN that torch itself loads (the nvidia-cudnn pip package)."""
    try:
        import nvidia.cudnn
    except ImportError:
        return [], []
    root = list(nvidia.cudnn.__path__)[0]
    return [os.path.join(root, "include")], [os.path.join(root, "lib")]


def cudnn_frontend_include():
    """The include folder of the header-only cuDNN frontend (the nvidia-cudnn-frontend pip package), or None."""
    from importlib import metadata

    try:
        include = metadata.distribution("nvidia-cudnn-frontend").locate_file("include")
    except metadata.PackageNotFoundError:
        return None
    return str(include) if os.path.isfile(os.path.join(str(include), "cudnn_frontend.h")) else None


def cutlass_include():
    """The CUTLASS 3 include folder: TFP8_CUTLASS_INCLUDE, else the nvidia-cutlass pip package's, or None."""
    from importlib import metadata

    candidates = [os.environ.get("TFP8_CUTLASS_INCLUDE", "")]
    try:
        candidates.append(str(metadata.distribution("nvidia-cutlass").locate_file("cutlass_library/source/include")))
    except metadata.PackageNotFoundError:
        pass
    return next((c for c in candidates if c and os.path.isfile(os.path.join(c, "cutlass", "cutlass.h"))), None)


def link_without_symbolic_functions():
    """Some Pythons (Debian/Ubuntu builds) link extensions with -Bsymbolic-functions. With a newer g++ than the one that
    built torch, the libstdc++ stream templates instantiated in our library then bind to our own copies, which crash
    when formatting numbers (seen on the H100 image, g++ 13.3: torch's error messages and cudnn-frontend's plan
    names). Link without it: C++ extensions link with LDCXXSHARED, C ones with LDSHARED."""
    for var in ("LDSHARED", "LDCXXSHARED"):
        flags = sysconfig.get_config_var(var) or ""
        if var not in os.environ and "-Bsymbolic-functions" in flags:
            os.environ[var] = flags.replace("-Wl,-Bsymbolic-functions", "")


def building_wheel():
    """TFP8_WHEEL=1 (tools/build_wheel.sh): a wheel to install elsewhere, tied to the torch it is built against."""
    return os.environ.get("TFP8_WHEEL") == "1"


def torch_cuda_major():
    import torch

    return (torch.version.cuda or "0").split(".")[0]


def torch_requirement():
    """The torch versions this package is tested with; a wheel takes only the torch minor it was compiled against (the
    extension uses torch's C++ ABI, which changes between minor versions)."""
    if building_wheel():
        import torch

        major, minor = torch.__version__.split("+")[0].split(".")[:2]
        return f"torch=={major}.{minor}.*"
    return "torch>=2.11,<2.16"


def extension():
    if os.environ.get("TFP8_FORCE_CPU") == "1" or CUDA_HOME is None:
        print("transformer_fp8: no CUDA toolkit found (or TFP8_FORCE_CPU=1): building the CPU-only extension")
        return CppExtension("transformer_fp8._C", BASE_SOURCES, extra_compile_args={"cxx": ["-O2"]})
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    link_without_symbolic_functions()
    cudnn_include, cudnn_lib = cudnn_dirs()
    families = cuda_families()
    include_dirs, link_args = [os.path.join(ROOT, "csrc")] + cudnn_include, []
    if "attention" in families:
        # The cuDNN torch loads (its folder as rpath, the soname torch links) and NVRTC, which the frontend's
        # headers reference (an experimental engine we never build): the toolkit's, unless torch loaded its own.
        include_dirs.append(cudnn_frontend_include())
        rpaths = cudnn_lib + [os.path.join(CUDA_HOME, "lib64")]
        if building_wheel():  # the user's site-packages, where torch's CUDA wheels keep these libraries
            rpaths = ["$ORIGIN/../nvidia/cudnn/lib", f"$ORIGIN/../nvidia/cu{torch_cuda_major()}/lib"]
        link_args = [f"-Wl,-rpath,{d}" for d in rpaths] + ["-l:libcudnn.so.9", "-lnvrtc"]
    if "grouped" in families:
        include_dirs.append(cutlass_include())
    if building_wheel():  # no host debug info in what users download (Python's CFLAGS carry -g)
        link_args.append("-Wl,--strip-debug")
    return CUDAExtension(
        "transformer_fp8._C",
        BASE_SOURCES + cuda_sources(families),
        include_dirs=include_dirs,
        library_dirs=cudnn_lib,
        libraries=["cublasLt"],
        extra_link_args=link_args,
        define_macros=[("TFP8_WITH_CUDA", "1")],
        extra_compile_args={
            "cxx": ["-O3"],
            # (no -std: torch adds the C++ standard its headers need, C++17 up to torch 2.12, C++20 after)
            "nvcc": ["-O3", "--expt-relaxed-constexpr", "-lineinfo"],
        },
    )


setup(
    name="transformer_fp8",
    packages=find_packages(include=["transformer_fp8", "transformer_fp8.*"]),
    install_requires=[torch_requirement(), "numpy"],
    # TFP8_NO_EXTENSION=1: register the package only (tools/setup.sh builds the extension in place before that)
    ext_modules=[] if os.environ.get("TFP8_NO_EXTENSION") == "1" else [extension()],
    cmdclass={"build_ext": BuildExtension},
)
