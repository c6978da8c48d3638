// Interface between the CPU operator glue (cpu_ops.cpp: checks, allocation,
// per-channel coefficients) and the vectorised kernels (kernels_impl.h),
// which are compiled once per SIMD level (kernels_{default,avx2,avx512}.cpp)
// and picked at run time. Plain C++ only: no ATen, no vector types, so this
// header is safe to include in every translation unit whatever its ISA.
#pragma once

#include <cstdint>

// Run-time SIMD dispatch (AVX2 and AVX512 builds of the kernels next to the
// baseline one) with GCC on x86-64, which targets those ISAs per file through
// `#pragma GCC target` (kernels_avx2.cpp, kernels_avx512.cpp). Other
// compilers and architectures build the baseline kernels only (correct, not
// vectorised beyond the compiler's default ISA). IABN_CPU_NO_SIMD_DISPATCH
// turns the dispatch off.
#if !defined(IABN_CPU_NO_SIMD_DISPATCH) && (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && \
    !defined(__clang__)
#define IABN_CPU_X86_DISPATCH 1
#endif

namespace inplace_abn {
namespace cpu {

enum class DType : int { Float = 0, Double = 1, Half = 2, BFloat16 = 3 };

// How the flat memory of a tensor maps to channels. Elements are addressed by
// their index e in memory order; the channel of e is (e / S) % C in both
// modes (channels-last: S = 1).
//  planar (rows == false): memory is (N, C, S), walked plane by plane with
//    broadcast per-channel coefficients. Contiguous tensors with large planes.
//  rows (rows == true): the channel pattern repeats every P = C S elements
//    (a "row"); walked with per-position coefficient arrays of one or more
//    rows. Channels-last tensors and (N, C) (S = 1), and contiguous tensors
//    with small planes (S > 1; no partial vector per plane).
struct Geometry {
  int64_t numel;
  int64_t C;
  int64_t S;
  bool rows;
};

// Per-channel vectors below are contiguous, of length C, in the compute type
// (double for double inputs, float otherwise) unless said otherwise.

// mean / var out: double[C] (biased variance).
struct StatsArgs {
  const void* x;
  DType dtype;
  Geometry g;
  double* mean;
  double* var;
};

// x <- f((x - mean_hi - mean_lo) * scale + shift [+ residual]); mask bits
// [z < z*] in memory order when mask != nullptr (SiLU).
struct ForwardArgs {
  void* x;
  const void* residual;  // nullptr or same dtype / layout as x
  DType dtype;
  Geometry g;
  const void* mean_hi;
  const void* mean_lo;
  const void* scale;
  const void* shift;
  int act;
  double param;
  int32_t* mask;
};

// sum_gz[c] = sum gz, sum_gz_zc[c] = sum gz * (z - shift [- residual]),
// with z = f^-1(y), gz = dy f'(z). Outputs double[C].
struct BackwardReduceArgs {
  const void* y;
  const void* dy;
  const void* residual;
  const int32_t* mask;  // SiLU branch bits, else unused
  DType dtype;
  Geometry g;
  const void* shift;
  int act;
  double param;
  double* sum_gz;
  double* sum_gz_zc;
};

// dx = a_gz * gz + b_zc * (z - shift [- residual]) + c0;  dres = gz.
struct BackwardInputArgs {
  const void* y;
  const void* dy;
  const void* residual;
  const int32_t* mask;
  DType dtype;
  Geometry g;
  const void* shift;
  const void* a_gz;
  const void* b_zc;
  const void* c0;
  int act;
  double param;
  void* dx;
  void* dres;  // nullptr unless the residual gradient is wanted
};

struct KernelTable {
  const char* name;
  void (*batch_stats)(const StatsArgs&);
  void (*forward)(const ForwardArgs&);
  void (*backward_reduce)(const BackwardReduceArgs&);
  void (*backward_input)(const BackwardInputArgs&);
};

// One table per SIMD level compiled into this build.
namespace DEFAULT {
const KernelTable& kernel_table();
}
#if defined(IABN_CPU_X86_DISPATCH)
namespace AVX2 {
const KernelTable& kernel_table();
}
namespace AVX512 {
const KernelTable& kernel_table();
}
#endif

}  // namespace cpu
}  // namespace inplace_abn
