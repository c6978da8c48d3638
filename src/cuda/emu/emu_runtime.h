// A small CPU emulator of the CUDA execution model, enough to run the kernels
// of kernels.cuh on the host for tests on machines without a GPU.
//
// Every block runs its threads as cooperative fibers (ucontext) on one OS
// thread. __syncthreads() is a barrier over all threads of the block; the warp
// intrinsics (__shfl_xor_sync, __shfl_down_sync, __ballot_sync) exchange values
// through a barrier over the 32 lanes of the warp and check that every lane
// made the same call with the full mask. A barrier that can never complete
// (a thread exited, or lanes diverged) is reported as an error instead of
// hanging, which is exactly the class of bug a GPU would turn into a hang or
// undefined behaviour. __shared__ maps to a static local (blocks run one at a
// time). Memory races between threads are not detected.
#pragma once

#define IABN_EMULATE 1

#include <ucontext.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct emu_uint3 {
  unsigned x, y, z;
};

namespace iabn_emu {

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  bool done = false;
};

struct WarpSlot {
  uint64_t value;
  int op;       // 1 shfl_xor, 2 shfl_down, 3 ballot
  int arg;      // offset
  unsigned mask;
};

struct State {
  emu_uint3 thread_idx{0, 0, 0}, block_idx{0, 0, 0}, block_dim{1, 1, 1}, grid_dim{1, 1, 1};
  std::vector<Fiber> fibers;
  int current = 0;
  int nthreads = 0;
  ucontext_t sched;
  std::function<void()> body;
  // block barrier
  long bar_gen = 0;
  int bar_count = 0;
  // warp barriers and exchange slots
  std::vector<long> warp_gen;
  std::vector<int> warp_count;
  std::vector<std::array<WarpSlot, 32>> slots;
  long events = 0;  // barrier releases and thread completions (progress)
  std::string error;
  size_t stack_size = 256 * 1024;
};

inline State& g() {
  static State s;
  return s;
}

inline void fail(const std::string& msg) {
  if (g().error.empty()) g().error = msg;
}

inline void yield() {
  State& s = g();
  swapcontext(&s.fibers[s.current].ctx, &s.sched);
}

inline void entry() {
  State& s = g();
  s.body();
  s.fibers[s.current].done = true;
  ++s.events;
  swapcontext(&s.fibers[s.current].ctx, &s.sched);
}

inline void syncthreads() {
  State& s = g();
  const long gen = s.bar_gen;
  if (++s.bar_count == s.nthreads) {
    s.bar_count = 0;
    ++s.bar_gen;
    ++s.events;
    return;
  }
  while (s.bar_gen == gen) yield();
}

inline int linear_tid() {
  const State& s = g();
  return static_cast<int>(s.thread_idx.x + s.block_dim.x * (s.thread_idx.y + s.block_dim.y * s.thread_idx.z));
}

inline void warp_barrier(int w) {
  State& s = g();
  const long gen = s.warp_gen[w];
  if (++s.warp_count[w] == 32) {
    s.warp_count[w] = 0;
    ++s.warp_gen[w];
    ++s.events;
    return;
  }
  while (s.warp_gen[w] == gen) yield();
}

// All 32 lanes deposit (value, op, arg, mask); returns the slots of the warp.
inline std::array<WarpSlot, 32> warp_exchange(uint64_t value, int op, int arg, unsigned mask) {
  State& s = g();
  if (s.nthreads % 32 != 0) fail("warp intrinsic in a block whose size is not a multiple of 32");
  if (mask != 0xffffffffu) fail("warp intrinsic with a partial mask");
  const int tid = linear_tid();
  const int w = tid / 32, lane = tid % 32;
  s.slots[w][lane] = WarpSlot{value, op, arg, mask};
  warp_barrier(w);
  std::array<WarpSlot, 32> r = s.slots[w];
  warp_barrier(w);
  for (int l = 0; l < 32; ++l)
    if (r[l].op != op || r[l].arg != arg) fail("lanes of a warp reached different warp intrinsics");
  (void)lane;
  return r;
}

