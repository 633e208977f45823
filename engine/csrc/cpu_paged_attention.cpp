// Decode attention over the paged KV cache on a CPU: one query token per sequence, reading its
// keys and values straight from the cache blocks its block table names.
//
// The torch reference first copies every sequence's blocks into a padded dense tensor and then
// runs SDPA over the padding too; here each sequence reads only its own tokens, once, block by
// block (a block holds block_size consecutive tokens of every KV head, so one sequence's read
// of a block is contiguous). Blocks are scattered in memory, which defeats the hardware's
// prefetcher at every block boundary: while a block is read, each token's row of the next
// block is prefetched (a row at a time, not the whole block at once, which would overflow
// the core's outstanding-miss slots and have most prefetches dropped; 2.7x faster on float32
// caches larger than the L3). Scores, softmax and the weighted sum are float32 whatever the
// cache dtype. Sequences run in parallel on torch's intra-op threads. The work per key is
// compute, not memory: the same batch over a cache that fits the L2 cache took as long as
// over one ten times larger, so the loops are laid out for the vector units (see decode()):
// 1.34 -> 0.93 ms a layer for 64 bfloat16 sequences of 300 tokens, SmolLM2's heads.

#include "cpu_attention_common.h"
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

inline void prefetch(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset);
}

constexpr int64_t kLanes = 8;  // one AVX2 register of float32

// kLanes floats as one value of the compiler's vector extension (a register on x86-64-v3).
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

inline Lanes load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, const Lanes& v) { std::memcpy(p, &v, sizeof v); }

// {sum of v[0], ..., sum of v[7]}: eight horizontal sums at the cost of about two.
inline Lanes sum_each(const Lanes* v) {
#if defined(__AVX__)
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_permute2f128_ps(u0, u1, 0x20) + _mm256_permute2f128_ps(u0, u1, 0x31);
#else
  Lanes out;
  for (int64_t i = 0; i < kLanes; ++i) {
    float sum = 0.f;
    for (int64_t l = 0; l < kLanes; ++l) sum += v[i][l];
    out[i] = sum;
  }
  return out;
#endif
}

