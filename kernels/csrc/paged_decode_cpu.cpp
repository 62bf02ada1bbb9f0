// CPU paged decode attention, reading the paged KV cache in place (layout and contract: kernels/paged_attention.py).
//
// One query row per sequence. A work item is one sequence (or, for small batches, one of its KV heads), taken by
// one thread. Only slots at positions < context_lens[b] are read, so whatever unowned slots hold (even NaN) cannot
// reach the output; a row with context 0 (a padding row) reads nothing and comes out as zeros. Items go longest
// first to whichever of at::parallel_for's threads is free. All accumulation is fp32.
//
// Three implementations of the same contract:
//  * attend16 (AVX-512 builds, head_dim a multiple of 16; the engine's case): 16-position tiles, each K/V row read
//    once for all the query heads of its GQA group, dot products reduced 16 at a time by vertical adds, a running
//    (online) softmax across tiles, so K and V are read once each and interleaved, with no score buffer. Per tile
//    and KV head, the softmax updates of up to four query rows run side by side (independent dependency chains),
//    then one pass over the V rows serves all of them (each V vector loaded, and widened if bf16/fp16, once per
//    four rows); the next tile's rows are prefetched a line or two per position of each q.k and p.V pass, spread
//    evenly over the tile's work, not in one burst (a burst fills the core's line fill buffers and stalls the
//    arithmetic behind it). With a bf16 cache on a CPU with AVX512-BF16 (and head_dim a multiple of 32), q.k is vdpbf16ps on the
//    cache rows as they are, and p is rounded to bf16 before p.V as the reference's softmax(...).to(v.dtype) does.
//  * attend8 (AVX2+FMA builds: every head_dim attend16 does not take, and every head_dim on CPUs without AVX-512):
//    attend16's design at eight lanes, in tiles of 32 positions (four groups of 8 dot products, each group reduced
//    by a tree of horizontal adds), one running-softmax update per query row and tile; bf16/fp16 rows widened to
//    fp32 once per tile for the whole GQA group; fp32 rows prefetched a tile ahead.
//  * attend (every other build): scores q.k block by block, an exact softmax, then the weighted sum of the V rows,
//    eight lanes at a time.
//
// Built and loaded at first use by kernels/cpu_ops.py; registers torch.ops.tidepool_cpu.paged_decode.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "simd.h"     // load16, the exp variants, vec8

#include <algorithm>
#include <array>
#include <utility>
#include <type_traits>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

namespace {

using namespace simd;

// unaligned loads and stores of simd.h's GCC vectors
typedef float vec8u __attribute__((vector_size(32), aligned(4), may_alias));
typedef uint16_t u16x8u __attribute__((vector_size(16), aligned(2), may_alias));

inline float hsum(vec8 v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

inline vec8 load8(const float* p) { return *reinterpret_cast<const vec8u*>(p); }
inline vec8 load8(const c10::BFloat16* p) {   // bf16 is the top half of an fp32
  return bits_to_float(__builtin_convertvector(*reinterpret_cast<const u16x8u*>(p), ivec8) << 16);
}
#if defined(__FLT16_MAX__)
typedef _Float16 f16x8u __attribute__((vector_size(16), aligned(2), may_alias));
inline vec8 load8(const c10::Half* p) { return __builtin_convertvector(*reinterpret_cast<const f16x8u*>(p), vec8); }
#else
inline vec8 load8(const c10::Half* p) {
  vec8 out;
  for (int i = 0; i < 8; ++i) out[i] = static_cast<float>(p[i]);
  return out;
}
#endif
// eight 8-bit KV codes, divided by kCodeScale (simd.h)
template <typename T, std::enable_if_t<kQuantized<T>, int> = 0>
inline vec8 load8(const T* p) {
#if defined(__AVX2__) && defined(__F16C__)
  return load8_codes(p);
#else
  vec8 out;
  for (int i = 0; i < 8; ++i) out[i] = code_to_float(p[i]);
  return out;
#endif
}

// A quantized cache's scales per (KV head, channel), [Hkv, D] (null for a 16/32-bit cache): K's folded into q
// (q . k = sum_c q_c s_c code_c), V's into the output (sum_t p_t s_c code_tc = s_c sum_t p_t code_tc).
struct Scales {
  const float* k = nullptr;
  const float* v = nullptr;
};
template <typename T>
inline float k_factor(const Scales& sc, int64_t hc) { return sc.k[hc] * kCodeScale<T>; }
// A quantized cache row (one token's KV head: `dim` codes, then its own fp16 scale) -> that scale; 1 otherwise. It
// multiplies the row's score (K) or its probability before p . V (V).
template <typename T>
inline float row_scale(const T* row, int64_t dim) {
  if constexpr (kQuantized<T>) {
    uint16_t bits;
    std::memcpy(&bits, row + dim, sizeof bits);
    return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
  } else {
    return 1.0f;
  }
}
template <typename T>
inline float v_factor(const Scales& sc, int64_t hc) { return sc.v[hc] * kCodeScale<T>; }

// each of `rows` rows of `len` scores becomes its softmax, in place
void softmax_rows(float* scores, int64_t rows, int64_t len) {
  const int64_t body = len / 8 * 8;
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = scores + r * len;
    float m = -std::numeric_limits<float>::infinity();
    if (body) {
      vec8 mv = load8(sr);
      for (int64_t t = 8; t < body; t += 8) {
        const vec8 x = load8(sr + t);
        mv = x > mv ? x : mv;
      }
      for (int i = 0; i < 8; ++i) m = std::max(m, mv[i]);
    }
    for (int64_t t = body; t < len; ++t) m = std::max(m, sr[t]);
    vec8 sv = {};
    for (int64_t t = 0; t < body; t += 8) {
      const vec8 e = exp8_nonpos(load8(sr + t) - m);
      *reinterpret_cast<vec8u*>(sr + t) = e;
      sv += e;
    }
    float sum = hsum(sv);
    for (int64_t t = body; t < len; ++t) {
      sr[t] = std::exp(sr[t] - m);
      sum += sr[t];
    }
    const float inv = 1.0f / sum;
    for (int64_t t = 0; t < len; ++t) sr[t] *= inv;
  }
}

// `rows` token rows of `bytes` bytes each, `stride` elements apart, toward the cache ahead of use
template <typename T>
inline void prefetch_rows(const T* first, int64_t rows, int64_t stride, int64_t bytes) {
  for (int64_t t = 0; t < rows; ++t) {
    const char* p = reinterpret_cast<const char*>(first + t * stride);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
  }
}

struct Shape {
  int64_t block_size, num_kv_heads, group, dim, pool_blocks;
  float scale;
  int64_t row;      // elements of one (token, KV head) row in the cache: dim, plus a quantized row's 2 scale bytes
};

// KV heads [h0, h1) of one sequence. head_dim = 8 * NC (NC = 0: any multiple of 8 up to 256, read at run time).
// scores: (h1 - h0) * group * ctx floats, acc: (h1 - h0) * group * head_dim floats. QT: q and out; T: the cache.
template <typename QT, typename T, int NC>
void attend(const QT* q, QT* out, const T* k_cache, const T* v_cache, const int32_t* table, int64_t ctx,
            int64_t h0, int64_t h1, const Shape& s, const Scales& sc, float* scores, float* acc) {
  const int64_t nc = NC ? NC : s.dim / 8;
  const int64_t dim = 8 * nc, group = s.group, row = s.row;
  const int64_t tok_stride = s.num_kv_heads * row;
  const int64_t blk_stride = s.block_size * tok_stride;
  const int64_t nblk = (ctx + s.block_size - 1) / s.block_size;
  const int64_t rows = (h1 - h0) * group;
  const int64_t head_bytes = (h1 - h0) * row * static_cast<int64_t>(sizeof(T));
  QT* oh = out + h0 * group * dim;
  if (ctx == 0) {     // a padding row (CUDA-graph style): attends to nothing
    std::fill(oh, oh + rows * dim, static_cast<QT>(0.0f));
    return;
  }
  for (int64_t j = 0; j < nblk; ++j) {
    TORCH_CHECK(table[j] >= 0 && table[j] < s.pool_blocks, "block table entry ", table[j], " out of range");
  }
  auto block_len = [&](int64_t j) { return std::min(s.block_size, ctx - j * s.block_size); };

  // scores[r][t] = scale * q_r . k_t, four positions in flight per query row
  for (int64_t j = 0; j < nblk; ++j) {
    const int64_t n = block_len(j);
    if (j + 1 < nblk) {
      prefetch_rows(k_cache + table[j + 1] * blk_stride + h0 * row, block_len(j + 1), tok_stride, head_bytes);
    } else {
      prefetch_rows(v_cache + table[0] * blk_stride + h0 * row, block_len(0), tok_stride, head_bytes);
    }
    const T* kb = k_cache + table[j] * blk_stride;
    for (int64_t h = h0; h < h1; ++h) {
      const T* kh = kb + h * row;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = (h - h0) * group + g;
        vec8 qv[NC ? NC : 32];
        for (int64_t c = 0; c < nc; ++c) qv[c] = load8(q + (h * group + g) * dim + 8 * c);
        if constexpr (kQuantized<T>) {
          for (int64_t c = 0; c < nc; ++c) {
            for (int i = 0; i < 8; ++i) qv[c][i] *= k_factor<T>(sc, h * dim + 8 * c + i);
          }
        }
        float* sr = scores + r * ctx + j * s.block_size;
        int64_t t = 0;
        for (; t + 4 <= n; t += 4) {
          const T* k0 = kh + t * tok_stride;
          const T* k1 = k0 + tok_stride;
          const T* k2 = k1 + tok_stride;
          const T* k3 = k2 + tok_stride;
          vec8 a0 = qv[0] * load8(k0), a1 = qv[0] * load8(k1), a2 = qv[0] * load8(k2), a3 = qv[0] * load8(k3);
          for (int64_t c = 1; c < nc; ++c) {
            a0 += qv[c] * load8(k0 + 8 * c);
            a1 += qv[c] * load8(k1 + 8 * c);
            a2 += qv[c] * load8(k2 + 8 * c);
            a3 += qv[c] * load8(k3 + 8 * c);
          }
          sr[t] = hsum(a0) * s.scale * row_scale(k0, dim);
          sr[t + 1] = hsum(a1) * s.scale * row_scale(k1, dim);
          sr[t + 2] = hsum(a2) * s.scale * row_scale(k2, dim);
          sr[t + 3] = hsum(a3) * s.scale * row_scale(k3, dim);
        }
        for (; t < n; ++t) {
          const T* k0 = kh + t * tok_stride;
          vec8 a0 = qv[0] * load8(k0);
          for (int64_t c = 1; c < nc; ++c) a0 += qv[c] * load8(k0 + 8 * c);
          sr[t] = hsum(a0) * s.scale * row_scale(k0, dim);
        }
      }
    }
  }

  softmax_rows(scores, rows, ctx);

  // acc[r] = sum_t p[r][t] * v_t, the accumulator row held in registers through each block
  std::fill(acc, acc + rows * dim, 0.0f);
  for (int64_t j = 0; j < nblk; ++j) {
    const int64_t n = block_len(j);
    if (j + 1 < nblk) {
      prefetch_rows(v_cache + table[j + 1] * blk_stride + h0 * row, block_len(j + 1), tok_stride, head_bytes);
    }
    const T* vb = v_cache + table[j] * blk_stride;
    for (int64_t h = h0; h < h1; ++h) {
      const T* vh = vb + h * row;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = (h - h0) * group + g;
        vec8 av[NC ? NC : 32];
        for (int64_t c = 0; c < nc; ++c) av[c] = load8(acc + r * dim + 8 * c);
        const float* pr = scores + r * ctx + j * s.block_size;
        for (int64_t t = 0; t < n; ++t) {
          const T* vt = vh + t * tok_stride;
          const float p = pr[t] * row_scale(vt, dim);
          for (int64_t c = 0; c < nc; ++c) av[c] += p * load8(vt + 8 * c);
        }
        for (int64_t c = 0; c < nc; ++c) *reinterpret_cast<vec8u*>(acc + r * dim + 8 * c) = av[c];
      }
    }
  }
  if constexpr (kQuantized<T>) {
    for (int64_t i = 0; i < rows * dim; ++i) {
      oh[i] = static_cast<QT>(acc[i] * v_factor<T>(sc, (h0 + i / dim / group) * dim + i % dim));
    }
  } else {
    for (int64_t i = 0; i < rows * dim; ++i) oh[i] = static_cast<QT>(acc[i]);
  }
}

