// The elementwise steps of a Llama layer, each fused into one pass over its data: RMSNorm (with
// the residual add before it), rotary embedding of the queries and keys, and SiLU-and-mul.
//
// In torch each is several ops (RMSNorm alone is eight), each a pass over the activations and,
// for every op large enough, a parallel region whose threads meet at a barrier: many small
// barriers per layer, each of which stalls the step when another process holds a core. Here
// each is one pass, run on one thread when the rows are few (a decode batch: the work is
// microseconds, less than waking the pool) and split by rows otherwise.
//
// The numerics are Hugging Face's, rounding step by step as torch's ops do in the model dtype:
// norms in float32, the result rounded to the model dtype before the weight multiplies it;
// rotary tables rounded to the model dtype, each product and the sum rounded; SiLU rounded
// before the multiply. In float32 every rounding is a no-op and only the order of the sum of
// squares differs from torch's.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// Rows handled per thread at least: below this a pass runs on the calling thread.
constexpr int64_t kMinElementsPerThread = 1 << 15;

inline int64_t row_grain(int64_t width) {
  return std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(1, width));
}

template <typename T>
inline float rounded(float value) {
  return static_cast<float>(static_cast<T>(value));
}

template <typename T>
void add_rms_norm_rows(T* x, T* residual, const T* weight, int64_t rows, int64_t width,
                       int64_t x_stride, float eps) {
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * x_stride;
      T* res = residual == nullptr ? nullptr : residual + r * width;
      float sum = 0.f;
      for (int64_t i = 0; i < width; ++i) {
        float h = static_cast<float>(xr[i]);
        if (res != nullptr) {
          h = rounded<T>(h + static_cast<float>(res[i]));
          res[i] = static_cast<T>(h);
        }
        sum += h * h;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
      const T* src = res != nullptr ? res : xr;
      for (int64_t i = 0; i < width; ++i) {
        const float normed = rounded<T>(static_cast<float>(src[i]) * inv);
        xr[i] = static_cast<T>(static_cast<float>(weight[i]) * normed);
      }
    }
  });
}

template <typename T>
void rotary_rows(T* qkv, int64_t rows, int64_t row_stride, const int64_t* positions,
                 const float* cos, const float* sin, int64_t num_positions, int64_t heads,
                 int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows, row_grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t pos = positions[r];
      const float* c = cos + pos * dim;
      const float* s = sin + pos * dim;
      T* row = qkv + r * row_stride;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = row + h * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = static_cast<float>(x[i]), b = static_cast<float>(x[i + half]);
          const float c1 = rounded<T>(c[i]), s1 = rounded<T>(s[i]);
          const float c2 = rounded<T>(c[i + half]), s2 = rounded<T>(s[i + half]);
          // HF: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1).
          x[i] = static_cast<T>(rounded<T>(a * c1) + rounded<T>(-b * s1));
          x[i + half] = static_cast<T>(rounded<T>(b * c2) + rounded<T>(a * s2));
        }
      }
    }
  });
}

template <typename T>
void silu_and_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, row_grain(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * 2 * width;
      const T* up = gate + width;
      T* o = out + r * width;
      for (int64_t i = 0; i < width; ++i) {
        const float g = static_cast<float>(gate[i]);
        const float silu = rounded<T>(g / (1.f + std::exp(-g)));
        o[i] = static_cast<T>(silu * static_cast<float>(up[i]));
      }
    }
  });
}

void check_float_dtype(const at::Tensor& t, const char* name) {
  const auto dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, name,
              " must be float32, bfloat16 or float16, not ", dtype);
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

// By its bits: this file is compiled with -ffast-math, under which std::isfinite is folded to
// true and comparisons may assume no NaN.
bool finite_and_non_negative(double value) {
  uint64_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const bool finite = ((bits >> 52) & 0x7ff) != 0x7ff;
  return finite && (bits >> 63) == 0;
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.stride(0) >= x.size(1),
              name, " must be a [rows, width] tensor with contiguous rows");
}

}  // namespace

// x: [rows, width], its rows contiguous; residual: None, or a contiguous [rows, width] tensor.
// With a residual: residual += x, then x = RMSNorm(residual); else x = RMSNorm(x). In place.
void add_rms_norm(at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                  double eps) {
  check_float_dtype(x, "x");
  check_rows(x, "x");
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 &&
                  weight.size(0) == width && weight.is_contiguous(),
              "weight must be a contiguous [width] tensor of x's dtype");
  TORCH_CHECK(finite_and_non_negative(eps), "eps must be a finite number >= 0");
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == x.scalar_type() && residual->sizes() == x.sizes() &&
                    residual->is_contiguous(),
                "residual must be a contiguous tensor shaped like x, of its dtype");
    TORCH_CHECK(!residual->is_same(x), "residual and x must be different tensors");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(),
                                residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr,
                                weight.data_ptr<scalar_t>(), rows, width, x.stride(0),
                                static_cast<float>(eps));
  });
}

// qkv: [rows, (heads + 2 * kv_heads) * dim], its rows contiguous: queries, keys, values. The
// queries and keys of each row are rotated in place by the angle of positions[row]; cos and sin
// are float32 [num_positions, dim] tables. Positions outside the tables are errors.
void rotary_qk(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
               const at::Tensor& sin, int64_t heads, int64_t kv_heads, int64_t dim) {
  check_float_dtype(qkv, "qkv");
  check_rows(qkv, "qkv");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && dim > 0 && dim % 2 == 0,
              "heads, kv_heads must be positive and dim a positive even number");
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "qkv's width must be (heads + 2 * kv_heads) * dim");
  const int64_t rows = qkv.size(0);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.size(0) == rows && positions.is_contiguous(),
              "positions must be a contiguous [rows] int64 tensor");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.dim() == 2 && cos.size(1) == dim && sin.sizes() == cos.sizes() &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "cos and sin must be contiguous float32 [num_positions, dim] tensors");
  const int64_t num_positions = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(pos[r] >= 0 && pos[r] < num_positions, "position ", pos[r], " of row ", r,
                " is outside the rotary tables (", num_positions, " positions)");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_qk", [&] {
    rotary_rows<scalar_t>(qkv.data_ptr<scalar_t>(), rows, qkv.stride(0), pos,
                          cos.data_ptr<float>(), sin.data_ptr<float>(), num_positions,
                          heads + kv_heads, dim);
  });
}

// gate_up: contiguous [rows, 2 * width] (gate, then up) -> [rows, width] silu(gate) * up.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_float_dtype(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [rows, 2 * width] tensor");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, width);
  });
  return out;
}
