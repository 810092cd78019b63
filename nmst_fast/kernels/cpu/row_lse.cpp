// Tempered logsumexp of each row of a float32 table over every column but one, in two passes over
// the row (its max, then the sum of exp2((z - max) * log2(e) / T)), with nothing written but the
// result; and, on top of it, the NMST / ST head's eos column for the vLLM processor (the per-row
// scalars of nmst_fast.integrations.vllm.eos_column.host_eos_value, in the same float64 order).
// The torch-op path of the row pass makes five passes and writes the table twice.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kWidth = Vec::size();
constexpr int64_t kUnroll = 4;
constexpr int64_t kStep = kWidth * kUnroll;
// The float32 partial sums are added into a double every this many vector steps: each lane then
// holds at most 16 terms of at most 1, so its rounding stays near one float32 ulp of the total.
constexpr int64_t kFlushSteps = 16;
constexpr double kLog2E = 1.4426950408889634;

// max of x[0, n), NaN if any entry is NaN.
float span_max(const float* x, int64_t n) {
  const float lowest = -std::numeric_limits<float>::infinity();
  Vec acc[kUnroll] = {Vec(lowest), Vec(lowest), Vec(lowest), Vec(lowest)};
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    for (int64_t k = 0; k < kUnroll; ++k) {
      acc[k] = at::vec::maximum(acc[k], Vec::loadu(x + i + k * kWidth));
    }
  }
  for (; i + kWidth <= n; i += kWidth) {
    acc[0] = at::vec::maximum(acc[0], Vec::loadu(x + i));
  }
  Vec all = at::vec::maximum(at::vec::maximum(acc[0], acc[1]), at::vec::maximum(acc[2], acc[3]));
  float lanes[kWidth];
  all.store(lanes);
  float best = lowest;
  bool nan = false;
  for (int64_t k = 0; k < kWidth; ++k) {
    nan |= std::isnan(lanes[k]);
    best = std::max(best, lanes[k]);
  }
  for (; i < n; ++i) {
    nan |= std::isnan(x[i]);
    best = std::max(best, x[i]);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : best;
}

// sum of 2^((x - shift) * scale) over x[0, n), accumulated in double every kFlushSteps vector steps.
double span_exp2_sum(const float* x, int64_t n, float shift, float scale) {
  const Vec vshift(shift), vscale(scale);
  double total = 0.0;
  int64_t i = 0;
  while (i + kStep <= n) {
    Vec acc[kUnroll] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
    for (int64_t s = 0; s < kFlushSteps && i + kStep <= n; ++s, i += kStep) {
      for (int64_t k = 0; k < kUnroll; ++k) {
        acc[k] = acc[k] + ((Vec::loadu(x + i + k * kWidth) - vshift) * vscale).exp2();
      }
    }
    float lanes[kWidth];
    ((acc[0] + acc[1]) + (acc[2] + acc[3])).store(lanes);
    for (int64_t k = 0; k < kWidth; ++k) {
      total += lanes[k];
    }
  }
  for (; i < n; ++i) {
    total += std::exp2((x[i] - shift) * scale);
  }
  return total;
}

// log sum_{v != skip} exp(row[v] * t_inv) in float64 for one row of width V; a row whose max is not
// finite gets max * t_inv (+inf, -inf for a row with no finite entry), NaN with any NaN entry.
double row_lse(const float* row, int64_t V, int64_t skip, double t_inv) {
  const int64_t after = V - skip - 1;
  const float left = span_max(row, skip), right = span_max(row + skip + 1, after);
  if (std::isnan(left) || std::isnan(right)) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  const float best = std::max(left, right);
  if (!std::isfinite(best)) {
    return static_cast<double>(best) * t_inv;
  }
  const float scale = static_cast<float>(kLog2E * t_inv);
  const double sum = span_exp2_sum(row, skip, best, scale) + span_exp2_sum(row + skip + 1, after, best, scale);
  return static_cast<double>(best) * t_inv + std::log(sum);
}

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

double log_sigmoid(double x) { return std::min(x, 0.0) - std::log1p(std::exp(-std::abs(x))); }

double log1mexp(double a) {
  if (a == 0.0) {
    return -std::numeric_limits<double>::infinity();
  }
  return a > -std::log(2.0) ? std::log(-std::expm1(a)) : std::log1p(-std::exp(a));
}

// Below this a = log(1 - alpha) is 1 - alpha = 0 in float64 (nmst_fast.decoding.distribution.LOG_SURVIVAL_FLOOR).
constexpr double kLogSurvivalFloor = -1e300;

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
      const bool live = std::abs(L) < std::numeric_limits<double>::infinity() &&
                        s > -std::numeric_limits<double>::infinity();  // false for NaN too
      double log_survival = 0.0;
      if (st) {
        const double running = sum_before[a] + (log_sigmoid(s) + log1m_eps);
        log_survival = step[a] >= 1 ? running : 0.0;
        sum_after[a] = live && step[a] >= 1 ? running : sum_before[a];
      } else if (step[a] >= 1) {
        log_survival = log_sigmoid(-s) + static_cast<double>(step[a]) * log1m_eps;
      }
      if (live) {
        const double zeta = L + log1mexp(log_survival) - std::max(log_survival, kLogSurvivalFloor);
        row[eos] = static_cast<float>(temperature[a] * std::min(zeta, L + max_gap));
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