#if defined(__AVX512F__)
// AVX-512 path (head_dim a multiple of 16). The library is built with -march=native, so this is compiled in only
// where the CPU has AVX-512; `attend` above serves every other build and head_dim. An item (a sequence's KV heads
// [h0, h1)) walks the context in tiles of 16 positions (a tile may span blocks), reads each K and V row once for
// all the query heads of its GQA group (bf16/fp16 K rows widened to fp32 once per tile, or read as they are by
// vdpbf16ps; V rows widened as loaded, once per four query rows), and keeps a running softmax
// per query row (the tile's max, rescale of the accumulator, exp): no score buffer, no second pass over K. A tile's
// 16 dot products are reduced together (a 16x16 transpose-and-add tree of vertical adds) instead of a horizontal sum
// each. A row's arithmetic does not depend on how rows are grouped into items or on the thread count.
namespace avx512 {

// v[0..15] -> one vector whose lane t is the sum of v[t]'s sixteen lanes: four rounds of shuffle-and-add (45
// instructions for 16 sums, where a horizontal sum each takes ~8 apiece). The tree leaves token t in lane
// 4 * (t % 4) + t / 4; the final permute (a 4x4 transpose, its own inverse) puts it in lane t.
inline __m512 reduce16(const __m512* v) {
  __m512 r[8], s[4], u[2];
  for (int i = 0; i < 8; ++i)   // 128-bit lanes 0-1: v[2i]'s halves added; lanes 2-3: v[2i+1]'s
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)   // 128-bit lane j: token 4i + j, four partial sums
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)   // 128-bit lane j: tokens 8i + j and 8i + 4 + j, two partials each
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0xEE));
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), t);
}

constexpr int kTile = 16;

// bf16 caches on CPUs with AVX512-BF16: q . k by vdpbf16ps on the cache rows as they are (products of two bf16 are
// exact in fp32, so only the order of the fp32 sums differs from widening first); needs head_dim % 32 == 0
#if defined(__AVX512BF16__)
template <typename T>
constexpr bool kBf16Dot = std::is_same_v<T, c10::BFloat16>;
inline __m512bh load32bh(const c10::BFloat16* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}
#else
template <typename T>
constexpr bool kBf16Dot = false;
#endif

// An int8 cache with bf16 q on CPUs with AVX512-VNNI: q . k as 16-bit integer dot products (vpdpwssd: 32 products
// an instruction, summed exactly in int32) of the K codes widened to int16 once per tile and each query row rounded
// to int16 once per call (one scale a row: at most half a step of 32767 over the row's |max|, far below bf16's own
// rounding of q). The fp32 path widens each code to fp32 and multiplies it by its row scale first.
#if defined(__AVX512VNNI__)
template <typename QT, typename T>
constexpr bool kInt16Dot = std::is_same_v<T, int8_t> && std::is_same_v<QT, c10::BFloat16>;
#else
template <typename QT, typename T>
constexpr bool kInt16Dot = false;
#endif

// The next tile's K and V rows (nrows of row_bytes), prefetched evenly over this tile's `slots` steps (one per
// position of each query row's q . k and of each pass of accumulate): `lines` lines in all, a line or two a step, so
// that the core's line fill buffers never fill up and stall the arithmetic, as a burst of prefetches does. Into L1,
// unless this tile's rows and the next's together would crowd it (to_l2: fp32 rows of three KV heads, 48 KiB).
constexpr int64_t kL1Bytes = 32 * 1024;
struct Prefetcher {
  const char* const* rows;
  int nrows;
  int64_t row_bytes, lines, slots;
  bool to_l2;
  int k = 0;
  int64_t b = 0, credit = 0;
  inline void step() {
    for (credit += lines; credit >= slots; credit -= slots) {
      if (k < nrows) {
        if (to_l2) {
          _mm_prefetch(rows[k] + b, _MM_HINT_T1);
        } else {
          _mm_prefetch(rows[k] + b, _MM_HINT_T0);
        }
        if ((b += 64) >= row_bytes) b = 0, ++k;
      }
    }
  }
};

