// Fused CPU element-wise ops of the decoder layer, one pass over memory each instead of several torch ops:
//   add_rms_norm:  residual += x (in place), out = weight * rms_norm(residual)
//   rms_norm:      out = weight * rms_norm(x)
//   silu_and_mul:  x [T, 2I] -> silu(x[:, :I]) * x[:, I:]
//   rotary:        q, k [T, heads, D] rotated in place (rotate-half layout) by per-token cos, sin [T, D]
//   store_kv:      key/value rows into their cache slots (slot -1: not stored)
//   store_kv_quant: the same into a quantized cache (kernels/paged_attention.py's quantize): per (token, KV head) row,
//                  x / channel scale takes its own fp16 scale, then the codes (int8 rounded half to even, fp8 as
//                  c10 converts, as torch does) and the scale's two bytes; bit for bit the reference's
//   argmax_rows:   logits [rows, V] -> int64 [rows], exactly torch.argmax(dim=-1): the first index of the maximum,
//                  the first NaN's index where a row has one, index 0 for a row of -inf
// Each computes in fp32 and rounds to the tensor's dtype wherever its torch definition (the *_ref functions of
// kernels/layer_ops.py, and store_kv_ref of kernels/paged_attention.py) rounds, so bf16/fp16 results match it
// to the last bit but for reduction order and exp's last ulp.
// With AVX-512 (F), fp32 and bf16 run explicit 16-lane loops: bf16 widened exactly, narrowed bit for bit as
// c10::BFloat16(float) (round to nearest even, denormals kept, NaN -> 0x7FC0): with AVX512-BF16 by its conversion
// (same rounding) except for blocks holding a NaN or an fp32 denormal, which it would flush, else in integer ops.
// fp16, AVX2 and generic builds run the scalar loops.
//
// Built with paged_decode_cpu.cpp into one library by kernels/cpu_ops.py (same cache, self-check and fallback).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "simd.h"     // load16, exp_clamped, exp_clamped16

#if defined(__AVX512F__)
#define TP_AVX512 1
#else
#define TP_AVX512 0
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace simd;

template <typename T>
inline float rd(float x) { return static_cast<float>(static_cast<T>(x)); }   // round through T
template <>
inline float rd<float>(float x) { return x; }

// rows per parallel chunk, from the bytes a row moves: ~64 KB a chunk, so a decode batch (64 rows: 74-600 KB) already
// takes both threads (a fork costs ~1-2 us; measured faster than one thread from ~64 KB) and a one-row call stays on one
inline int64_t grain_for(int64_t row_bytes, int64_t chunk_bytes = 64 * 1024) {
  return std::max<int64_t>(1, chunk_bytes / std::max<int64_t>(row_bytes, 1));
}

#if TP_AVX512
// 16 lanes of T <-> fp32: fp32 and bf16 (exact widening; RNE narrowing as c10::BFloat16(float)) everywhere; fp16
// only loaded (argmax, by simd.h's load16)
template <typename T>
constexpr bool kVec = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// 32 values of T as two fp32 vectors: fp32 its two halves; bf16 its even and its odd elements, one shift or one
// mask each (no lane crossing). Element-wise code never sees the difference, as long as every operand is loaded so.
struct V32 {
  __m512 a, b;
};
inline V32 load32(const float* p) { return {_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16)}; }
inline V32 load32(const c10::BFloat16* p) {
  const __m512i v = _mm512_loadu_si512(p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))))};
}

// fp32 rounded to the nearest bf16, ties to even (c10's round_to_nearest_even), kept as an fp32 with the low 16
// bits clear. NaNs are not canonicalised here: every NaN in these kernels is a widened bf16 input or the default
// NaN of an invalid operation (or propagated from one), so its low 16 bits are zero and the bias cannot carry.
inline __m512i round_bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
}

template <typename T>
inline V32 vrd(V32 v);   // round through T
template <>
inline V32 vrd<float>(V32 v) { return v; }
template <>
inline V32 vrd<c10::BFloat16>(V32 v) {
  return {_mm512_castsi512_ps(round_bf16_bits(v.a)), _mm512_castsi512_ps(round_bf16_bits(v.b))};
}

