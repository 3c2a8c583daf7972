// y[M, N] = x[M, K] @ W^T for a GGUF Q4_0 / Q4_1 / Q8_0 weight W [N, K] and a batch of rows of x, by
// integer dot products of u8 x s8 summed four to an int32 lane, in one of two forms chosen at build:
//   AVX512-VNNI (AVX512F, AVX512BW): vpdpbusd, 16 int32 lanes: 64 multiply-adds per instruction
//   AVX2 (with FMA, F16C): vpmaddubsw (u8 x s8, pairs summed to int16) then vpmaddwd by ones (the
//     int16 pairs summed to int32), 8 int32 lanes: the same integer dots, as exact
// Why and when it runs, the packing, and its error: nanovllm/kernels/cpu_gguf_vnni.py, which
// compiles this file through torch Inductor's C++ code cache (-march=native, or x86-64-v3 where the
// engine is limited to AVX2; -ffp-contract=off) after defining:
//   ELEMENT_TYPE: x's and y's (float, at::BFloat16)
//   GGUF_TYPE: 0 for Q4_0 (w = d * (q - 8)), 1 for Q4_1 (w = d * q + m), 2 for Q8_0 (w = d * q, q int8)
//   TILE_M: rows of x per register tile; TILE_G: groups of 16 output rows (columns of y) per tile
//
// x is quantized here, per row and per 32 values along K (a GGUF block's span):
//   d_x = max|x| / 127, q_x = round-to-nearest-even(x * (127 / max|x|)) in [-127, 127] (0 where
// max|x| = 0), and s_x = d_x * sum(q_x). The packed weight (cpu_gguf_vnni.py `pack`): groups of
// 16 output rows, each group its K / 32 blocks one after another, each block GROUP_BLOCK_BYTES:
//   nibbles [4 chunks][16 rows][4 bytes]: chunk c, row r, byte j holds q[r][4c + j] in its low
//     nibble and q[r][16 + 4c + j] in its high nibble (q the file's 4-bit values, 0..15)
//   d f16 [16 rows], then (Q4_1) m f16 [16 rows]
// so one 64-byte chunk, masked and shifted, gives two vectors whose int32 lane r holds four
// consecutive k of row r: one vpdpbusd against four values of x broadcast is 64 multiply-adds (AVX2
// reads the chunk as two 32-byte halves, rows 0-7 and 8-15, each its own vectors of 8 lanes).
// Per block and (row of x, row of W): dot = sum q_w q_x (exact in int32), then
//   y += (d_w * d_x) * dot + m_w * s_x     (Q4_0: the -8 offset enters as dot's start, -8 sum q_x)
// which is x_q @ dequant(W)^T, x_q = d_x * q_x, up to fp32 rounding in another summation order; both
// forms compute the same dots and the same fp32 operations in the same order: the same y, bit for bit.
// Q8_0 (the weights signed): blocks of [8 chunks][16 rows][4 bytes] int8 (chunk c holds k 4c..4c+3),
// d f16 [16 rows], then -128 * sum q_w int32 [16 rows]. AVX512-VNNI: x enters vpdpbusd as u8
// q_x + 128, and the dot starts at -128 sum q_w, so that it ends at sum q_w q_x. AVX2 (whose int16
// pairs that offset would overflow: 2 x 255 x 128): |q_w| as u8 times q_x with q_w's sign (vpsignb),
// |pairs| <= 2 x 128 x 127, widened every chunk; the -128 sum q_w is not read. y += (d_w * d_x) * dot.
#include <Python.h>  // (first, as Python asks): only to let other Python threads run meanwhile

#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define GGUF_INT8_AVX512_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GGUF_INT8_AVX2 1
#else
#error "cpu_gguf_vnni.cpp needs AVX512-VNNI (with AVX512F, AVX512BW) or AVX2 (with FMA, F16C)"
#endif

using T = ELEMENT_TYPE;

