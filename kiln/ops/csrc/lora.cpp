// kiln_cpu::lora_add_ — y[t] += scaling[s] * (x[t] A_s^T) B_s^T for every token t whose
// slot s = indices[t] is >= 0; kiln/ops/lora.py has the slot layout and the contract.
//
// Why C++: the op runs after every decoder linear, every step. As ATen calls (aminmax,
// two small bf16 GEMMs, a one-hot mask) it cost 200-600 us per call at 32 decode rows on
// an AVX512-BF16 host, which over 120 linears more than doubled a 32-request decode step.
// Few rows (decode): tokens grouped by slot into tiles of kTile, which share every load of
// A_s and B_s^T. Shrink: h[t] = x[t] A_s^T, fp32 dot products of length in, parallel over
// (tile, rank row). Expand: y[t, n0:n0+64] += scaling[s] * h[t] B_s^T[:, n0:n0+64], FMAs
// across 64 output columns (B is stored transposed so that its rows are contiguous),
// parallel over (tile, column block), so one token still uses every thread. h stays fp32
// and y is rounded once. Many rows (prefill chunks): per-slot ATen GEMMs on the slot's
// rows, in PEFT's order ((x A^T) B^T, times scaling, added).
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "simd.h"

namespace {

using namespace kiln_isa;

constexpr int64_t kGemmFrom = 512;  // rows from which per-slot ATen GEMMs beat the loops (bf16, 2 cores)
constexpr int64_t kTile = 4;        // tokens of one slot that share each weight load
constexpr int64_t kCols = 64;       // output columns per expand task (4 registers)

template <typename T>
inline V16 load16(const T* p);
template <>
inline V16 load16<float>(const float* p) { return loadu(p); }
template <>
inline V16 load16<c10::BFloat16>(const c10::BFloat16* p) { return load_bf16(p); }
template <typename T>
inline void store16(T* p, V16 v);
template <>
inline void store16<float>(float* p, V16 v) { storeu(p, v); }
template <>
inline void store16<c10::BFloat16>(c10::BFloat16* p, V16 v) { store_bf16(p, v); }

// Up to kTile tokens with the same slot: they read each row of A_s and B_s^T once.
struct Tile {
  int64_t slot, n, t[kTile];
};

std::vector<Tile> make_tiles(const int64_t* idx, int64_t rows, int64_t slots) {
  std::vector<Tile> tiles;
  for (int64_t s = 0; s < slots; ++s) {
    Tile tile{s, 0, {}};
    for (int64_t t = 0; t < rows; ++t) {
      if (idx[t] != s) continue;
      tile.t[tile.n++] = t;
      if (tile.n == kTile) {
        tiles.push_back(tile);
        tile.n = 0;
      }
    }
    if (tile.n) tiles.push_back(tile);
  }
  return tiles;
}

// h[t, r] = x[t] . A_s[r] for the tile's tokens and one row r of A_s.
template <typename T>
void shrink(const Tile& tile, int64_t r, const float* xf, const T* ap, int64_t K, int64_t nr,
            float* h) {
  const T* a = ap + (tile.slot * nr + r) * K;
  V16 acc[kTile] = {zero(), zero(), zero(), zero()};
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const V16 av = load16(a + k);
    for (int64_t i = 0; i < tile.n; ++i) acc[i] = fmadd(loadu(xf + tile.t[i] * K + k), av, acc[i]);
  }
  for (int64_t i = 0; i < tile.n; ++i) {
    float sum = reduce_add(acc[i]);
    for (int64_t kk = k; kk < K; ++kk) sum += xf[tile.t[i] * K + kk] * static_cast<float>(a[kk]);
    h[tile.t[i] * nr + r] = sum;
  }
}

// y[t, n0:n1] += scaling * h[t] B_s^T[:, n0:n1] for the tile's tokens (bt is B^T).
template <typename T>
void expand(const Tile& tile, int64_t n0, int64_t n1, const float* h, const T* bt, int64_t ldb,
            int64_t nr, float sc, T* yp, int64_t ldy) {
  if (n1 - n0 == kCols) {
    V16 acc[kTile][4];
    for (int64_t i = 0; i < tile.n; ++i)
      for (int j = 0; j < 4; ++j) acc[i][j] = zero();
    for (int64_t r = 0; r < nr; ++r) {
      const T* b = bt + (tile.slot * nr + r) * ldb + n0;
      const V16 b0 = load16(b), b1 = load16(b + 16), b2 = load16(b + 32), b3 = load16(b + 48);
      for (int64_t i = 0; i < tile.n; ++i) {
        const V16 hv = set1(h[tile.t[i] * nr + r]);
        acc[i][0] = fmadd(hv, b0, acc[i][0]);
        acc[i][1] = fmadd(hv, b1, acc[i][1]);
        acc[i][2] = fmadd(hv, b2, acc[i][2]);
        acc[i][3] = fmadd(hv, b3, acc[i][3]);
      }
    }
    const V16 scale = set1(sc);
    for (int64_t i = 0; i < tile.n; ++i) {
      T* y = yp + tile.t[i] * ldy + n0;
      for (int j = 0; j < 4; ++j)  // PEFT's order: the update scaled, then added
        store16(y + 16 * j, add(load16(y + 16 * j), mul(acc[i][j], scale)));
    }
    return;
  }
  for (int64_t i = 0; i < tile.n; ++i) {  // the ragged last block: scalar
    const float* ht = h + tile.t[i] * nr;
    T* y = yp + tile.t[i] * ldy;
    for (int64_t n = n0; n < n1; ++n) {
      float d = 0.f;
      for (int64_t r = 0; r < nr; ++r) d += ht[r] * static_cast<float>(bt[(tile.slot * nr + r) * ldb + n]);
      y[n] = static_cast<T>(static_cast<float>(y[n]) + d * sc);
    }
  }
}

