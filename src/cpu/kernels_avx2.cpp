// AVX2 + FMA build of the CPU kernels, picked at run time (cpu_ops.cpp).
// The ISA is enabled for this file only, after the baseline headers
// (kernels_preamble.h), so that no inline function shared with other files is
// compiled for AVX2.
#include "cpu/kernel_api.h"
#if defined(IABN_CPU_X86_DISPATCH)
#define CPU_CAPABILITY AVX2
#include "cpu/kernels_preamble.h"
#pragma GCC push_options
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#include "cpu/isa_macros.h"
#define CPU_CAPABILITY_AVX2
#include "cpu/kernels_impl.h"
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif
