// Paged decode attention on the CPU: one query token per sequence, each sequence's keys and
// values read where the paged cache holds them (no gather, no copy), fp32 accumulation.
// Why and when it runs: nanovllm/kernels/cpu_paged_decode.py, which compiles this file
// through torch Inductor's C++ code cache after defining four macros:
//   ELEMENT_TYPE: the query's, the cache's and the output's (float, at::BFloat16, at::Half)
//   HEAD_DIM: a multiple of the vector width (a head's floats fit in registers)
//   PREFETCH_BLOCKS: how many blocks ahead of the one being read are prefetched
//
// Work: one task per (sequence, KV head, key partition). A task loads the query heads of its
// KV head's group once, reads each of its K rows once for all of them (scores), takes the
// softmax over its scores in fp32 (two passes over a per-thread scratch), then reads each V
// row once (weighted sum). A sequence with one partition writes its output directly; with
// several (few long sequences: the caller splits them so that every thread gets work), each
// partition leaves its (max, sum, unnormalised output) and a second loop merges them.
// bf16 on AVX512-BF16 has rows of its own (bf16_rows below: each row converted once for the
// group, `vdpbf16ps` for the scores); outputs are rounded in registers (store_scaled).
#include <Python.h>  // (first, as Python asks): only to let other Python threads run meanwhile

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

using T = ELEMENT_TYPE;
constexpr int64_t D = HEAD_DIM;
constexpr int64_t PREFETCH_AHEAD = PREFETCH_BLOCKS;

namespace {

#include "cpu_vec_floats.h"  // Vec, W, load_floats
static_assert(D % W == 0, "head_dim must be a multiple of the vector width");

// Where the cache keeps element (block, row, kv_head, 0): strides in elements.
struct CacheLayout {
  int64_t block, row, head;
};

struct Problem {
  const T* q;             // [num_seqs, num_heads, d]
  const T* k;             // paged, CacheLayout k_at
  const T* v;             // paged, CacheLayout v_at
  const int32_t* tables;  // [num_seqs, table_width], -1 padded
  const int32_t* lens;    // [num_seqs] context lengths
  T* out;                 // [num_seqs, num_heads, d]
  float* partials;        // [num_seqs, kv_heads, num_parts, group, d + 2] when num_parts > 1
  CacheLayout k_at, v_at;
  int64_t num_heads, kv_heads, d, block_size, table_width, part_len, num_parts;
  float scale;

  int64_t group() const { return num_heads / kv_heads; }
};

// Asks the CPU to bring `rows` rows of D elements, `stride` elements apart, into its L2 cache.
// Into L2 (`prefetcht1`), not L1 (`prefetcht0`): two blocks ahead are 64 lines in flight, more
// than L1's miss buffers hold; B2-like decode, 30 layers cold, two threads, bf16: 10.3-10.6 ms
// against 13.1-13.3 (benchmarks/RESULTS.md "B2 CPU, round 15").
constexpr int kPrefetchLocality = 2;  // __builtin_prefetch's: 3 L1 (t0), 2 L2 (t1), 1 L3 (t2)
inline void prefetch_rows(const T* first, int64_t rows, int64_t stride) {
  constexpr int64_t kLine = 64, kBytes = D * sizeof(T);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < kBytes; b += kLine)
      __builtin_prefetch(reinterpret_cast<const char*>(first + r * stride) + b, 0, kPrefetchLocality);
}

// Calls f(first row, n rows, key position of the first row) for the runs of consecutive cache
// rows (one block's) that hold keys [start, end) of sequence `seq`, KV head `head`, in K (Keys)
// or V. The blocks lie anywhere in memory, which the hardware prefetcher cannot guess: each run
// asks for the one PREFETCH_AHEAD runs later before it is read.
template <bool Keys, typename F>
inline void for_each_run(const Problem& p, int64_t seq, int64_t head, int64_t start, int64_t end, F f) {
  const T* cache = Keys ? p.k : p.v;
  const CacheLayout& at = Keys ? p.k_at : p.v_at;
  const int32_t* table = p.tables + seq * p.table_width;
  auto run_at = [&](int64_t t) {
    return cache + table[t / p.block_size] * at.block + (t % p.block_size) * at.row + head * at.head;
  };
  for (int64_t t = start; t < end;) {
    const int64_t n = std::min(p.block_size - t % p.block_size, end - t);
    const int64_t ahead = (t / p.block_size + PREFETCH_AHEAD) * p.block_size;  // a later block's start
    if (ahead < end) prefetch_rows(run_at(ahead), std::min(p.block_size, end - ahead), at.row);
    f(run_at(t), n, t);
    t += n;
  }
}

