"""Build of inplace_abn: one extension, inplace_abn._C, holding the operator
schemas and device-agnostic front ends (src/ops), the CPU kernels (src/cpu)
and, when CUDA is usable or forced, the CUDA kernels (src/cuda).

The CPU kernels (src/cpu/*_kernel.cpp) are compiled once per instruction set,
as ATen compiles its native/cpu kernels: each object with its ISA's flags and
-DCPU_CAPABILITY=<ISA> -DCPU_CAPABILITY_<ISA> (which select at::vec's
implementation and the kernels' namespace); src/cpu/dispatch.cpp picks one at
run time. The baseline (DEFAULT) objects come first on the link line, so the
linker keeps their copies of inline functions shared with the ISA objects.

Environment:
  INPLACE_ABN_FORCE_CUDA=1   compile the CUDA sources even without a GPU
                             (needs CUDA_HOME / nvcc; CI uses this)
  INPLACE_ABN_NO_CUDA=1      never compile the CUDA sources
  TORCH_CUDA_ARCH_LIST       CUDA architectures (default: the visible GPUs', or
                             Volta to Hopper + PTX when none is visible)
  INPLACE_ABN_NO_AVX=1       build the CPU kernels for DEFAULT only (no AVX2 /
                             AVX512 variants; at::vec's default path, NEON on
                             aarch64); CI tests this build too
"""
import glob
import os
import platform
import sys

from setuptools import find_packages, setup

from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension, check_compiler_is_gcc

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
    import torch

    if sys.platform in ("win32", "darwin") or "OpenMP" not in torch.__config__.parallel_info():
        print("inplace_abn: building without OpenMP: the CPU kernels will run on one thread", file=sys.stderr)
        return []
    return ["-fopenmp"]


def _rel(pattern):
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern)))


KERNEL_SOURCES = _rel("src/cpu/*_kernel.cpp")


def _cpu_capabilities(gcc=False):
    """(ISA, compiler flags) for each build of the CPU kernels, baseline first (flags as ATen's)."""
    isas = [("DEFAULT", [])]
    if platform.machine().lower() in ("x86_64", "amd64") and sys.platform != "win32" and not _flag("INPLACE_ABN_NO_AVX"):
        avx2 = ["-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2"]
        avx512 = avx2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
        # AVX2: GCC's scheduling before register allocation (off by default on x86)
        # interleaves the 2-4 independent SiLU inverses of a reduction's loop pass:
        # backward_reduce keeping z, 1 thread, 4.91-5.02 -> 4.61-4.68 ms at 16x64x56x56,
        # 0.64 -> 0.59 at 16x512x7x7 (bench_cpu_ops.py); on AVX512 0-4% slower, so not there.
        sched = ["-fschedule-insns", "-fsched-pressure"] if gcc else []
        # AVX2: GCC's inlining budget per file (40% growth) ran out in every backward kernel file, and which element
        # function it then called out of line (a call per vector, the vectors through memory) moved with each change
        # to the file: the ELU inverse, the SiLU table, vlog, the partial loads (perf: 2-10% of a layer step each).
        # Not AVX512: there the one-pass kernels got slower with it (contiguous 16x512x7x7 SiLU layer 1.18-1.34x).
        inline = ["--param", "inline-unit-growth=400"] if gcc else []
        isas += [("AVX2", avx2 + sched + inline), ("AVX512", avx512)]
    # -Wno-psabi: GCC notes that vector arguments pass differently across ISAs (as they do)
    return [(isa, flags + [f"-DCPU_CAPABILITY={isa}", f"-DCPU_CAPABILITY_{isa}", "-Wno-psabi"]) for isa, flags in isas]


class BuildExt(BuildExtension):
    """Compiles KERNEL_SOURCES once per CPU capability, each into its own folder, and links them in."""

    def build_extension(self, ext):
        cxx = ext.extra_compile_args["cxx"] if isinstance(ext.extra_compile_args, dict) else ext.extra_compile_args
        objects = []
        for isa, flags in _cpu_capabilities(check_compiler_is_gcc(self.compiler.compiler_so[0])):
            objects += self.compiler.compile(KERNEL_SOURCES, output_dir=os.path.join(self.build_temp, isa.lower()),
                                             include_dirs=ext.include_dirs, extra_postargs=list(cxx) + flags)
        ext.extra_objects = objects + list(ext.extra_objects or [])
        super().build_extension(ext)


def _extensions():
    sources = _rel("src/ops/*.cpp") + _rel("src/cpu/dispatch.cpp")
    omp = _openmp_flags()
    cxx = ["-O3", "-fvisibility=hidden"] + omp  # torch adds its -std (C++20 for torch 2.14)
    include_dirs = [os.path.join(HERE, "src")]
    cuda_sources = _rel("src/cuda/*.cu") + _rel("src/cuda/*.cpp")
    if _want_cuda() and cuda_sources:
        import torch

        if not torch.cuda.is_available():  # forced build: torch cannot detect the GPUs' archs
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", _default_arch_list())
        return [
            CUDAExtension(
                "inplace_abn._C",
                sources + cuda_sources,
                include_dirs=include_dirs,
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
        "test": ["pytest", "numpy", "torchvision", "diffusers", "timm"],
        "examples": ["torchvision", "tqdm", "matplotlib", "diffusers"],
    },
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildExt},
    zip_safe=False,
)
