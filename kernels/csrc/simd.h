// Vector helpers shared by the native CPU kernels (paged_decode_cpu.cpp, fused_cpu.cpp; one library, one compiler
// command, so both see the same #if branches): 16 lanes of fp32 / bf16 / fp16 / 8-bit KV codes loaded as fp32, and
// exp.
//
// 8-bit KV codes (kernels/kv_quant.py): int8, fp8 e5m2 and fp8 e4m3fn. They are widened by integer shifts and the
// F16C conversion, not by a table: an e5m2 byte is the top half of an fp16; an e4m3 byte b becomes the fp16 bits
// ((b & 0x7F) << 7) | ((b & 0x80) << 8) (vectors: b sign-extended to 16 bits, << 7, & 0xBF80), whose value is b's
// divided by 2^8 (subnormals included), so its reader
// multiplies by kCodeScale (folded into the per-head scale, no extra multiply per element). e4m3fn's NaN code is
// never stored (the store saturates).
//
// exp is Cephes expf, written once for every lane width: n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts, the
// first exact in few bits, so r carries no rounding error of note), exp(r) ~ 1 + r + r^2 P(r) with P of degree 5
// (~1 ulp), exp(x) = 2^n exp(r). The variants differ in the x they take and in how they round n and apply 2^n:
//   exp8_nonpos (GCC vectors, every build), exp8_nonpos_avx2, exp16_nonpos: x <= 0 (a softmax's x - max), clamped
//     below at -87 so that 2^n stays a normal float;
//   exp_clamped (scalar; auto-vectorises), exp_clamped16: any x, clamped to [-104, 89].
// Each keeps the operation order of the kernel code it was taken from, so every kernel's results are what they were
// to the bit; where two variants round differently, the comment above them says so.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace simd {

struct Fp8E4M3 { uint8_t bits; };
struct Fp8E5M2 { uint8_t bits; };
template <typename T>
constexpr bool kQuantized = std::is_same_v<T, int8_t> || std::is_same_v<T, Fp8E4M3> || std::is_same_v<T, Fp8E5M2>;
template <typename T>
constexpr float kCodeScale = std::is_same_v<T, Fp8E4M3> ? 256.0f : 1.0f;     // value = widened code * kCodeScale

// one code as fp16 bits (the portable path)
inline uint16_t code_to_half_bits(Fp8E4M3 c) {
  return static_cast<uint16_t>(((c.bits & 0x7F) << 7) | ((c.bits & 0x80) << 8));
}
inline uint16_t code_to_half_bits(Fp8E5M2 c) { return static_cast<uint16_t>(c.bits << 8); }
inline float code_to_float(int8_t c) { return static_cast<float>(c); }
template <typename T>
inline float code_to_float(T c) {
  return static_cast<float>(c10::Half(code_to_half_bits(c), c10::Half::from_bits()));
}

#if defined(__AVX2__) && defined(__F16C__)
// eight codes -> eight fp32 (divided by kCodeScale)
inline __m256 load8_codes(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8_codes(const Fp8E5M2* p) {
  const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(x, 8));
}
inline __m256 load8_codes(const Fp8E4M3* p) {
  const __m128i x = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(x, 7), _mm_set1_epi16(static_cast<short>(0xBF80))));
}
#endif

// GCC/Clang vector extensions: eight fp32 lanes, AVX/AVX-512 with -march=native, split into narrower ops elsewhere.
typedef float vec8 __attribute__((vector_size(32)));
typedef int32_t ivec8 __attribute__((vector_size(32)));

inline vec8 splat8(float x) { return vec8{} + x; }
inline vec8 bits_to_float(ivec8 bits) {
  vec8 out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {    // bf16 is the top half of an fp32
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// sixteen 8-bit KV codes (divided by kCodeScale, as load8_codes)
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const Fp8E5M2* p) {
  const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(x, 8));
}
inline __m512 load16(const Fp8E4M3* p) {
  const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(static_cast<short>(0xBF80))));
}
#endif