namespace {

constexpr int64_t BLOCK = 32;         // k values of a GGUF block (and of an x scale)
constexpr int64_t GROUP = 16;         // output rows of a packed group: the int32 lanes of a 512-bit vector
constexpr bool Q8 = GGUF_TYPE == 2;
constexpr int64_t VALUE_BYTES = Q8 ? BLOCK * GROUP : BLOCK * GROUP / 2;  // a block's values (Q4: nibbles)
// Q4_0: d; Q4_1: d, m (f16); Q8_0: d (f16), -128 * sum q (int32)
constexpr int64_t GROUP_BLOCK_BYTES = VALUE_BYTES + (GGUF_TYPE == 0 ? 2 : GGUF_TYPE == 1 ? 4 : 6) * GROUP;
constexpr int64_t CHUNK_BYTES = GROUP * 4;  // 16 rows x 4 bytes: one 512-bit load, or two 256-bit
constexpr int64_t CHUNKS = VALUE_BYTES / CHUNK_BYTES;  // chunks per block (Q4: each two vectors of 4 k)
constexpr float QMAX = 127.f;         // the largest |q_x|

#ifdef GGUF_INT8_AVX512_VNNI
// ---- AVX512-VNNI: a group's 16 rows are the 16 int32 lanes of one vector ----
constexpr int X_OFFSET = Q8 ? 128 : 0;  // added to q_x where the weights are the signed operand

// 16 values of x from p, as fp32.
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {  // bf16: the high half of an fp32
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// 16 floats -> bf16 bits, rounded to nearest even as c10::BFloat16's conversion (NaN: 0x7FC0).
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// One row of x [k] -> q [k] int8 (Q8_0: q + 128 as u8), and per block d [k / 32], s [k / 32] (d * sum q),
// neg8sum [k / 32] (-8 sum q, Q4_0's dot start).
void quantize_row(const T* x, int8_t* q, float* d, float* s, int32_t* neg8sum, int64_t k) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < k / BLOCK; ++b) {
    const __m512 lo = load16(x + b * BLOCK), hi = load16(x + b * BLOCK + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, sign), _mm512_and_ps(hi, sign)));
    const float inv = amax > 0.f ? QMAX / amax : 0.f;
    const __m512 iv = _mm512_set1_ps(inv);
    // (the default rounding mode: to nearest, ties to even, as torch.round)
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, iv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, iv));
    const __m512i offset = _mm512_set1_epi32(X_OFFSET);  // (Q8_0: q_x + 128 as u8, 1..255)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * BLOCK), _mm512_cvtepi32_epi8(_mm512_add_epi32(qlo, offset)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * BLOCK + 16), _mm512_cvtepi32_epi8(_mm512_add_epi32(qhi, offset)));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    d[b] = amax / QMAX;
    s[b] = d[b] * static_cast<float>(sum);
    neg8sum[b] = -8 * sum;
  }
}

// y rows [m0, m0 + MR) x output rows of groups [g0, g0 + NG): xq [M, K] int8 and its per-block
// scales dx, sums sx, neg8 [M, K / 32]; w the packed groups.
template <int MR, int NG>
void tile(const int8_t* xq, const float* dx, const float* sx, const int32_t* neg8, const uint8_t* w, T* y,
          int64_t n, int64_t k, int64_t m0, int64_t g0) {
  const int64_t blocks = k / BLOCK;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* wp[NG];
  for (int g = 0; g < NG; ++g) wp[g] = w + (g0 + g) * blocks * GROUP_BLOCK_BYTES;
  __m512 acc[MR][NG];
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < NG; ++g) acc[m][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[MR][NG];
    for (int g = 0; g < NG; ++g) {
      const uint8_t* sp = wp[g] + b * GROUP_BLOCK_BYTES + VALUE_BYTES;
      for (int m = 0; m < MR; ++m) {
        if constexpr (Q8) dot[m][g] = _mm512_loadu_si512(sp + 2 * GROUP);  // -128 sum q_w
        else if constexpr (GGUF_TYPE == 0) dot[m][g] = _mm512_set1_epi32(neg8[(m0 + m) * blocks + b]);
        else dot[m][g] = _mm512_setzero_si512();
      }
    }
    if constexpr (Q8) {
      for (int c = 0; c < CHUNKS; ++c) {
        __m512i v[NG];
        for (int g = 0; g < NG; ++g) v[g] = _mm512_loadu_si512(wp[g] + b * GROUP_BLOCK_BYTES + CHUNK_BYTES * c);
        for (int m = 0; m < MR; ++m) {
          int32_t a;
          std::memcpy(&a, xq + (m0 + m) * k + b * BLOCK + 4 * c, 4);
          const __m512i xa = _mm512_set1_epi32(a);
          for (int g = 0; g < NG; ++g) dot[m][g] = _mm512_dpbusd_epi32(dot[m][g], xa, v[g]);
        }
      }
    } else {
      for (int c = 0; c < CHUNKS; ++c) {
        __m512i lo[NG], hi[NG];
        for (int g = 0; g < NG; ++g) {
          const __m512i v = _mm512_loadu_si512(wp[g] + b * GROUP_BLOCK_BYTES + CHUNK_BYTES * c);
          lo[g] = _mm512_and_si512(v, low4);
          hi[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
        for (int m = 0; m < MR; ++m) {
          const int8_t* xm = xq + (m0 + m) * k + b * BLOCK + 4 * c;
          int32_t a, h;
          std::memcpy(&a, xm, 4);
          std::memcpy(&h, xm + 16, 4);
          const __m512i xa = _mm512_set1_epi32(a), xh = _mm512_set1_epi32(h);
          for (int g = 0; g < NG; ++g) {
            dot[m][g] = _mm512_dpbusd_epi32(dot[m][g], lo[g], xa);
            dot[m][g] = _mm512_dpbusd_epi32(dot[m][g], hi[g], xh);
          }
        }
      }
    }
    __m512 dw[NG], mw[NG];
    for (int g = 0; g < NG; ++g) {
      const uint8_t* sp = wp[g] + b * GROUP_BLOCK_BYTES + VALUE_BYTES;
      dw[g] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp)));
      if constexpr (GGUF_TYPE == 1) mw[g] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + 32)));
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 d = _mm512_set1_ps(dx[(m0 + m) * blocks + b]);
      const __m512 s = _mm512_set1_ps(sx[(m0 + m) * blocks + b]);
      for (int g = 0; g < NG; ++g) {
        acc[m][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][g]), _mm512_mul_ps(dw[g], d), acc[m][g]);
        if constexpr (GGUF_TYPE == 1) acc[m][g] = _mm512_fmadd_ps(mw[g], s, acc[m][g]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int g = 0; g < NG; ++g) {
      const int64_t col = (g0 + g) * GROUP, valid = std::min<int64_t>(GROUP, n - col);
      T* out = y + (m0 + m) * n + col;
      if constexpr (std::is_same_v<T, float>) {
        _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << valid) - 1), acc[m][g]);
      } else {
        _mm256_mask_storeu_epi16(out, static_cast<__mmask16>((1u << valid) - 1), to_bf16(acc[m][g]));
      }
    }
  }
}

