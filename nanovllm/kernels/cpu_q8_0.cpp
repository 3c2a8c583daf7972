// y[M, N] = x[M, K] @ (q * d + o)^T for a weight of int8 values and block scales (GGUF Q8_0, Q6_K),
// and block offsets (GGUF Q5_K), read as stored: int8 values q [N, K], one float scale d per
// SCALE_BLOCK values [N, K / SCALE_BLOCK] and, where HAS_OFFSETS, one float offset o per block alike.
// Why and when it runs: nanovllm/kernels/cpu_q8_0.py, which compiles this file through torch
// Inductor's C++ code cache (-ffp-contract=off) after defining:
//   ELEMENT_TYPE: x's and y's element type (float, at::BFloat16)
//   SCALE_BLOCK: values per scale (32: Q8_0, Q5_K; 16: Q6_K)
//   HAS_OFFSETS: 1 where each block has an offset too (Q5_K), else 0 (the code below is then that of
//                the kernel without offsets: no argument, no work)
//
// Each weight vector is dequantized in registers (int8 -> float, times its block's scale: one fp32
// rounding, as gguf's dequantization rounds d * q) and multiplied into fp32 accumulators. The
// offsets' part, sum over blocks b of o[n, b] * (sum of x[m] over block b), is added into the same
// accumulators after the blocks: the block sums of x are taken once per call (xs [M, K / BLOCK]), so
// an offset costs K / BLOCK multiply-adds per output, not one per weight. The result is x.float() @
// (the weight's values)^T in another summation order, rounded to ELEMENT_TYPE once.
// Rows of W are taken NR at a time and rows of x MR at a time (MR x NR accumulator vectors), each
// W vector converted once per MR rows of x; the threads split N.
#include <Python.h>  // (first, as Python asks): only to let other Python threads run meanwhile

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

using T = ELEMENT_TYPE;

namespace {

#include "cpu_vec_floats.h"  // Vec, W, load_floats

constexpr int64_t BLOCK = SCALE_BLOCK;  // values per block (one scale each)
constexpr bool OFFSETS = HAS_OFFSETS;   // whether each block has an offset too
constexpr int64_t NR = 2;      // rows of W per tile
constexpr int64_t MAX_MR = 8;  // rows of x per tile: MR x NR accumulators + NR weights + 1 x in 19 registers
// Rows of W one thread takes at a time (a multiple of NR): 64 rows of 576 int8 are 36 KB, and
// enough tiles per thread that two threads end together
constexpr int64_t ROWS_PER_TASK = 64;
// How far ahead of a tile its rows of W are asked into the cache, in bytes. With the hardware
// prefetcher alone one thread streamed the 49152 x 576 head at 6.7 GB/s; asking 8 rows of 576 bytes
// ahead made it 19 GB/s, 4 rows 16, 16 rows 14, 64 rows 11 (a stand-alone C++ loop of this kernel's
// shape, one thread, on the 2-core AVX512 VM of benchmarks/RESULTS.md "Q8_0 kept quantized on the
// CPU"); in this kernel, two threads, 0 / 2304 / 4608 / 9216 bytes ahead: 3.0 / 1.4 / 1.7 / 2.1 ms.
constexpr int64_t PREFETCH_BYTES = 4608;
constexpr int64_t CACHE_LINE = 64;

// Asks for `bytes` from p (a later tile's rows) to be brought into the cache.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += CACHE_LINE) __builtin_prefetch(c + o);
}

// W int8 values at p as floats, times the block scale s.
inline Vec load_q8(const int8_t* p, const Vec& s) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  return Vec(v) * s;
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  return Vec(v) * s;
#else
  float f[W];
  for (int64_t i = 0; i < W; ++i) f[i] = static_cast<float>(p[i]);
  return Vec::loadu(f) * s;
#endif
}

