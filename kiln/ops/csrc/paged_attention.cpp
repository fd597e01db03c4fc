// kiln_cpu::unified_attention — the "cpu" attention backend, one C++ call per layer.
//
// Why: in PyTorch, decode attention is a gather copy plus ~20 small ops per layer (tiny
// bf16 bmm calls cost ~70 us each here), and the Python around it another ~100 us; that
// made attention the largest item of a batch-1 decode step. Here single-token rows read
// K/V straight from the paged cache, and the op needs no Python at all, so on the CPU the
// model compiles into one Inductor graph that calls it like any other extern kernel.
//
// The batch layout reaches the op the way vLLM's forward context reaches its attention:
// the runner installs it (`set_batch`, with each layer's KV cache and softmax scale)
// around each forward, thread-locally, and the op reads it by layer index. With nothing
// installed (a dummy or tracing run) the op is a no-op, as the Python op is without
// metadata.
//
// Layouts: key/value cache [blocks, block_size, kv_heads, head_size], contiguous; q/out
// [tokens, heads, head_size]; block_table [reqs, max_blocks], seq_lens and
// query_start_loc int32; decode_reqs int64 [R, 2] (runs, see decode_impl), prefill_reqs
// int64 [P]. Decode rows run in the kernel below (fp32 arithmetic; bf16 dot products for
// bf16 caches on AVX512-BF16 builds, see scores_bf16); bf16 prefill rows run the tiled
// kernel of attention_prefill.h over K/V packed from their blocks; float32 prefill rows
// gather their blocks and call SDPA with a bottom-right causal mask, as the torch backend
// does (SDPA's own causal flag where the rows are a whole prompt).
//
// Per layer the batch also carries its KV-cache group (each group has its own block
// table and slot mapping: the hybrid cache of sliding-window models), its sliding window
// (0: none; the query at p sees keys p - window + 1 .. p, and only blocks the window
// reaches are read, since out-of-window table entries may already belong to another
// request) and its softcap (0: none; scores -> cap * tanh(scores / cap), Gemma 2).
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_decode.h"
#include "attention_prefill.h"
#include "simd.h"

