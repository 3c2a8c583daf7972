// y[M, N] = x[M, K] @ W^T for a GGUF Q4_0 / Q4_1 weight W [N, K] and a few rows of x (M <= 8),
// fp32 accumulation. Why and when it runs, and the packing: nanovllm/kernels/cpu_gguf_q4.py, which
// compiles this file through torch Inductor's C++ code cache after defining:
//   ELEMENT_TYPE: x's and y's (float, at::BFloat16)
//   Q4_TYPE: 0 for Q4_0 (w = d * (q - 8)), 1 for Q4_1 (w = d * q + m)
//   Q4_ISA: 0 the widest this CPU has (AVX512, else AVX2, else plain C++); 2 AVX2 at most; 1 plain
//   PREFETCH_BYTES: how far ahead of the tile being read the next bytes are prefetched (0: none)
//
// The packed weight (cpu_gguf_q4.py `pack`): tiles of 32 output rows, each tile its K / 32 blocks
// one after another, each block TILE_BLOCK_BYTES:
//   nibbles [32 k][16 bytes]: byte r of k holds row r's q in its low nibble, row r + 16's in its high
//   d f16 [32 rows], then (Q4_1) m f16 [32 rows]
// so the 32 rows' weights at one k are one 16-byte load, and the vector lanes are output rows: a
// weight is unpacked once for all M rows of x, each x value broadcast to the 16 (AVX2: 8) rows.
// Per block: s = sum_k q_k x_k in fp32 (exact products of small integers and x), then
// y += d * s + m * sum_k x_k (Q4_0: m = -8 d), so the products differ from x @ dequant(W)^T only
// in summation order and where the rounding falls.
#include <Python.h>  // (first, as Python asks): only to let other Python threads run meanwhile

#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

using T = ELEMENT_TYPE;

namespace {

constexpr int64_t ROWS = 32;   // output rows of a tile (two nibbles of 16 bytes)
constexpr int64_t BLOCK = 32;  // k values of a GGUF block
constexpr int64_t NIBBLE_BYTES = BLOCK * ROWS / 2;
constexpr int64_t TILE_BLOCK_BYTES = NIBBLE_BYTES + (Q4_TYPE == 1 ? 2 : 1) * ROWS * 2;
constexpr int64_t MAX_M = 8;

#if Q4_ISA == 0 && defined(CPU_CAPABILITY_AVX512)
// ---- AVX512: a tile's 32 rows are two vectors of 16 floats ----
using V = __m512;
constexpr int NV = 2;
inline V zero() { return _mm512_setzero_ps(); }
inline V bcast(const float* p) { return _mm512_set1_ps(*p); }
inline V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V add(V a, V b) { return _mm512_add_ps(a, b); }
inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline void store(float* p, V a) { _mm512_storeu_ps(p, a); }
// The 32 rows' q at one k, as floats: rows 0-15, 16-31.
inline void unpack(const uint8_t* p, V* q) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  q[0] = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  q[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
// 32 f16 values (the tile's d or m) as floats.
inline void load_f16(const uint8_t* p, V* out) {
  out[0] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  out[1] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
}
#elif Q4_ISA != 1 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// ---- AVX2: four vectors of 8 floats ----
using V = __m256;
constexpr int NV = 4;
inline V zero() { return _mm256_setzero_ps(); }
inline V bcast(const float* p) { return _mm256_broadcast_ss(p); }
inline V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V add(V a, V b) { return _mm256_add_ps(a, b); }
inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline void store(float* p, V a) { _mm256_storeu_ps(p, a); }
inline void unpack(const uint8_t* p, V* q) {  // rows 0-7, 8-15, 16-23, 24-31
  const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  const __m256i mask = _mm256_set1_epi32(15);
  q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(lo, mask));
  q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(hi, mask));
  q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4));
  q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4));
}
inline void load_f16(const uint8_t* p, V* out) {
  for (int h = 0; h < 4; ++h) out[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
}
#else
// ---- plain C++: one "vector" is the tile's 32 rows (the compiler vectorizes the loops) ----
struct V {
  float v[ROWS];
};
constexpr int NV = 1;
inline V zero() { return V{}; }
inline V bcast(const float* p) {
  V r;
  for (int i = 0; i < ROWS; ++i) r.v[i] = *p;
  return r;
}
inline V fmadd(V a, V b, V c) {
  for (int i = 0; i < ROWS; ++i) c.v[i] = a.v[i] * b.v[i] + c.v[i];
  return c;
}
inline V add(V a, V b) {
  for (int i = 0; i < ROWS; ++i) a.v[i] += b.v[i];
  return a;
}
inline V mul(V a, V b) {
  for (int i = 0; i < ROWS; ++i) a.v[i] *= b.v[i];
  return a;
}
inline void store(float* p, V a) { std::memcpy(p, a.v, sizeof(a.v)); }
inline void unpack(const uint8_t* p, V* q) {
  for (int i = 0; i < ROWS / 2; ++i) q[0].v[i] = p[i] & 15, q[0].v[i + ROWS / 2] = p[i] >> 4;
}
inline void load_f16(const uint8_t* p, V* out) {
  for (int i = 0; i < ROWS; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    out[0].v[i] = static_cast<float>(c10::Half(h, c10::Half::from_bits()));
  }
}
#endif

// Independent sums per (row of x, vector) over a block's k: a sum takes every SPLIT-th k, so that
// with one or two rows of x there are 8 FMA chains in flight, not 2 or 4 (a choice from FMA's
// latency of several cycles, not measured against other splits).
template <int M>
constexpr int split() { return M == 1 ? 4 : M == 2 ? 2 : 1; }

// y rows [tile * 32, tile * 32 + 32) (those < n) for M rows of x: xf [M, K] fp32, xsum [M, K / 32]
// the per-block sums of x.
template <int M>
void run_tile(const uint8_t* w, const float* xf, const float* xsum, T* y, int64_t tile, int64_t n, int64_t k) {
  constexpr int S = split<M>();
  const int64_t blocks = k / BLOCK;
  const uint8_t* p = w + tile * blocks * TILE_BLOCK_BYTES;
  V acc[M][NV];
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < NV; ++h) acc[m][h] = zero();
  for (int64_t b = 0; b < blocks; ++b, p += TILE_BLOCK_BYTES) {
    V s[S][M][NV];
    for (int u = 0; u < S; ++u)
      for (int m = 0; m < M; ++m)
        for (int h = 0; h < NV; ++h) s[u][m][h] = zero();
    const float* xb = xf + b * BLOCK;
#if PREFETCH_BYTES > 0
    for (int64_t line = 0; line < TILE_BLOCK_BYTES; line += 64) __builtin_prefetch(p + PREFETCH_BYTES + line, 0, 3);
#endif
    for (int64_t kk = 0; kk < BLOCK; kk += S) {
      for (int u = 0; u < S; ++u) {
        V q[NV];
        unpack(p + (kk + u) * (ROWS / 2), q);
        for (int m = 0; m < M; ++m) {
          const V xv = bcast(xb + m * k + kk + u);
          for (int h = 0; h < NV; ++h) s[u][m][h] = fmadd(q[h], xv, s[u][m][h]);
        }
      }
    }
    V d[NV], mn[NV];
    load_f16(p + NIBBLE_BYTES, d);
#if Q4_TYPE == 1
    load_f16(p + NIBBLE_BYTES + ROWS * 2, mn);
#else
    const float minus8 = -8.f;
    for (int h = 0; h < NV; ++h) mn[h] = mul(d[h], bcast(&minus8));
#endif
    for (int m = 0; m < M; ++m) {
      const V xs = bcast(xsum + m * blocks + b);
      for (int h = 0; h < NV; ++h) {
        V t = s[0][m][h];
        for (int u = 1; u < S; ++u) t = add(t, s[u][m][h]);
        acc[m][h] = fmadd(mn[h], xs, fmadd(t, d[h], acc[m][h]));
      }
    }
  }
  const int64_t row0 = tile * ROWS, valid = std::min<int64_t>(ROWS, n - row0);
  for (int m = 0; m < M; ++m) {
    float out[ROWS];
    for (int h = 0; h < NV; ++h) store(out + h * (ROWS / NV), acc[m][h]);
    for (int64_t r = 0; r < valid; ++r) y[m * n + row0 + r] = static_cast<T>(out[r]);
  }
}