// The V side of one KV head's tile: acc rows [R) (row stride `dim` floats), vector columns [C) (the caller offsets
// acc and hd to the first column) = acc * alpha + sum_t p_t v_t over the tile's n positions, p from pt (kTile floats
// per row), V rows read from the cache (bf16/fp16 widened as loaded): each V vector is loaded once for the R rows.
template <int R, int C, typename VT>
void accumulate(float* acc, int64_t dim, const float* alpha, const float* pt, int n, const VT* const* vr,
                int64_t hd, Prefetcher* pfr) {
  __m512 a[R][C];
  for (int r = 0; r < R; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < C; ++c) a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * dim + 16 * c), al);
  }
  for (int t = 0; t < n; ++t) {
    pfr->step();
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(vr[t] + hd + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 pv = _mm512_set1_ps(pt[r * kTile + t]);
      for (int c = 0; c < C; ++c) a[r][c] = _mm512_fmadd_ps(pv, v[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + r * dim + 16 * c, a[r][c]);
  }
}

constexpr int kRowsAtOnce = 4, kColsAtOnce = 4;     // accumulate: up to 16 accumulator registers
template <typename VT>
using AccumulateFn = void (*)(float*, int64_t, const float*, const float*, int, const VT* const*, int64_t, Prefetcher*);
template <typename VT, int... I>
constexpr std::array<AccumulateFn<VT>, sizeof...(I)> accumulate_table(std::integer_sequence<int, I...>) {
  return {&accumulate<I / kColsAtOnce + 1, I % kColsAtOnce + 1, VT>...};
}
template <typename VT>     // [rows - 1][cols - 1]
constexpr auto kAccumulate = accumulate_table<VT>(std::make_integer_sequence<int, kRowsAtOnce * kColsAtOnce>{});

// floats of per-thread scratch attend16 needs
inline int64_t scratch_floats(const Shape& s, int64_t heads) {
  return heads * (2 * s.group * s.dim + kTile * s.dim + s.group * (kTile + 2) + kTile + s.group * s.dim / 2) +
         s.group * (kTile + 1);
}

// One sequence's KV heads [h0, h1): their `group` query rows each of q (the sequence's [Hq, D] row) -> the same rows
// of out. head_dim = 16 * NC (NC = 0: read at run time). Per tile and KV head: the scores, running max and
// probabilities of its query rows, up to kRowsAtOnce side by side (independent chains the core overlaps), then one
// pass over the head's V rows for all of them (accumulate).
template <typename QT, typename T, int NC>
void attend16(const QT* q, QT* out, const T* k_cache, const T* v_cache, const int32_t* table, int64_t ctx, int64_t h0,
              int64_t h1, const Shape& s, const Scales& sc, float* scratch) {
  const int64_t nc = NC ? NC : s.dim / 16;
  const int64_t dim = 16 * nc, group = s.group, bs = s.block_size, heads = h1 - h0, rows = heads * group;
  const int64_t row = s.row, tok_stride = s.num_kv_heads * row, blk_stride = bs * tok_stride, span = heads * dim;
  const QT* qh = q + h0 * group * dim;
  QT* oh = out + h0 * group * dim;
  if (ctx == 0) {     // a padding row (CUDA-graph style): attends to nothing
    std::fill(oh, oh + rows * dim, static_cast<QT>(0.0f));
    return;
  }
  const int64_t nblk = (ctx + bs - 1) / bs;
  for (int64_t j = 0; j < nblk; ++j) {
    TORCH_CHECK(table[j] >= 0 && table[j] < s.pool_blocks, "block table entry ", table[j], " out of range");
  }
  float* acc = scratch;                       // [rows, dim] un-normalised output (row = (head, query in group))
  float* qf = acc + rows * dim;               // [rows, dim] q in fp32 (times K's scale, quantized caches)
  float* kf = qf + rows * dim;                // [kTile, heads, dim] a tile's K rows widened (16/8-bit, no bf16_dot)
  float* den = kf + kTile * span;             // [rows, kTile] running softmax denominator, lane by lane
  float* mx = den + rows * kTile;             // [rows] running max of the scaled scores
  float* pw = mx + rows;                      // [group, kTile] a KV head's probabilities for the tile
  float* alpha = pw + group * kTile;          // [group] and the tile's rescale of its accumulator rows
  float* qs = alpha + group;                  // [rows] kInt16Dot: each query row's scale (q16 = qf / qs)
  float* krs = qs + rows;                     // [heads, kTile] and a tile's K row scales
  int16_t* q16 = reinterpret_cast<int16_t*>(krs + heads * kTile);     // [rows, dim] and q as int16
  int16_t* k16 = reinterpret_cast<int16_t*>(kf);     // [kTile, heads, dim] a tile's K codes as int16
  for (int64_t i = 0; i < rows * dim; ++i) qf[i] = static_cast<float>(qh[i]);
  if constexpr (kQuantized<T>) {
    for (int64_t i = 0; i < rows * dim; ++i) qf[i] *= k_factor<T>(sc, (h0 + i / dim / group) * dim + i % dim);
  }
  const bool int16_dot = kInt16Dot<QT, T> && nc % 2 == 0;
  if (int16_dot) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* x = qf + r * dim;
      float m = 0.0f;
      for (int64_t i = 0; i < dim; ++i) m = std::max(m, std::abs(x[i]));
      const float inv = m > 0.0f ? 32767.0f / m : 0.0f;
      qs[r] = m / 32767.0f;
      for (int64_t i = 0; i < dim; ++i) {
        q16[r * dim + i] = static_cast<int16_t>(std::min(32767.0f, std::max(-32767.0f, std::nearbyint(x[i] * inv))));
      }
    }
  }
  std::fill(acc, acc + rows * dim, 0.0f);
  std::fill(den, den + rows * kTile, 0.0f);
  std::fill(mx, mx + rows, -std::numeric_limits<float>::infinity());
  const __m512 scale = _mm512_set1_ps(s.scale);
  const int64_t span_bytes = heads * row * static_cast<int64_t>(sizeof(T));     // a tile row in the cache
  // offsets of the tile's rows (heads h0..h1 of each position; one division per tile, not per row)
  auto tile_offsets = [&](int64_t p0, int64_t* off) {
    const int64_t n = std::min<int64_t>(kTile, ctx - p0);
    int64_t j = p0 / bs, o = p0 % bs;
    for (int64_t t = 0; t < n; ++t) {
      off[t] = table[j] * blk_stride + o * tok_stride + h0 * row;
      if (++o == bs) o = 0, ++j;
    }
  };

  const float* kr[kTile];     // this tile's K rows in fp32 (the cache's, or widened into kf)
  const T* kb[kTile];         // this tile's K and V rows in the cache, heads h0..h1 side by side (row apart)
  const T* vb[kTile];
  const bool bf16_dot = kBf16Dot<T> && std::is_same_v<QT, T> && nc % 2 == 0;
  int64_t cur[kTile], nxt[kTile];
  const char* pf[2 * kTile];  // the next tile's K and V rows, prefetched through this tile (Prefetcher)
  tile_offsets(0, cur);
  for (int64_t p0 = 0; p0 < ctx; p0 += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, ctx - p0));
    int npf = 0;
    if (p0 + kTile < ctx) {
      tile_offsets(p0 + kTile, nxt);
      for (int64_t t = 0, m = std::min<int64_t>(kTile, ctx - p0 - kTile); t < m; ++t) {
        pf[npf++] = reinterpret_cast<const char*>(k_cache + nxt[t]);
        pf[npf++] = reinterpret_cast<const char*>(v_cache + nxt[t]);
      }
    }
    for (int t = 0; t < n; ++t) {
      kb[t] = k_cache + cur[t];
      vb[t] = v_cache + cur[t];
      if constexpr (std::is_same_v<T, float>) {
        kr[t] = kb[t];
      } else if (int16_dot) {     // codes widened to int16, their row scales aside
#if defined(__AVX512VNNI__)
        for (int64_t h = 0; h < heads; ++h) {
          const T* kt = kb[t] + h * row;
          krs[h * kTile + t] = row_scale(kt, dim);
          for (int64_t c = 0; c < nc / 2; ++c) {
            const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kt + 32 * c));
            _mm512_storeu_si512(k16 + t * span + h * dim + 32 * c, _mm512_cvtepi8_epi16(codes));
          }
        }