namespace {

using namespace kiln_attn;

struct Piece {
  int64_t entry, rows, first, total, chunks, part;  // part: its partials' offset
};
struct Item {
  int32_t piece, head, chunk;
};


// Decode items: `reqs` is [R, 2], (first entry, rows) per run of consecutive entries that
// are consecutive query tokens of one request, each one longer than the last (the
// backend's split of a verify step; rows = 1 for a plain decode row). A run is cut into
// pieces of at most kMaxGroup / group tokens (the query vectors one item holds), and
// with a sliding window into single tokens (each token's window starts elsewhere); each
// piece's keys into chunks of kKeyChunk. One item is (piece, KV head, chunk); the thread
// that finishes a (piece, KV head)'s last chunk merges its partials into the output.
// Before the key chunks, a lone run's tokens were cut into pieces to feed 2 threads, and
// each piece read the whole context. SmolLM2's whole forward (bf16 KV, Zen 4, 2 threads,
// in one process, ms): 1 token at 300 / 600 / 1000 keys 4.41 -> 4.22 / 4.66 -> 4.41 /
// 5.35 -> 4.98; 3 tokens 5.42 -> 5.19 / 5.21 -> 4.99 / 6.34 -> 6.02; 7 tokens even
// (7.98 -> 7.96 / 7.26 -> 7.45 / 8.77 -> 8.81). The partials take about 2.4% of the bytes
// of the KV they summarise (a thread-local buffer, kept between calls).
template <typename T>
void decode_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& key_cache,
                 const at::Tensor& value_cache, const at::Tensor& block_table,
                 const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                 const at::Tensor& reqs, double scale, int64_t window, double softcap) {
  TORCH_CHECK(reqs.dim() == 2 && reqs.size(1) == 2 && reqs.is_contiguous(),
              "unified_attention: decode_reqs must be [R, 2] (first entry, rows)");
  const int64_t heads = q.size(1), D = q.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t runs = reqs.size(0);
  const auto* req = reqs.data_ptr<int64_t>();
  const auto* lens = seq_lens.data_ptr<int32_t>();
  const int64_t cap = window > 0 ? 1 : std::max<int64_t>(1, kMaxGroup / group);
  std::vector<Piece> pieces;
  std::vector<Item> items;
  // Work up to and including each item: key-vector products, plus four per key for
  // reading its rows.
  std::vector<int64_t> cost_upto;
  int64_t part_floats = 0, cost = 0;
  for (int64_t i = 0; i < runs; ++i) {
    const int64_t n = req[2 * i + 1];
    for (int64_t r = 0; r < n; r += cap) {
      const int64_t e = req[2 * i] + r, rows = std::min(cap, n - r), total = lens[e + rows - 1];
      const int64_t first = window > 0 ? std::max<int64_t>(0, total - window) : 0;
      const int64_t chunks = (total - first + kKeyChunk - 1) / kKeyChunk;
      const auto p = static_cast<int32_t>(pieces.size());
      pieces.push_back({e, rows, first, total, chunks, part_floats});
      part_floats += kv_heads * chunks * rows * group * partial_floats(D);
      for (int32_t h = 0; h < kv_heads; ++h)
        for (int32_t k = 0; k < chunks; ++k) {
          items.push_back({p, h, k});
          cost += chunk_keys(total - first, k * kKeyChunk) * (rows * group + 4);
          cost_upto.push_back(cost);
        }
    }
  }
  // Reused across calls (this op runs on the caller's thread, one layer at a time).
  static thread_local std::vector<float> parts;
  static thread_local std::vector<int32_t> pending;  // chunks still out per (piece, head)
  parts.resize(std::max<size_t>(parts.size(), part_floats));
  pending.resize(pieces.size() * kv_heads);
  for (size_t p = 0; p < pieces.size(); ++p)
    for (int64_t h = 0; h < kv_heads; ++h)
      pending[p * kv_heads + h] = static_cast<int32_t>(pieces[p].chunks);
  const auto* qsl = query_start_loc.data_ptr<int32_t>();
  const auto* table = block_table.data_ptr<int32_t>();
  const int64_t table_stride = block_table.stride(0);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kc = key_cache.data_ptr<T>();
  const T* vc = value_cache.data_ptr<T>();
  auto* attend = attend_chunk<T, 0>;  // the head size's unrolled build, where there is one
  switch (D / 16) {
    case 1: attend = attend_chunk<T, 1>; break;
    case 2: attend = attend_chunk<T, 2>; break;
    case 4: attend = attend_chunk<T, 4>; break;
    case 8: attend = attend_chunk<T, 8>; break;
    default: break;
  }
  float* part_base = parts.data();
  int32_t* pend = pending.data();
  const std::vector<int64_t> bounds = split_by_cost(cost_upto);
  const auto threads = static_cast<int64_t>(bounds.size()) - 1;
  // An item's K and V rows into L2, all at once (their DRAM round trips overlap): a
  // thread's first before it starts, each next one while the one before runs.
  auto prefetch_item = [&](int64_t i) {
    const Piece& pc = pieces[items[i].piece];
    const int64_t k0 = items[i].chunk * kKeyChunk;
    prefetch_chunk(kc, vc - kc, table + pc.entry * table_stride, pc.first + k0,
                   chunk_keys(pc.total - pc.first, k0), block_size, kv_heads, items[i].head,
                   D);
  };
  at::parallel_for(0, threads, 1, [&](int64_t t_begin, int64_t t_end) {
    std::vector<float> scores;
    std::vector<const T*> rows;
    if (bounds[t_begin] < bounds[t_end]) prefetch_item(bounds[t_begin]);
    for (int64_t i = bounds[t_begin]; i < bounds[t_end]; ++i) {
      if (i + 1 < bounds[t_end]) prefetch_item(i + 1);
      const Item it = items[i];
      const Piece& pc = pieces[it.piece];
      const int64_t tok = qsl[pc.entry], nv = pc.rows * group;
      const Run run{qp + tok * q.stride(0), op + tok * out.stride(0), q.stride(0),
                    out.stride(0), q.stride(1), pc.rows};
      float* head_part = part_base + pc.part + it.head * pc.chunks * nv * partial_floats(D);
      attend(run, kc, vc, table + pc.entry * table_stride, pc.first, pc.total,
             it.chunk * kKeyChunk, block_size, kv_heads, it.head, group, D,
             static_cast<float>(scale), static_cast<float>(softcap),
             head_part + it.chunk * nv * partial_floats(D), scores, rows);
      // The last chunk in merges: acq_rel orders the other threads' partials before it.
      if (__atomic_sub_fetch(pend + it.piece * kv_heads + it.head, 1, __ATOMIC_ACQ_REL) == 0)
        merge_partials<T>(run, pc.total - pc.first, it.head, group, D, head_part);
    }
  });
}


