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
#include <Python.h>  // (first, as Python asks): only to let other Python threads run meanwhile

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

using T = ELEMENT_TYPE;
constexpr int64_t D = HEAD_DIM;
constexpr int64_t PREFETCH_AHEAD = PREFETCH_BLOCKS;

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();  // floats a vector holds
static_assert(D % W == 0, "head_dim must be a multiple of the vector width");

// W elements at p, as floats.
inline Vec load_floats(const float* p) { return Vec::loadu(p); }
inline Vec load_floats(const at::BFloat16* p) {
  Vec out;
  at::vec::load_to_float<at::BFloat16>(p, out);
  return out;
}
inline Vec load_floats(const at::Half* p) {
  Vec out;
  at::vec::load_to_float<at::Half>(p, out);
  return out;
}

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

// Asks the CPU to bring `rows` rows of D elements, `stride` elements apart, into its caches.
inline void prefetch_rows(const T* first, int64_t rows, int64_t stride) {
  constexpr int64_t kLine = 64, kBytes = D * sizeof(T);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < kBytes; b += kLine)
      __builtin_prefetch(reinterpret_cast<const char*>(first + r * stride) + b);
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

// In place: scores of one query head -> exp(score - max); returns (max, sum of the exps).
std::pair<float, float> exp_in_place(float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
  Vec sum(0.f), vm(m);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    Vec x = (Vec::loadu(s + i) - vm).exp();
    x.store(s + i);
    sum = sum + x;
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

// One (sequence, KV head, partition) task; scratch: this thread's floats, group * (part_len + 2d + 2).
void run_task(const Problem& p, int64_t task, float* scratch) {
  const int64_t G = p.group(), d = D;
  const int64_t part = task % p.num_parts, head = (task / p.num_parts) % p.kv_heads;
  const int64_t seq = task / (p.num_parts * p.kv_heads);
  const int64_t len = p.lens[seq], start = part * p.part_len, end = std::min(len, start + p.part_len);
  float* q = scratch;            // [group, d]
  float* acc = q + G * d;        // [group, d]
  float* stats = acc + G * d;    // max [group], then sum [group]
  float* scores = stats + 2 * G; // [group, end - start]
  float* partial = p.partials + task * G * (d + 2);  // [group, d], then max [group], sum [group]
  if (start >= end) {  // a partition past this sequence's end: weight 0 in the merge
    for (int64_t g = 0; g < G; ++g) partial[G * d + g] = -std::numeric_limits<float>::infinity();
    return;
  }
  const T* q_in = p.q + (seq * p.num_heads + head * G) * d;
  for (int64_t i = 0; i < G * d; ++i) q[i] = static_cast<float>(q_in[i]) * p.scale;
  task_scores(p, seq, head, start, end, q, scores);
  for (int64_t g = 0; g < G; ++g) {
    auto [m, s] = exp_in_place(scores + g * (end - start), end - start);
    stats[g] = m, stats[G + g] = s;
  }
  task_values(p, seq, head, start, end, scores, acc);
  if (p.num_parts == 1) {
    T* o = p.out + (seq * p.num_heads + head * G) * d;
    for (int64_t g = 0; g < G; ++g) {
      const float norm = 1.f / stats[G + g];
      for (int64_t c = 0; c < d; ++c) o[g * d + c] = static_cast<T>(acc[g * d + c] * norm);
    }
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
    const float norm = 1.f / total;
    for (int64_t c = 0; c < d; ++c) o[g * d + c] = static_cast<T>(sum_out[c] * norm);
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
    std::vector<float> scratch(p.group() * (part_len + 2 * d + 2));
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