#endif
      } else if (!bf16_dot) {     // widened; a quantized row times its own scale
        for (int64_t h = 0; h < heads; ++h) {
          const T* kt = kb[t] + h * row;
          const __m512 rs = _mm512_set1_ps(row_scale(kt, dim));
          for (int64_t c = 0; c < nc; ++c) {
            __m512 x = load16(kt + 16 * c);
            if constexpr (kQuantized<T>) x = _mm512_mul_ps(x, rs);
            _mm512_storeu_ps(kf + t * span + h * dim + 16 * c, x);
          }
        }
        kr[t] = kf + t * span;
      }
    }
    std::copy(nxt, nxt + kTile, cur);
    const __mmask16 valid = static_cast<__mmask16>(n == kTile ? 0xFFFF : (1u << n) - 1);
    const int64_t vpasses = heads * ((group + kRowsAtOnce - 1) / kRowsAtOnce) * ((nc + kColsAtOnce - 1) / kColsAtOnce);
    Prefetcher pfr{pf, npf, span_bytes, npf * ((span_bytes + 63) / 64), rows * kTile + vpasses * n,
                   4 * kTile * span_bytes > kL1Bytes};

    alignas(64) float vrs[kTile];     // a quantized cache: this head's V row scales over the tile
    // query rows g0..g0 + RB of KV head h: scores, running max and denominator, probabilities into pw
    auto score_rows = [&](auto rb, int64_t h, int64_t g0) {
      constexpr int RB = decltype(rb)::value;
      const int64_t hd = h * dim;     // this KV head, as an offset into a tile row
      __m512 sc[RB];
      for (int i = 0; i < RB; ++i) {
        const int64_t r = h * group + g0 + i;
        __m512 dots[kTile];
        bool dotted = false;
#if defined(__AVX512BF16__)
        if constexpr (kBf16Dot<T> && std::is_same_v<QT, T>) {
          if (bf16_dot) {   // q . k straight from the bf16 rows: each lane sums two exact products in fp32 (vdpbf16ps)
            __m512bh qb[((NC ? NC : 16) + 1) / 2];
            const T* qr = qh + r * dim;
            for (int64_t c = 0; c < nc / 2; ++c) qb[c] = load32bh(qr + 32 * c);
            for (int t = 0; t < n; ++t) {
              pfr.step();
              const T* kt = kb[t] + hd;
              __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[0], load32bh(kt));
              for (int64_t c = 1; c < nc / 2; ++c) a = _mm512_dpbf16_ps(a, qb[c], load32bh(kt + 32 * c));
              dots[t] = a;
            }
            dotted = true;
          }
        }
#endif
#if defined(__AVX512VNNI__)
        if constexpr (kInt16Dot<QT, T>) {
          if (int16_dot) {
            __m512i qv[((NC ? NC : 16) + 1) / 2];
            for (int64_t c = 0; c < nc / 2; ++c) qv[c] = _mm512_loadu_si512(q16 + r * dim + 32 * c);
            for (int t = 0; t < n; ++t) {
              pfr.step();
              const int16_t* kt = k16 + t * span + hd;
              __m512i a = _mm512_dpwssd_epi32(_mm512_setzero_si512(), qv[0], _mm512_loadu_si512(kt));
              for (int64_t c = 1; c < nc / 2; ++c) a = _mm512_dpwssd_epi32(a, qv[c], _mm512_loadu_si512(kt + 32 * c));
              dots[t] = _mm512_cvtepi32_ps(a);
            }
            dotted = true;
          }
        }
#endif
        if (!dotted) {
          __m512 qv[NC ? NC : 16];
          for (int64_t c = 0; c < nc; ++c) qv[c] = _mm512_loadu_ps(qf + r * dim + 16 * c);
          for (int t = 0; t < n; ++t) {
            pfr.step();
            const float* kt = kr[t] + hd;
            __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kt));
            for (int64_t c = 1; c < nc; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kt + 16 * c), a);
            dots[t] = a;
          }
        }
        for (int t = n; t < kTile; ++t) pfr.step(), dots[t] = _mm512_setzero_ps();
        sc[i] = _mm512_mul_ps(reduce16(dots), scale);
        if (int16_dot) {    // times the row's q scale and the K rows' own scales
          for (int t = n; t < kTile; ++t) krs[h * kTile + t] = 0.0f;
          sc[i] = _mm512_mul_ps(_mm512_mul_ps(sc[i], _mm512_set1_ps(qs[r])), _mm512_loadu_ps(krs + h * kTile));
        }
      }
      for (int i = 0; i < RB; ++i) {
        const int64_t r = h * group + g0 + i;
        const float m_old = mx[r];
        const float m_new = std::max(m_old, _mm512_mask_reduce_max_ps(valid, sc[i]));
        // exp(m_old - m_new): ~0 on the first tile (m_old = -inf), where acc and den are still 0
        const __m512 al = exp16_nonpos(_mm512_set1_ps(m_old - m_new));
        __m512 p = _mm512_maskz_mov_ps(valid, exp16_nonpos(_mm512_sub_ps(sc[i], _mm512_set1_ps(m_new))));
        _mm512_storeu_ps(den + r * kTile, _mm512_fmadd_ps(_mm512_loadu_ps(den + r * kTile), al, p));
        mx[r] = m_new;
        alpha[g0 + i] = _mm512_cvtss_f32(al);
#if defined(__AVX512BF16__)
        if constexpr (kBf16Dot<T>) {    // p rounded to bf16 for p . V, as the reference's softmax(...).to(v.dtype)
          if (bf16_dot) p = load16(reinterpret_cast<const c10::BFloat16*>(&static_cast<const __m256i&>(
                                       (__m256i)_mm512_cvtneps_pbh(p))));
        }
#endif
        if constexpr (kQuantized<T>) p = _mm512_mul_ps(p, _mm512_loadu_ps(vrs));     // times the V rows' scales
        _mm512_storeu_ps(pw + (g0 + i) * kTile, p);
      }
    };
    for (int64_t h = 0; h < heads; ++h) {
      if constexpr (kQuantized<T>) {
        for (int t = 0; t < kTile; ++t) vrs[t] = t < n ? row_scale(vb[t] + h * row, dim) : 0.0f;
      }
      for (int64_t g0 = 0; g0 < group; g0 += kRowsAtOnce) {
        switch (std::min<int64_t>(kRowsAtOnce, group - g0)) {
          case 1: score_rows(std::integral_constant<int, 1>{}, h, g0); break;
          case 2: score_rows(std::integral_constant<int, 2>{}, h, g0); break;
          case 3: score_rows(std::integral_constant<int, 3>{}, h, g0); break;
          default: score_rows(std::integral_constant<int, 4>{}, h, g0); break;
        }
      }
      // acc += p . V for the head's rows, kRowsAtOnce rows by kColsAtOnce vectors at a time
      for (int64_t g0 = 0; g0 < group; g0 += kRowsAtOnce) {
        const int64_t nr = std::min<int64_t>(kRowsAtOnce, group - g0);
        for (int64_t c0 = 0; c0 < nc; c0 += kColsAtOnce) {
          const int64_t ncol = std::min<int64_t>(kColsAtOnce, nc - c0);
          kAccumulate<T>[(nr - 1) * kColsAtOnce + ncol - 1](acc + (h * group + g0) * dim + 16 * c0, dim, alpha + g0,
                                                             pw + g0 * kTile, n, vb, h * row + 16 * c0, &pfr);
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(den + r * kTile));
    if constexpr (kQuantized<T>) {
      const int64_t hc = (h0 + r / group) * dim;
      for (int64_t i = 0; i < dim; ++i) oh[r * dim + i] = static_cast<QT>(acc[r * dim + i] * inv * v_factor<T>(sc, hc + i));
    } else {
      for (int64_t i = 0; i < dim; ++i) oh[r * dim + i] = static_cast<QT>(acc[r * dim + i] * inv);
    }
  }
}

}  // namespace avx512
#endif