struct Batch {
  bool active = false;
  std::vector<at::Tensor> kv_caches;  // per layer [2, blocks, block_size, kv_heads, D]
  std::vector<double> scales;          // per layer softmax scale
  std::vector<int64_t> windows;        // per layer sliding window, 0 = none
  std::vector<double> softcaps;        // per layer logit softcap, 0 = none
  std::vector<int64_t> groups;         // per layer KV-cache group
  std::vector<at::Tensor> slot_mappings, block_tables;  // per group
  at::Tensor seq_lens, query_start_loc, decode_reqs, prefill_reqs;
  int64_t num_tokens = 0;
  // Layer keep_layer computes only the last prefill_keep[i] query rows of prefill entry i
  // and zeroes the others' output (kiln.runner.kept_rows: no one reads them); -1: none.
  int64_t keep_layer = -1;
  at::Tensor prefill_keep;
};

thread_local Batch batch;

// bf16 prefill rows run kiln's tiled kernel (attention_prefill.h) unless switched off
// (`set_prefill_kernel(False)`: SDPA over gathered blocks, for A/B runs in one process).
bool prefill_kernel = true;

// Tokens per thread from which write_kv splits: a prompt's rows (and the first touches of
// its fresh cache pages, which the cache takes lazily) on every thread; decode steps stay
// on one. A SmolLM2 layer at 2,000 tokens (2-vCPU Xeon, benchmarks/attention_rows.py):
// about 0.4 -> 0.2 ms.
constexpr int64_t kWriteGrain = 256;

// [tokens, heads, D] with each token's heads one contiguous row (any row stride): `t`
// itself, else a contiguous copy.
at::Tensor rows_of(const at::Tensor& t) {
  return t.stride(2) == 1 && (t.size(1) == 1 || t.stride(1) == t.size(2)) ? t : t.contiguous();
}

// Copy each token's K and V rows into its cache slot; a negative slot (padding) is skipped.
// A token's heads are contiguous (rows_of), its rows may be strided: in a model K and V
// are column ranges of the QKV projection's output, read in place (copying them out first
// took two more passes over 1.5 MB a layer at 2,000 tokens).
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
              at::Tensor& value_cache, const at::Tensor& slots, int64_t n) {
  const int64_t row = key_cache.size(2) * key_cache.size(3) * key_cache.element_size();
  const int64_t k_stride = key.stride(0) * key.element_size();
  const int64_t v_stride = value.stride(0) * value.element_size();
  const auto* slot = slots.data_ptr<int64_t>();
  const auto* k = static_cast<const char*>(key.data_ptr());
  const auto* v = static_cast<const char*>(value.data_ptr());
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  at::parallel_for(0, n, kWriteGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (slot[t] < 0) continue;
      std::memcpy(kc + slot[t] * row, k + t * k_stride, row);
      std::memcpy(vc + slot[t] * row, v + t * v_stride, row);
    }
  });
}

