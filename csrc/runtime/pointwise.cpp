// Compiled with -ffp-contract=off (CMakeLists.txt): each step is one IEEE
// operation per element, rounded once, as in ATen's kernels.
#include "runtime/pointwise.h"

#include <ATen/Parallel.h>
#include <c10/core/DynamicCast.h>

#include <algorithm>

namespace torch_mgpu::runtime {
namespace {

constexpr int64_t kBlock = 1024;       // elements per block: a few slots stay in L1
constexpr int64_t kGrain = 32768;      // elements per intra-op task (ATen's grain size)

// A host number converted to T as ATen converts a CPU scalar operand.
template <typename T>
T constant_as(const c10::IValue& v) {
  if (v.isDouble()) return static_cast<T>(v.toDouble());
  if (v.isInt()) return static_cast<T>(v.toInt());
  const auto& t = v.toTensor();
  return c10::fetch_and_cast<T>(t.scalar_type(), t.const_data_ptr());
}

// One input of a step for one block: a pointer, or a constant.
template <typename T>
struct In {
  const T* p = nullptr;
  T c = T(0);
};

template <typename T, typename F>
C10_ALWAYS_INLINE void binary(T* d, In<T> a, In<T> b, int64_t n, F f) {
  if (a.p && b.p) {
    for (int64_t j = 0; j < n; ++j) d[j] = f(a.p[j], b.p[j]);
  } else if (a.p) {
    const T c = b.c;
    for (int64_t j = 0; j < n; ++j) d[j] = f(a.p[j], c);
  } else if (b.p) {
    const T c = a.c;
    for (int64_t j = 0; j < n; ++j) d[j] = f(c, b.p[j]);
  } else {
    const T r = f(a.c, b.c);
    std::fill(d, d + n, r);
  }
}

template <typename T, typename F>
C10_ALWAYS_INLINE void unary(T* d, In<T> a, int64_t n, F f) {
  if (a.p) {
    for (int64_t j = 0; j < n; ++j) d[j] = f(a.p[j]);
  } else {
    std::fill(d, d + n, f(a.c));
  }
}

template <typename T>
C10_ALWAYS_INLINE void step(plan::PointwiseOp op, T* d, In<T> a, In<T> b, int64_t n) {
  switch (op) {
    case plan::PointwiseOp::Add:
      binary(d, a, b, n, [](T x, T y) { return x + y; });
      break;
    case plan::PointwiseOp::Sub:
      binary(d, a, b, n, [](T x, T y) { return x - y; });
      break;
    case plan::PointwiseOp::Mul:
      binary(d, a, b, n, [](T x, T y) { return x * y; });
      break;
    case plan::PointwiseOp::Div:
      binary(d, a, b, n, [](T x, T y) { return x / y; });
      break;
    case plan::PointwiseOp::Neg:
      unary(d, a, n, [](T x) { return -x; });
      break;
    case plan::PointwiseOp::Relu:
      // ATen's relu is clamp_min(x, 0): NaN stays NaN, -0.0 stays -0.0.
      unary(d, a, n, [](T x) { return x < T(0) ? T(0) : x; });
      break;
  }
}

// What one execution of a group reads and writes.
template <typename T>
struct Pass {
  const plan::FusedGroup& grp;
  const std::vector<const void*>& external;
  const std::vector<void*>& out;
  std::vector<T> constants;  // [2 * step + input]
  std::vector<T> scalars;    // per external: its element, for Scalar externals
};

// Block [b, b + len) of a broadcast external into `dst`.
template <typename T>
C10_ALWAYS_INLINE void gather(const plan::FusedExternal& e, const T* src, int64_t b, int64_t len, T* dst) {
  if (e.kind == plan::FusedExternal::Kind::Inner) {
    // Element j reads j % period: runs of the source, from where b falls.
    int64_t at = b % e.period, filled = 0;
    while (filled < len) {
      const int64_t run = std::min(e.period - at, len - filled);
      std::copy(src + at, src + at + run, dst + filled);
      filled += run;
      at = 0;
    }
  } else {
    // Outer: element j reads j / period: runs of one value.
    int64_t q = b / e.period, r = b % e.period, filled = 0;
    while (filled < len) {
      const int64_t run = std::min(e.period - r, len - filled);
      std::fill(dst + filled, dst + filled + run, src[q]);
      filled += run;
      ++q;
      r = 0;
    }
  }
}

// Elements [begin, end), block by block. `scratch`: the group's slots, then
// two blocks for broadcast inputs.
template <typename T>
C10_ALWAYS_INLINE void run_range(const Pass<T>& pass, int64_t begin, int64_t end, T* scratch) {
  const auto& steps = pass.grp.steps;
  const size_t n = steps.size();
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t len = std::min(kBlock, end - b);
    auto where = [&](size_t k) -> T* {
      const auto& s = steps[k];
      return s.materialize ? static_cast<T*>(pass.out[k]) + b : scratch + s.slot * kBlock;
    };
    for (size_t k = 0; k < n; ++k) {
      const auto& s = steps[k];
      In<T> in[2];
      for (int a = 0; a < s.arity; ++a) {
        switch (s.in[a].kind) {
          case plan::PointwiseInput::Kind::Constant:
            in[a].c = pass.constants[2 * k + a];
            break;
          case plan::PointwiseInput::Kind::Step:
            in[a].p = where(static_cast<size_t>(s.in[a].index));
            break;
          case plan::PointwiseInput::Kind::External: {
            const auto& e = pass.grp.externals[s.in[a].index];
            const T* src = static_cast<const T*>(pass.external[s.in[a].index]);
            if (e.kind == plan::FusedExternal::Kind::Same) {
              in[a].p = src + b;
            } else if (e.kind == plan::FusedExternal::Kind::Scalar) {
              in[a].c = pass.scalars[s.in[a].index];
            } else {
              T* dst = scratch + (pass.grp.slots + a) * kBlock;
              gather(e, src, b, len, dst);
              in[a].p = dst;
            }
            break;
          }
        }
      }
      step<T>(s.op, where(k), in[0], in[1], len);
    }
  }
}

// One copy of the loops per instruction set, picked at load time for this
// CPU (the vector width ATen's kernels use too). Vector adds, multiplies,
// divides and compares round exactly as scalar ones do.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define MGPU_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MGPU_VECTOR_CLONES
#endif

MGPU_VECTOR_CLONES void range_float(const Pass<float>& pass, int64_t begin, int64_t end, float* scratch) {
  run_range(pass, begin, end, scratch);
}

MGPU_VECTOR_CLONES void range_double(const Pass<double>& pass, int64_t begin, int64_t end, double* scratch) {
  run_range(pass, begin, end, scratch);
}

inline void range(const Pass<float>& p, int64_t b, int64_t e, float* s) { range_float(p, b, e, s); }
inline void range(const Pass<double>& p, int64_t b, int64_t e, double* s) { range_double(p, b, e, s); }

template <typename T>
void run_typed(const ir::Graph& g, const plan::FusedGroup& grp, const std::vector<const void*>& external,
               const std::vector<void*>& out) {
  const size_t n = grp.steps.size();
  Pass<T> pass{grp, external, out, std::vector<T>(2 * n, T(0)), std::vector<T>(grp.externals.size(), T(0))};
  for (size_t j = 0; j < grp.externals.size(); ++j)
    if (grp.externals[j].kind == plan::FusedExternal::Kind::Scalar) pass.scalars[j] = *static_cast<const T*>(external[j]);
  // Constants, once per execution (their values change from run to run).
  for (size_t k = 0; k < n; ++k) {
    const auto& s = grp.steps[k];
    for (int a = 0; a < s.arity; ++a)
      if (s.in[a].kind == plan::PointwiseInput::Kind::Constant)
        pass.constants[2 * k + a] = constant_as<T>(g.nodes[s.node]->args[s.in[a].index].constant);
  }
  at::parallel_for(0, grp.numel, kGrain, [&](int64_t begin, int64_t end) {
    thread_local std::vector<char> scratch_bytes;
    const size_t need = static_cast<size_t>(grp.slots + 2) * kBlock * sizeof(T) + 64;
    if (scratch_bytes.size() < need) scratch_bytes.resize(need);
    // Blocks on a 64-byte boundary, as vector loads like them.
    auto base = reinterpret_cast<uintptr_t>(scratch_bytes.data());
    T* scratch = reinterpret_cast<T*>((base + 63) & ~uintptr_t(63));
    range(pass, begin, end, scratch);
  });
}

} // namespace

void run_pointwise(const ir::Graph& g, const plan::FusedGroup& grp, const std::vector<const void*>& external,
                   const std::vector<void*>& out) {
  if (grp.dtype == c10::ScalarType::Double) {
    run_typed<double>(g, grp, external, out);
  } else {
    TORCH_INTERNAL_ASSERT(grp.dtype == c10::ScalarType::Float, "mgpu: fused group of unexpected dtype");
    run_typed<float>(g, grp, external, out);
  }
}

} // namespace torch_mgpu::runtime