template <int M>
void run(const uint8_t* w, const float* xf, const float* xsum, T* y, int64_t n, int64_t k, int64_t threads) {
  const int64_t tiles = (n + ROWS - 1) / ROWS;
  // static: the tiles cost the same; each thread streams one contiguous range of the weight
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tiles > 1)
  for (int64_t t = 0; t < tiles; ++t) run_tile<M>(w, xf, xsum, y, t, n, k);
}

}  // namespace

// The entry point (Inductor's bindings call `kernel`): y [m, n] = x [m, k] @ W^T, W packed as
// above ([ceil(n / 32), k / 32, TILE_BLOCK_BYTES] bytes), 1 <= m <= 8, k a multiple of 32.
extern "C" void kernel(const T* x, const uint8_t* w, T* y, int64_t m, int64_t n, int64_t k, int64_t threads) {
  if (m < 1 || m > MAX_M || k % BLOCK) throw std::invalid_argument("q4 kernel: 1 <= m <= 8, k % 32 == 0");
  Py_BEGIN_ALLOW_THREADS
  const int64_t blocks = k / BLOCK;
  std::vector<float> xf(m * k), xsum(m * blocks);  // x in fp32; its sum over each block
  for (int64_t i = 0; i < m * k; ++i) xf[i] = static_cast<float>(x[i]);
  for (int64_t i = 0; i < m * blocks; ++i) {
    float s = 0.f;
    for (int64_t j = 0; j < BLOCK; ++j) s += xf[i * BLOCK + j];
    xsum[i] = s;
  }
  switch (m) {
    case 1: run<1>(w, xf.data(), xsum.data(), y, n, k, threads); break;
    case 2: run<2>(w, xf.data(), xsum.data(), y, n, k, threads); break;
    case 3: run<3>(w, xf.data(), xsum.data(), y, n, k, threads); break;
    case 4: run<4>(w, xf.data(), xsum.data(), y, n, k, threads); break;
    case 5: run<5>(w, xf.data(), xsum.data(), y, n, k, threads); break;
    case 6: run<6>(w, xf.data(), xsum.data(), y, n, k, threads); break;
    case 7: run<7>(w, xf.data(), xsum.data(), y, n, k, threads); break;
    default: run<8>(w, xf.data(), xsum.data(), y, n, k, threads); break;
  }
  Py_END_ALLOW_THREADS
}