// One request with several query rows: SDPA over its gathered blocks, query row i at
// absolute position seq_len - q_len + i seeing keys 0..that position. Inputs are 4-D, the
// mask additive (0 / -inf) and K/V expanded to the query heads: otherwise (3-D inputs, a
// boolean mask or GQA) CPU SDPA takes its unfused math path instead of its flash kernel,
// measured about 7x slower on a 128-token prefill.
//
// With a window, only the blocks from the one holding the first query's first visible key
// are gathered, and the mask also hides keys more than window - 1 before each query. With
// a softcap the scores are computed explicitly (SDPA has none), as transformers' eager
// attention does: scale, cap, mask, float32 softmax, then V.
//
// keep >= 0: only the last `keep` query rows are computed (they see what they would see
// among all of them); the others' output is zeroed.
void prefill(const at::Tensor& q, at::Tensor& out, const at::Tensor& key_cache,
             const at::Tensor& value_cache, const at::Tensor& block_table, int64_t r,
             double scale, int64_t window, double softcap, int64_t keep) {
  const auto* qsl = batch.query_start_loc.data_ptr<int32_t>();
  int64_t start = qsl[r], q_len = qsl[r + 1] - qsl[r];
  if (keep >= 0 && keep < q_len) {
    out.narrow(0, start, q_len - keep).zero_();
    start += q_len - keep;
    q_len = keep;
    if (q_len == 0) return;
  }
  const int64_t len = batch.seq_lens.data_ptr<int32_t>()[r];
  const int64_t block_size = key_cache.size(1), group = q.size(1) / key_cache.size(2);
  const int64_t first_block =
      window > 0 ? std::max<int64_t>(0, len - q_len - window + 1) / block_size : 0;
  if (prefill_kernel && q.scalar_type() == at::kBFloat16) {
    const kiln_prefill::Prompt p{
        reinterpret_cast<const uint16_t*>(q.data_ptr()) + start * q.stride(0),
        reinterpret_cast<uint16_t*>(out.data_ptr()) + start * out.stride(0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), q_len, len,
        first_block * block_size, window, static_cast<float>(scale),
        static_cast<float>(softcap)};
    kiln_prefill::prefill_bf16(
        p, reinterpret_cast<const uint16_t*>(key_cache.data_ptr()),
        reinterpret_cast<const uint16_t*>(value_cache.data_ptr()),
        block_table.data_ptr<int32_t>() + r * block_table.stride(0), block_size,
        key_cache.size(2), group, q.size(2));
    return;
  }
  const int64_t offset = first_block * block_size, n = len - offset;
  const auto blocks = block_table[r]
                          .narrow(0, first_block,
                                  (len + block_size - 1) / block_size - first_block)
                          .to(at::kLong);
  auto gather = [&](const at::Tensor& cache) {
    auto rows = cache.index_select(0, blocks).flatten(0, 1).narrow(0, 0, n).transpose(0, 1);
    return (group > 1 ? rows.repeat_interleave(group, 0) : rows).unsqueeze(0);
  };  // [1, heads, n, D]
  const auto qr = q.narrow(0, start, q_len).transpose(0, 1).unsqueeze(0);
  // Keys a query row must not see: later ones, and with a window those too far back.
  auto hidden = [&]() {
    const auto opts = at::TensorOptions().dtype(at::kLong);
    const auto qpos = at::arange(q_len, opts).unsqueeze(1).add(len - q_len);
    const auto kpos = at::arange(n, opts).unsqueeze(0).add(offset);
    auto h = kpos.gt(qpos);
    return window > 0 ? h.logical_or(kpos.le(qpos.sub(window))) : h;
  };
  at::Tensor res;
  if (softcap > 0) {
    const auto keys = gather(key_cache), values = gather(value_cache);
    auto scores = at::matmul(qr, keys.transpose(-1, -2)).mul(scale);
    scores = at::tanh(scores.div(softcap)).mul(softcap).masked_fill(hidden(), -INFINITY);
    res = at::matmul(at::softmax(scores, -1, at::kFloat).to(values.scalar_type()), values);
  } else if (n == q_len && (window <= 0 || window >= n)) {
    // A whole prompt (no prefix, no key out of the window): the causal mask is SDPA's
    // own, so its flash kernel skips the blocks above the diagonal instead of reading an
    // explicit mask over all of them. SmolLM2, 2,000 tokens, bf16, Zen 4, 2 threads:
    // 68-77 -> 39-43 ms per layer.
    res = at::scaled_dot_product_attention(qr, gather(key_cache), gather(value_cache), {},
                                           0.0, true, scale, false);
  } else {
    const auto mask = at::zeros({q_len, n}, q.options()).masked_fill(hidden(), -INFINITY);
    res = at::scaled_dot_product_attention(qr, gather(key_cache), gather(value_cache), mask,
                                           0.0, false, scale, false);
  }
  out.narrow(0, start, q_len).copy_(res.select(0, 0).transpose(0, 1));
}

}  // namespace