// out[0..3] = the sums of the lanes of a, b, c, e (one horizontal reduction for four dot products).
inline void sum4(const Vec& a, const Vec& b, const Vec& c, const Vec& e, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  auto half = [](const Vec& x) {  // 16 lanes -> 8
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
  };
  const __m256 abce = _mm256_hadd_ps(_mm256_hadd_ps(half(a), half(b)), _mm256_hadd_ps(half(c), half(e)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abce), _mm256_extractf128_ps(abce, 1)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 abce = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, e));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abce), _mm256_extractf128_ps(abce, 1)));
#else
  const Vec* v[4] = {&a, &b, &c, &e};
  for (int i = 0; i < 4; ++i) out[i] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, *v[i]);
#endif
}

// q . k over the head dimension, as a vector of partial sums.
inline Vec dot(const float* q, const T* k) {
  Vec s(0.f);
  for (int64_t c = 0; c < D; c += W) s = at::vec::fmadd(Vec::loadu(q + c), load_floats(k + c), s);
  return s;
}

// scores[g * n + i] = (q_g . k_i) for the keys of the task; q holds the scaled queries [group, D].
// A run of rows (one block's) stays in L1 while each query head of the group reads it.
void task_scores(const Problem& p, int64_t seq, int64_t head, int64_t start, int64_t end, const float* q,
                 float* scores) {
  const int64_t G = p.group(), n = end - start, stride = p.k_at.row;
  for_each_run<true>(p, seq, head, start, end, [&](const T* k, int64_t rows, int64_t t0) {
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float* s = scores + g * n + (t0 - start);
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) {  // four independent dot products, one reduction
        const T* kr = k + r * stride;
        sum4(dot(qg, kr), dot(qg, kr + stride), dot(qg, kr + 2 * stride), dot(qg, kr + 3 * stride), s + r);
      }
      for (; r < rows; ++r)
        s[r] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, dot(qg, k + r * stride));
    }
  });
}

// In place: scores of one query head -> exp(score - max); returns (max, sum of the exps). The
// maximum by vectors (any order gives the same); the last n % W scores by one more vector where
// VectorTail (bf16 rows: another exp and summation order than std::exp's one by one), else one by
// one as the generic rows always did.
template <bool VectorTail>
std::pair<float, float> exp_in_place(float* s, int64_t n) {
  Vec vmax(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + W <= n; i += W) vmax = at::vec::maximum(vmax, Vec::loadu(s + i));
  float m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
  for (; i < n; ++i) m = std::max(m, s[i]);
  Vec sum(0.f), vm(m);
  for (i = 0; i + W <= n; i += W) {
    Vec x = (Vec::loadu(s + i) - vm).exp();
    x.store(s + i);
    sum = sum + x;
  }
  if constexpr (VectorTail) {
    if (i < n) {
      const int rest = static_cast<int>(n - i);
      const Vec x = Vec::set(Vec(0.f), (Vec::loadu(s + i, rest) - vm).exp(), rest);
      x.store(s + i, rest);
      sum = sum + x;
    }
    return {m, at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum)};
  }
  float total = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    total += s[i];
  }
  return {m, total};
}