inline void store32(float* p, V32 v) {
  _mm512_storeu_ps(p, v.a);
  _mm512_storeu_ps(p + 16, v.b);
}
// rounds as c10::BFloat16(float), NaN -> 0x7FC0
inline void store32_exact(c10::BFloat16* p, V32 v) {
  const __m512i qnan = _mm512_set1_epi32(0x7FC00000);
  const __m512i a = _mm512_mask_mov_epi32(round_bf16_bits(v.a), _mm512_cmp_ps_mask(v.a, v.a, _CMP_UNORD_Q), qnan);
  const __m512i b = _mm512_mask_mov_epi32(round_bf16_bits(v.b), _mm512_cmp_ps_mask(v.b, v.b, _CMP_UNORD_Q), qnan);
  _mm512_storeu_si512(p, _mm512_or_si512(_mm512_srli_epi32(a, 16), b));
}
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// AVX512-BF16 rounds to nearest even too, in one instruction, but flushes fp32 denormals to zero and keeps NaN
// payloads: a block with either takes the integer path
inline void store32(c10::BFloat16* p, V32 v) {
  if (__builtin_expect(_mm512_fpclass_ps_mask(v.a, 0xA1) | _mm512_fpclass_ps_mask(v.b, 0xA1), 0)) {   // NaN, denormal
    store32_exact(p, v);
    return;
  }
  const __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v.b, v.a));   // a in words 0-15, b in 16-31
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  _mm512_storeu_si512(p, _mm512_permutexvar_epi16(interleave, packed));
}
#else
inline void store32(c10::BFloat16* p, V32 v) { store32_exact(p, v); }
#endif

inline V32 operator+(V32 x, V32 y) { return {_mm512_add_ps(x.a, y.a), _mm512_add_ps(x.b, y.b)}; }
inline V32 operator*(V32 x, V32 y) { return {_mm512_mul_ps(x.a, y.a), _mm512_mul_ps(x.b, y.b)}; }
inline V32 operator*(V32 x, __m512 y) { return {_mm512_mul_ps(x.a, y), _mm512_mul_ps(x.b, y)}; }
#endif

// one row: residual (when given) += x in place, rounded to T; out = weight * rd(h * scale), h the row's (new) values
// read back exactly from where they are stored, so no scratch row
template <typename T>
inline void rms_norm_row(const T* xr, T* rr, const T* wp, T* orow, int64_t n, float eps) {
  const T* h = rr ? rr : xr;
  int64_t i = 0;
  float sum = 0.f;
#if TP_AVX512
  if constexpr (kVec<T>) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    if (rr) {
      for (; i + 32 <= n; i += 32) {
        const V32 v = vrd<T>(load32(rr + i) + load32(xr + i));
        store32(rr + i, v);
        s0 = _mm512_fmadd_ps(v.a, v.a, s0);
        s1 = _mm512_fmadd_ps(v.b, v.b, s1);
      }
    } else {
      for (; i + 32 <= n; i += 32) {
        const V32 v = load32(xr + i);
        s0 = _mm512_fmadd_ps(v.a, v.a, s0);
        s1 = _mm512_fmadd_ps(v.b, v.b, s1);
      }
    }
    sum = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
  }
#endif
  for (; i < n; ++i) {
    if (rr) rr[i] = static_cast<T>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
    const float v = static_cast<float>(h[i]);
    sum += v * v;
  }
  const float scale = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  i = 0;
#if TP_AVX512
  if constexpr (kVec<T>) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (; i + 32 <= n; i += 32) store32(orow + i, load32(wp + i) * vrd<T>(load32(h + i) * sc));
  }