// ---- exp ---------------------------------------------------------------------------------------------------------
// The operations exp_reduced needs, per lane type. OpLanes: a float or a GCC vector of floats, by operators (so the
// compiler fuses a * b + c into one FMA wherever it did when the polynomial was written out with operators);
// Lanes8 / Lanes16: AVX2 / AVX-512 vectors, by intrinsics (explicit FMAs).
template <typename T>
struct OpLanes {
  using V = T;
  static V set1(float c) {
    if constexpr (std::is_same_v<T, float>) return c;
    else return T{} + c;
  }
  static V mul(V a, V b) { return a * b; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V fmadd(V a, V b, V c) { return a * b + c; }
  static V fnmadd(V a, V b, V c) { return c - a * b; }
};

#if defined(__AVX2__) && defined(__FMA__)
struct Lanes8 {
  using V = __m256;
  static V set1(float c) { return _mm256_set1_ps(c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
};
#endif

#if defined(__AVX512F__)
struct Lanes16 {
  using V = __m512;
  static V set1(float c) { return _mm512_set1_ps(c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
};
#endif

constexpr float kLog2e = 1.44269504088896341f;

// n = round(x log2 e) by adding and taking away 1.5 * 2^23 (the sum has no fraction bits left)
template <typename L>
inline typename L::V exp_round_n(typename L::V x) {
  const typename L::V magic = L::set1(12582912.0f);
  return L::sub(L::fmadd(x, L::set1(kLog2e), magic), magic);
}

// exp(r) for r = x - n ln 2, n = round(x log2 e) as the caller rounded it: 1 + r + r^2 P(r), the one copy of Cephes
// expf's coefficients. r^2 P(r) as (P(r) r) r, or with kSquareFirst as P(r) (r r) (exp_clamped16's order).
template <typename L, bool kSquareFirst = false>
inline typename L::V exp_reduced(typename L::V x, typename L::V n) {
  using V = typename L::V;
  V r = L::fnmadd(n, L::set1(0.693359375f), x);     // ln 2 = 0.693359375 - 2.12194440e-4
  r = L::fnmadd(n, L::set1(-2.12194440e-4f), r);
  V p = L::set1(1.9875691500e-4f);
  p = L::fmadd(p, r, L::set1(1.3981999507e-3f));
  p = L::fmadd(p, r, L::set1(8.3334519073e-3f));
  p = L::fmadd(p, r, L::set1(4.1665795894e-2f));
  p = L::fmadd(p, r, L::set1(1.6666665459e-1f));
  p = L::fmadd(p, r, L::set1(5.0000001201e-1f));
  if constexpr (kSquareFirst) return L::add(L::fmadd(p, L::mul(r, r), r), L::set1(1.0f));
  else return L::add(L::fmadd(L::mul(p, r), r, r), L::set1(1.0f));
}

// exp(x) for x <= 0, eight at a time in GCC vectors: n rounded by exp_round_n, 2^n built in the exponent bits
inline vec8 exp8_nonpos(vec8 x) {
  using L = OpLanes<vec8>;
  x = x < splat8(-87.0f) ? splat8(-87.0f) : x;              // keeps 2^n normal; NaN passes through
  const vec8 n = exp_round_n<L>(x);
  const vec8 p = exp_reduced<L>(x, n);
  return p * bits_to_float((__builtin_convertvector(n, ivec8) + 127) << 23);
}

#if defined(__AVX2__) && defined(__FMA__)
// exp8_nonpos in AVX2 registers, but n rounded from the rounded product x log2 e (vroundps), not by exp_round_n's
// fused add, so the two may differ in the last ulp; NaN passes through
inline __m256 exp8_nonpos_avx2(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);   // max_ps returns its second operand when one is NaN
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 p = exp_reduced<Lanes8>(x, n);
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#if defined(__AVX512F__)
// exp(x) for x <= 0, sixteen at a time: exp8_nonpos_avx2's steps, 2^n by scalef; NaN passes through
inline __m512 exp16_nonpos(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);   // max_ps returns its second operand when one is NaN
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(exp_reduced<Lanes16>(x, n), n);
}
#endif

// exp(x), x clamped to [-104, 89], beyond which exp rounds to 0 or overflows to inf; 2^n (n in [-150, 128]) applied
// in two halves that are normal floats, which rounds once, as a single scaling would. NaN stays NaN. Auto-vectorises.
inline float exp_clamped(float x) {
  using L = OpLanes<float>;
  x = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);
  const float n = exp_round_n<L>(x);
  const float p = exp_reduced<L>(x, n);
  const int32_t n0 = static_cast<int32_t>(n), n1 = n0 / 2;
  const int32_t bits1 = (n1 + 127) << 23, bits2 = (n0 - n1 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &bits1, sizeof s1);
  std::memcpy(&s2, &bits2, sizeof s2);
  return p * s1 * s2;
}

#if defined(__AVX512F__)
// exp_clamped on 16 lanes: the same clamp and n, r^2 P(r) as P(r) (r r) (so the last ulp may differ), 2^n by scalef
// (p * 2^n rounded once)
inline __m512 exp_clamped16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), _mm512_min_ps(_mm512_set1_ps(89.0f), x));    // NaN passes both
  const __m512 n = exp_round_n<Lanes16>(x);
  return _mm512_scalef_ps(exp_reduced<Lanes16, true>(x, n), n);
}
#endif

}  // namespace simd
