// What the CPU attention kernels (decode and prefill) share: conversions between the cache's
// dtype and float32 (their arithmetic is float32 whatever the cache holds), and the checks of
// the query, caches and block tables that make a wrong input an error, never a read outside
// the cache.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

inline void to_float(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline void to_float(const at::BFloat16* src, float* dst, int64_t n) {
  // bfloat16 is the upper half of a float32: a shift, which the compiler vectorizes.
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t word = static_cast<uint32_t>(bits[i]) << 16;
    float value;
    std::memcpy(&value, &word, sizeof(value));
    dst[i] = value;
  }
}

inline void to_float(const at::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// Softmax of scores[0, n) in place: each becomes exp(score - max) divided by their sum.
inline void softmax(float* scores, int64_t n) {
  const float top = *std::max_element(scores, scores + n);
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    scores[t] = std::exp(scores[t] - top);
    sum += scores[t];
  }
  const float inv = 1.f / sum;
  for (int64_t t = 0; t < n; ++t) scores[t] *= inv;
}

// A [rows, heads, dim] tensor whose rows may lie apart (a view of the step's fused qkv rows)
// but whose heads are adjacent within a row: row r, head h starts at r * stride(0) + h * dim.
inline bool heads_adjacent(const at::Tensor& t) {
  return t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2) &&
         (t.size(0) <= 1 || t.stride(0) >= t.size(1) * t.size(2));
}

// q: [rows, heads, dim], rows possibly apart (heads_adjacent); out: [rows, heads, dim]
// contiguous; k_cache, v_cache: [num_slots, kv_heads, dim], num_slots a multiple of
// block_size; one dtype for all four.
inline void check_attention_tensors(const char* kernel, const at::Tensor& q,
                                    const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    int64_t block_size, const at::Tensor& out) {
  TORCH_CHECK(q.device().is_cpu(), kernel, " runs on the CPU");
  TORCH_CHECK(heads_adjacent(q), "q must be an [n, heads, dim] tensor with adjacent heads");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous(),
              "the K and V caches must be contiguous [num_slots, kv_heads, dim] tensors");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "q, the caches and out must share one dtype");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(), "out must be a contiguous tensor shaped like q");
  const int64_t heads = q.size(1), kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == q.size(2), "the caches' head size differs from q's");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(block_size > 0 && k_cache.size(0) % block_size == 0,
              "the caches must hold whole blocks of block_size slots");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, kernel,
              " supports float32, bfloat16 and float16, not ", dtype);
}

// A contiguous [n] int64 tensor (the tables' companions: lengths, offsets).
inline void check_index_vector(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == n && t.is_contiguous(),
              what, " must be a contiguous [n] int64 tensor");
}

// Sequence `seq`'s context of `len` tokens lies in its row of the block table, and every
// block it uses is in the cache.
inline void check_context(const int64_t* table, int64_t max_blocks, int64_t len, int64_t seq,
                          int64_t block_size, int64_t cache_blocks) {
  TORCH_CHECK(len > 0 && len <= max_blocks * block_size, "context length ", len,
              " of sequence ", seq, " is outside its block table");
  const int64_t used = (len + block_size - 1) / block_size;
  for (int64_t b = 0; b < used; ++b) {
    TORCH_CHECK(table[b] >= 0 && table[b] < cache_blocks, "block id ", table[b],
                " of sequence ", seq, " is outside the cache");
  }
}
