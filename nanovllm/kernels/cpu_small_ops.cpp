// A decode step's small ops on the CPU in one pass each: residual add + RMSNorm, RoPE with the
// K/V store, SiLU-and-mul. Why and when they run: nanovllm/kernels/cpu_small_ops.py, which
// compiles this file through torch Inductor's C++ code cache (-ffp-contract=off: no product is
// fused into an add, so the arithmetic rounds where torch's ops round) after defining:
//   ELEMENT_TYPE: the activations' (float, at::BFloat16, at::Half)
//   OP: which op `kernel` is (OP_RMS_NORM, OP_ROPE_STORE, OP_SILU_MUL)
//   HEAD_DIM: OP_ROPE_STORE's head size (a multiple of twice the vector width)
//   PARALLEL_MIN_ELEMENTS: below this many elements an op runs on one thread
//
// Each op follows the arithmetic of the torch code it replaces (nanovllm/kernels/fused_ops.py):
// fp32 inside, rounded to ELEMENT_TYPE where that code rounds, so RoPE, the store and SiLU-and-mul
// give the same bits; the RMSNorm's sum of squares is summed in another order than torch's (its
// mean, and so a rounded output, can differ in the last bit: about 3 values in a million in bf16).
#include <Python.h>  // (first, as Python asks): only to let other Python threads run meanwhile

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <omp.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>

#define OP_RMS_NORM 1
#define OP_ROPE_STORE 2
#define OP_SILU_MUL 3

using T = ELEMENT_TYPE;

namespace {

#include "cpu_vec_floats.h"  // Vec, W, load_floats

// Elements are handled in pairs of vectors (2W: one vector of 16-bit elements), rounded in registers.
constexpr int64_t P = 2 * W;

// 2W elements at p as two float vectors.
inline void load2(const float* p, Vec& a, Vec& b) { a = Vec::loadu(p), b = Vec::loadu(p + W); }
inline void load2(const at::BFloat16* p, Vec& a, Vec& b) {
  std::tie(a, b) = at::vec::convert_bfloat16_float(at::vec::Vectorized<at::BFloat16>::loadu(p));
}
inline void load2(const at::Half* p, Vec& a, Vec& b) {
  std::tie(a, b) = at::vec::convert_half_float(at::vec::Vectorized<at::Half>::loadu(p));
}

// Two float vectors stored as 2W elements of T, rounded to nearest even (as `Tensor.to(dtype)`).
inline void store2(float* p, const Vec& a, const Vec& b) { a.store(p), b.store(p + W); }
inline void store2(at::BFloat16* p, const Vec& a, const Vec& b) { at::vec::convert_float_bfloat16(a, b).store(p); }
inline void store2(at::Half* p, const Vec& a, const Vec& b) { at::vec::convert_float_half(a, b).store(p); }

// a, b rounded to T and back (a torch op whose output is T rounds there).
inline void round2(Vec& a, Vec& b) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    std::tie(a, b) = at::vec::convert_bfloat16_float(at::vec::convert_float_bfloat16(a, b));
  } else if constexpr (std::is_same_v<T, at::Half>) {
    std::tie(a, b) = at::vec::convert_half_float(at::vec::convert_float_half(a, b));
  }
}

// One float rounded to T and back (the scalar tails).
inline float round1(float x) { return static_cast<float>(static_cast<T>(x)); }

// Runs f(row) for rows [0, n), on `threads` threads where the work is large enough.
template <typename F>
inline void for_rows(int64_t n, int64_t elements_per_row, int64_t threads, F f) {
  const bool parallel = threads > 1 && n > 1 && n * elements_per_row >= PARALLEL_MIN_ELEMENTS;
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
  for (int64_t r = 0; r < n; ++r) f(r);
}

}  // namespace

#if OP == OP_RMS_NORM
// out[r] = weight * (h * rsqrt(mean(h^2) + eps)), h = x[r] (+ residual[r], also written to
// residual_out[r]); each a row of `hidden` elements. As fused_ops._rms_norm_torch: in fp32, h
// rounded to T, the normalized row rounded to T, then the product by the weight rounded to T
// (for fp32, F.rms_norm's x * rstd * weight). Without add_residual, residual and residual_out
// are not read or written.
extern "C" void kernel(const T* x, const T* residual, const T* weight, T* out, T* residual_out, int64_t n,
                       int64_t hidden, int64_t add_residual, float eps, int64_t threads) {
  Py_BEGIN_ALLOW_THREADS
  for_rows(n, hidden, threads, [&](int64_t r) {
    float h[8192];  // the row (after the add, rounded) in fp32 (the caller checks hidden <= 8192)
    const T* xr = x + r * hidden;
    const T* rr = residual + r * hidden;
    T* sr = residual_out + r * hidden;
    Vec sq(0.f);
    float tail = 0.f;
    int64_t c = 0;
    for (; c + P <= hidden; c += P) {
      Vec a, b;
      load2(xr + c, a, b);
      if (add_residual) {
        Vec ra, rb;
        load2(rr + c, ra, rb);
        a = a + ra, b = b + rb;
        store2(sr + c, a, b);
        round2(a, b);
      }
      store2(h + c, a, b);
      sq = sq + a * a;
      sq = sq + b * b;
    }
    for (; c < hidden; ++c) {
      float v = static_cast<float>(xr[c]);
      if (add_residual) {
        sr[c] = static_cast<T>(v + static_cast<float>(rr[c]));
        v = static_cast<float>(sr[c]);
      }
      h[c] = v;
      tail += v * v;
    }
    const float sum = at::vec::vec_reduce_all<float>([](Vec& u, Vec& v) { return u + v; }, sq) + tail;
    const float mean = sum / static_cast<float>(hidden);  // as torch's mean: the sum, then / n
    const float rstd = 1.f / std::sqrt(mean + eps);
    const Vec vr(rstd);
    T* o = out + r * hidden;
    for (c = 0; c + P <= hidden; c += P) {
      Vec a = Vec::loadu(h + c) * vr, b = Vec::loadu(h + c + W) * vr, wa, wb;
      round2(a, b);
      load2(weight + c, wa, wb);
      store2(o + c, a * wa, b * wb);
    }
    for (; c < hidden; ++c) o[c] = static_cast<T>(round1(h[c] * rstd) * static_cast<float>(weight[c]));
  });
  Py_END_ALLOW_THREADS
}
#endif