// DIM > 0 fixes the head size at compile time (the common sizes, fully unrolled); 0 reads it
// at run time. A block is converted to float32 once (in `rows`, a few KB that stay in the L1
// cache) and each query head then reads it: its scores eight keys at a time, each key's dot
// product left as a vector until eight are summed together; its weighted sum of the values in
// registers across the block.
template <typename T, int DIM>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& tables, const at::Tensor& lens, int64_t block_size, double scale,
            at::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1);
  const int64_t dim = DIM > 0 ? DIM : q.size(2);
  const int64_t whole = dim / kLanes * kLanes;  // the rest (dim % 8) is summed one by one
  const int64_t kv_heads = k_cache.size(1);
  const int64_t group = heads / kv_heads;
  const int64_t max_blocks = tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t token_elems = kv_heads * dim;  // one token's keys (or values), every KV head
  const int64_t block_elems = block_size * token_elems;
  const int64_t token_bytes = token_elems * static_cast<int64_t>(sizeof(T));
  const int64_t block_bytes = block_size * token_bytes;
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(heads * dim), rows(block_elems), acc(heads * dim), probs;
    Lanes parts[kLanes];
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t len = lp[seq];
      const int64_t* table = tp + seq * max_blocks;
      const int64_t num_blocks = (len + block_size - 1) / block_size;
      to_float(qp + seq * heads * dim, query.data(), heads * dim);
      for (int64_t i = 0; i < heads * dim; ++i) query[i] *= fscale;
      probs.resize(heads * len);
      // Calls visit(b, tokens) with `rows` holding block b's first `tokens` rows of `cache`
      // (every KV head, as floats), for each block in order, prefetching the next block's
      // rows while it converts.
      auto for_each_block = [&](const T* cache, auto&& visit) {
        for (int64_t b = 0; b < num_blocks; ++b) {
          const T* next = b + 1 < num_blocks ? cache + table[b + 1] * block_elems : nullptr;
          const T* block = cache + table[b] * block_elems;
          const int64_t tokens = std::min(block_size, len - b * block_size);
          for (int64_t j = 0; j < tokens; ++j) {
            if (next != nullptr) prefetch(next + j * token_elems, token_bytes);
            to_float(block + j * token_elems, rows.data() + j * token_elems, token_elems);
          }
          visit(b, tokens);
        }
      };
      if (num_blocks > 0) prefetch(kp + table[0] * block_elems, block_bytes);

      for_each_block(kp, [&](int64_t b, int64_t tokens) {
        for (int64_t h = 0; h < heads; ++h) {
          const float* qh = query.data() + h * dim;
          const float* keys = rows.data() + (h / group) * dim;
          float* scores = probs.data() + h * len + b * block_size;
          for (int64_t j0 = 0; j0 < tokens; j0 += kLanes) {
            const int64_t count = std::min(kLanes, tokens - j0);
            for (int64_t j = 0; j < kLanes; ++j) {
              Lanes dot = {};
              if (j < count) {
                const float* kr = keys + (j0 + j) * token_elems;
                for (int64_t i = 0; i < whole; i += kLanes) dot += load(qh + i) * load(kr + i);
              }
              parts[j] = dot;
            }
            float sums[kLanes];
            store(sums, sum_each(parts));
            for (int64_t j = 0; j < count; ++j) {
              const float* kr = keys + (j0 + j) * token_elems;
              for (int64_t i = whole; i < dim; ++i) sums[j] += qh[i] * kr[i];
              scores[j0 + j] = sums[j];
            }
          }
        }
      });
      if (num_blocks > 0) prefetch(vp + table[0] * block_elems, block_bytes);
      for (int64_t h = 0; h < heads; ++h) {
        float* p = probs.data() + h * len;
        const float top = *std::max_element(p, p + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          p[t] = std::exp(p[t] - top);
          sum += p[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) p[t] *= inv;
      }

      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_block(vp, [&](int64_t b, int64_t tokens) {
        for (int64_t h = 0; h < heads; ++h) {
          const float* weights = probs.data() + h * len + b * block_size;
          const float* values = rows.data() + (h / group) * dim;
          float* ah = acc.data() + h * dim;
          if constexpr (DIM > 0 && DIM % kLanes == 0 && DIM <= 128) {
            Lanes sum[DIM / kLanes];
            for (int64_t c = 0; c < DIM / kLanes; ++c) sum[c] = load(ah + c * kLanes);
            for (int64_t j = 0; j < tokens; ++j) {
              const float* vr = values + j * token_elems;
              for (int64_t c = 0; c < DIM / kLanes; ++c) sum[c] += weights[j] * load(vr + c * kLanes);
            }
            for (int64_t c = 0; c < DIM / kLanes; ++c) store(ah + c * kLanes, sum[c]);
          } else {
            for (int64_t j = 0; j < tokens; ++j) {
              const float* vr = values + j * token_elems;
              for (int64_t i = 0; i < dim; ++i) ah[i] += weights[j] * vr[i];
            }
          }
        }
      });
      from_float(acc.data(), op + seq * heads * dim, heads * dim);
    }
  });
}

template <typename T>
void dispatch_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& tables, const at::Tensor& lens, int64_t block_size,
                  double scale, at::Tensor& out) {
  switch (q.size(2)) {
    case 64:
      return decode<T, 64>(q, k_cache, v_cache, tables, lens, block_size, scale, out);
    case 128:
      return decode<T, 128>(q, k_cache, v_cache, tables, lens, block_size, scale, out);
    default:
      return decode<T, 0>(q, k_cache, v_cache, tables, lens, block_size, scale, out);
  }
}

}  // namespace

// q, out: [n, heads, dim]; k_cache, v_cache: [num_slots, kv_heads, dim] with num_slots a
// multiple of block_size; tables: [n, max_blocks] int64 block ids; lens: [n] int64 context
// lengths (the new token's K/V already written). Everything is checked before any read, so a
// wrong table is an error, never a read outside the cache.
void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& tables, const at::Tensor& lens, int64_t block_size,
                  double scale, at::Tensor& out) {
  check_attention_tensors("paged_decode", q, k_cache, v_cache, block_size, out);
  const int64_t n = q.size(0);
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.size(0) == n &&
                  tables.is_contiguous(),
              "tables must be a contiguous [n, max_blocks] int64 tensor");
  check_index_vector(lens, n, "lens");
  const int64_t cache_blocks = k_cache.size(0) / block_size;
  const int64_t max_blocks = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t seq = 0; seq < n; ++seq) {
    check_context(tp + seq * max_blocks, max_blocks, lp[seq], seq, block_size, cache_blocks);
  }
  switch (q.scalar_type()) {
    case at::kBFloat16:
      return dispatch_dim<at::BFloat16>(q, k_cache, v_cache, tables, lens, block_size, scale, out);
    case at::kHalf:
      return dispatch_dim<at::Half>(q, k_cache, v_cache, tables, lens, block_size, scale, out);
    default:  // float32 (the dtype was checked)
      return dispatch_dim<float>(q, k_cache, v_cache, tables, lens, block_size, scale, out);
  }
}