// acc[g * D + c] = sum_i weights[g * n + i] * v_i[c], over the keys of the task; per run of
// rows (one block's, in L1) and query head, the head's D floats stay in registers.
void task_values(const Problem& p, int64_t seq, int64_t head, int64_t start, int64_t end, const float* weights,
                 float* acc) {
  const int64_t G = p.group(), n = end - start, stride = p.v_at.row;
  std::fill(acc, acc + G * D, 0.f);
  for_each_run<false>(p, seq, head, start, end, [&](const T* v, int64_t rows, int64_t t0) {
    for (int64_t g = 0; g < G; ++g) {
      Vec a[D / W];
      for (int64_t c = 0; c < D / W; ++c) a[c] = Vec::loadu(acc + g * D + c * W);
      const float* w = weights + g * n + (t0 - start);
      for (int64_t r = 0; r < rows; ++r) {
        const Vec wr(w[r]);
        for (int64_t c = 0; c < D / W; ++c) a[c] = at::vec::fmadd(wr, load_floats(v + r * stride + c * W), a[c]);
      }
      for (int64_t c = 0; c < D / W; ++c) a[c].store(acc + g * D + c * W);
    }
  });
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// bf16 rows on AVX512-BF16 (the kind the engine runs bf16 on). Most of the generic path's time
// went to converting each row to fp32 once for every query head of the group; here a row is read
// and converted once for all of them:
// - scores: `vdpbf16ps` multiplies the bf16 query and key pairs exactly and sums them in fp32 (in
//   another order than the generic path's fmadd: the scores differ from its at fp32 rounding);
// - values: a row's bf16 pairs as fp32 by a shift (even elements) and a mask (odd ones), then the
//   generic path's fmadd per element in the same order (its bits); the sums kept de-interleaved.
constexpr bool kBf16Rows = std::is_same_v<T, at::BFloat16> && D % 32 == 0;
namespace bf16_rows {
constexpr int64_t R = D / 32;     // 512-bit registers a row of bf16 fills
constexpr int64_t kMaxHeads = 4;  // query heads whose sums stay in registers together

// (the code below is compiled for every T, and runs only where T is at::BFloat16)
inline const at::BFloat16* as_bf16(const T* p) { return reinterpret_cast<const at::BFloat16*>(p); }
inline __m512bh load_pairs(const at::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512 even_floats(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
inline __m512 odd_floats(__m512i x) {
  return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// s[g * n + r] = q_g . k_r for the rows of one run, NG query heads q [NG, D] (bf16, unscaled).
template <int NG>
void scores_run(const at::BFloat16* q, const at::BFloat16* k, int64_t rows, int64_t stride, float* s, int64_t n) {
  __m512bh qv[NG][R];
  for (int g = 0; g < NG; ++g)
    for (int64_t c = 0; c < R; ++c) qv[g][c] = load_pairs(q + g * D + c * 32);
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {  // four rows' sums per head, one reduction
    __m512 acc[NG][4];
    for (int j = 0; j < 4; ++j) {
      __m512bh kv[R];
      for (int64_t c = 0; c < R; ++c) kv[c] = load_pairs(k + (r + j) * stride + c * 32);
      for (int g = 0; g < NG; ++g) {
        acc[g][j] = _mm512_setzero_ps();
        for (int64_t c = 0; c < R; ++c) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], qv[g][c], kv[c]);
      }
    }
    for (int g = 0; g < NG; ++g) sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3], s + g * n + r);
  }
  for (; r < rows; ++r)
    for (int g = 0; g < NG; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < R; ++c) acc = _mm512_dpbf16_ps(acc, qv[g][c], load_pairs(k + r * stride + c * 32));
      s[g * n + r] = _mm512_reduce_add_ps(acc);
    }
}

