// y = x W^T (+ b) in float32 for a few rows of x: a decode step of one to a few sequences.
//
// With so few rows a linear layer is a pass over its weight, and memory bandwidth is the
// limit: every weight is read once and used for each row of x. oneDNN's prepacked matmul
// (cpu_linear.py) is laid out for many rows and reads more than that at one to four rows;
// this pass reads each weight row once, from the plain [out, in] layout, for up to kBatch
// rows of x at a time (more rows go in passes of kBatch), accumulating kLanes-wide partial
// sums that the compiler keeps in vector registers (x86-64-v3: one FMA per lane group).
// Output rows are split between torch's threads.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kLanes = 8;   // one AVX2 register of float32
constexpr int kCols = 4;    // weight rows (outputs) per tile
constexpr int kBatch = 4;   // rows of x per pass over the weight
constexpr int64_t kTilesPerTask = 16;

// kLanes floats as one value of the compiler's vector extension: a register where the target
// has one that wide, pairs or scalars where it has not (the code is the same).
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

inline Lanes load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);  // an unaligned load
  return v;
}

// Outputs [n, n + count) (count <= kCols) of M rows of x.
template <int M>
void tile(const float* x, const float* w, const float* bias, float* y, int64_t in,
          int64_t out, int64_t n, int64_t count) {
  Lanes acc[M][kCols] = {};
  const float* rows[kCols];
  for (int j = 0; j < kCols; ++j) rows[j] = w + (n + std::min<int64_t>(j, count - 1)) * in;
  const int64_t whole = in / kLanes * kLanes;
  for (int64_t k = 0; k < whole; k += kLanes) {
    Lanes wk[kCols];
    for (int j = 0; j < kCols; ++j) wk[j] = load(rows[j] + k);
    for (int m = 0; m < M; ++m) {
      const Lanes xk = load(x + m * in + k);
      for (int j = 0; j < kCols; ++j) acc[m][j] += xk * wk[j];
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int j = 0; j < count; ++j) {
      float sum = 0.f;
      for (int l = 0; l < kLanes; ++l) sum += acc[m][j][l];
      for (int64_t k = whole; k < in; ++k) sum += x[m * in + k] * rows[j][k];
      y[m * out + n + j] = sum + (bias != nullptr ? bias[n + j] : 0.f);
    }
  }
}

template <int M>
void pass(const float* x, const float* w, const float* bias, float* y, int64_t in, int64_t out) {
  const int64_t tiles = (out + kCols - 1) / kCols;
  at::parallel_for(0, tiles, kTilesPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * kCols;
      tile<M>(x, w, bias, y, in, out, n, std::min<int64_t>(kCols, out - n));
    }
  });
}

}  // namespace

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "few_rows_linear: x and weight must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "few_rows_linear: x and weight must be float32");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(),
              "few_rows_linear: x and weight must be contiguous");
  TORCH_CHECK(x.size(1) == weight.size(1), "few_rows_linear: x has ", x.size(1),
              " columns, weight ", weight.size(1));
  const int64_t rows = x.size(0), in = x.size(1), out = weight.size(0);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out && bias->is_contiguous() &&
                    bias->scalar_type() == at::kFloat,
                "few_rows_linear: bias must be a contiguous float32 vector of ", out);
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({rows, out}, x.options());
  const float* w = weight.data_ptr<float>();
  for (int64_t r = 0; r < rows; r += kBatch) {
    const float* xr = x.data_ptr<float>() + r * in;
    float* yr = y.data_ptr<float>() + r * out;
    switch (std::min<int64_t>(kBatch, rows - r)) {
      case 1: pass<1>(xr, w, b, yr, in, out); break;
      case 2: pass<2>(xr, w, b, yr, in, out); break;
      case 3: pass<3>(xr, w, b, yr, in, out); break;
      default: pass<4>(xr, w, b, yr, in, out); break;
    }
  }
  return y;
}
