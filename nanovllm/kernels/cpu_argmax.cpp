// The argmax of each row of x [n, vocab], as torch's `argmax(-1)`: the first index of the row's
// largest value, a NaN counting as larger than any number (the first NaN wins). Built by
// nanovllm/kernels/cpu_argmax.py through utils/cpp_compiler.py with:
//   ELEMENT_TYPE: x's C++ type (float, at::BFloat16, at::Half)
// Two passes over a row: the maximum in float vectors (at::vec::maximum, which keeps a NaN), then
// the first position holding it. Values are compared as floats, which every element type converts
// to exactly, so the index is torch's.
#include <Python.h>  // (first, as Python asks): only to let other Python threads run meanwhile

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <limits>

using T = ELEMENT_TYPE;

namespace {

#include "cpu_vec_floats.h"  // Vec, W, load_floats

// The larger of a and b, a NaN winning.
inline float nan_max(float a, float b) { return std::isnan(a) || a >= b ? a : b; }

int64_t row_argmax(const T* row, int64_t vocab) {
  Vec best_lanes(-std::numeric_limits<float>::infinity());
  int64_t c = 0;
  for (; c + W <= vocab; c += W) best_lanes = at::vec::maximum(best_lanes, load_floats(row + c));
  float lanes[W];
  best_lanes.store(lanes);
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < W; ++i) best = nan_max(best, lanes[i]);
  for (; c < vocab; ++c) best = nan_max(best, static_cast<float>(row[c]));
  const bool nan = std::isnan(best);
  for (int64_t i = 0; i < vocab; ++i) {
    const float v = static_cast<float>(row[i]);
    if (nan ? std::isnan(v) : v == best) return i;
  }
  return 0;  // (not reached: the maximum is one of the row's values)
}

}  // namespace

// out [n] int64 = argmax of each row of x [n, vocab] (contiguous), rows split over `threads`.
extern "C" void kernel(const T* x, int64_t* out, int64_t n, int64_t vocab, int64_t threads) {
  Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(threads) if (n > 1)
  for (int64_t r = 0; r < n; ++r) out[r] = row_argmax(x + r * vocab, vocab);
  Py_END_ALLOW_THREADS
}