#endif
  for (; i < n; ++i) orow[i] = static_cast<T>(static_cast<float>(wp[i]) * rd<T>(static_cast<float>(h[i]) * scale));
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, at::Tensor& out,
                   float eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0, os = out.stride(0);
  at::parallel_for(0, rows, grain_for(n * sizeof(T) * (rp ? 4 : 2)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row<T>(xp + r * xs, rp ? rp + r * rs : nullptr, wp, op + r * os, n, eps);
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must match x's last dimension and dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  switch (x.scalar_type()) {
    case at::kFloat: rms_norm_impl<float>(x, nullptr, weight, out, static_cast<float>(eps)); break;
    case at::kBFloat16: rms_norm_impl<c10::BFloat16>(x, nullptr, weight, out, static_cast<float>(eps)); break;
    case at::kHalf: rms_norm_impl<c10::Half>(x, nullptr, weight, out, static_cast<float>(eps)); break;
    default: TORCH_CHECK(false, "unsupported dtype ", x.scalar_type());
  }
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual must match x in shape and dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must match x's last dimension and dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  switch (x.scalar_type()) {
    case at::kFloat: rms_norm_impl<float>(x, &residual, weight, out, static_cast<float>(eps)); break;
    case at::kBFloat16: rms_norm_impl<c10::BFloat16>(x, &residual, weight, out, static_cast<float>(eps)); break;
    case at::kHalf: rms_norm_impl<c10::Half>(x, &residual, weight, out, static_cast<float>(eps)); break;
    default: TORCH_CHECK(false, "unsupported dtype ", x.scalar_type());
  }
  return out;
}

#if TP_AVX512
// silu(a) = a / (1 + exp(-a)), torch's formula (exp(-a) = inf for a < -89: -0; a = -inf: NaN, as torch)
inline __m512 silu16(__m512 a) {
  const __m512 na = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(static_cast<int32_t>(0x80000000u))));
  return _mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_clamped16(na)));
}
inline V32 silu32(V32 a) { return {silu16(a.a), silu16(a.b)}; }
#endif

template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), n = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, grain_for(3 * n * sizeof(T)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = xp + r * xs;
      const T* u = g + n;
      T* o = op + r * n;
      int64_t i = 0;
#if TP_AVX512
      if constexpr (kVec<T>) {
        for (; i + 32 <= n; i += 32) {
          const V32 a = load32(g + i);
          store32(o + i, vrd<T>(silu32(a)) * load32(u + i));
        }
      }
#endif
#pragma GCC ivdep
      for (; i < n; ++i) {
        const float a = static_cast<float>(g[i]);
        o[i] = static_cast<T>(rd<T>(a / (1.0f + exp_clamped(-a))) * static_cast<float>(u[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x's last dimension must be even");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat: silu_and_mul_impl<float>(x, out); break;
    case at::kBFloat16: silu_and_mul_impl<c10::BFloat16>(x, out); break;
    case at::kHalf: silu_and_mul_impl<c10::Half>(x, out); break;
    default: TORCH_CHECK(false, "unsupported dtype ", x.scalar_type());
  }
  return out;
}

#if TP_AVX512
constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
inline V32 rot_mul(V32 x, V32 y) { return {_mm512_mul_round_ps(x.a, y.a, kRne), _mm512_mul_round_ps(x.b, y.b, kRne)}; }
inline V32 rot_add(V32 x, V32 y) { return {_mm512_add_round_ps(x.a, y.a, kRne), _mm512_add_round_ps(x.b, y.b, kRne)}; }
inline V32 neg(V32 x) {
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  return {_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x.a), sign)),
          _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x.b), sign))};
}
#endif

template <typename T>
void rotate_rows(T* x, int64_t tokens, int64_t heads, int64_t ts, int64_t hs, const T* cos, const T* sin,
                 int64_t cs, int64_t half, int64_t t) {
  const T* c = cos + t * cs;
  const T* s = sin + t * cs;
  int64_t vec_end = 0;
#if TP_AVX512
  if constexpr (kVec<T>) {
    // x * cos + rotate_half(x) * sin with torch's roundings: each product, then the sum, rounded to T (explicitly
    // rounded mul/add, which the compiler does not contract into a fused multiply-add)
    vec_end = half / 32 * 32;
    for (int64_t i = 0; i < vec_end; i += 32) {
      const V32 c1 = load32(c + i), c2 = load32(c + i + half), s1 = load32(s + i), s2 = load32(s + i + half);
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + t * ts + h * hs;
        const V32 x1 = load32(v + i), x2 = load32(v + i + half);
        store32(v + i, rot_add(vrd<T>(rot_mul(x1, c1)), vrd<T>(rot_mul(neg(x2), s1))));
        store32(v + i + half, rot_add(vrd<T>(rot_mul(x2, c2)), vrd<T>(rot_mul(x1, s2))));
      }
    }
  }