#if defined(__AVX2__) && defined(__FMA__)
// AVX2 path (every head_dim, a multiple of 8), for CPUs without AVX-512 and for head_dims attend16 does not take. The
// same design as attend16 at half the width: an item walks its context in tiles of 8 positions (a tile may span
// blocks), reads each K and V row once for all the query heads of its GQA group (bf16/fp16 rows widened to fp32 once
// per tile, not once per query row), keeps a running softmax per query row, and reduces a tile's 8 dot products
// together (a transpose-and-add tree of horizontal adds). Positions past the context read a zero row, never the cache,
// and their probabilities are zeroed, so the loops always run whole tiles. A row's arithmetic does not depend on how
// rows are grouped into items or on the thread count.
namespace avx2 {

constexpr int kTile = 32;    // positions per tile: four groups of eight, one running-softmax update per row

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {    // bf16 is the top half of an fp32
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <typename T, std::enable_if_t<kQuantized<T>, int> = 0>
inline __m256 load8(const T* p) { return load8_codes(p); }     // 8-bit KV codes, divided by kCodeScale

// v[0..7] -> one vector whose lane t is the sum of v[t]'s eight lanes
inline __m256 reduce8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);   // 128-bit lane: four tokens' half sums
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

inline float hmax(__m256 x) {
  __m256 m = _mm256_max_ps(x, _mm256_permute2f128_ps(x, x, 1));
  m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4E));
  m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xB1));
  return _mm256_cvtss_f32(m);
}

inline float hsum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// floats of per-thread scratch attend8 needs
inline int64_t scratch_floats(const Shape& s, int64_t heads) {
  return heads * (2 * s.group * s.dim + (2 * kTile + 1) * s.dim + 2 * s.group);
}

