// Included by kernels_avx2.cpp / kernels_avx512.cpp right after their target
// pragma. The compiler enables the ISA for the code that follows but does not
// define the ISA macros (__AVX2__, __AVX512F__, ...) that sleef.h tests to
// declare its vector functions, which at::vec's AVX2 / AVX512 headers call.
// Define them for sleef.h only, then restore them.
// Expects IABN_ISA_AVX512 defined (or not) by the including file.
#pragma once

#include <immintrin.h>

#ifndef __AVX__
#define __AVX__ 1
#define IABN_UNDEF_AVX
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#define IABN_UNDEF_AVX2
#endif
#ifndef __FMA__
#define __FMA__ 1
#define IABN_UNDEF_FMA
#endif
#if defined(IABN_ISA_AVX512) && !defined(__AVX512F__)
#define __AVX512F__ 1
#define IABN_UNDEF_AVX512F
#endif

#include <sleef.h>

#ifdef IABN_UNDEF_AVX
#undef __AVX__
#undef IABN_UNDEF_AVX
#endif
#ifdef IABN_UNDEF_AVX2
#undef __AVX2__
#undef IABN_UNDEF_AVX2
#endif
#ifdef IABN_UNDEF_FMA
#undef __FMA__
#undef IABN_UNDEF_FMA
#endif
#ifdef IABN_UNDEF_AVX512F
#undef __AVX512F__
#undef IABN_UNDEF_AVX512F
#endif