#endif
  if (vec_end == half) return;
  for (int64_t h = 0; h < heads; ++h) {
    T* v = x + t * ts + h * hs;
#pragma GCC ivdep
    for (int64_t i = vec_end; i < half; ++i) {
      const float x1 = static_cast<float>(v[i]), x2 = static_cast<float>(v[i + half]);
      const float lo = rd<T>(x1 * static_cast<float>(c[i])) + rd<T>(-x2 * static_cast<float>(s[i]));
      const float hi = rd<T>(x2 * static_cast<float>(c[i + half])) + rd<T>(x1 * static_cast<float>(s[i + half]));
      v[i] = static_cast<T>(lo);
      v[i + half] = static_cast<T>(hi);
    }
  }
}

template <typename T>
void rotary_impl(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = q.size(0), dim = q.size(2), half = dim / 2;
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, tokens, grain_for(2 * (q.size(1) + k.size(1) + 1) * dim * sizeof(T)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate_rows<T>(qp, tokens, q.size(1), q.stride(0), q.stride(1), cp, sp, cos.stride(0), half, t);
      rotate_rows<T>(kp, tokens, k.size(1), k.stride(0), k.stride(1), cp, sp, cos.stride(0), half, t);
    }
  });
}

void rotary(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1, "q, k must be [T, heads, D]");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(2) % 2 == 0, "q, k shapes disagree");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.stride(1) == 1 && sin.stride(0) == cos.stride(0) &&
              sin.stride(1) == 1 && cos.size(0) == q.size(0) && cos.size(1) == q.size(2),
              "cos, sin must be [T, D] with contiguous rows");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == q.scalar_type() &&
              sin.scalar_type() == q.scalar_type(), "q, k, cos, sin must share a dtype");
  switch (q.scalar_type()) {
    case at::kFloat: rotary_impl<float>(q, k, cos, sin); break;
    case at::kBFloat16: rotary_impl<c10::BFloat16>(q, k, cos, sin); break;
    case at::kHalf: rotary_impl<c10::Half>(q, k, cos, sin); break;
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
}

template <typename T>
void store_kv_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                   const int64_t* slots) {
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  const int64_t total_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slots[t] < total_slots, "slot ", slots[t], " outside the cache");
  const T* kp = key.data_ptr<T>();
  const T* vp = value.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0), vs1 = value.stride(1);
  const int64_t row = heads * dim;     // a slot's heads are contiguous in the cache, and mostly in key/value too
  const bool k_rows = heads == 1 || ks1 == dim, v_rows = heads == 1 || vs1 == dim;
  // prefill-sized stores split across threads (which also shares out the page faults of a pool's first use)
  at::parallel_for(0, tokens, grain_for(4 * row * sizeof(T), 128 * 1024), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      if (k_rows) std::memcpy(kc + slot * row, kp + t * ks0, row * sizeof(T));
      else for (int64_t h = 0; h < heads; ++h) std::memcpy(kc + slot * row + h * dim, kp + t * ks0 + h * ks1, dim * sizeof(T));
      if (v_rows) std::memcpy(vc + slot * row, vp + t * vs0, row * sizeof(T));
      else for (int64_t h = 0; h < heads; ++h) std::memcpy(vc + slot * row + h * dim, vp + t * vs0 + h * vs1, dim * sizeof(T));
    }
  });
}

void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.stride(2) == 1 && value.stride(2) == 1,
              "key, value must be [T, Hkv, D] with contiguous rows");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
              k_cache.size(2) == key.size(1) && k_cache.size(3) == key.size(2) && k_cache.sizes() == v_cache.sizes(),
              "caches must be contiguous [blocks, block_size, Hkv, D]");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == v_cache.scalar_type() &&
              key.scalar_type() == value.scalar_type(), "key, value and caches must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == key.size(0), "slot_mapping must be int64 [T]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  switch (key.scalar_type()) {
    case at::kFloat: store_kv_impl<float>(key, value, k_cache, v_cache, slots); break;
    case at::kBFloat16: store_kv_impl<c10::BFloat16>(key, value, k_cache, v_cache, slots); break;
    case at::kHalf: store_kv_impl<c10::Half>(key, value, k_cache, v_cache, slots); break;
    default: TORCH_CHECK(false, "unsupported dtype ", key.scalar_type());
  }
}

