// The engine's CPU kernels, one Python extension (cpu_kernels.py builds it): decode and prefill
// attention over the paged KV cache (cpu_paged_attention.cpp, cpu_paged_prefill.cpp), the
// fused elementwise steps of a layer (cpu_layer_ops.cpp) and float32 linear layers on a few
// rows (cpu_few_rows_linear.cpp).
// Every function checks its inputs before reading any of them.
#pragma once

#include <ATen/ATen.h>

void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& tables, const at::Tensor& lens, int64_t block_size,
                  double scale, at::Tensor& out);

void write_kv_cache(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                    const at::Tensor& k, const at::Tensor& v);

void paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& tables, const at::Tensor& q_starts, const at::Tensor& q_lens,
                   const at::Tensor& context_lens, int64_t block_size, double scale,
                   at::Tensor& out);

void add_rms_norm(at::Tensor& x, const c10::optional<at::Tensor>& residual,
                  const at::Tensor& weight, double eps);

void rotary_qk(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
               const at::Tensor& sin, int64_t heads, int64_t kv_heads, int64_t dim);

at::Tensor silu_and_mul(const at::Tensor& gate_up);

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight,
                           const c10::optional<at::Tensor>& bias);