// KV heads [h0, h1) of one sequence: their query rows of q (the sequence's [Hq, D] row) -> the same rows of out.
// head_dim = 8 * NC (NC = 0: read at run time).
template <typename QT, typename T, int NC>
void attend8(const QT* q, QT* out, const T* k_cache, const T* v_cache, const int32_t* table, int64_t ctx, int64_t h0,
             int64_t h1, const Shape& s, const Scales& sc, float* scratch) {
  constexpr int kChunk = 8;     // accumulator registers per pass over a V row (of 16 ymm registers)
  constexpr int kGroups = kTile / 8;
  const int64_t nc = NC ? NC : s.dim / 8;
  const int64_t dim = 8 * nc, group = s.group, bs = s.block_size, heads = h1 - h0, rows = heads * group;
  const int64_t row = s.row, tok_stride = s.num_kv_heads * row, blk_stride = bs * tok_stride, span = heads * dim;
  const QT* qh = q + h0 * group * dim;
  QT* oh = out + h0 * group * dim;
  if (ctx == 0) {     // a padding row (CUDA-graph style): attends to nothing
    std::fill(oh, oh + rows * dim, static_cast<QT>(0.0f));
    return;
  }
  const int64_t nblk = (ctx + bs - 1) / bs;
  for (int64_t j = 0; j < nblk; ++j) {
    TORCH_CHECK(table[j] >= 0 && table[j] < s.pool_blocks, "block table entry ", table[j], " out of range");
  }
  float* acc = scratch;                       // [rows, dim] un-normalised output (row = (head, query in group))
  float* qf = acc + rows * dim;               // [rows, dim] q in fp32 (times K's scale, quantized caches)
  float* kf = qf + rows * dim;                // [kTile, heads, dim] a tile's K rows widened (16/8-bit only)
  float* vf = kf + kTile * span;              // [kTile, heads, dim] and its V rows
  float* zero = vf + kTile * span;            // [heads, dim] zeros: the K row of positions past the context
  float* mx = zero + span;                    // [rows] running max of the scaled scores
  float* den = mx + rows;                     // [rows] running softmax denominator
  for (int64_t i = 0; i < rows * dim; ++i) qf[i] = static_cast<float>(qh[i]);
  if constexpr (kQuantized<T>) {
    for (int64_t i = 0; i < rows * dim; ++i) qf[i] *= k_factor<T>(sc, (h0 + i / dim / group) * dim + i % dim);
  }
  std::fill(acc, acc + rows * dim, 0.0f);
  std::fill(zero, zero + span, 0.0f);
  std::fill(mx, mx + rows, -std::numeric_limits<float>::infinity());
  std::fill(den, den + rows, 0.0f);
  const __m256 scale = _mm256_set1_ps(s.scale);
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);

  const float* kr[kTile];     // this tile's rows, heads h0..h1 side by side (dim floats apart)
  const float* vr[kTile];
  int64_t j = 0, o = 0;       // block and offset of the tile's first position
  for (int64_t p0 = 0; p0 < ctx; p0 += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, ctx - p0));
    const int ng = (n + 7) / 8;     // groups of 8 positions holding one at least
    for (int t = 0; t < n; ++t) {
      const int64_t off = table[j] * blk_stride + o * tok_stride + h0 * row;
      if (++o == bs) o = 0, ++j;
      if constexpr (std::is_same_v<T, float>) {
        kr[t] = k_cache + off;
        vr[t] = v_cache + off;
      } else {    // widened; a quantized row times its own scale
        for (int64_t h = 0; h < heads; ++h) {
          const T* kt = k_cache + off + h * row;
          const T* vt = v_cache + off + h * row;
          const __m256 ks = _mm256_set1_ps(row_scale(kt, dim)), vs = _mm256_set1_ps(row_scale(vt, dim));
          for (int64_t c = 0; c < nc; ++c) {
            __m256 kx = load8(kt + 8 * c), vx = load8(vt + 8 * c);
            if constexpr (kQuantized<T>) kx = _mm256_mul_ps(kx, ks), vx = _mm256_mul_ps(vx, vs);
            _mm256_storeu_ps(kf + t * span + h * dim + 8 * c, kx);
            _mm256_storeu_ps(vf + t * span + h * dim + 8 * c, vx);
          }
        }
        kr[t] = kf + t * span;
        vr[t] = vf + t * span;
      }
    }
    for (int t = n; t < 8 * ng; ++t) kr[t] = zero;
    // fp32 rows: the next tile's K and V rows are prefetched a few positions per query row, spread over this tile's
    // work (+10% at 256 sequences); bf16/fp16 rows, widened at the tile's start, are compute-bound and skip it
    int64_t nxt[kTile];
    int nn = 0;
    if constexpr (std::is_same_v<T, float>) {
      nn = static_cast<int>(std::min<int64_t>(kTile, std::max<int64_t>(0, ctx - p0 - kTile)));
      for (int64_t t = 0, jj = j, oo = o; t < nn; ++t) {
        nxt[t] = table[jj] * blk_stride + oo * tok_stride + h0 * row;
        if (++oo == bs) oo = 0, ++jj;
      }
    }
    __m256 valid[kGroups];
    for (int g = 0; g < kGroups; ++g) {
      valid[g] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8 * g), lane));
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int t = r * nn / rows, e = (r + 1) * nn / rows; t < e; ++t) {
        for (int64_t b = 0; b < span * 4; b += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(k_cache + nxt[t]) + b, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(v_cache + nxt[t]) + b, _MM_HINT_T0);
        }
      }
      const int64_t hd = r / group * dim;     // this query row's KV head, as an offset into a tile row
      const float* qr = qf + r * dim;
      __m256 sc[kGroups];     // the tile's scaled scores, eight positions a vector
      __m256 tile_max = minus_inf;
      for (int g = 0; g < ng; ++g) {
        __m256 dots[8];
        for (int t = 0; t < 8; ++t) dots[t] = _mm256_setzero_ps();
        for (int64_t c = 0; c < nc; ++c) {
          const __m256 qc = _mm256_loadu_ps(qr + 8 * c);
          for (int t = 0; t < 8; ++t) dots[t] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kr[8 * g + t] + hd + 8 * c), dots[t]);
        }
        sc[g] = _mm256_blendv_ps(minus_inf, _mm256_mul_ps(reduce8(dots), scale), valid[g]);
        tile_max = _mm256_max_ps(tile_max, sc[g]);
      }
      const float m_old = mx[r];
      const float m_new = std::max(m_old, hmax(tile_max));
      const float alpha = std::exp(m_old - m_new);     // 0 on the first tile (m_old = -inf)
      const __m256 mv = _mm256_set1_ps(m_new);
      alignas(32) float pt[kTile];
      __m256 psum = _mm256_setzero_ps();
      for (int g = 0; g < ng; ++g) {
        const __m256 p = _mm256_and_ps(valid[g], exp8_nonpos_avx2(_mm256_sub_ps(sc[g], mv)));
        psum = _mm256_add_ps(psum, p);
        _mm256_store_ps(pt + 8 * g, p);
      }
      den[r] = den[r] * alpha + hsum(psum);
      mx[r] = m_new;
      float* ar = acc + r * dim;
      const __m256 al = _mm256_set1_ps(alpha);
      for (int64_t c0 = 0; c0 < nc; c0 += kChunk) {
        const int64_t cn = std::min<int64_t>(kChunk, nc - c0);
        __m256 a[kChunk];
        for (int64_t c = 0; c < cn; ++c) a[c] = _mm256_mul_ps(_mm256_loadu_ps(ar + 8 * (c0 + c)), al);
        for (int t = 0; t < n; ++t) {
          const __m256 pv = _mm256_set1_ps(pt[t]);
          const float* vt = vr[t] + hd + 8 * c0;
          for (int64_t c = 0; c < cn; ++c) a[c] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vt + 8 * c), a[c]);
        }
        for (int64_t c = 0; c < cn; ++c) _mm256_storeu_ps(ar + 8 * (c0 + c), a[c]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.0f / den[r];
    if constexpr (kQuantized<T>) {
      const int64_t hc = (h0 + r / group) * dim;
      for (int64_t i = 0; i < dim; ++i) oh[r * dim + i] = static_cast<QT>(acc[r * dim + i] * inv * v_factor<T>(sc, hc + i));
    } else {
      for (int64_t i = 0; i < dim; ++i) oh[r * dim + i] = static_cast<QT>(acc[r * dim + i] * inv);
    }
  }
}

}  // namespace avx2
#endif