// One row of `dim` values (x, channel scales sc) -> `dim` codes of C and the row's fp16 scale, at out.
template <typename C, typename T>
inline void quantize_row(const T* x, const float* sc, int64_t dim, float limit, uint8_t* out, float* y) {
  float amax = 0.0f;
  for (int64_t i = 0; i < dim; ++i) {
    y[i] = static_cast<float>(x[i]) / sc[i];
    amax = std::max(amax, std::abs(y[i]));
  }
  c10::Half rh(std::min(amax / limit, 65504.0f));
  if (!(static_cast<float>(rh) > 0.0f)) rh = c10::Half(1.0f);
  const float r = static_cast<float>(rh);
  for (int64_t i = 0; i < dim; ++i) {
    const float z = std::min(std::max(y[i] / r, -limit), limit);
    if constexpr (std::is_same_v<C, int8_t>) {
      const int8_t code = static_cast<int8_t>(std::nearbyint(z));
      std::memcpy(out + i, &code, 1);
    } else {
      const C code(z);
      std::memcpy(out + i, &code, 1);
    }
  }
  std::memcpy(out + dim, &rh.x, 2);
}

template <typename C, typename T>
void store_kv_quant_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                         const int64_t* slots, const float* k_sc, const float* v_sc, float limit) {
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2), width = dim + 2;
  const int64_t total_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slots[t] < total_slots, "slot ", slots[t], " outside the cache");
  const T* kp = key.data_ptr<T>();
  const T* vp = value.data_ptr<T>();
  uint8_t* kc = static_cast<uint8_t*>(k_cache.data_ptr());
  uint8_t* vc = static_cast<uint8_t*>(v_cache.data_ptr());
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0), vs1 = value.stride(1);
  at::parallel_for(0, tokens, grain_for(4 * heads * dim * sizeof(T), 128 * 1024), [&](int64_t begin, int64_t end) {
    std::vector<float> y(dim);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      for (int64_t h = 0; h < heads; ++h) {
        uint8_t* row = kc + (slot * heads + h) * width;
        quantize_row<C>(kp + t * ks0 + h * ks1, k_sc + h * dim, dim, limit, row, y.data());
        quantize_row<C>(vp + t * vs0 + h * vs1, v_sc + h * dim, dim, limit, vc + (slot * heads + h) * width, y.data());
      }
    }
  });
}

template <typename C>
void store_kv_quant_typed(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                          const int64_t* slots, const float* k_sc, const float* v_sc, float limit) {
  switch (key.scalar_type()) {
    case at::kFloat: store_kv_quant_impl<C, float>(key, value, k_cache, v_cache, slots, k_sc, v_sc, limit); break;
    case at::kBFloat16: store_kv_quant_impl<C, c10::BFloat16>(key, value, k_cache, v_cache, slots, k_sc, v_sc, limit); break;
    case at::kHalf: store_kv_quant_impl<C, c10::Half>(key, value, k_cache, v_cache, slots, k_sc, v_sc, limit); break;
    default: TORCH_CHECK(false, "unsupported dtype ", key.scalar_type());
  }
}

void store_kv_quant(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
                    const at::Tensor& slot_mapping, const at::Tensor& k_scale, const at::Tensor& v_scale) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.stride(2) == 1 && value.stride(2) == 1 &&
              key.scalar_type() == value.scalar_type(), "key, value must be [T, Hkv, D] with contiguous rows");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
              k_cache.size(2) == key.size(1) && k_cache.size(3) == key.size(2) + 2 &&
              k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "caches must be contiguous [blocks, block_size, Hkv, D + 2]");
  TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat && k_scale.is_contiguous() &&
              v_scale.is_contiguous() && k_scale.numel() == key.size(1) * key.size(2) &&
              v_scale.numel() == key.size(1) * key.size(2), "k_scale and v_scale must be contiguous fp32 [Hkv, D]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == key.size(0), "slot_mapping must be int64 [T]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* ks = k_scale.data_ptr<float>();
  const float* vs = v_scale.data_ptr<float>();
  switch (k_cache.scalar_type()) {
    case at::ScalarType::Char: store_kv_quant_typed<int8_t>(key, value, k_cache, v_cache, slots, ks, vs, 127.0f); break;
    case at::ScalarType::Float8_e4m3fn:
      store_kv_quant_typed<c10::Float8_e4m3fn>(key, value, k_cache, v_cache, slots, ks, vs, 448.0f); break;
    case at::ScalarType::Float8_e5m2:
      store_kv_quant_typed<c10::Float8_e5m2>(key, value, k_cache, v_cache, slots, ks, vs, 57344.0f); break;
    default: TORCH_CHECK(false, "unsupported quantized cache dtype ", k_cache.scalar_type());
  }
}

