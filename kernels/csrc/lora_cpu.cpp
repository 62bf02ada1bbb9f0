// LoRA products of the rows a step gathers by adapter (decode tokens of several adapters; Punica SGMV/BGMV), in
// place on the base linear's output, one call per linear:
//   for every segment g (slot s = seg_slots[g], token rows rows[seg_starts[g]:seg_starts[g + 1]]):
//     xa = x[rows] @ a[s]                                               a: [S, in, N], N = len(blocks) * r
//     y[rows, block i's columns] += xa[:, i*r:(i+1)*r] @ b[s, i*r:(i+1)*r, block i's columns]    b: [S, N, out]
// Only the diagonal blocks of a stacked b are read (the slot pool leaves the rest zero), nothing is gathered,
// padded or scattered, and the rows of one tile (up to TM rows of one segment) go through a[s] and b[s] together:
// the shrink's and the expand's accumulators stay in registers. The tiles are shared among the threads.
// fp32 only (kernels/lora_ops.py keeps other dtypes on the torch path); results equal the torch definition
// (sgmv_ref) to fp32 rounding.
//
// Built with the other kernels into one library by kernels/cpu_ops.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "simd.h"     // vec8

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// 8 fp32 lanes by GCC/Clang vector extensions (simd.h's vec8): one AVX2 register, split into narrower ones
// elsewhere. A micro-tile is TM rows x NV vectors of accumulators: 4 x 3 = 12 registers, plus 3 loads and a
// broadcast, fits the 16 registers of AVX2 (wider tiles spill, several times slower).
using v8 = simd::vec8;
inline v8 ld8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void st8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

constexpr int TM = 4;          // rows per tile
constexpr int kMaxNV = 3;      // vectors of columns per micro-tile
constexpr int kMaxN = 512;     // widest shrink (len(blocks) * rank) a tile keeps on the stack

// out[i][c + 8j] = sum_k x[i][k] a[k][c + 8j] for the tile's rows i < m (rows past m repeat row 0, unused)
template <int NV>
inline void shrink_cols(const float* const* x, int m, const float* a, int64_t in, int64_t n, int64_t c,
                        float (*out)[kMaxN]) {
  v8 acc[TM][NV];
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = v8{};
  for (int64_t k = 0; k < in; ++k) {
    const float* ak = a + k * n + c;
    v8 av[NV];
    for (int j = 0; j < NV; ++j) av[j] = ld8(ak + 8 * j);
    for (int i = 0; i < TM; ++i) {
      const v8 xv = v8{} + x[i][k];
      for (int j = 0; j < NV; ++j) acc[i][j] += xv * av[j];
    }
  }
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < NV; ++j) st8(&out[i][c + 8 * j], acc[i][j]);
}

// y[i][c + 8j] += sum_q xa[i][q] b[q][c + 8j], q < r (xa and b at the block's rank offset)
template <int NV>
inline void expand_cols(float (*xa)[kMaxN], int64_t q0, int m, const float* b, int64_t r, int64_t out_stride,
                        int64_t c, float* const* y) {
  v8 acc[TM][NV];
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = v8{};
  for (int64_t q = 0; q < r; ++q) {
    const float* bq = b + q * out_stride + c;
    v8 bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = ld8(bq + 8 * j);
    for (int i = 0; i < TM; ++i) {
      const v8 xv = v8{} + xa[i][q0 + q];
      for (int j = 0; j < NV; ++j) acc[i][j] += xv * bv[j];
    }
  }
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < NV; ++j) st8(y[i] + c + 8 * j, ld8(y[i] + c + 8 * j) + acc[i][j]);
}

void tile(const float* const* x, float* const* y, int m, const float* a, const float* b, int64_t in, int64_t n,
          int64_t out, const std::vector<int64_t>& blocks) {
  float xa[TM][kMaxN];
  int64_t c = 0;
  while (c + 8 <= n) {                       // up to kMaxNV vectors of columns a pass over x
    const int64_t v = std::min<int64_t>(kMaxNV, (n - c) / 8);
    switch (v) {
      case 3: shrink_cols<3>(x, m, a, in, n, c, xa); break;
      case 2: shrink_cols<2>(x, m, a, in, n, c, xa); break;
      default: shrink_cols<1>(x, m, a, in, n, c, xa); break;
    }
    c += 8 * v;
  }
  for (; c < n; ++c) {                       // a rank off the vector width
    for (int i = 0; i < m; ++i) {
      float s = 0.0f;
      for (int64_t k = 0; k < in; ++k) s += x[i][k] * a[k * n + c];
      xa[i][c] = s;
    }
  }
  const int64_t nb = static_cast<int64_t>(blocks.size()), r = n / nb;
  int64_t col = 0;
  for (int64_t blk = 0; blk < nb; ++blk) {
    const int64_t width = blocks[blk], q0 = blk * r;
    const float* bb = b + q0 * out;           // the block's rank rows; its columns start at col
    float* yc[TM];
    for (int i = 0; i < TM; ++i) yc[i] = y[i] + col;
    int64_t cc = 0;
    while (cc + 8 <= width) {
      const int64_t v = std::min<int64_t>(kMaxNV, (width - cc) / 8);
      switch (v) {
        case 3: expand_cols<3>(xa, q0, m, bb + col, r, out, cc, yc); break;
        case 2: expand_cols<2>(xa, q0, m, bb + col, r, out, cc, yc); break;
        default: expand_cols<1>(xa, q0, m, bb + col, r, out, cc, yc); break;
      }
      cc += 8 * v;
    }
    for (; cc < width; ++cc) {
      for (int i = 0; i < m; ++i) {
        float s = 0.0f;
        for (int64_t q = 0; q < r; ++q) s += xa[i][q0 + q] * bb[q * out + col + cc];
        yc[i][cc] += s;
      }
    }
    col += width;
  }
}

