"""Build of inplace_abn: one extension, inplace_abn._C, holding the operator
schemas (src/ops.cpp), the CPU kernels (src/cpu) and, when CUDA is usable or
forced, the CUDA kernels (src/cuda).

Environment:
  INPLACE_ABN_FORCE_CUDA=1   compile the CUDA sources even without a GPU
                             (needs CUDA_HOME / nvcc; CI uses this)
  INPLACE_ABN_NO_CUDA=1      never compile the CUDA sources
  TORCH_CUDA_ARCH_LIST       CUDA architectures (default: the visible GPUs', or
                             Volta to Hopper + PTX when none is visible)
"""
import glob
import os

from setuptools import find_packages, setup

from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))


def _default_arch_list():
    """Volta to Hopper + PTX; CUDA 13 dropped Volta (sm_70), so start at Turing there."""
    import torch

    major = int((torch.version.cuda or "12").split(".")[0])
    return ("7.0;" if major < 13 else "") + "7.5;8.0;8.6;8.9;9.0+PTX"


def _flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _want_cuda():
    if _flag("INPLACE_ABN_NO_CUDA"):
        return False
    if _flag("INPLACE_ABN_FORCE_CUDA"):
        if CUDA_HOME is None:
            raise RuntimeError("INPLACE_ABN_FORCE_CUDA=1 but no CUDA toolkit was found: set CUDA_HOME")
        return True
    import torch

    return torch.cuda.is_available() and CUDA_HOME is not None


def _openmp_flags():
    """-fopenmp where torch's intra-op pool is OpenMP (the Linux wheels).

    at::parallel_for is a header template: compiled without OpenMP it runs
    every loop on one thread, whatever torch.get_num_threads() says. Linking
    with -fopenmp records libgomp.so.1, the same soname as torch's bundled
    copy, so the process still has one OpenMP runtime.
    """
    import sys

    import torch

    if sys.platform in ("win32", "darwin") or "OpenMP" not in torch.__config__.parallel_info():
        print("inplace_abn: building without OpenMP: the CPU kernels will run on one thread", file=sys.stderr)
        return []
    return ["-fopenmp"]


def _extensions():
    rel = lambda pattern: sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern)))
    sources = rel("src/*.cpp") + rel("src/cpu/*.cpp")
    omp = _openmp_flags()
    cxx = ["-O3", "-fvisibility=hidden"] + omp  # torch adds its -std (C++20 for torch 2.14)
    include_dirs = [os.path.join(HERE, "src")]
    cuda_sources = rel("src/cuda/*.cu")
    if _want_cuda() and cuda_sources:
        import torch

        if not torch.cuda.is_available():  # forced build: torch cannot detect the GPUs' archs
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", _default_arch_list())
        return [
            CUDAExtension(
                "inplace_abn._C",
                sources + cuda_sources,
                include_dirs=include_dirs,
                define_macros=[("INPLACE_ABN_WITH_CUDA", None)],
                extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]},
                extra_link_args=omp,
            )
        ]
    return [
        CppExtension("inplace_abn._C", sources, include_dirs=include_dirs, extra_compile_args={"cxx": cxx},
                     extra_link_args=omp)
    ]


setup(
    name="inplace_abn",
    version="2.0.0",
    description="In-Place Activated BatchNorm for memory-efficient training of deep networks",
    long_description=open(os.path.join(HERE, "README.md")).read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["inplace_abn", "inplace_abn.*"]),
    install_requires=["torch>=2.4"],
    extras_require={
        "test": ["pytest", "numpy", "torchvision"],
        "examples": ["torchvision", "tqdm", "matplotlib"],
    },
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildExtension},
    zip_safe=False,
)