// ---- argmax_rows ------------------------------------------------------------------------------------------------
// One scan of a stretch [begin, end) of a row: `idx` the first index of its largest value (begin when all are -inf),
// `nan` the first NaN's index or -1. Stretches of one row combine in order (argmax_combine), so a row can be split
// across threads. bf16/fp16 widen to fp32 exactly, so comparing in fp32 is comparing the stored values.
struct ArgmaxPart {
  float max;
  int64_t idx;
  int64_t nan;
};

template <typename T>
inline float widen(T v) { return static_cast<float>(v); }

template <typename T>
ArgmaxPart argmax_scalar(const T* p, int64_t begin, int64_t end) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t idx = -1;
  for (int64_t i = begin; i < end; ++i) {
    const float x = widen(p[i]);
    if (x > m) { m = x; idx = i; }
    else if (x != x) return {m, idx < 0 ? begin : idx, i};
  }
  return {m, idx < 0 ? begin : idx, -1};
}

#if TP_AVX512
// 4 x 16 lanes, each keeping the first index of its own largest value (strict >: NaN never wins a lane, an equal
// later value never replaces); NaNs are only noted, then found by a scalar rescan (rare). The lanes reduce to the
// largest value and, among lanes holding it, the smallest index: the row's first maximum.
template <typename T>
ArgmaxPart argmax_avx512(const T* p, int64_t begin, int64_t end) {
  constexpr int64_t W = 16, U = 4 * W;
  const int64_t vec_end = begin + (end - begin) / U * U;
  if (vec_end == begin) return argmax_scalar(p, begin, end);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m0 = ninf, m1 = ninf, m2 = ninf, m3 = ninf;
  const __m512i none = _mm512_set1_epi32(-1);
  __m512i i0 = none, i1 = none, i2 = none, i3 = none;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(W);
  __m512i cur = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(begin)), lane);   // index of lane 0, 1, ...
  __mmask16 nan = 0;
  for (int64_t i = begin; i < vec_end; i += U) {
    const __m512 x0 = load16(p + i), x1 = load16(p + i + W), x2 = load16(p + i + 2 * W), x3 = load16(p + i + 3 * W);
    const __mmask16 g0 = _mm512_cmp_ps_mask(x0, m0, _CMP_GT_OQ), g1 = _mm512_cmp_ps_mask(x1, m1, _CMP_GT_OQ);
    const __mmask16 g2 = _mm512_cmp_ps_mask(x2, m2, _CMP_GT_OQ), g3 = _mm512_cmp_ps_mask(x3, m3, _CMP_GT_OQ);
    nan |= _mm512_cmp_ps_mask(x0, x1, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x2, x3, _CMP_UNORD_Q);
    const __m512i c1 = _mm512_add_epi32(cur, step), c2 = _mm512_add_epi32(c1, step), c3 = _mm512_add_epi32(c2, step);
    m0 = _mm512_mask_mov_ps(m0, g0, x0); i0 = _mm512_mask_mov_epi32(i0, g0, cur);
    m1 = _mm512_mask_mov_ps(m1, g1, x1); i1 = _mm512_mask_mov_epi32(i1, g1, c1);
    m2 = _mm512_mask_mov_ps(m2, g2, x2); i2 = _mm512_mask_mov_epi32(i2, g2, c2);
    m3 = _mm512_mask_mov_ps(m3, g3, x3); i3 = _mm512_mask_mov_epi32(i3, g3, c3);
    cur = _mm512_add_epi32(c3, step);
  }
  if (nan) {    // the first NaN of the vector part decides the row (or this stretch)
    for (int64_t i = begin; i < vec_end; ++i)
      if (widen(p[i]) != widen(p[i])) return {widen(p[i]), i, i};
  }
  alignas(64) float mv[U];
  alignas(64) int32_t iv[U];
  _mm512_store_ps(mv, m0); _mm512_store_ps(mv + W, m1); _mm512_store_ps(mv + 2 * W, m2); _mm512_store_ps(mv + 3 * W, m3);
  _mm512_store_si512(iv, i0); _mm512_store_si512(iv + W, i1); _mm512_store_si512(iv + 2 * W, i2); _mm512_store_si512(iv + 3 * W, i3);
  float m = -std::numeric_limits<float>::infinity();
  int64_t idx = -1;
  for (int64_t l = 0; l < U; ++l) {
    if (iv[l] < 0) continue;                                   // a lane that saw only -inf
    if (mv[l] > m || (mv[l] == m && iv[l] < idx)) { m = mv[l]; idx = iv[l]; }
  }
  for (int64_t i = vec_end; i < end; ++i) {                   // the tail: later indices, so strict >
    const float x = widen(p[i]);
    if (x > m) { m = x; idx = i; }
    else if (x != x) return {m, idx < 0 ? begin : idx, i};
  }
  return {m, idx < 0 ? begin : idx, -1};
}
#endif