#else  // GGUF_INT8_AVX2
// ---- AVX2: a group's 16 rows are two vectors of 8 int32 lanes (a chunk's two 32-byte halves) ----
constexpr int64_t LANES = 8;                 // int32 (and fp32) lanes of a 256-bit vector
constexpr int64_t HALVES = GROUP / LANES;    // vectors of a group
constexpr int64_t HALF_BYTES = CHUNK_BYTES / HALVES;
constexpr int Q4_MAX = 15, Q8_ABS_MAX = 128;  // the largest q_w of Q4, the largest |q_w| of Q8_0 (int8)
// Q4: a vpmaddubsw lane holds two products q_w q_x, |.| <= 2 * 15 * 127; a block adds its 2 * CHUNKS
// (low and high nibbles of each chunk) in int16 before vpmaddwd widens them: <= 30480, no saturation
static_assert(Q8 || 2 * CHUNKS * 2 * Q4_MAX * QMAX <= INT16_MAX, "the Q4 int16 sums would saturate");
// Q8_0: two products |q_w| q_x, |.| <= 2 * 128 * 127 = 32512, widened at every chunk
static_assert(2 * Q8_ABS_MAX * QMAX <= INT16_MAX, "the Q8_0 int16 pairs would saturate");

// 8 values of x from p, as fp32.
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));  // (T is float: the cast is for the bf16 build)
  } else {  // bf16: the high half of an fp32
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// 8 floats -> bf16 bits, rounded to nearest even as c10::BFloat16's conversion (NaN: 0x7FC0).
inline __m128i to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // (each 128-bit lane packs its 4 values twice: keep the low 64 bits of each lane)
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0b1000));
}

inline float max_of(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t sum_of(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// One row of x [k] -> q [k] int8, and per block d [k / 32], s [k / 32] (d * sum q), neg8sum [k / 32]
// (-8 sum q, Q4_0's dot start): the same values as the AVX512 form's.
void quantize_row(const T* x, int8_t* q, float* d, float* s, int32_t* neg8sum, int64_t k) {
  constexpr int PARTS = BLOCK / LANES;
  static_assert(PARTS == 4, "a block is four vectors of 8, packed to bytes below");
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  // packs_epi32 then packs_epi16 leave 4-byte runs in the order 0, 2, 4, 6, 1, 3, 5, 7: put back
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < k / BLOCK; ++b) {
    __m256 v[PARTS];
    for (int i = 0; i < PARTS; ++i) v[i] = load8(x + b * BLOCK + LANES * i);
    const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], sign), _mm256_and_ps(v[1], sign)),
                                   _mm256_max_ps(_mm256_and_ps(v[2], sign), _mm256_and_ps(v[3], sign)));
    const float amax = max_of(a);
    const float inv = amax > 0.f ? QMAX / amax : 0.f;
    const __m256 iv = _mm256_set1_ps(inv);
    __m256i qi[PARTS];  // (the default rounding mode: to nearest, ties to even, as torch.round)
    for (int i = 0; i < PARTS; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], iv));
    // |q| <= 127: the saturating packs keep every value
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * BLOCK), _mm256_permutevar8x32_epi32(bytes, order));
    const int32_t sum = sum_of(_mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3])));
    d[b] = amax / QMAX;
    s[b] = d[b] * static_cast<float>(sum);
    neg8sum[b] = -8 * sum;
  }
}

