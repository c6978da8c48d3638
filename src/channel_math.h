// Per-channel math of In-Place ABN in float64 (docs/DESIGN.md sections 1, 2 and 6): the coefficient tables the
// element-wise kernels read, the running-statistics update and the abs mode's weight gradient. The single source of
// truth for these formulas, as activations.h is for the element-wise ones: the CPU front ends evaluate them in a loop
// over the channels (src/ops/common.h), the CUDA front ends in one small kernel (src/cuda/channel_kernels.cu), so a
// layer costs no extra operator calls or launches for its per-channel arithmetic.
#pragma once

#include <type_traits>

#include "activations.h"

namespace inplace_abn {

// Rows of the coefficient table (a contiguous (rows, C) tensor in the accumulation dtype):
// forward_: z = ((x - mean_hi) - mean_lo) scale + shift [+ residual], the mean split into hi + lo so that x - mean
// keeps its accuracy when |mean| >> std.
enum ForwardRow : int { kFwdMeanHi, kFwdMeanLo, kFwdScale, kFwdShift, kFwdRows };
// backward_reduce: zc = z - shift [- residual]; the kernel sums gz and gz zc, and divides the second by the gain
// g~ (xhat = zc / g~).
enum ReduceRow : int { kRedShift, kRedGain, kRedRows };
// backward_input: dx = a gz + b zc + c0 = g~ r (gz - mean_gz - xhat mean_gz_xhat).
enum InputRow : int { kInShift, kInA, kInB, kInC0, kInRows };
// gn_backward (GroupNorm, CPU), one column per (n, c): the shift and gain of ReduceRow and the
// (n, group)'s inverse std; the kernel derives InputRow.
enum GnRow : int { kGnShift, kGnGain, kGnRstd, kGnRows };

// Which table, and its inputs v[k] in order (a missing tensor reads as its fill):
enum class Table : int {
  Forward,     // mean, var, weight, bias
  Reduce,      // bias, weight
  Input,       // var, weight, bias, mean_gz_xhat, mean_gz
  GnBackward,  // bias, weight, var
};
constexpr int kMaxTableInputs = 5;

IABN_HD constexpr int table_inputs_of(Table t) {
  return t == Table::Forward ? 4 : t == Table::Reduce ? 2 : t == Table::Input ? 5 : 3;
}

IABN_HD constexpr int table_rows_of(Table t) {
  return t == Table::Forward  ? int(kFwdRows)
         : t == Table::Reduce ? int(kRedRows)
         : t == Table::Input  ? int(kInRows)
                              : int(kGnRows);
}

// The scalars of a table besides its per-channel inputs.
struct TableSpec {
  double eps;
  bool has_weight;     // else g~ = 1 (the weight's fill): a non-affine layer normalises to xhat
  bool signed_weight;  // g~ = sign(gamma) (|gamma| + eps), sign(0) = +1; else |gamma| + eps
  bool acc_float = true;    // Forward: the accumulation dtype is float32 (the mean's hi part rounded to it)
  bool groupnorm = false;   // Input: GroupNorm's rows (gn_input_row)
  double sums_scale = 0.0;  // Input: k, the scale of the sums (1/n in training, 0 in eval)
};

IABN_HD double gain(double w, const TableSpec& s) {
  if (!s.has_weight) return w;
  const double g = fabs(w) + s.eps;
  return s.signed_weight && w < 0 ? -g : g;
}

IABN_HD double inv_std(double var, double eps) { return 1.0 / iabn_sqrt(var + eps); }

// GroupNorm's (a, b, c0) of InputRow from its (n, group) means of g~ gz and of g~ gz xhat, for channel gain g and
// inverse std r (zc = g~ xhat, hence the / g).
IABN_HD void gn_input_row(double g, double r, double mean_ggz_xhat, double mean_ggz, double* row) {
  row[0] = g * r;
  row[1] = -r * mean_ggz_xhat / g;
  row[2] = -r * mean_ggz;
}

// The rows of table T for one column: out[r] from the inputs v.
template <Table T>
IABN_HD void table_column(const TableSpec& s, const double* v, double* out) {
  if constexpr (T == Table::Forward) {
    const double hi = s.acc_float ? double(float(v[0])) : v[0];
    out[kFwdMeanHi] = hi;
    out[kFwdMeanLo] = v[0] - hi;
    out[kFwdScale] = gain(v[2], s) * inv_std(v[1], s.eps);
    out[kFwdShift] = v[3];
  } else if constexpr (T == Table::Reduce) {
    out[kRedShift] = v[0];
    out[kRedGain] = gain(v[1], s);
  } else if constexpr (T == Table::Input) {
    const double r = inv_std(v[0], s.eps), g = gain(v[1], s), a = g * r;
    out[kInShift] = v[2];
    if (s.groupnorm) {
      gn_input_row(g, r, v[3] * s.sums_scale, v[4] * s.sums_scale, out + kInA);
    } else {
      out[kInA] = a;
      out[kInB] = -r * (v[3] * s.sums_scale);
      out[kInC0] = -a * (v[4] * s.sums_scale);
    }
  } else {
    out[kGnShift] = v[0];
    out[kGnGain] = gain(v[1], s);
    out[kGnRstd] = inv_std(v[2], s.eps);
  }
}

// f(std::integral_constant<Table, T>{}) for the table t.
template <class F>
inline void dispatch_table(Table t, F&& f) {
  switch (t) {
    case Table::Forward: return f(std::integral_constant<Table, Table::Forward>{});
    case Table::Reduce: return f(std::integral_constant<Table, Table::Reduce>{});
    case Table::Input: return f(std::integral_constant<Table, Table::Input>{});
    case Table::GnBackward: return f(std::integral_constant<Table, Table::GnBackward>{});
  }
}

// torch.nn.BatchNorm's running statistic r <- (1 - m) r + m s factor (1 for the mean, n / (n - 1) for the variance).
IABN_HD double running_update(double r, double s, double factor, double m) { return (1.0 - m) * r + m * (s * factor); }

// The abs mode's weight gradient: d|gamma|/dgamma = sign(gamma), so s sign(w) (exact: s, -s or 0; NaN for a NaN
// weight, as at::sign). w is the weight as the sums' dtype holds it.
IABN_HD double abs_weight_grad(double s, double w) {
  const double sign = w > 0 ? 1.0 : w < 0 ? -1.0 : w == 0 ? 0.0 : w;
  return s * sign;
}

}  // namespace inplace_abn