void lora_rows(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& rows,
               const at::Tensor& seg_starts, const at::Tensor& seg_slots, at::IntArrayRef blocks) {
  TORCH_CHECK(y.device().is_cpu() && x.device().is_cpu() && a.device().is_cpu() && b.device().is_cpu(),
              "lora_rows: CPU tensors only");
  TORCH_CHECK(y.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat &&
              b.scalar_type() == at::kFloat, "lora_rows: fp32 only");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a.dim() == 3 && b.dim() == 3, "lora_rows: x, y 2-D; a, b 3-D");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1 && a.is_contiguous() && b.is_contiguous(),
              "lora_rows: rows of x and y, and a and b, must be contiguous");
  const int64_t in = x.size(1), out = y.size(1), n = a.size(2), slots = a.size(0);
  TORCH_CHECK(a.size(1) == in && b.size(0) == slots && b.size(1) == n && b.size(2) == out && x.size(0) == y.size(0),
              "lora_rows: shapes do not agree");
  TORCH_CHECK(n <= kMaxN, "lora_rows: shrink width above ", kMaxN);
  std::vector<int64_t> widths(blocks.begin(), blocks.end());
  if (widths.empty()) widths.push_back(out);
  int64_t total = 0;
  for (int64_t w : widths) total += w;
  TORCH_CHECK(total == out && n % static_cast<int64_t>(widths.size()) == 0, "lora_rows: blocks do not fit b");
  TORCH_CHECK(rows.scalar_type() == at::kLong && seg_starts.scalar_type() == at::kLong &&
              seg_slots.scalar_type() == at::kLong && rows.is_contiguous() && seg_starts.is_contiguous() &&
              seg_slots.is_contiguous(), "lora_rows: rows, seg_starts, seg_slots contiguous int64");
  const int64_t groups = seg_slots.numel(), nrows = x.size(0);
  TORCH_CHECK(seg_starts.numel() == groups + 1, "lora_rows: seg_starts must have one more entry than seg_slots");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = seg_starts.data_ptr<int64_t>();
  const int64_t* gp = seg_slots.data_ptr<int64_t>();
  std::vector<int64_t> tiles;                // (segment, first row index) of every tile, flattened
  for (int64_t g = 0; g < groups; ++g) {
    TORCH_CHECK(gp[g] >= 0 && gp[g] < slots && sp[g] <= sp[g + 1] && sp[g + 1] <= rows.numel(),
                "lora_rows: bad segment ", g);
    for (int64_t t = sp[g]; t < sp[g + 1]; t += TM) {
      tiles.push_back(g);
      tiles.push_back(t);
    }
  }
  for (int64_t i = 0; i < rows.numel(); ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < nrows, "lora_rows: row out of range");
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  const int64_t xs = x.stride(0), ys = y.stride(0), ntiles = static_cast<int64_t>(tiles.size() / 2);
  // a tile is TM * (in * n + n * out / len(blocks)) multiply-adds: chunks of >= ~32K of them (a fork costs ~1-2 us)
  const int64_t per_tile = TM * (in * n + n * out / static_cast<int64_t>(widths.size()));
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, per_tile));
  at::parallel_for(0, ntiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = tiles[2 * t], first = tiles[2 * t + 1];
      const int m = static_cast<int>(std::min<int64_t>(TM, sp[g + 1] - first));
      const float* xr[TM];
      float* yr[TM];
      for (int i = 0; i < TM; ++i) {
        const int64_t row = rp[first + (i < m ? i : 0)];
        xr[i] = xp + row * xs;
        yr[i] = yp + row * ys;
      }
      tile(xr, yr, m, ap + gp[g] * in * n, bp + gp[g] * n * out, in, n, out, widths);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tidepool_cpu, m) {
  m.def("lora_rows(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor rows, Tensor seg_starts, Tensor seg_slots, "
        "int[] blocks) -> ()");
  m.impl("lora_rows", c10::DispatchKey::CPU, &lora_rows);
}