// valid (1..8) of the 8 sums in v -> out.
inline void store8(T* out, __m256 v, int64_t valid) {
  alignas(32) T part[LANES];
  T* dst = valid == LANES ? out : part;
  if constexpr (std::is_same_v<T, float>) {
    _mm256_storeu_ps(reinterpret_cast<float*>(dst), v);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), to_bf16(v));
  }
  if (dst == part) std::memcpy(out, part, valid * sizeof(T));
}

// Four x values at p, broadcast to every int32 lane.
inline __m256i broadcast4(const int8_t* p) {
  int32_t a;
  std::memcpy(&a, p, 4);
  return _mm256_set1_epi32(a);
}

// One block's int32 dots of x rows [m0, m0 + MR) with the NV vectors of 8 output rows at wv[v] (the
// block's values, each offset to its half of the chunks): dot[m][v] lane r = sum q_w q_x.
template <int MR, int NV>
inline void block_dots(const int8_t* xb, int64_t k, const uint8_t* const* wv, __m256i (&dot)[MR][NV]) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Q8) {
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v) dot[m][v] = _mm256_setzero_si256();
    for (int c = 0; c < CHUNKS; ++c) {
      __m256i q[NV], qabs[NV];
      for (int v = 0; v < NV; ++v) {
        q[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wv[v] + CHUNK_BYTES * c));
        qabs[v] = _mm256_abs_epi8(q[v]);  // (-128 stays 0x80: 128 as the unsigned operand)
      }
      for (int m = 0; m < MR; ++m) {
        const __m256i xa = broadcast4(xb + m * k + 4 * c);
        for (int v = 0; v < NV; ++v) {
          const __m256i pairs = _mm256_maddubs_epi16(qabs[v], _mm256_sign_epi8(xa, q[v]));
          dot[m][v] = _mm256_add_epi32(dot[m][v], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
  } else {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i sum[MR][NV];  // int16 pairs
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v) sum[m][v] = _mm256_setzero_si256();
    for (int c = 0; c < CHUNKS; ++c) {
      __m256i lo[NV], hi[NV];
      for (int v = 0; v < NV; ++v) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wv[v] + CHUNK_BYTES * c));
        lo[v] = _mm256_and_si256(q, low4);
        hi[v] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
      }
      for (int m = 0; m < MR; ++m) {
        const __m256i xa = broadcast4(xb + m * k + 4 * c), xh = broadcast4(xb + m * k + 16 + 4 * c);
        for (int v = 0; v < NV; ++v)
          sum[m][v] = _mm256_add_epi16(sum[m][v], _mm256_add_epi16(_mm256_maddubs_epi16(lo[v], xa),
                                                                   _mm256_maddubs_epi16(hi[v], xh)));
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v) dot[m][v] = _mm256_madd_epi16(sum[m][v], ones);
  }
}

