// Baseline build of the CPU kernels (no ISA beyond the compiler's default).
#define CPU_CAPABILITY DEFAULT
#include "cpu/kernels_preamble.h"
#include "cpu/kernels_impl.h"