template <typename T>
inline ArgmaxPart argmax_part(const T* p, int64_t begin, int64_t end) {
#if TP_AVX512
  return argmax_avx512(p, begin, end);
#else
  return argmax_scalar(p, begin, end);
#endif
}

// parts of one row, in index order -> the row's argmax
inline int64_t argmax_combine(const ArgmaxPart* parts, int64_t n) {
  ArgmaxPart best = parts[0];
  for (int64_t c = 0; c < n; ++c) if (parts[c].nan >= 0) return parts[c].nan;
  for (int64_t c = 1; c < n; ++c) if (parts[c].max > best.max) best = parts[c];
  return best.idx;
}

template <typename T>
void argmax_rows_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1), rs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  int64_t* op = out.data_ptr<int64_t>();
  // few rows (one online request, a handful): each row split into stretches of >= 4096 values (multiples of 64)
  // so every thread has work; many rows: a row per task
  const int64_t threads = at::get_num_threads();
  int64_t chunks = 1;
  if (rows < 4 * threads && n >= 8192) {
    chunks = std::min<int64_t>((4 * threads + rows - 1) / rows, n / 4096);
  }
  const int64_t chunk = chunks == 1 ? n : (n / chunks + 63) / 64 * 64;
  chunks = (n + chunk - 1) / chunk;
  const int64_t grain = std::max<int64_t>(1, 32768 / chunk);   // tiny inputs stay on one thread
  if (chunks == 1) {
    at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const ArgmaxPart part = argmax_part(xp + r * rs, 0, n);
        op[r] = part.nan >= 0 ? part.nan : part.idx;
      }
    });
    return;
  }
  std::vector<ArgmaxPart> parts(rows * chunks);
  at::parallel_for(0, rows * chunks, grain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t r = t / chunks, c = t % chunks;
      parts[t] = argmax_part(xp + r * rs, c * chunk, std::min(n, (c + 1) * chunk));
    }
  });
  for (int64_t r = 0; r < rows; ++r) op[r] = argmax_combine(parts.data() + r * chunks, chunks);
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  check_rows(logits, "logits");
  TORCH_CHECK(logits.size(1) > 0, "logits must have a non-empty last dimension");
  TORCH_CHECK(logits.size(1) < std::numeric_limits<int32_t>::max() - 64, "logits rows too long");
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  if (logits.size(0) == 0) return out;
  switch (logits.scalar_type()) {
    case at::kFloat: argmax_rows_impl<float>(logits, out); break;
    case at::kBFloat16: argmax_rows_impl<c10::BFloat16>(logits, out); break;
    case at::kHalf: argmax_rows_impl<c10::Half>(logits, out); break;
    default: TORCH_CHECK(false, "unsupported dtype ", logits.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tidepool_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("store_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.impl("rotary", c10::DispatchKey::CPU, &rotary);
  m.impl("store_kv", c10::DispatchKey::CPU, &store_kv);
  m.def("store_kv_quant(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor k_scale, Tensor v_scale) -> ()");
  m.impl("store_kv_quant", c10::DispatchKey::CPU, &store_kv_quant);
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, &argmax_rows);
}