inline float sum_lanes(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// The weight as the kernel reads it: q [N, K] int8, d [N, K / BLOCK] scales, o [N, K / BLOCK] offsets
// (nullptr without OFFSETS).
struct Weight {
  const int8_t* q;
  const float* d;
  const float* o;
};

// x as fp32 rows [M, K] and, with OFFSETS, their block sums xs [M, K / BLOCK] (else nullptr).
struct Rows {
  const float* x;
  const float* xs;
};

// acc[m][r] += sum over blocks b of o[n0 + r, b] * xs[m, b], W blocks at a time (the last run partial).
template <int64_t MR, int64_t NR_>
inline void add_offsets(Vec (&acc)[MR][NR_], const Rows& in, const float* o, int64_t blocks, int64_t n0) {
  for (int64_t b = 0; b < blocks; b += W) {
    const int64_t count = std::min(W, blocks - b);
    Vec ov[NR_];
    for (int64_t r = 0; r < NR_; ++r) ov[r] = Vec::loadu(o + (n0 + r) * blocks + b, count);
    for (int64_t m = 0; m < MR; ++m) {
      const Vec sv = Vec::loadu(in.xs + m * blocks + b, count);  // (lanes past `count` load as 0)
      for (int64_t r = 0; r < NR_; ++r) acc[m][r] = at::vec::fmadd(sv, ov[r], acc[m][r]);
    }
  }
}

// y[m, n0 + r] for m < MR, r < NR_ (NR_ rows of W from n0).
template <int64_t MR, int64_t NR_>
void tile(const Rows& in, const Weight& w8, T* y, int64_t N, int64_t K, int64_t n0) {
  const float* x = in.x;
  const int8_t* q = w8.q;
  const float* d = w8.d;
  Vec acc[MR][NR_];
  for (int64_t m = 0; m < MR; ++m)
    for (int64_t r = 0; r < NR_; ++r) acc[m][r] = Vec(0.f);
  const int64_t blocks = K / BLOCK;
  const int64_t ahead = n0 + PREFETCH_BYTES / K;  // the rows PREFETCH_BYTES ahead, and their scales
  if (ahead + NR_ <= N) {
    prefetch(q + ahead * K, NR_ * K);
    prefetch(d + ahead * blocks, NR_ * blocks * static_cast<int64_t>(sizeof(float)));
    if constexpr (OFFSETS) prefetch(w8.o + ahead * blocks, NR_ * blocks * static_cast<int64_t>(sizeof(float)));
  }
  for (int64_t b = 0; b < blocks; ++b) {
    Vec s[NR_];
    for (int64_t r = 0; r < NR_; ++r) s[r] = Vec(d[(n0 + r) * blocks + b]);
    for (int64_t c = b * BLOCK; c < (b + 1) * BLOCK; c += W) {
      Vec w[NR_];
      for (int64_t r = 0; r < NR_; ++r) w[r] = load_q8(q + (n0 + r) * K + c, s[r]);
      for (int64_t m = 0; m < MR; ++m) {
        const Vec xv = Vec::loadu(x + m * K + c);
        for (int64_t r = 0; r < NR_; ++r) acc[m][r] = at::vec::fmadd(xv, w[r], acc[m][r]);
      }
    }
  }
  if constexpr (OFFSETS) add_offsets<MR, NR_>(acc, in, w8.o, blocks, n0);
  for (int64_t m = 0; m < MR; ++m)
    for (int64_t r = 0; r < NR_; ++r) y[m * N + n0 + r] = static_cast<T>(sum_lanes(acc[m][r]));
}

// Rows [n_start, n_end) of W for all M rows of x, MR rows of x at a time.
template <int64_t MR>
void rows_for(const Rows& in, const Weight& w8, T* y, int64_t N, int64_t K, int64_t n_start, int64_t n_end) {
  int64_t n = n_start;
  for (; n + NR <= n_end; n += NR) tile<MR, NR>(in, w8, y, N, K, n);
  for (; n < n_end; ++n) tile<MR, 1>(in, w8, y, N, K, n);
}

void rows(const Rows& in, const Weight& w8, T* y, int64_t M, int64_t N, int64_t K, int64_t n_start,
          int64_t n_end) {
  const int64_t blocks = K / BLOCK;
  for (int64_t m = 0; m < M; m += MAX_MR) {
    const Rows im{in.x + m * K, OFFSETS ? in.xs + m * blocks : nullptr};
    T* ym = y + m * N;
    switch (std::min(M - m, MAX_MR)) {
      case 1: rows_for<1>(im, w8, ym, N, K, n_start, n_end); break;
      case 2: rows_for<2>(im, w8, ym, N, K, n_start, n_end); break;
      case 3: rows_for<3>(im, w8, ym, N, K, n_start, n_end); break;
      case 4: rows_for<4>(im, w8, ym, N, K, n_start, n_end); break;
      case 5: rows_for<5>(im, w8, ym, N, K, n_start, n_end); break;
      case 6: rows_for<6>(im, w8, ym, N, K, n_start, n_end); break;
      case 7: rows_for<7>(im, w8, ym, N, K, n_start, n_end); break;
      default: rows_for<8>(im, w8, ym, N, K, n_start, n_end); break;
    }
  }
}

// y = x @ W^T for x [M, K] (T), W as stored, y [M, N] (T); K a multiple of BLOCK, all contiguous.
void run(const T* x, const Weight& w8, T* y, int64_t M, int64_t N, int64_t K, int64_t num_threads) {
  if (K % BLOCK) throw std::invalid_argument("K is not a whole number of blocks");
  Py_BEGIN_ALLOW_THREADS  // no Python object is touched below
  std::vector<float> xf(M * K);  // x as fp32 rows, read by every thread
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(x[i]);
  std::vector<float> xs(OFFSETS ? M * (K / BLOCK) : 0);  // their block sums, in order
  for (int64_t b = 0; b < static_cast<int64_t>(xs.size()); ++b) {
    float s = 0.f;
    for (int64_t i = b * BLOCK; i < (b + 1) * BLOCK; ++i) s += xf[i];
    xs[b] = s;
  }
  const Rows in{xf.data(), OFFSETS ? xs.data() : nullptr};
  const int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && tasks > 1)
  for (int64_t t = 0; t < tasks; ++t)
    rows(in, w8, y, M, N, K, t * ROWS_PER_TASK, std::min(N, (t + 1) * ROWS_PER_TASK));
  Py_END_ALLOW_THREADS
}

}  // namespace

#if HAS_OFFSETS
// x [M, K] (T), q [N, K] int8, d and o [N, K / BLOCK] float, y [M, N] (T).
void kernel(const T* x, const int8_t* q, const float* d, const float* o, T* y, int64_t M, int64_t N, int64_t K,
            int64_t num_threads) {
  run(x, Weight{q, d, o}, y, M, N, K, num_threads);
}
#else
// x [M, K] (T), q [N, K] int8, d [N, K / BLOCK] float, y [M, N] (T).
void kernel(const T* x, const int8_t* q, const float* d, T* y, int64_t M, int64_t N, int64_t K,
            int64_t num_threads) {
  run(x, Weight{q, d, nullptr}, y, M, N, K, num_threads);
}
#endif