template <typename QT, typename T>
void run(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& context_lens, float scale, const Scales& sc) {
  const int64_t batch = q.size(0), num_heads = q.size(1), dim = q.size(2);
  const Shape s{k_cache.size(1), k_cache.size(2), num_heads / k_cache.size(2), dim, k_cache.size(0), scale,
                k_cache.size(3)};
  const int64_t table_stride = block_tables.stride(0), width = block_tables.size(1);
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const QT* qp = q.data_ptr<QT>();
  QT* op = out.data_ptr<QT>();
  const T* kp = reinterpret_cast<const T*>(k_cache.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v_cache.data_ptr());

  int64_t max_ctx = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= width * s.block_size, "context_lens[", b, "] = ", lens[b],
                " is outside [0, block table width * block_size]");
    max_ctx = std::max<int64_t>(max_ctx, lens[b]);
  }
  std::vector<int64_t> order(batch);    // longest first, so that the last items to start are short ones
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lens[a] > lens[b]; });
#if defined(__AVX512F__)
  if (dim % 16 == 0) {    // one item per (sequence, KV head), whatever the batch
    void (*kernel16)(const QT*, QT*, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t, const Shape&,
                     const Scales&, float*);
    switch (dim) {
      case 64: kernel16 = &avx512::attend16<QT, T, 4>; break;
      case 128: kernel16 = &avx512::attend16<QT, T, 8>; break;
      default: kernel16 = &avx512::attend16<QT, T, 0>; break;
    }
    const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), batch * s.num_kv_heads));
    // a few sequences: one item per (sequence, KV head) so that every thread has work; else one per sequence, which
    // reads each cache block's rows (all KV heads side by side) front to back
    const int64_t splits = batch >= 4 * threads ? 1 : s.num_kv_heads;
    const int64_t heads_per_item = s.num_kv_heads / splits, items = batch * splits;
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      std::vector<float> scratch(avx512::scratch_floats(s, heads_per_item));
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
        const int64_t b = order[i / splits], h0 = i % splits * heads_per_item;
        kernel16(qp + b * num_heads * dim, op + b * num_heads * dim, kp, vp, tables + b * table_stride, lens[b], h0,
                 h0 + heads_per_item, s, sc, scratch.data());
      }
    });
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  {   // every head_dim (a multiple of 8) that attend16 did not take
    void (*kernel8)(const QT*, QT*, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t, const Shape&,
                    const Scales&, float*);
    switch (dim) {
      case 64: kernel8 = &avx2::attend8<QT, T, 8>; break;
      case 128: kernel8 = &avx2::attend8<QT, T, 16>; break;
      default: kernel8 = &avx2::attend8<QT, T, 0>; break;
    }
    const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), batch * s.num_kv_heads));
    const int64_t splits = batch >= 4 * threads ? 1 : s.num_kv_heads;     // as for attend16
    const int64_t heads_per_item = s.num_kv_heads / splits, items = batch * splits;
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      std::vector<float> scratch(avx2::scratch_floats(s, heads_per_item));
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
        const int64_t b = order[i / splits], h0 = i % splits * heads_per_item;
        kernel8(qp + b * num_heads * dim, op + b * num_heads * dim, kp, vp, tables + b * table_stride, lens[b], h0,
                h0 + heads_per_item, s, sc, scratch.data());
      }
    });
    return;
  }
#endif
  void (*kernel)(const QT*, QT*, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t, const Shape&,
                 const Scales&, float*, float*);
  switch (dim) {
    case 64: kernel = &attend<QT, T, 8>; break;
    case 128: kernel = &attend<QT, T, 16>; break;
    default: kernel = &attend<QT, T, 0>; break;
  }

  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), batch * s.num_kv_heads));
  // a few sequences: one item per (sequence, KV head) so that every thread has work
  const int64_t splits = batch >= 4 * threads ? 1 : s.num_kv_heads;
  const int64_t heads_per_item = s.num_kv_heads / splits;
  const int64_t items = batch * splits;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch(heads_per_item * s.group * (max_ctx + dim));
    float* acc = scratch.data();
    float* scores = acc + heads_per_item * s.group * dim;
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t b = order[i / splits], h0 = i % splits * heads_per_item;
      kernel(qp + b * num_heads * dim, op + b * num_heads * dim, kp, vp, tables + b * table_stride, lens[b], h0,
             h0 + heads_per_item, s, sc, scores, acc);
    }
  });
}

// A quantized cache (fp8 e4m3fn / e5m2, int8 codes, each row with its fp16 scale; k_scale and v_scale [Hkv, D] fp32)
// with fp32 or bf16 q.
template <typename QT>
void run_quantized(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& context_lens, float scale, const Scales& sc) {
  switch (k_cache.scalar_type()) {
    case at::ScalarType::Float8_e4m3fn: run<QT, Fp8E4M3>(q, out, k_cache, v_cache, block_tables, context_lens, scale, sc); break;
    case at::ScalarType::Float8_e5m2: run<QT, Fp8E5M2>(q, out, k_cache, v_cache, block_tables, context_lens, scale, sc); break;
    case at::ScalarType::Char: run<QT, int8_t>(q, out, k_cache, v_cache, block_tables, context_lens, scale, sc); break;
    default: TORCH_CHECK(false, "unsupported quantized cache dtype ", k_cache.scalar_type());
  }
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                        const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
              block_tables.device().is_cpu() && context_lens.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q must be [B, Hq, D], k_cache and v_cache the same [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q and the caches must be contiguous");
  const bool quantized = k_scale.has_value();
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "the caches must share a dtype");
  TORCH_CHECK(quantized || q.scalar_type() == k_cache.scalar_type(), "q and the caches must share a dtype");
  TORCH_CHECK(!quantized || (v_scale.has_value() && k_scale->scalar_type() == at::kFloat &&
                             v_scale->scalar_type() == at::kFloat && k_scale->is_contiguous() &&
                             v_scale->is_contiguous() && k_scale->numel() == k_cache.size(2) * q.size(2) &&
                             v_scale->numel() == k_cache.size(2) * q.size(2)),
              "k_scale and v_scale must be contiguous fp32 [Hkv, D]");
  // a quantized cache's rows are head_dim codes and their own fp16 scale (2 bytes)
  TORCH_CHECK(q.size(2) + (quantized ? 2 : 0) == k_cache.size(3) && q.size(2) % 8 == 0 && q.size(2) <= 256,
              "head_dim must match (a quantized cache: head_dim + 2 bytes a row) and be a multiple of 8 up to 256");
  TORCH_CHECK(k_cache.size(2) > 0 && q.size(1) % k_cache.size(2) == 0, "Hq must be a multiple of Hkv");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
              block_tables.size(0) == q.size(0), "block_tables must be int32 [B, W] with unit column stride");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() &&
              context_lens.numel() == q.size(0), "context_lens must be contiguous int32 [B]");
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.size(0) == 0) return out;
  const float s = static_cast<float>(scale);
  if (quantized) {
    const Scales sc{k_scale->data_ptr<float>(), v_scale->data_ptr<float>()};
    switch (q.scalar_type()) {
      case at::kFloat: run_quantized<float>(q, out, k_cache, v_cache, block_tables, context_lens, s, sc); break;
      case at::kBFloat16: run_quantized<c10::BFloat16>(q, out, k_cache, v_cache, block_tables, context_lens, s, sc); break;
      default: TORCH_CHECK(false, "q of a quantized cache must be fp32 or bf16, not ", q.scalar_type());
    }
    return out;
  }
  const Scales none;
  switch (q.scalar_type()) {
    case at::kFloat: run<float, float>(q, out, k_cache, v_cache, block_tables, context_lens, s, none); break;
    case at::kBFloat16: run<c10::BFloat16, c10::BFloat16>(q, out, k_cache, v_cache, block_tables, context_lens, s, none); break;
    case at::kHalf: run<c10::Half, c10::Half>(q, out, k_cache, v_cache, block_tables, context_lens, s, none); break;
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tidepool_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, &paged_decode);
}
