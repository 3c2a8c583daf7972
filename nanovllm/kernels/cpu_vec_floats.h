// Float vectors from the element types the CPU kernels take (float, at::BFloat16, at::Half), for
// cpu_paged_decode.cpp and cpu_small_ops.cpp. Not compiled on its own: `cpp_compiler.source` puts
// this text where a kernel source includes it (inside that source's anonymous namespace, after
// <ATen/cpu/vec/vec.h>), so the library's hash covers it.

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();  // floats a vector holds

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
