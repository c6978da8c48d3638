// The front ends' per-channel work on CUDA (ChannelStub, src/ops/kernel.h) with channel_math.h's formulas: the
// coefficient tables, the running-statistics update and the abs mode's weight gradient, one launch each (as ATen
// ops, ~40 small launches per layer bound a layer's time on an H200; docs/DESIGN.md section 6).
#include "cuda/launch.cuh"

namespace inplace_abn {
namespace gpu {
namespace {

constexpr int kChannelThreads = 256;

// A per-channel vector as the kernels read it: entry i of p (of dtype t) as a double.
struct Column {
  const void* p = nullptr;  // null: every entry is `fill`
  at::ScalarType t = at::kFloat;
  double fill = 0.0;
  int64_t div = 1, mod = 0;  // column k reads entry (k / div) % mod (mod 0: k / div)
};

__device__ __forceinline__ double load_double(const void* p, at::ScalarType t, int64_t i) {
  switch (t) {
    case at::ScalarType::Double: return static_cast<const double*>(p)[i];
    case at::ScalarType::Half: return static_cast<float>(static_cast<const c10::Half*>(p)[i]);
    case at::ScalarType::BFloat16: return static_cast<float>(static_cast<const c10::BFloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ void store_double(void* p, at::ScalarType t, int64_t i, double v) {
  switch (t) {
    case at::ScalarType::Double: static_cast<double*>(p)[i] = v; break;
    case at::ScalarType::Half: static_cast<c10::Half*>(p)[i] = c10::Half(static_cast<float>(v)); break;
    case at::ScalarType::BFloat16: static_cast<c10::BFloat16*>(p)[i] = c10::BFloat16(static_cast<float>(v)); break;
    default: static_cast<float*>(p)[i] = static_cast<float>(v);
  }
}

struct Columns {
  Column in[kMaxTableInputs];
};

template <Table T, typename acc_t>
__global__ void __launch_bounds__(kChannelThreads)
    table_kernel(TableSpec spec, Columns cols, int K, int64_t C, acc_t* __restrict__ out) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  double v[kMaxTableInputs], rows[table_rows_of(T)];
#pragma unroll
  for (int k = 0; k < kMaxTableInputs; ++k) {
    if (k >= K) break;
    const Column& col = cols.in[k];
    int64_t i = c / col.div;
    if (col.mod) i %= col.mod;
    v[k] = col.p ? load_double(col.p, col.t, i) : col.fill;
  }
  table_column<T>(spec, v, rows);
#pragma unroll
  for (int r = 0; r < table_rows_of(T); ++r) out[r * C + c] = static_cast<acc_t>(rows[r]);
}

// (r: null to skip) r[c] <- running_update(r[c], s[c], factor, m), for the mean and the var
template <typename acc_t>
__global__ void __launch_bounds__(kChannelThreads)
    running_kernel(void* rm, const acc_t* __restrict__ mean, void* rv, const acc_t* __restrict__ var,
                   at::ScalarType rm_t, at::ScalarType rv_t, double var_factor, double m, int64_t C) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  if (rm) store_double(rm, rm_t, c, running_update(load_double(rm, rm_t, c), double(mean[c]), 1.0, m));
  if (rv) store_double(rv, rv_t, c, running_update(load_double(rv, rv_t, c), double(var[c]), var_factor, m));
}

template <typename acc_t>
__global__ void __launch_bounds__(kChannelThreads)
    weight_grad_kernel(const acc_t* __restrict__ s, const void* w, at::ScalarType w_t, void* out, int64_t C) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const double wc = static_cast<double>(static_cast<acc_t>(load_double(w, w_t, c)));  // in s's dtype
  store_double(out, w_t, c, abs_weight_grad(double(s[c]), wc));
}

dim3 channel_grid(int64_t C) { return dim3(static_cast<unsigned>(ceil_div(std::max<int64_t>(C, 1), kChannelThreads))); }

bool readable(at::ScalarType t) { return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16; }

// t as a contiguous tensor of a dtype the kernels read (a copy only when it is not one).
at::Tensor readable_copy(const at::Tensor& t) {
  return readable(t.scalar_type()) ? t.contiguous() : t.to(at::kDouble).contiguous();
}

void table_cuda(Table t, const TableSpec& spec, const ChannelInput* in, const at::Tensor& table) {
  const int K = table_inputs_of(t);
  std::array<at::Tensor, kMaxTableInputs> keep;  // (alive until the launch is queued)
  Columns cols;
  for (int k = 0; k < K; ++k) {
    cols.in[k].fill = in[k].fill;
    cols.in[k].div = in[k].div;
    cols.in[k].mod = in[k].mod;
    if (in[k].t.has_value()) {
      keep[k] = readable_copy(*in[k].t);
      cols.in[k].p = keep[k].const_data_ptr();
      cols.in[k].t = keep[k].scalar_type();
    }
  }
  const int64_t C = table.size(1);
  AT_DISPATCH_FLOATING_TYPES(table.scalar_type(), "inplace_abn_table_cuda", [&] {
    dispatch_table(t, [&](auto tag) {
      launch(&table_kernel<decltype(tag)::value, scalar_t>, channel_grid(C), dim3(kChannelThreads), spec, cols, K, C,
             table.mutable_data_ptr<scalar_t>());
    });
  });
}

void running_cuda(const at::Tensor& running_mean, const at::Tensor& mean, const at::Tensor& running_var,
                  const at::Tensor& var, double var_factor, double momentum) {
  // (a strided view of a buffer, or one of a dtype the kernel lacks: updated through a copy)
  auto direct = [](const at::Tensor& r) { return !r.defined() || (r.is_contiguous() && readable(r.scalar_type())); };
  if (!direct(running_mean) || !direct(running_var)) {
    auto work = [](const at::Tensor& r) { return r.defined() ? readable_copy(r).clone() : r; };
    const at::Tensor rm = work(running_mean), rv = work(running_var);
    running_cuda(rm, mean, rv, var, var_factor, momentum);
    if (rm.defined()) running_mean.copy_(rm);
    if (rv.defined()) running_var.copy_(rv);
    return;
  }
  const int64_t C = mean.numel();
  AT_DISPATCH_FLOATING_TYPES(mean.scalar_type(), "inplace_abn_running_cuda", [&] {
    launch(&running_kernel<scalar_t>, channel_grid(C), dim3(kChannelThreads),
           running_mean.defined() ? running_mean.mutable_data_ptr() : nullptr, mean.const_data_ptr<scalar_t>(),
           running_var.defined() ? running_var.mutable_data_ptr() : nullptr, var.const_data_ptr<scalar_t>(),
           running_mean.defined() ? running_mean.scalar_type() : at::kFloat,
           running_var.defined() ? running_var.scalar_type() : at::kFloat, var_factor, momentum, C);
  });
}

void weight_grad_cuda(const at::Tensor& s, const at::Tensor& w, const at::Tensor& out) {
  if (!readable(w.scalar_type()) || !w.is_contiguous() || !out.is_contiguous()) {
    const at::Tensor tmp = at::empty(w.sizes(), w.options().dtype(at::kDouble));
    weight_grad_cuda(s, readable_copy(w).to(at::kDouble), tmp);
    out.copy_(tmp);
    return;
  }
  const at::Tensor sc = s.contiguous();
  AT_DISPATCH_FLOATING_TYPES(sc.scalar_type(), "inplace_abn_weight_grad_cuda", [&] {
    launch(&weight_grad_kernel<scalar_t>, channel_grid(w.numel()), dim3(kChannelThreads), sc.const_data_ptr<scalar_t>(),
           w.const_data_ptr(), w.scalar_type(), out.mutable_data_ptr(), w.numel());
  });
}

}  // namespace

static const bool channel_stub_registered =
    ((cuda_channel_stub = ChannelStub{&table_cuda, &running_cuda, &weight_grad_cuda}), true);

}  // namespace gpu
}  // namespace inplace_abn
