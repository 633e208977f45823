// The Python module of the engine's CPU kernels (declared in cpu_kernels.h).

#include "cpu_kernels.h"

#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL, as torch's own ops run: the server's event loop keeps serving while a
  // step's kernels run (they touch no Python object).
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode", &paged_decode, "Decode attention over a paged KV cache (CPU)", no_gil);
  m.def("write_kv_cache", &write_kv_cache,
        "Store the step's keys and values into their cache slots (CPU)", no_gil);
  m.def("paged_prefill", &paged_prefill,
        "Causal prefill attention of chunks over a paged KV cache (CPU)", no_gil);
  m.def("add_rms_norm", &add_rms_norm,
        "In place: residual += x, then x = RMSNorm(residual) (or x = RMSNorm(x) without one)",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"), no_gil);
  m.def("rotary_qk", &rotary_qk, "In place: rotary embedding of the queries and keys of qkv rows",
        no_gil);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [rows, 2 * width] gate_up rows",
        no_gil);
  m.def("few_rows_linear", &few_rows_linear, "x @ weight.T (+ bias) in float32, for few rows of x",
        py::arg("x"), py::arg("weight"), py::arg("bias"), no_gil);
}