// acc[g] (de-interleaved: register j of 2R holds the even (j even) or odd elements of 32 of the
// row's) += sum_r w[g * n + r] * v_r over the rows of one run, NG query heads.
template <int NG>
void values_run(const float* w, int64_t n, const at::BFloat16* v, int64_t rows, int64_t stride, float* acc) {
  __m512 a[NG][2 * R];
  for (int g = 0; g < NG; ++g)
    for (int64_t j = 0; j < 2 * R; ++j) a[g][j] = _mm512_loadu_ps(acc + g * D + j * 16);
  for (int64_t r = 0; r < rows; ++r) {
    __m512 x[2 * R];
    for (int64_t c = 0; c < R; ++c) {
      const __m512i pairs = _mm512_loadu_si512(v + r * stride + c * 32);
      x[2 * c] = even_floats(pairs), x[2 * c + 1] = odd_floats(pairs);
    }
    for (int g = 0; g < NG; ++g) {
      const __m512 wr = _mm512_set1_ps(w[g * n + r]);
      for (int64_t j = 0; j < 2 * R; ++j) a[g][j] = _mm512_fmadd_ps(wr, x[j], a[g][j]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int64_t j = 0; j < 2 * R; ++j) _mm512_storeu_ps(acc + g * D + j * 16, a[g][j]);
}

// f.template operator()<NG>(first head) for the query heads [0, G) in groups of at most kMaxHeads.
template <typename F>
inline void for_head_groups(int64_t G, F f) {
  for (int64_t g0 = 0; g0 < G; g0 += kMaxHeads) {
    switch (std::min(kMaxHeads, G - g0)) {
      case 1: f.template operator()<1>(g0); break;
      case 2: f.template operator()<2>(g0); break;
      case 3: f.template operator()<3>(g0); break;
      default: f.template operator()<4>(g0); break;
    }
  }
}

// As task_scores, q the query heads [group, D] in bf16, unscaled (the scale applied to the sums).
void task_scores(const Problem& p, int64_t seq, int64_t head, int64_t start, int64_t end, const at::BFloat16* q,
                 float* scores) {
  const int64_t G = p.group(), n = end - start, stride = p.k_at.row;
  for_each_run<true>(p, seq, head, start, end, [&](const T* k, int64_t rows, int64_t t0) {
    for_head_groups(G, [&]<int NG>(int64_t g0) {
      scores_run<NG>(q + g0 * D, as_bf16(k), rows, stride, scores + g0 * n + (t0 - start), n);
    });
  });
  for (int64_t i = 0; i < G * n; ++i) scores[i] *= p.scale;
}

// As task_values, acc [group, D] in the elements' order.
void task_values(const Problem& p, int64_t seq, int64_t head, int64_t start, int64_t end, const float* weights,
                 float* acc, float* split) {
  const int64_t G = p.group(), n = end - start, stride = p.v_at.row;
  std::fill(split, split + G * D, 0.f);
  for_each_run<false>(p, seq, head, start, end, [&](const T* v, int64_t rows, int64_t t0) {
    for_head_groups(G, [&]<int NG>(int64_t g0) {
      values_run<NG>(weights + g0 * n + (t0 - start), n, as_bf16(v), rows, stride, split + g0 * D);
    });
  });
  // lanes 0-15 of (even, odd) -> elements 0-15 of the 32 (e0 o0 e1 o1 ...), then 16-31
  const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < R; ++c) {
      const __m512 even = _mm512_loadu_ps(split + g * D + 2 * c * 16);
      const __m512 odd = _mm512_loadu_ps(split + g * D + (2 * c + 1) * 16);
      _mm512_storeu_ps(acc + g * D + c * 32, _mm512_permutex2var_ps(even, first, odd));
      _mm512_storeu_ps(acc + g * D + c * 32 + 16, _mm512_permutex2var_ps(even, second, odd));
    }
}
}  // namespace bf16_rows
#else
constexpr bool kBf16Rows = false;
#endif

// o[c] = x[c] * norm rounded to T, c < D (rounded to nearest even, as the scalar conversion).
inline void store_scaled(T* o, const float* x, float norm) {
  const Vec n(norm);
  int64_t c = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; c < D; c += W) (Vec::loadu(x + c) * n).store(o + c);
  } else {
    for (; c + 2 * W <= D; c += 2 * W) {
      const Vec a = Vec::loadu(x + c) * n, b = Vec::loadu(x + c + W) * n;
      if constexpr (std::is_same_v<T, at::BFloat16>) at::vec::convert_float_bfloat16(a, b).store(o + c);
      else at::vec::convert_float_half(a, b).store(o + c);
    }
  }
  for (; c < D; ++c) o[c] = static_cast<T>(x[c] * norm);
}