#if OP == OP_ROPE_STORE
constexpr int64_t D = HEAD_DIM, HALF = D / 2;
static_assert(HALF % P == 0, "head_dim must be a multiple of four vector widths");

// One head's d elements rotated ("rotate half" layout) by cos, sin [d/2], in place: the first
// half x1 * cos - x2 * sin, the second x2 * cos + x1 * sin, each product and sum rounded in fp32
// (no fused multiply-add), the result rounded to T (as fused_ops._rotate).
inline void rotate(T* x, const float* cos, const float* sin) {
  Vec o[D / W];  // the rotated head, stored once both halves are read
  for (int64_t c = 0; c < HALF; c += P) {
    Vec x1a, x1b, x2a, x2b;
    load2(x + c, x1a, x1b);
    load2(x + HALF + c, x2a, x2b);
    const Vec ca = Vec::loadu(cos + c), cb = Vec::loadu(cos + c + W);
    const Vec sa = Vec::loadu(sin + c), sb = Vec::loadu(sin + c + W);
    o[c / W] = x1a * ca - x2a * sa, o[c / W + 1] = x1b * cb - x2b * sb;
    o[(HALF + c) / W] = x2a * ca + x1a * sa, o[(HALF + c) / W + 1] = x2b * cb + x1b * sb;
  }
  for (int64_t c = 0; c < D; c += P) store2(x + c, o[c / W], o[c / W + 1]);
}

// qkv [n, (heads + 2 * kv_heads) * d] rows (row stride qkv_row): q and k rotated in place by
// the cos | sin row of each token's position (cos_sin [max_position, d] fp32); then the rotated
// k and the v heads of each token with a slot >= 0 copied to the caches at that slot (element
// (block, row, head, 0) at block * stride_block + row * stride_row + head * stride_head).
extern "C" void kernel(T* qkv, const int64_t* positions, const float* cos_sin, T* k_cache, T* v_cache,
                       const int64_t* slots, int64_t n, int64_t qkv_row, int64_t heads, int64_t kv_heads,
                       int64_t block_size, int64_t k_block, int64_t k_row, int64_t k_head, int64_t v_block,
                       int64_t v_row, int64_t v_head, int64_t threads) {
  Py_BEGIN_ALLOW_THREADS
  for_rows(n, (heads + 2 * kv_heads) * D, threads, [&](int64_t r) {
    T* row = qkv + r * qkv_row;
    const float* cos = cos_sin + positions[r] * D;
    for (int64_t h = 0; h < heads + kv_heads; ++h) rotate(row + h * D, cos, cos + HALF);
    const int64_t slot = slots[r];
    if (slot < 0) return;
    const int64_t block = slot / block_size, at_row = slot % block_size;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const T* k = row + (heads + h) * D;
      const T* v = row + (heads + kv_heads + h) * D;
      std::copy(k, k + D, k_cache + block * k_block + at_row * k_row + h * k_head);
      std::copy(v, v + D, v_cache + block * v_block + at_row * v_row + h * v_head);
    }
  });
  Py_END_ALLOW_THREADS
}
#endif

#if OP == OP_SILU_MUL
// out [n, d] = silu(gate) * up for x [n, 2d] = (gate | up): silu(g) = g / (1 + exp(-g)) in fp32
// rounded to T, then the product rounded to T (as F.silu(gate) * up).
extern "C" void kernel(const T* x, T* out, int64_t n, int64_t d, int64_t threads) {
  Py_BEGIN_ALLOW_THREADS
  for_rows(n, 2 * d, threads, [&](int64_t r) {
    const T* gate = x + r * 2 * d;
    const T* up = gate + d;
    T* o = out + r * d;
    const Vec one(1.f);
    int64_t c = 0;
    for (; c + P <= d; c += P) {
      Vec a, b, ua, ub;
      load2(gate + c, a, b);
      a = a / (one + a.neg().exp()), b = b / (one + b.neg().exp());
      round2(a, b);
      load2(up + c, ua, ub);
      store2(o + c, a * ua, b * ub);
    }
    for (; c < d; ++c) {
      const float g = static_cast<float>(gate[c]);
      o[c] = static_cast<T>(round1(g / (1.f + std::exp(-g))) * static_cast<float>(up[c]));
    }
  });
  Py_END_ALLOW_THREADS
}
#endif