template <typename T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8, "");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

template <typename T>
T shfl_xor(unsigned mask, T v, int off) {
  auto r = warp_exchange(to_bits(v), 1, off, mask);
  const int lane = linear_tid() % 32;
  return from_bits<T>(r[(lane ^ off) & 31].value);
}

template <typename T>
T shfl_down(unsigned mask, T v, int off) {
  auto r = warp_exchange(to_bits(v), 2, off, mask);
  const int lane = linear_tid() % 32;
  return lane + off < 32 ? from_bits<T>(r[lane + off].value) : v;
}

inline unsigned ballot(unsigned mask, int pred) {
  auto r = warp_exchange(pred ? 1u : 0u, 3, 0, mask);
  unsigned w = 0;
  for (int l = 0; l < 32; ++l) w |= static_cast<unsigned>(r[l].value & 1u) << l;
  return w;
}

// Runs the kernel body (a closure calling the kernel) over the grid.
inline void run(dim3 grid, dim3 block, std::function<void()> body) {
  State& s = g();
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || block.x == 0 || block.y == 0 || block.z == 0)
    throw std::runtime_error("emulated launch with an empty grid or block");
  if (grid.y > 65535 || grid.z > 65535) throw std::runtime_error("emulated launch: gridDim.y/z above 65535");
  const int nt = static_cast<int>(block.x * block.y * block.z);
  if (nt > 1024) throw std::runtime_error("emulated launch: more than 1024 threads per block");
  s.body = std::move(body);
  s.block_dim = {block.x, block.y, block.z};
  s.grid_dim = {grid.x, grid.y, grid.z};
  s.nthreads = nt;
  s.error.clear();
  if (static_cast<int>(s.fibers.size()) < nt) s.fibers.resize(nt);
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        s.block_idx = {bx, by, bz};
        s.bar_gen = 0;
        s.bar_count = 0;
        s.warp_gen.assign((nt + 31) / 32, 0);
        s.warp_count.assign((nt + 31) / 32, 0);
        s.slots.assign((nt + 31) / 32, std::array<WarpSlot, 32>{});
        for (int t = 0; t < nt; ++t) {
          Fiber& f = s.fibers[t];
          f.done = false;
          if (f.stack.size() < s.stack_size) f.stack.resize(s.stack_size);
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = f.stack.data();
          f.ctx.uc_stack.ss_size = f.stack.size();
          f.ctx.uc_link = nullptr;
          makecontext(&f.ctx, &entry, 0);
        }
        int alive = nt;
        while (alive > 0) {
          const long before = s.events;
          for (int t = 0; t < nt; ++t) {
            if (s.fibers[t].done) continue;
            s.current = t;
            s.thread_idx = {static_cast<unsigned>(t % block.x), static_cast<unsigned>((t / block.x) % block.y),
                            static_cast<unsigned>(t / (block.x * block.y))};
            swapcontext(&s.sched, &s.fibers[t].ctx);
            if (s.fibers[t].done) --alive;
          }
          if (alive > 0 && s.events == before) {
            s.error = "deadlock: a barrier or warp intrinsic can never complete (exited or diverged threads)";
            break;
          }
        }
        if (!s.error.empty()) throw std::runtime_error("CUDA emulator, block (" + std::to_string(bx) + "," +
                                                       std::to_string(by) + "): " + s.error);
      }
}

}  // namespace iabn_emu

// CUDA built-ins used by kernels.cuh.
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define threadIdx (iabn_emu::g().thread_idx)
#define blockIdx (iabn_emu::g().block_idx)
#define blockDim (iabn_emu::g().block_dim)
#define gridDim (iabn_emu::g().grid_dim)
#define __syncthreads() iabn_emu::syncthreads()
#define __shfl_xor_sync(mask, v, off) iabn_emu::shfl_xor((mask), (v), (off))
#define __shfl_down_sync(mask, v, off) iabn_emu::shfl_down((mask), (v), (off))
#define __ballot_sync(mask, pred) iabn_emu::ballot((mask), (pred))
