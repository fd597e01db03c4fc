// kiln_cpu::write_kv and kiln_cpu::paged_decode — the torch backend's hot path in C++.
//
// Why: a decode step attends one query row per request over a short paged context. In
// PyTorch that is a gather copy plus ~20 small ops per layer (tiny bf16 bmm calls cost
// ~70 us each here), which made attention the largest item of a batch-1 decode step.
// These kernels read K/V straight from the paged cache, in place.
//
// Layouts (the backend's): key/value cache [blocks, block_size, kv_heads, head_size],
// contiguous; q/out rows [tokens, heads, head_size] with unit stride in head_size;
// block_table [reqs, max_blocks] int32; seq_lens, query_start_loc int32; decode_reqs
// int64 (the requests whose single query token is attended here). Scores, softmax and
// the weighted sum run in fp32; head_size must be a multiple of 16.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

constexpr int kMaxChunks = 16;  // head_size <= 256
constexpr int kMaxGroup = 16;   // query heads per KV head

// One (request, KV head): the `group` query heads sharing that KV head, in two passes
// over the context (scores from K, then the softmax-weighted sum of V).
template <typename T>
void attend_one(const T* q, T* out, const T* kc, const T* vc, const int32_t* blocks,
                int64_t len, int64_t block_size, int64_t kv_heads, int64_t head,
                int64_t group, int64_t D, int64_t q_head_stride, float scale,
                std::vector<float>& scores) {
  const int64_t chunks = D / 16;
  __m512 qv[kMaxGroup][kMaxChunks];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < chunks; ++c)
      qv[g][c] = _mm512_mul_ps(load16(q + (head * group + g) * q_head_stride + c * 16),
                               _mm512_set1_ps(scale));
  scores.resize(group * len);
  auto row = [&](const T* cache, int64_t j) {
    const int64_t slot = static_cast<int64_t>(blocks[j / block_size]) * block_size +
                         j % block_size;
    return cache + (slot * kv_heads + head) * D;
  };
  for (int64_t j = 0; j < len; ++j) {
    const T* k = row(kc, j);
    __m512 kv[kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c) kv[c] = load16(k + c * 16);
    for (int64_t g = 0; g < group; ++g) {
      __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int64_t c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
      scores[g * len + j] = _mm512_reduce_add_ps(acc);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * len;
    float mx = -INFINITY;
    for (int64_t j = 0; j < len; ++j) mx = std::max(mx, s[j]);
    float sum = 0.f;
    for (int64_t j = 0; j < len; ++j) {
      s[j] = std::exp(s[j] - mx);
      sum += s[j];
    }
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < len; ++j) s[j] *= inv;
  }
  __m512 acc[kMaxGroup][kMaxChunks];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < chunks; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    const T* v = row(vc, j);
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 vv = load16(v + c * 16);
      for (int64_t g = 0; g < group; ++g)
        acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * len + j]), vv, acc[g][c]);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < chunks; ++c)
      store16(out + (head * group + g) * q_head_stride + c * 16, acc[g][c]);
}

template <typename T>
void decode_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& key_cache,
                 const at::Tensor& value_cache, const at::Tensor& block_table,
                 const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                 const at::Tensor& reqs, double scale) {
  const int64_t R = reqs.size(0), heads = q.size(1), D = q.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const int64_t group = heads / kv_heads;
  const auto* req = reqs.data_ptr<int64_t>();
  const auto* lens = seq_lens.data_ptr<int32_t>();
  const auto* qsl = query_start_loc.data_ptr<int32_t>();
  const auto* table = block_table.data_ptr<int32_t>();
  const int64_t table_stride = block_table.stride(0);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kc = key_cache.data_ptr<T>();
  const T* vc = value_cache.data_ptr<T>();
  at::parallel_for(0, R * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = req[item / kv_heads], head = item % kv_heads;
      const int64_t tok = qsl[r];
      attend_one<T>(qp + tok * q.stride(0), op + tok * out.stride(0), kc, vc,
                    table + r * table_stride, lens[r], block_size, kv_heads, head, group,
                    D, q.stride(1), static_cast<float>(scale), scores);
    }
  });
}

}  // namespace

void paged_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_table,
                  const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                  const at::Tensor& decode_reqs, double scale) {
  const int64_t D = q.size(2), group = q.size(1) / key_cache.size(2);
  TORCH_CHECK(D % 16 == 0 && D / 16 <= kMaxChunks, "paged_decode: head_size ", D,
              " must be a multiple of 16 and at most ", 16 * kMaxChunks);
  TORCH_CHECK(group <= kMaxGroup, "paged_decode: at most ", kMaxGroup,
              " query heads per KV head");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && key_cache.is_contiguous() &&
                  value_cache.is_contiguous(), "paged_decode: unexpected layout");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt &&
                  decode_reqs.scalar_type() == at::kLong, "paged_decode: index dtypes");
  if (q.scalar_type() == at::kFloat) {
    decode_impl<float>(out, q, key_cache, value_cache, block_table, seq_lens,
                       query_start_loc, decode_reqs, scale);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "paged_decode: float32 or bfloat16");
    decode_impl<c10::BFloat16>(out, q, key_cache, value_cache, block_table, seq_lens,
                               query_start_loc, decode_reqs, scale);
  }
}

// Copy each token's K and V rows into its cache slot; a negative slot (padding) is skipped.
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
              at::Tensor value_cache, const at::Tensor& slots) {
  TORCH_CHECK(key.is_contiguous() && value.is_contiguous() && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && slots.scalar_type() == at::kLong,
              "write_kv: contiguous K/V and int64 slots expected");
  const int64_t T = slots.size(0);
  const int64_t row = key_cache.size(2) * key_cache.size(3) * key_cache.element_size();
  const auto* slot = slots.data_ptr<int64_t>();
  const auto* k = static_cast<const char*>(key.data_ptr());
  const auto* v = static_cast<const char*>(value.data_ptr());
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    if (slot[t] < 0) continue;
    std::memcpy(kc + slot[t] * row, k + t * row, row);
    std::memcpy(vc + slot[t] * row, v + t * row, row);
  }
}

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor key_cache, Tensor value_cache, "
        "Tensor block_table, Tensor seq_lens, Tensor query_start_loc, Tensor decode_reqs, "
        "float scale) -> ()");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("write_kv", &write_kv);
}
