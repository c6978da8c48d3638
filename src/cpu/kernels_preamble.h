// Included first by kernels_{default,avx2,avx512}.cpp: the headers that are
// not specific to a SIMD level, so that their inline functions are compiled
// for the baseline ISA in every file (the same code everywhere, whichever
// copy the linker keeps). Only the at::vec headers (namespaced by
// CPU_CAPABILITY) and the kernels themselves are compiled for the file's ISA.
#pragma once

#include <algorithm>
#include <array>
#include <cassert>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <tuple>
#include <type_traits>
#include <vector>

#include <ATen/NumericUtils.h>
#include <ATen/Parallel.h>
#include <ATen/native/Math.h>
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16-math.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Load.h>
#include <c10/util/MathConstants.h>
#include <c10/util/TypeCast.h>
#include <c10/util/complex.h>
#include <c10/util/copysign.h>
#include <c10/util/irange.h>

#include "cpu/kernel_api.h"