template <typename T>
void lora_loops(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                const float* scaling, const int64_t* idx, int64_t slots, int64_t nr) {
  const int64_t rows = x.size(0), K = x.size(1), N = y.size(1);
  const int64_t ldx = x.stride(0), ldy = y.stride(0), ldb = bt.stride(0);
  const T* xp = x.data_ptr<T>();
  const std::vector<Tile> tiles = make_tiles(idx, rows, slots);
  const int64_t ntiles = static_cast<int64_t>(tiles.size());
  std::vector<float> xf(rows * K), h(rows * nr);
  for (int64_t t = 0; t < rows; ++t)  // fp32 rows once (a few KiB per token)
    if (idx[t] >= 0)
      for (int64_t k = 0; k < K; ++k) xf[t * K + k] = static_cast<float>(xp[t * ldx + k]);
  at::parallel_for(0, ntiles * nr, 4, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q)
      shrink(tiles[q / nr], q % nr, xf.data(), a.data_ptr<T>(), K, nr, h.data());
  });
  const int64_t blocks = (N + kCols - 1) / kCols;
  at::parallel_for(0, ntiles * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      const Tile& tile = tiles[q / blocks];
      const int64_t n0 = q % blocks * kCols;
      expand(tile, n0, std::min(N, n0 + kCols), h.data(), bt.data_ptr<T>(), ldb, nr,
             scaling[tile.slot], y.data_ptr<T>(), ldy);
    }
  });
}

void lora_gemms(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                const float* scaling, const int64_t* idx, int64_t slots, int64_t nr) {
  const int64_t rows = x.size(0);
  std::vector<std::vector<int64_t>> members(slots);
  for (int64_t t = 0; t < rows; ++t)
    if (idx[t] >= 0) members[idx[t]].push_back(t);
  for (int64_t s = 0; s < slots; ++s) {
    auto& m = members[s];
    if (m.empty()) continue;
    const auto A = a.narrow(0, s * nr, nr), Bt = bt.narrow(0, s * nr, nr);
    if (static_cast<int64_t>(m.size()) == rows) {
      y.add_(at::mm(at::mm(x, A.t()), Bt).mul_(scaling[s]));
      continue;
    }
    const auto sel = at::from_blob(m.data(), {static_cast<int64_t>(m.size())}, at::kLong).clone();
    y.index_add_(0, sel, at::mm(at::mm(x.index_select(0, sel), A.t()), Bt).mul_(scaling[s]));
  }
}

}  // namespace

void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a,
               const at::Tensor& lora_b, const at::Tensor& scaling, const at::Tensor& indices) {
  const int64_t rows = x.size(0), slots = scaling.size(0);
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && y.size(0) == rows && x.stride(1) == 1 &&
                  y.stride(1) == 1, "lora_add_: y [T, out] and x [T, in] with unit column stride");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && lora_a.scalar_type() == y.scalar_type() &&
                  lora_b.scalar_type() == y.scalar_type() &&
                  (y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16),
              "lora_add_: y, x, lora_a and lora_b share one dtype, float32 or bfloat16");
  TORCH_CHECK(lora_a.is_contiguous() && lora_b.is_contiguous() && slots > 0 &&
                  lora_a.size(0) % slots == 0 && lora_a.size(1) == x.size(1) &&
                  lora_b.size(0) == lora_a.size(0) && lora_b.size(1) == y.size(1),
              "lora_add_: lora_a [S*NR, in] and lora_b (B^T) [S*NR, out], contiguous");
  TORCH_CHECK(scaling.scalar_type() == at::kFloat && scaling.is_contiguous() &&
                  indices.scalar_type() == at::kLong && indices.is_contiguous() &&
                  indices.size(0) >= rows,
              "lora_add_: scaling float32 [S], indices int64 with at least T entries");
  const int64_t* idx = indices.data_ptr<int64_t>();
  bool any = false;
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(idx[t] < slots, "lora_add_: token ", t, " has slot ", idx[t], " of ", slots);
    any = any || idx[t] >= 0;
  }
  if (!any) return;  // the base model only: nothing to add
  const int64_t nr = lora_a.size(0) / slots;
  const float* sc = scaling.data_ptr<float>();
  if (rows >= kGemmFrom)
    lora_gemms(y, x, lora_a, lora_b, sc, idx, slots, nr);
  else if (y.scalar_type() == at::kFloat)
    lora_loops<float>(y, x, lora_a, lora_b, sc, idx, slots, nr);
  else
    lora_loops<c10::BFloat16>(y, x, lora_a, lora_b, sc, idx, slots, nr);
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("lora_add_", &lora_add_); }
