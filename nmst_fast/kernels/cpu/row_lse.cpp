// The torch ops over head_row.h's row math: the tempered logsumexp of each row of a float32 table over
// every column but one (nothing written but the result), and on top of it the head's eos column for
// the HF, vLLM and llama.cpp processors (nmst_fast.decoding.eos_column). The torch-op path of the row
// pass makes five passes and writes the table twice.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "head_row.h"

namespace {

using namespace nmst_fast_cpu;

void check_rows(const at::Tensor& rows, int64_t skip, const char* op) {
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kFloat && rows.dim() == 2 && rows.stride(1) == 1,
              op, ": rows must be a (A, V) float32 CPU tensor with unit column stride");
  TORCH_CHECK(0 <= skip && skip < rows.size(1), op, ": the skipped column must be a column of rows");
}

const double* row_values(const std::optional<at::Tensor>& values, int64_t A, const char* name) {
  if (!values.has_value()) {
    return nullptr;
  }
  TORCH_CHECK(values->device().is_cpu() && values->scalar_type() == at::kDouble && values->dim() == 1 &&
                  values->size(0) == A && values->is_contiguous(),
              name, " must be a contiguous (A,) float64 CPU tensor");
  return values->data_ptr<double>();
}

// (A,) float64: log sum_{v != skip} exp(rows[a, v] * inverse[a]) for rows (A, V) float32 with unit
// column stride; inverse (A,) float64 1/T per row, or absent (1).
at::Tensor non_eos_lse(const at::Tensor& rows, int64_t skip, const std::optional<at::Tensor>& inverse) {
  check_rows(rows, skip, "non_eos_lse");
  const int64_t A = rows.size(0), V = rows.size(1), row_stride = rows.stride(0);
  const double* inv = row_values(inverse, A, "non_eos_lse: inverse");
  at::Tensor out = at::empty({A}, rows.options().dtype(at::kDouble));
  const float* base = rows.data_ptr<float>();
  double* result = out.data_ptr<double>();
  at::parallel_for(0, A, 1, [&](int64_t begin, int64_t end) {
    for (int64_t a = begin; a < end; ++a) {
      result[a] = row_lse(base + a * row_stride, V, skip, inv ? inv[a] : 1.0);
    }
  });
  return out;
}

// Writes the eos column of a group of head rows of ``logits`` (B, V) at one decoding step and returns
// ST's running sums after the step ((A,) float64; empty for NMST). Row a of the group is logits row
// rows[a] (int64 indices, distinct) at step steps[a] (t <= 0: context) with temperature
// temperatures[a] (1 for greedy rows): its eos entry becomes T * min(zeta_eos, L_T + max_gap), rounded
// to float32, zeta_eos the head's effective eos logit over L_T = log sum_{v != eos} exp(z_v / T). A row
// without a distribution (L_T NaN or infinite, eos logit NaN or -inf) keeps its eos logit and ST's
// sum. ``before``: ST's sums before the step (NMST: absent).
at::Tensor write_eos_column(at::Tensor& logits, const at::Tensor& rows, int64_t eos, const at::Tensor& temperatures,
                            const at::Tensor& steps, const std::optional<at::Tensor>& before, double eps,
                            double max_gap) {
  check_rows(logits, eos, "write_eos_column");
  const int64_t A = rows.numel(), B = logits.size(0), V = logits.size(1), row_stride = logits.stride(0);
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "write_eos_column: rows must be a contiguous (A,) int64 CPU tensor of row indices");
  const int64_t* row_index = rows.data_ptr<int64_t>();
  for (int64_t a = 0; a < A; ++a) {
    TORCH_CHECK(0 <= row_index[a] && row_index[a] < B, "write_eos_column: row index ", row_index[a],
                " outside the logits' ", B, " rows");
  }
  const double* temperature = row_values(temperatures, A, "write_eos_column: temperatures");
  TORCH_CHECK(steps.device().is_cpu() && steps.scalar_type() == at::kLong && steps.dim() == 1 && steps.size(0) == A &&
                  steps.is_contiguous(),
              "write_eos_column: steps must be a contiguous (A,) int64 CPU tensor");
  const int64_t* step = steps.data_ptr<int64_t>();
  const double* sum_before = row_values(before, A, "write_eos_column: before");
  const bool st = sum_before != nullptr;
  at::Tensor sums_after = at::empty({st ? A : 0}, logits.options().dtype(at::kDouble));
  double* sum_after = sums_after.data_ptr<double>();
  float* base = logits.data_ptr<float>();
  const double log1m_eps = std::log1p(-eps);
  at::parallel_for(0, A, 1, [&](int64_t begin, int64_t end) {
    for (int64_t a = begin; a < end; ++a) {
      float* row = base + row_index[a] * row_stride;
      const double s = static_cast<double>(row[eos]);
      const double L = row_lse(row, V, eos, 1.0 / temperature[a]);
      double value = 0.0, after = st ? sum_before[a] : 0.0;
      if (head_eos_value(L, s, step[a], temperature[a], st, after, log1m_eps, max_gap, &value, &after)) {
        row[eos] = static_cast<float>(value);
      }
      if (st) {
        sum_after[a] = after;
      }
    }
  });
  return sums_after;
}

}  // namespace

TORCH_LIBRARY(nmst_fast_cpu, m) {
  m.def("non_eos_lse(Tensor rows, int skip, Tensor? inverse) -> Tensor");
  m.def("write_eos_column(Tensor(a!) logits, Tensor rows, int eos, Tensor temperatures, Tensor steps, "
        "Tensor? before, float eps, float max_gap) -> Tensor");
}

TORCH_LIBRARY_IMPL(nmst_fast_cpu, CPU, m) {
  m.impl("non_eos_lse", &non_eos_lse);
  m.impl("write_eos_column", &write_eos_column);
}