// One (sequence, KV head, partition) task; scratch: this thread's floats, group * (part_len + 3d + 2).
void run_task(const Problem& p, int64_t task, float* scratch) {
  const int64_t G = p.group(), d = D;
  const int64_t part = task % p.num_parts, head = (task / p.num_parts) % p.kv_heads;
  const int64_t seq = task / (p.num_parts * p.kv_heads);
  const int64_t len = p.lens[seq], start = part * p.part_len, end = std::min(len, start + p.part_len);
  float* q = scratch;            // [group, d]
  float* acc = q + G * d;        // [group, d]
  float* stats = acc + G * d;    // max [group], then sum [group]
  float* split = stats + 2 * G;  // [group, d]: bf16_rows's de-interleaved sums
  float* scores = split + G * d; // [group, end - start]
  float* partial = p.partials + task * G * (d + 2);  // [group, d], then max [group], sum [group]
  if (start >= end) {  // a partition past this sequence's end: weight 0 in the merge
    for (int64_t g = 0; g < G; ++g) partial[G * d + g] = -std::numeric_limits<float>::infinity();
    return;
  }
  const T* q_in = p.q + (seq * p.num_heads + head * G) * d;
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  if constexpr (kBf16Rows) bf16_rows::task_scores(p, seq, head, start, end, bf16_rows::as_bf16(q_in), scores);
#endif
  if constexpr (!kBf16Rows) {
    for (int64_t i = 0; i < G * d; ++i) q[i] = static_cast<float>(q_in[i]) * p.scale;
    task_scores(p, seq, head, start, end, q, scores);
  }
  for (int64_t g = 0; g < G; ++g) {
    auto [m, s] = exp_in_place<kBf16Rows>(scores + g * (end - start), end - start);
    stats[g] = m, stats[G + g] = s;
  }
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  if constexpr (kBf16Rows) bf16_rows::task_values(p, seq, head, start, end, scores, acc, split);
#endif
  if constexpr (!kBf16Rows) task_values(p, seq, head, start, end, scores, acc);
  if (p.num_parts == 1) {
    T* o = p.out + (seq * p.num_heads + head * G) * d;
    for (int64_t g = 0; g < G; ++g) store_scaled(o + g * d, acc + g * d, 1.f / stats[G + g]);
    return;
  }
  std::copy(acc, acc + G * d, partial);
  std::copy(stats, stats + 2 * G, partial + G * d);
}

// The partitions of one (sequence, KV head) merged into its output rows.
void merge(const Problem& p, int64_t pair) {
  const int64_t G = p.group(), d = D, head = pair % p.kv_heads, seq = pair / p.kv_heads;
  const float* first = p.partials + pair * p.num_parts * G * (d + 2);
  T* o = p.out + (seq * p.num_heads + head * G) * d;
  for (int64_t g = 0; g < G; ++g) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t part = 0; part < p.num_parts; ++part) m = std::max(m, first[part * G * (d + 2) + G * d + g]);
    std::vector<float> sum_out(d, 0.f);
    float total = 0.f;
    for (int64_t part = 0; part < p.num_parts; ++part) {
      const float* partial = first + part * G * (d + 2);
      const float pm = partial[G * d + g];
      if (pm == -std::numeric_limits<float>::infinity()) continue;  // an empty partition
      const float w = std::exp(pm - m);
      total += w * partial[G * d + G + g];
      for (int64_t c = 0; c < d; ++c) sum_out[c] += w * partial[g * d + c];
    }
    store_scaled(o + g * d, sum_out.data(), 1.f / total);
  }
}

}  // namespace

// The entry point (Inductor's bindings call `kernel`); pointers arrive as tensors' data.
extern "C" void kernel(const T* q, const T* k, const T* v, const int32_t* tables, const int32_t* lens, T* out,
                       float* partials, int64_t num_seqs,
                       int64_t num_heads, int64_t kv_heads, int64_t d, int64_t block_size, int64_t table_width,
                       int64_t k_block, int64_t k_row, int64_t k_head, int64_t v_block, int64_t v_row,
                       int64_t v_head, int64_t part_len, int64_t num_parts, float scale, int64_t num_threads) {
  if (d != D) throw std::invalid_argument("kernel built for another head_dim");
  const Problem p{q, k, v, tables, lens, out, partials, {k_block, k_row, k_head},
                  {v_block, v_row, v_head}, num_heads, kv_heads, d, block_size, table_width, part_len,
                  num_parts, scale};
  const int64_t num_tasks = num_seqs * kv_heads * num_parts;
  // No Python object is touched below: the GIL is released, as torch's own ops do, so that
  // another Python thread (a server's event loop beside its engine thread) runs meanwhile.
  Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scratch(p.group() * (part_len + 3 * d + 2));
    // dynamic: sequences of uneven lengths make tasks of uneven cost
    // dynamic: sequences of uneven lengths make tasks of uneven cost
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task) run_task(p, task, scratch.data());
    if (num_parts > 1) {
#pragma omp for schedule(static)
      for (int64_t pair = 0; pair < num_seqs * kv_heads; ++pair) merge(p, pair);
    }
  }
  Py_END_ALLOW_THREADS
}