void set_batch(std::vector<at::Tensor> kv_caches, std::vector<double> scales,
               std::vector<int64_t> windows, std::vector<double> softcaps,
               std::vector<int64_t> groups, std::vector<at::Tensor> slot_mappings,
               std::vector<at::Tensor> block_tables, at::Tensor seq_lens,
               at::Tensor query_start_loc, at::Tensor decode_reqs, at::Tensor prefill_reqs,
               int64_t num_tokens, int64_t keep_layer, at::Tensor prefill_keep) {
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt &&
                  decode_reqs.scalar_type() == at::kLong &&
                  prefill_reqs.scalar_type() == at::kLong,
              "set_batch: int32 lengths and int64 request rows expected");
  const size_t layers = kv_caches.size();
  TORCH_CHECK(scales.size() == layers && windows.size() == layers &&
                  softcaps.size() == layers && groups.size() == layers,
              "set_batch: one scale, window, softcap and group per layer");
  TORCH_CHECK(keep_layer < 0 || (prefill_keep.scalar_type() == at::kLong &&
                                  prefill_keep.numel() == prefill_reqs.numel()),
              "set_batch: one int64 kept-row count per prefill entry");
  TORCH_CHECK(slot_mappings.size() == block_tables.size() && !block_tables.empty(),
              "set_batch: one slot mapping and block table per group");
  for (auto g : groups)
    TORCH_CHECK(g >= 0 && g < static_cast<int64_t>(block_tables.size()),
                "set_batch: layer group ", g, " has no block table");
  for (size_t g = 0; g < block_tables.size(); ++g) {
    TORCH_CHECK(block_tables[g].scalar_type() == at::kInt &&
                    slot_mappings[g].scalar_type() == at::kLong,
                "set_batch: int32 tables and int64 slots expected");
    block_tables[g] = block_tables[g].contiguous();
  }
  batch = Batch{true, std::move(kv_caches), std::move(scales), std::move(windows),
                std::move(softcaps), std::move(groups), std::move(slot_mappings),
                std::move(block_tables), seq_lens, query_start_loc, decode_reqs,
                prefill_reqs, num_tokens, keep_layer, prefill_keep.contiguous()};
}

void clear_batch() { batch = Batch{}; }

void set_prefill_kernel(bool enabled) { prefill_kernel = enabled; }

void unified_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       at::Tensor out, const at::Tensor& layer_index) {
  if (!batch.active) return;
  TORCH_CHECK(layer_index.numel() == 1 && layer_index.scalar_type() == at::kLong &&
                  layer_index.device().is_cpu(),
              "unified_attention: layer_index must be one int64 on the CPU");
  const int64_t layer = *layer_index.data_ptr<int64_t>();
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(batch.kv_caches.size()),
              "unified_attention: no KV cache for layer ", layer);
  const double scale = batch.scales[layer], softcap = batch.softcaps[layer];
  const int64_t window = batch.windows[layer];
  const auto& block_table = batch.block_tables[batch.groups[layer]];
  const int64_t D = q.size(2), group = q.size(1) / k.size(1);
  TORCH_CHECK(D % 16 == 0 && D / 16 <= kMaxChunks && group <= kMaxGroup,
              "unified_attention: head_size must be a multiple of 16 up to ", 16 * kMaxChunks,
              " with at most ", kMaxGroup, " query heads per KV head");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "unified_attention: unit-stride heads");
  auto key_cache = batch.kv_caches[layer][0];
  auto value_cache = batch.kv_caches[layer][1];
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "unified_attention: contiguous KV cache expected");
  write_kv(rows_of(k), rows_of(v), key_cache, value_cache,
           batch.slot_mappings[batch.groups[layer]], batch.num_tokens);
  if (batch.decode_reqs.numel() > 0) {
    if (q.scalar_type() == at::kFloat) {
      decode_impl<float>(out, q, key_cache, value_cache, block_table, batch.seq_lens,
                         batch.query_start_loc, batch.decode_reqs, scale, window, softcap);
    } else {
      TORCH_CHECK(q.scalar_type() == at::kBFloat16, "unified_attention: float32 or bfloat16");
      decode_impl<c10::BFloat16>(out, q, key_cache, value_cache, block_table,
                                 batch.seq_lens, batch.query_start_loc, batch.decode_reqs,
                                 scale, window, softcap);
    }
  }
  const auto* rows = batch.prefill_reqs.data_ptr<int64_t>();
  const int64_t* keep =
      layer == batch.keep_layer ? batch.prefill_keep.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; i < batch.prefill_reqs.numel(); ++i)
    prefill(q, out, key_cache, value_cache, block_table, rows[i], scale, window, softcap,
            keep ? keep[i] : -1);
}

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  // Catch-all kernels: these two only install host state.
  m.def("set_batch(Tensor[] kv_caches, float[] scales, int[] windows, float[] softcaps, "
        "int[] groups, Tensor[] slot_mappings, Tensor[] block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, Tensor decode_reqs, Tensor prefill_reqs, "
        "int num_tokens, int keep_layer, Tensor prefill_keep) -> ()", &set_batch);
  m.def("clear_batch() -> ()", &clear_batch);
  m.def("set_prefill_kernel(bool enabled) -> ()", &set_prefill_kernel);
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) {
  m.impl("unified_attention", &unified_attention);
}
