// The row math shared by the torch ops (row_lse.cpp) and the llama.cpp sampler (llama_sampler.cpp):
// the tempered logsumexp of a float32 row over every column but one, in two passes over the row (its
// max, then the sum of exp2((z - max) * log2(e) / T)), nothing written; and the NMST / ST head's eos
// entry from it, the per-row scalars of nmst_fast.decoding.eos_column.host_eos_value in the same
// float64 order.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace nmst_fast_cpu {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kWidth = Vec::size();
constexpr int64_t kUnroll = 4;
constexpr int64_t kStep = kWidth * kUnroll;
// The float32 partial sums are added into a double every this many vector steps: each lane then
// holds at most 16 terms of at most 1, so its rounding stays near one float32 ulp of the total.
constexpr int64_t kFlushSteps = 16;
constexpr double kLog2E = 1.4426950408889634;

// max of x[0, n), NaN if any entry is NaN.
inline float span_max(const float* x, int64_t n) {
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

// 2^x of float32 lanes x <= 0, inlined (Sleef's exp2 is a call, around which a pass spills every accumulator it
// holds): 2^n * p(f) with n = round(x), f = x - n in [-1/2, 1/2] and p the degree-6 polynomial of Cephes' exp2f
// (relative error below 2e-7); 0 below -126 (-inf included).
inline Vec exp2_nonpositive(const Vec& x) {
  const Vec n = x.round();
  const Vec f = x - n;
  Vec p(1.535336188319500e-4f);
  p = at::vec::fmadd(p, f, Vec(1.339887440266574e-3f));
  p = at::vec::fmadd(p, f, Vec(9.618437357674640e-3f));
  p = at::vec::fmadd(p, f, Vec(5.550332471162809e-2f));
  p = at::vec::fmadd(p, f, Vec(2.402264791363012e-1f));
  p = at::vec::fmadd(p, f, Vec(6.931472028550421e-1f));
  p = at::vec::fmadd(p, f, Vec(1.f));
  // 2^n as the float whose exponent field is n + 127 (1..127 here)
  const Vec two_n = at::vec::cast<float>(at::vec::convert_to_int_of_same_size((n + Vec(127.f)) * Vec(8388608.f)));
  return Vec::blendv(Vec(0.f), p * two_n, x >= Vec(-126.f));
}

// sum of 2^((x - shift) * scale) over x[0, n), accumulated in double every kFlushSteps vector steps.
inline double span_exp2_sum(const float* x, int64_t n, float shift, float scale) {
  const Vec vshift(shift), vscale(scale);
  double total = 0.0;
  int64_t i = 0;
  while (i + kStep <= n) {
    Vec acc[kUnroll] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
    for (int64_t s = 0; s < kFlushSteps && i + kStep <= n; ++s, i += kStep) {
      for (int64_t k = 0; k < kUnroll; ++k) {
        acc[k] = acc[k] + exp2_nonpositive((Vec::loadu(x + i + k * kWidth) - vshift) * vscale);
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
inline double row_lse(const float* row, int64_t V, int64_t skip, double t_inv) {
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

inline double log_sigmoid(double x) { return std::min(x, 0.0) - std::log1p(std::exp(-std::abs(x))); }

inline double log1mexp(double a) {
  if (a == 0.0) {
    return -std::numeric_limits<double>::infinity();
  }
  return a > -std::log(2.0) ? std::log(-std::expm1(a)) : std::log1p(-std::exp(a));
}

// Below this a = log(1 - alpha) is 1 - alpha = 0 in float64 (nmst_fast.decoding.distribution.LOG_SURVIVAL_FLOOR).
constexpr double kLogSurvivalFloor = -1e300;

// a = log(1 - alpha_t) of the NMST (``st`` false) or ST head at step ``step`` (t <= 0: context, a = 0) from the
// eos logit s: NMST's logsigma(-s) + t * log1p(-eps), or ST's running sum before the step plus logsigma(s) +
// log1p(-eps). ``*sum_after``: ST's running sum after the step (``sum_before`` at context steps; NMST: untouched).
inline double step_log_survival(bool st, double s, int64_t step, double log1m_eps, double sum_before,
                                double* sum_after) {
  if (st) {
    const double running = sum_before + (log_sigmoid(s) + log1m_eps);
    *sum_after = step >= 1 ? running : sum_before;
    return step >= 1 ? running : 0.0;
  }
  return step >= 1 ? log_sigmoid(-s) + static_cast<double>(step) * log1m_eps : 0.0;
}

// The eos entry of one head row at step ``step`` (t <= 0: context) with temperature ``temperature``,
// from L = log sum_{v != eos} exp(z_v / T) and the row's eos logit s: returns whether the row has a
// distribution (L finite, s neither NaN nor -inf); if so ``*eos_value`` = T * min(zeta_eos, L +
// max_gap), zeta_eos the head's effective eos logit. ST (``st``): ``sum_before`` is the running sum
// before the step, ``*sum_after`` after it (unchanged for a row without a distribution or t <= 0).
inline bool head_eos_value(double L, double s, int64_t step, double temperature, bool st, double sum_before,
                           double log1m_eps, double max_gap, double* eos_value, double* sum_after) {
  const bool live = std::abs(L) < std::numeric_limits<double>::infinity() &&
                    s > -std::numeric_limits<double>::infinity();  // false for NaN too
  double running = sum_before;
  const double log_survival = step_log_survival(st, s, step, log1m_eps, sum_before, &running);
  *sum_after = live ? running : sum_before;
  if (live) {
    const double zeta = L + log1mexp(log_survival) - std::max(log_survival, kLogSurvivalFloor);
    *eos_value = temperature * std::min(zeta, L + max_gap);
  }
  return live;
}

// One decoding step's token of one float32 row of width V (select_rows.cpp's select_row, whose settings these are:
// head 0 NMST / 1 ST / 2 VA, top_k 0 none / 1 greedy, cut top-p's p less its slack (>= 1: none), min_p <= 0: none)
// at the uniform u in [0, 1): returns whether the row has a distribution; *token the draw, *state_after ST's running
// sum after the step.
bool draw_row(const float* row, int64_t V, int64_t head, int64_t eos, double log1m_eps, double temperature,
              int64_t top_k, double cut, double min_p, int64_t step, double state_before, double u, int64_t* token,
              double* state_after);

}  // namespace nmst_fast_cpu