// y rows [m0, m0 + MR) x output rows of groups [g0, g0 + NG): xq [M, K] int8 and its per-block
// scales dx, sums sx, neg8 [M, K / 32]; w the packed groups. Vector v is half v % 2 of group g0 + v / 2.
template <int MR, int NG>
void tile(const int8_t* xq, const float* dx, const float* sx, const int32_t* neg8, const uint8_t* w, T* y,
          int64_t n, int64_t k, int64_t m0, int64_t g0) {
  constexpr int NV = NG * HALVES;
  const int64_t blocks = k / BLOCK;
  const uint8_t* gp[NV];
  for (int v = 0; v < NV; ++v) gp[v] = w + (g0 + v / HALVES) * blocks * GROUP_BLOCK_BYTES;
  __m256 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = gp[v] + b * GROUP_BLOCK_BYTES + (v % HALVES) * HALF_BYTES;
    __m256i dot[MR][NV];
    block_dots<MR, NV>(xq + m0 * k + b * BLOCK, k, wv, dot);
    __m256 dw[NV], mw[NV];
    for (int v = 0; v < NV; ++v) {
      const uint8_t* sp = gp[v] + b * GROUP_BLOCK_BYTES + VALUE_BYTES + (v % HALVES) * LANES * 2;
      dw[v] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp)));
      if constexpr (GGUF_TYPE == 1) mw[v] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 2 * GROUP)));
    }
    for (int m = 0; m < MR; ++m) {
      const __m256 d = _mm256_set1_ps(dx[(m0 + m) * blocks + b]);
      const __m256 s = _mm256_set1_ps(sx[(m0 + m) * blocks + b]);
      const __m256i start = _mm256_set1_epi32(GGUF_TYPE == 0 ? neg8[(m0 + m) * blocks + b] : 0);
      for (int v = 0; v < NV; ++v) {
        const __m256i dv = GGUF_TYPE == 0 ? _mm256_add_epi32(dot[m][v], start) : dot[m][v];
        acc[m][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dv), _mm256_mul_ps(dw[v], d), acc[m][v]);
        if constexpr (GGUF_TYPE == 1) acc[m][v] = _mm256_fmadd_ps(mw[v], s, acc[m][v]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < NV; ++v) {
      const int64_t col = (g0 + v / HALVES) * GROUP + (v % HALVES) * LANES;
      if (col < n) store8(y + (m0 + m) * n + col, acc[m][v], std::min<int64_t>(LANES, n - col));
    }
  }
}
#endif

// All rows of x for groups [g0, g0 + NG), TILE_M rows at a time, then the remainder.
template <int NG>
void column(const int8_t* xq, const float* dx, const float* sx, const int32_t* neg8, const uint8_t* w, T* y,
            int64_t m, int64_t n, int64_t k, int64_t g0) {
  int64_t m0 = 0;
  for (; m0 + TILE_M <= m; m0 += TILE_M) tile<TILE_M, NG>(xq, dx, sx, neg8, w, y, n, k, m0, g0);
  const int64_t rest = m - m0;
  // (a switch up to the largest TILE_M tried: 8)
  switch (rest) {
    case 0: break;
    case 1: tile<1, NG>(xq, dx, sx, neg8, w, y, n, k, m0, g0); break;
    case 2: tile<std::min(2, TILE_M), NG>(xq, dx, sx, neg8, w, y, n, k, m0, g0); break;
    case 3: tile<std::min(3, TILE_M), NG>(xq, dx, sx, neg8, w, y, n, k, m0, g0); break;
    case 4: tile<std::min(4, TILE_M), NG>(xq, dx, sx, neg8, w, y, n, k, m0, g0); break;
    case 5: tile<std::min(5, TILE_M), NG>(xq, dx, sx, neg8, w, y, n, k, m0, g0); break;
    case 6: tile<std::min(6, TILE_M), NG>(xq, dx, sx, neg8, w, y, n, k, m0, g0); break;
    default: tile<std::min(7, TILE_M), NG>(xq, dx, sx, neg8, w, y, n, k, m0, g0); break;
  }
}

}  // namespace

// The entry point (Inductor's bindings call `kernel`): y [m, n] = x [m, k] @ W^T, W packed as above
// ([ceil(n / 16), k / 32, GROUP_BLOCK_BYTES] bytes), k a multiple of 32.
extern "C" void kernel(const T* x, const uint8_t* w, T* y, int64_t m, int64_t n, int64_t k, int64_t threads) {
  static_assert(TILE_M >= 1 && TILE_M <= 8, "the remainder switch covers TILE_M <= 8");
  if (m < 1 || k % BLOCK) throw std::invalid_argument("gguf vnni kernel: m >= 1, k % 32 == 0");
  Py_BEGIN_ALLOW_THREADS
  const int64_t blocks = k / BLOCK, groups = (n + GROUP - 1) / GROUP;
  std::vector<int8_t> xq(m * k);
  std::vector<float> dx(m * blocks), sx(m * blocks);
  std::vector<int32_t> neg8(m * blocks);
  const int64_t tiles = (groups + TILE_G - 1) / TILE_G;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r)
      quantize_row(x + r * k, xq.data() + r * k, dx.data() + r * blocks, sx.data() + r * blocks,
                   neg8.data() + r * blocks, k);
    // static: the tiles cost the same; each thread streams one contiguous range of the weight
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t g0 = t * TILE_G;
      if (g0 + TILE_G <= groups)
        column<TILE_G>(xq.data(), dx.data(), sx.data(), neg8.data(), w, y, m, n, k, g0);
      else
        for (int64_t g = g0; g < groups; ++g) column<1>(xq.data(), dx.data(), sx.data(), neg8.data(), w, y, m, n, k, g);
    }
  }
  Py_END_ALLOW_THREADS
}
