// One decoding step's token selection on float32 CPU rows, for the NMST, ST and VA heads: greedy,
// sampling, top-k, top-p, min-p and their combinations (top-k, then top-p, then min-p), with temperature
// dividing the non-eos logits (every logit for VA). A row takes a few passes over its V logits and no sort of the
// vocabulary; the exponentials are 2^x in float32 lanes, inlined (exp2_nonpositive), summed in float32 blocks
// flushed into float64:
//   1. the max of the non-eos logits (NaN refused), for top-k each block's;
//   2. the sum of exp((z - max) / T), giving L_T and the head's scalars (a = log(1 - alpha_t), the
//      eos log-probability and effective logit zeta_eos) in float64; top-p alone also sums the mass
//      at or above a few floors under the max, which bracket the nucleus's boundary in a band of logits;
//   3. by strategy: greedy, the first column of the max; sampling, one inverse-CDF walk of the same
//      exponentials to the uniform's target (whole blocks passed while the running sum stays short of it);
//      top-k, the entries of the blocks whose max (taken in pass 1) reaches the k-th largest block max, the k best
//      of them selected; top-p, the band's entries collected (compressed vector stores), split by their own sums until
//      few are left, the boundary found among them by a histogram, sorting only the boundary bucket; the draw
//      walks the row above the band or the band's kept tokens.
// Tokens rank by probability, ties to the lower index: non-eos tokens by their logit, eos by zeta_eos.
// Top-k keeps the k best (eos counted), top-p the smallest most-probable prefix whose mass reaches p
// (after top-k: of the top-k set's renormalized mass), min-p the tokens whose probability is at least
// min_p times the most probable one's (of the step distribution, before any renormalization); the draw is the inverse CDF of the kept weights
// at the caller's uniform, as nmst_fast.decoding.host_rows finishes a row.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/DistributionsHelper.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/csrc/Generator.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include "head_row.h"

namespace {

using namespace nmst_fast_cpu;
namespace py = pybind11;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr float kInfF = std::numeric_limits<float>::infinity();

// The non-eos columns of a row: [0, eos) and (eos, V); VA's are the whole row (second span empty).
struct Spans {
  const float* first;
  int64_t first_size;
  const float* second;
  int64_t second_size;
  int64_t second_offset;  // the column of second[0]

  template <typename F>
  void each(F&& f) const {  // f(pointer, size, column of pointer[0])
    f(first, first_size, int64_t{0});
    f(second, second_size, second_offset);
  }
};

// Lanes of a comparison's result (all-ones lanes where true) as a bit mask.
inline uint32_t lane_mask(const Vec& compared) {
  return ~static_cast<uint32_t>(compared.zero_mask()) & ((uint32_t{1} << kWidth) - 1);
}

// The sum of v's lanes in float32 (the portable Vectorized's reduce_add does not build).
inline float lane_sum(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return v.reduce_add();
#else
  float lanes[kWidth];
  v.store(lanes);
  float total = 0.f;
  for (int64_t k = 0; k < kWidth; ++k) {
    total += lanes[k];
  }
  return total;
#endif
}

// The lanes of v in [low, high) as a bit mask (AVX-512: two compares into mask registers).
inline uint32_t lanes_in(const Vec& v, const Vec& low, const Vec& high) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_mask_cmp_ps_mask(_mm512_cmp_ps_mask(v, low, _CMP_GE_OQ), v, high, _CMP_LT_OQ);
#else
  return lane_mask(v >= low) & lane_mask(v < high);
#endif
}

// Calls f(i) for each i in [begin, end) with x[i] in [low, high), in order (NaN never is).
template <typename F>
inline void each_column_in(const float* x, int64_t begin, int64_t end, float low, float high, F&& f) {
  const Vec vlow(low), vhigh(high);
  int64_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    for (uint32_t hits = lanes_in(Vec::loadu(x + i), vlow, vhigh); hits != 0; hits &= hits - 1) {
      f(i + __builtin_ctz(hits));
    }
  }
  for (; i < end; ++i) {
    if (x[i] >= low && x[i] < high) {
      f(i);
    }
  }
}

// acc + (e where v >= floor, else 0) (AVX-512: a compare into a mask register and a masked add).
inline Vec add_where_at_least(const Vec& acc, const Vec& v, const Vec& floor, const Vec& e) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_mask_add_ps(acc, _mm512_cmp_ps_mask(v, floor, _CMP_GE_OQ), acc, e);
#else
  return acc + Vec::blendv(Vec(0.f), e, v >= floor);
#endif
}

// The first column in x[0, n) holding ``value`` (-1: none).
inline int64_t first_column_of(const float* x, int64_t n, float value) {
  const Vec target(value);
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) {
    const uint32_t hits = lane_mask(Vec::loadu(x + i) == target);
    if (hits != 0) {
      return i + __builtin_ctz(hits);
    }
  }
  for (; i < n; ++i) {
    if (x[i] == value) {
      return i;
    }
  }
  return -1;
}

// Thresholds of top-p's candidate sets, in nats under the max of zeta; the last holds every column.
// Steps of 2 nats keep the band that holds the nucleus's boundary at most e^2 times the nucleus's size on
// exponential tails (a flat N(0, 3²) row's 0.9 nucleus ends about 8 nats under its max, a Zipf-peaked one's about
// 9, where a tail's entries multiply fastest); each level costs every vector of the sums' pass a compare and a
// masked add, and 3-nat steps made the Zipf-peaked rows' steps slower (CHANGELOG).
constexpr int kLevels = 10;
constexpr double kLevelGaps[kLevels] = {2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 24.0, kInf};
// A band of top-p's candidates larger than this is split into kSublevels by the sums over its own entries, and
// narrowed to the sublevel that holds the nucleus's boundary, until it is no larger (or no longer splits).
constexpr int64_t kBandRefine = 256;
constexpr int kSublevels = 8;

// The sums of 2^((x - shift) * scale) over the entries of x[0, n) >= each of the ``Levels`` ``floors`` (raw
// logits), each added into ``sums`` (float32 lanes flushed into float64 as span_exp2_sum).
template <int Levels>
inline void span_exp2_level_sums(const float* x, int64_t n, float shift, float scale, const float* floors,
                                 double* sums) {
  const Vec vshift(shift), vscale(scale), zero(0.f);
  Vec vfloor[Levels];
  for (int j = 0; j < Levels; ++j) {
    vfloor[j] = Vec(floors[j]);
  }
  int64_t i = 0;
  while (i + kWidth <= n) {
    Vec acc[Levels];
    for (int j = 0; j < Levels; ++j) {
      acc[j] = zero;
    }
    for (int64_t s = 0; s < kFlushSteps * kUnroll && i + kWidth <= n; ++s, i += kWidth) {
      const Vec v = Vec::loadu(x + i);
      const Vec e = exp2_nonpositive((v - vshift) * vscale);
      for (int j = 0; j < Levels; ++j) {
        acc[j] = add_where_at_least(acc[j], v, vfloor[j], e);
      }
    }
    for (int j = 0; j < Levels; ++j) {
      float lanes[kWidth];
      acc[j].store(lanes);
      for (int64_t k = 0; k < kWidth; ++k) {
        sums[j] += lanes[k];
      }
    }
  }
  for (; i < n; ++i) {
    const double e = std::exp2((x[i] - shift) * scale);
    for (int j = 0; j < Levels; ++j) {
      sums[j] += x[i] >= floors[j] ? e : 0.0;
    }
  }
}

// The inverse-CDF walk of one span: adds 2^((x - shift) * scale) of x[0, n) (with ``Floored``, of its entries >=
// ``floor`` only) to *cumulative until it passes ``target``; returns that column (-1 if it does not), keeping the
// last column of positive weight. Blocks of kStep columns are summed in float32 lanes and passed whole while the
// running sum stays at or below the target; the block that passes it is walked entry by entry in float64.
template <bool Floored>
inline int64_t span_walk(const float* x, int64_t n, float shift, float scale, float floor, double target,
                         double* cumulative, int64_t* last_positive) {
  const Vec vshift(shift), vscale(scale), vfloor(floor), zero(0.f);
  auto weights = [&](int64_t at) {
    const Vec v = Vec::loadu(x + at);
    const Vec e = exp2_nonpositive((v - vshift) * vscale);
    if constexpr (Floored) {
      return add_where_at_least(zero, v, vfloor, e);
    }
    return e;
  };
  int64_t i = 0, last_block = -1;  // the last block of positive weight passed whole
  for (; i + kStep <= n; i += kStep) {
    Vec e[kUnroll];
    for (int64_t k = 0; k < kUnroll; ++k) {
      e[k] = weights(i + k * kWidth);
    }
    const double block = lane_sum((e[0] + e[1]) + (e[2] + e[3]));
    if (!(*cumulative + block > target)) {
      *cumulative += block;
      last_block = block > 0.0 ? i : last_block;
      continue;
    }
    float lanes[kStep];
    for (int64_t k = 0; k < kUnroll; ++k) {
      e[k].store(lanes + k * kWidth);
    }
    for (int64_t k = 0; k < kStep; ++k) {
      if (lanes[k] > 0.f) {
        *cumulative += lanes[k];
        *last_positive = i + k;
        if (*cumulative > target) {
          return i + k;
        }
      }
    }
    last_block = -1;  // its last positive column is recorded
  }
  if (last_block >= 0) {  // the last positive column of the last block passed whole
    float lanes[kStep];
    for (int64_t k = 0; k < kUnroll; ++k) {
      weights(last_block + k * kWidth).store(lanes + k * kWidth);
    }
    for (int64_t k = kStep - 1; k >= 0; --k) {
      if (lanes[k] > 0.f) {
        *last_positive = std::max(*last_positive, last_block + k);
        break;
      }
    }
  }
  for (; i < n; ++i) {
    const double e = Floored && !(x[i] >= floor) ? 0.0 : std::exp2((x[i] - shift) * scale);
    if (e > 0.0) {
      *cumulative += e;
      *last_positive = i;
      if (*cumulative > target) {
        return i;
      }
    }
  }
  return -1;
}

// The inverse-CDF walk over the spans (see span_walk): the column where the running sum passes ``target``, else
// the last column of positive weight.
template <bool Floored>
int64_t spans_walk(const Spans& spans, float shift, float scale, float floor, double target) {
  double running = 0.0;
  int64_t last_positive = -1, column = -1;
  spans.each([&](const float* x, int64_t n, int64_t offset) {
    if (column >= 0) {
      return;
    }
    int64_t last = -1;
    const int64_t at = span_walk<Floored>(x, n, shift, scale, floor, target, &running, &last);
    if (last >= 0) {
      last_positive = offset + last;
    }
    if (at >= 0) {
      column = offset + at;
    }
  });
  return column >= 0 ? column : last_positive;
}

// A ranked candidate: its zeta (logit / T; zeta_eos for eos), its column, its probability.
struct Candidate {
  double zeta;
  int64_t column;
  double prob;
  int64_t bucket;  // top-p's histogram bucket (nucleus)
};

inline bool ranks_before(const Candidate& a, const Candidate& b) {
  return a.zeta > b.zeta || (a.zeta == b.zeta && a.column < b.column);
}

// Entries per block of top-k's block maxima: a few hundred blocks at the usual vocabularies.
constexpr int64_t kMaxBlock = 256;

// The max of x[0, n) (NaN where any entry is NaN, -inf for n = 0), the max of each block of kMaxBlock entries
// appended to ``maxima`` (the last block may be shorter).
inline float span_block_maxima(const float* x, int64_t n, std::vector<float>* maxima) {
  float best = -kInfF;
  bool nan = false;
  for (int64_t b = 0; b < n; b += kMaxBlock) {
    const float m = span_max(x + b, std::min(kMaxBlock, n - b));
    nan |= std::isnan(m);
    best = std::max(best, m);
    maxima->push_back(m);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : best;
}

// The k best (logit, column) of the spans, ties to the lower column, in ``pairs`` (unordered), from the spans'
// block maxima (``maxima``: span_block_maxima's, the first span's blocks first). The k-th largest block max is at
// most the k-th largest logit (k blocks reach it), so only the blocks that reach it are read and their entries at
// or above it collected, those equal to it only while fewer than k are (ties go to the lower column, and columns
// rise along the scan); the k best of those are selected. ``scratch``: a buffer.
void top_columns(const Spans& spans, int64_t k, const std::vector<float>& maxima, std::vector<float>* scratch,
                 std::vector<std::pair<float, int64_t>>* pairs) {
  float floor = -kInfF;  // k blocks or fewer: every entry may be among the k best
  if (static_cast<int64_t>(maxima.size()) > k) {
    scratch->assign(maxima.begin(), maxima.end());
    std::nth_element(scratch->begin(), scratch->begin() + (k - 1), scratch->end(), std::greater<float>());
    floor = (*scratch)[k - 1];
  }
  pairs->clear();
  int64_t ties = 0;  // entries equal to the floor collected
  size_t block = 0;
  spans.each([&](const float* x, int64_t n, int64_t offset) {
    auto offer = [&](int64_t at) {
      if (x[at] > floor || ties++ < k) {
        pairs->emplace_back(x[at], offset + at);
      }
    };
    for (int64_t b0 = 0; b0 < n; b0 += kMaxBlock, ++block) {
      if (maxima[block] >= floor) {  // the row's entries are finite (select_row checks its max)
        each_column_in(x, b0, std::min(n, b0 + kMaxBlock), floor, kInfF, offer);
      }
    }
  });
  if (static_cast<int64_t>(pairs->size()) > k) {
    std::nth_element(pairs->begin(), pairs->begin() + (k - 1), pairs->end(),
                     [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
                       return a.first > b.first || (a.first == b.first && a.second < b.second);
                     });
    pairs->resize(k);
  }
}

// The columns of the spans whose logit is at least ``low``, appended as (logit, column).
void columns_at_least(const Spans& spans, float low, std::vector<std::pair<float, int64_t>>* out) {
  out->clear();
  spans.each([&](const float* x, int64_t n, int64_t offset) {
    each_column_in(x, 0, n, low, kInfF, [&](int64_t at) { out->emplace_back(x[at], offset + at); });
  });
}

// Top-p's band: the logits and columns of the spans' entries in [low, high), ``size`` of them (the buffers keep
// their largest size between rows: a full vector store may write past ``size``).
struct Band {
  std::vector<float> x;
  std::vector<int32_t> column;
  int64_t size = 0;

  void collect(const Spans& spans, int64_t V, float low, float high) {
    if (static_cast<int64_t>(x.size()) < V + kWidth) {
      x.resize(static_cast<size_t>(V + kWidth));
      column.resize(static_cast<size_t>(V + kWidth));
    }
    size = 0;
    spans.each([&](const float* row, int64_t n, int64_t offset) {
      size = collect_span(row, n, offset, low, high, x.data(), column.data(), size);
    });
  }

  // Appends the entries of row[0, n) in [low, high) at xs[count], columns[count] (columns from ``offset``);
  // returns the new count. Branch-free on AVX-512: each vector's hits compressed in registers and stored whole (a
  // compressing store to memory is slow on some CPUs), whether it has any or not.
  static int64_t collect_span(const float* row, int64_t n, int64_t offset, float low, float high, float* xs,
                              int32_t* columns, int64_t count) {
    int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
    const Vec vlow(low), vhigh(high);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; i + kWidth <= n; i += kWidth) {
      const __m512 v = _mm512_loadu_ps(row + i);
      const __mmask16 hits = _mm512_mask_cmp_ps_mask(_mm512_cmp_ps_mask(v, vlow, _CMP_GE_OQ), v, vhigh, _CMP_LT_OQ);
      const __m512i at = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(offset + i)), lanes);
      _mm512_storeu_ps(xs + count, _mm512_maskz_compress_ps(hits, v));
      _mm512_storeu_si512(columns + count, _mm512_maskz_compress_epi32(hits, at));
      count += __builtin_popcount(hits);
    }
#endif
    each_column_in(row, i, n, low, high, [&](int64_t at) {
      xs[count] = row[at];
      columns[count++] = static_cast<int32_t>(offset + at);
    });
    return count;
  }

  // Keeps the entries in [low, high), in place (a compressed vector's store never passes the entries unread).
  void narrow(float low, float high) {
    const Vec vlow(low), vhigh(high);
    int64_t count = 0, i = 0;
#if defined(CPU_CAPABILITY_AVX512)
    for (; i + kWidth <= size; i += kWidth) {
      const __m512 v = _mm512_loadu_ps(x.data() + i);
      const __m512i at = _mm512_loadu_si512(column.data() + i);
      const __mmask16 hits = _mm512_mask_cmp_ps_mask(_mm512_cmp_ps_mask(v, vlow, _CMP_GE_OQ), v, vhigh, _CMP_LT_OQ);
      _mm512_storeu_ps(x.data() + count, _mm512_maskz_compress_ps(hits, v));
      _mm512_storeu_si512(column.data() + count, _mm512_maskz_compress_epi32(hits, at));
      count += __builtin_popcount(hits);
    }
#endif
    for (; i < size; ++i) {
      if (x[i] >= low && x[i] < high) {
        x[count] = x[i];
        column[count++] = column[i];
      }
    }
    size = count;
  }

  // The entries as candidates, appended: zeta = logit * inverse and probability factor * 2^((logit - shift) *
  // scale), the exponentials in float32 lanes as the level sums that bracket the band (``scratch``: their buffer).
  void candidates(float shift, float scale, double inverse, double factor, std::vector<float>* scratch,
                  std::vector<Candidate>* out) const {
    scratch->resize(static_cast<size_t>((size + kWidth - 1) / kWidth * kWidth));
    const Vec vshift(shift), vscale(scale);
    for (int64_t i = 0; i < size; i += kWidth) {
      exp2_nonpositive((Vec::loadu(x.data() + i) - vshift) * vscale).store(scratch->data() + i);
    }
    for (int64_t i = 0; i < size; ++i) {
      out->push_back({static_cast<double>(x[i]) * inverse, column[i], factor * (*scratch)[i], 0});
    }
  }
};

// Index of the draw among ``weights`` (rank order, positive sum) at uniform u: the first whose
// cumulative sum exceeds u * total (u * total kept one ulp below the total).
int64_t inverse_cdf(const std::vector<double>& cumulative, double u) {
  const double total = cumulative.back();
  const double target = std::min(u * total, std::nextafter(total, 0.0));
  return std::upper_bound(cumulative.begin(), cumulative.end(), target) - cumulative.begin();
}

// Histogram buckets of top-p's boundary search (on zeta between the candidates' lowest and highest).
constexpr int64_t kBuckets = 2048;
// Candidate sets up to this size are sorted whole.
constexpr size_t kSortWhole = 256;

// The kept prefix of the ranked ``candidates`` (modified: reordered) for top-p cut ``cut`` of ``mass``
// (the mass top-p is taken against), after ``before`` of it kept ahead of every candidate: the kept candidates
// in ``kept`` (any order, ties at the boundary by rank); returns false where the candidates' mass does not reach
// the cut (the nucleus goes past them).
bool nucleus(std::vector<Candidate>& candidates, double cut, double mass, std::vector<Candidate>* kept,
             double before = 0.0) {
  kept->clear();
  auto walk = [&](std::vector<Candidate>::iterator begin, std::vector<Candidate>::iterator end, double before) {
    std::sort(begin, end, ranks_before);
    for (auto it = begin; it != end; ++it) {
      if (!kept->empty() && before / mass >= cut) {
        return true;
      }
      kept->push_back(*it);
      before += it->prob;
    }
    return false;
  };
  // Where the walk keeps every candidate, the nucleus ends inside them only if their whole mass reaches the cut.
  auto all_reach_cut = [&] {
    double total = before;
    for (const Candidate& c : candidates) {
      total += c.prob;
    }
    return total / mass >= cut;
  };
  if (candidates.size() <= kSortWhole) {
    return walk(candidates.begin(), candidates.end(), before) || all_reach_cut();
  }
  double top = -kInf, low = kInf;
  for (const Candidate& c : candidates) {
    top = std::max(top, c.zeta);
    if (c.prob > 0.0) {
      low = std::min(low, c.zeta);
    }
  }
  const double width = (top - low) / static_cast<double>(kBuckets);
  auto bucket = [&](double zeta) {  // 0: the top bucket; zero-probability candidates in the last
    if (!(width > 0.0) || !(zeta >= low)) {
      return zeta >= low ? int64_t{0} : kBuckets - 1;
    }
    return std::min<int64_t>(kBuckets - 1, static_cast<int64_t>((top - zeta) / width));
  };
  std::vector<double> bucket_mass(kBuckets, 0.0);
  for (Candidate& c : candidates) {
    c.bucket = bucket(c.zeta);
    bucket_mass[c.bucket] += c.prob;
  }
  // The boundary bucket: the first whose end brings the mass to the cut.
  double running = before;
  int64_t boundary = 0;
  while (boundary < kBuckets - 1 && (running + bucket_mass[boundary]) / mass < cut) {
    running += bucket_mass[boundary++];
  }
  // Candidates above the boundary bucket first (all kept), then the boundary bucket, sorted.
  auto mid = std::partition(candidates.begin(), candidates.end(),
                            [&](const Candidate& c) { return c.bucket < boundary; });
  auto end = std::partition(mid, candidates.end(), [&](const Candidate& c) { return c.bucket == boundary; });
  kept->assign(candidates.begin(), mid);
  return walk(mid, end, running) || all_reach_cut();
}

// A thread's buffers for its rows, kept between calls (a fresh band buffer of V entries was a large allocation,
// zeroed and page-faulted, on every call).
struct Workspace {
  std::vector<std::pair<float, int64_t>> pairs;
  std::vector<Candidate> candidates, kept;
  std::vector<double> cumulative;
  std::vector<float> scratch;
  std::vector<float> maxima;  // top-k's block maxima
  Band band;
};

Workspace& thread_workspace() {
  thread_local Workspace workspace;
  return workspace;
}

struct RowResult {
  int64_t token;
  double log_prob;
  double state;
  bool ok;
};

struct Settings {
  int64_t head;  // 0 NMST, 1 ST, 2 VA
  int64_t eos;
  double log1m_eps;
  double temperature;
  int64_t top_k;  // 0: none; 1: greedy
  double cut;     // top-p's p less the float64 slack; >= 1: none
  double min_p;   // min-p's ratio; <= 0: none
};

RowResult select_row(const float* row, int64_t V, const Settings& cfg, int64_t step, double state_before, double u,
                     Workspace& work) {
  std::vector<std::pair<float, int64_t>>* pairs = &work.pairs;
  std::vector<Candidate>*candidates = &work.candidates, *kept = &work.kept;
  std::vector<double>* cumulative = &work.cumulative;
  std::vector<float>* scratch = &work.scratch;
  Band* band = &work.band;
  const bool special = cfg.head != 2;
  const int64_t eos = cfg.eos;
  const Spans spans = special ? Spans{row, eos, row + eos + 1, V - eos - 1, eos + 1} : Spans{row, V, row, 0, V};
  RowResult out{0, 0.0, state_before, false};
  // 1. The max of the non-eos logits; for top-k, also each block's (top_columns).
  std::vector<float>* maxima = &work.maxima;
  maxima->clear();
  const bool blocks = cfg.top_k > 1;
  const float left = blocks ? span_block_maxima(spans.first, spans.first_size, maxima)
                            : span_max(spans.first, spans.first_size);
  const float right = blocks ? span_block_maxima(spans.second, spans.second_size, maxima)
                             : span_max(spans.second, spans.second_size);
  const double s = special ? static_cast<double>(row[eos]) : 0.0;
  if (std::isnan(left) || std::isnan(right) || std::isnan(s)) {
    return out;
  }
  const float best = std::max(left, right);
  if (!std::isfinite(best)) {  // +inf, or no finite non-eos logit
    return out;
  }
  // 2. L_T and the head's scalars.
  const double inverse = 1.0 / cfg.temperature;
  const float scale = static_cast<float>(kLog2E * inverse);
  const bool top_p_alone = cfg.top_k == 0 && cfg.cut < 1.0;
  double level_sums[kLevels] = {};
  float floors[kLevels];
  double sum = 0.0;
  if (top_p_alone) {
    for (int j = 0; j < kLevels; ++j) {
      floors[j] = std::isfinite(kLevelGaps[j]) ? static_cast<float>(best - kLevelGaps[j] * cfg.temperature) : -kInfF;
    }
    spans.each([&](const float* x, int64_t n, int64_t) {
      span_exp2_level_sums<kLevels>(x, n, best, scale, floors, level_sums);
    });
    sum = level_sums[kLevels - 1];
  } else {
    spans.each([&](const float* x, int64_t n, int64_t) { sum += span_exp2_sum(x, n, best, scale); });
  }
  const double L = static_cast<double>(best) * inverse + std::log(sum);
  const double a = special ? step_log_survival(cfg.head == 1, s, step, cfg.log1m_eps, state_before, &out.state)
                           : 0.0;  // log(1 - alpha_t)
  const double floored = std::max(a, kLogSurvivalFloor);
  const double log_norm = L - floored;
  const double eos_log_prob = special ? log1mexp(a) : -kInf;
  const double eos_zeta = special ? L + eos_log_prob - floored : -kInf;
  const double top_zeta = static_cast<double>(best) * inverse;
  out.ok = true;
  auto choose = [&](int64_t column, double zeta) {
    out.token = column;
    out.log_prob = special && column == eos ? eos_log_prob : zeta - log_norm;
  };
  // 3. Greedy: the first column of the max against eos.
  if (cfg.top_k == 1) {
    int64_t column = first_column_of(spans.first, spans.first_size, best);
    if (column < 0) {
      column = spans.second_offset + first_column_of(spans.second, spans.second_size, best);
    }
    if (special && (eos_zeta > top_zeta || (eos_zeta == top_zeta && eos < column))) {
      choose(eos, eos_zeta);
    } else {
      choose(column, top_zeta);
    }
    return out;
  }
  // Sampling: eos with probability 1 - e^a, else the inverse-CDF walk of the non-eos exponentials.
  const bool min_p = cfg.min_p > 0.0;
  if (cfg.top_k == 0 && !(cfg.cut < 1.0) && !min_p) {
    const double survival = special ? std::exp(a) : 1.0;
    if (special && !(u < survival)) {
      choose(eos, eos_zeta);
      return out;
    }
    const double target = std::min(u / survival * sum, std::nextafter(sum, 0.0));
    const int64_t column = spans_walk<false>(spans, best, scale, -kInfF, target);
    choose(column, static_cast<double>(row[column]) * inverse);
    return out;
  }
  // Candidates: the top k (then eos merged in by rank and the list cut to k), or top-p's set above a floor.
  candidates->clear();
  auto add_eos = [&] {
    if (special) {
      candidates->push_back({eos_zeta, eos, std::exp(eos_log_prob), 0});
    }
  };
  auto add_pairs = [&] {
    for (const auto& [logit, column] : *pairs) {
      const double zeta = static_cast<double>(logit) * inverse;
      candidates->push_back({zeta, column, std::exp(zeta - log_norm), 0});
    }
  };
  // Min-p's floor: a probability of min_p times the most probable token's (eos or the best other one).
  const double min_prob = min_p ? cfg.min_p * std::max(std::exp(top_zeta - log_norm), special ? std::exp(eos_log_prob)
                                                                                              : 0.0)
                                : 0.0;
  auto below_min_p = [&](const Candidate& c) { return c.prob < min_prob; };
  double mass = 1.0;  // what top-p's p is a share of
  if (cfg.top_k > 1) {
    top_columns(spans, cfg.top_k, *maxima, scratch, pairs);
    add_pairs();
    add_eos();
    std::sort(candidates->begin(), candidates->end(), ranks_before);
    if (static_cast<int64_t>(candidates->size()) > cfg.top_k) {
      candidates->resize(cfg.top_k);
    }
    mass = 0.0;
    for (const Candidate& c : *candidates) {
      mass += c.prob;
    }
    if (!(cfg.cut < 1.0)) {
      kept->assign(candidates->begin(), candidates->end());
    } else {
      nucleus(*candidates, cfg.cut, mass, kept);
    }
    kept->erase(std::remove_if(kept->begin(), kept->end(), below_min_p), kept->end());
  } else if (min_p) {
    // Min-p's set, then top-p's nucleus inside it where the set's mass reaches the cut (both are prefixes of the
    // ranking: the shorter one is kept). The set is collected above a floor on the logits a little under the
    // exact one (float32 rounding), then cut by the probabilities themselves.
    const double zeta_floor = std::log(min_prob) + log_norm;
    const double logit_floor = zeta_floor * cfg.temperature;
    columns_at_least(
        spans, std::nextafter(static_cast<float>(logit_floor - 1e-6 * (1.0 + std::abs(logit_floor))), -kInfF), pairs);
    candidates->clear();
    add_pairs();
    add_eos();
    candidates->erase(std::remove_if(candidates->begin(), candidates->end(), below_min_p), candidates->end());
    double total = 0.0;
    for (const Candidate& c : *candidates) {
      total += c.prob;
    }
    if (cfg.cut < 1.0 && total >= cfg.cut) {
      nucleus(*candidates, cfg.cut, 1.0, kept);
    } else {
      kept->assign(candidates->begin(), candidates->end());
    }
  } else {
    // Top-p alone. The level sums bracket the nucleus's boundary: every token at or above ``high`` is kept (their
    // mass is surely short of the cut), none under ``low`` (the mass at or above it surely reaches the cut). Only
    // the band [low, high) is collected and ranked (nucleus(), after the mass above it); the draw walks either the
    // row's columns at or above ``high`` or the band's kept tokens.
    const double survival = special ? std::exp(a) : 1.0;
    const double eos_prob = special ? std::exp(eos_log_prob) : 0.0;
    auto eos_at_or_above = [&](float at) { return special && eos_zeta >= static_cast<double>(at) * inverse; };
    auto mass_at = [&](float at, double level_sum) {  // the step's mass at or above the floor ``at``
      return survival * level_sum / sum + (eos_at_or_above(at) ? eos_prob : 0.0);
    };
    constexpr double kMargin = 1e-4;  // room for the float32 sums' rounding
    int level = 0;
    while (level < kLevels - 1 && mass_at(floors[level], level_sums[level]) < cfg.cut + kMargin) {
      ++level;
    }
    float low = floors[level], high = kInfF;
    double high_sum = 0.0;
    for (int j = level - 1; j >= 0; --j) {
      if (mass_at(floors[j], level_sums[j]) <= cfg.cut - kMargin) {
        high = floors[j];
        high_sum = level_sums[j];
        break;
      }
    }
    double above = std::isfinite(high) ? mass_at(high, high_sum) : 0.0;
    for (;;) {
      band->collect(spans, V, low, high);
      // A large band is split by its own entries' sums: the sublevel holding the boundary is kept, the mass above
      // it joins ``above``.
      while (band->size > kBandRefine && std::isfinite(high)) {
        float sub_floors[kSublevels];
        double sub_sums[kSublevels] = {};
        for (int j = 0; j < kSublevels; ++j) {
          sub_floors[j] = static_cast<float>(high - (static_cast<double>(high) - low) * (j + 1) / kSublevels);
        }
        sub_floors[kSublevels - 1] = low;
        span_exp2_level_sums<kSublevels>(band->x.data(), band->size, best, scale, sub_floors, sub_sums);
        const float old_low = low, old_high = high;
        double next_above = above;
        for (int j = 0; j < kSublevels; ++j) {
          const bool eos_here = eos_at_or_above(sub_floors[j]) && !eos_at_or_above(old_high);
          const double m = above + survival * sub_sums[j] / sum + (eos_here ? eos_prob : 0.0);
          if (m >= cfg.cut + kMargin) {
            low = sub_floors[j];
            break;
          }
          if (m <= cfg.cut - kMargin) {
            high = sub_floors[j];
            next_above = m;
          }
        }
        if (low == old_low && high == old_high) {
          break;  // the boundary sits within the sums' rounding of a sublevel floor: the band as it is
        }
        above = next_above;
        band->narrow(low, high);
      }
      candidates->clear();
      band->candidates(best, scale, inverse, survival / sum, scratch, candidates);
      if (eos_at_or_above(low) && !eos_at_or_above(high)) {
        add_eos();
      }
      if (nucleus(*candidates, cfg.cut, 1.0, kept, above) || level == kLevels - 1) {
        break;
      }
      // Rounding past the margin (the band's mass short of the cut): every token from the next level's floor up.
      high = kInfF;
      above = 0.0;
      low = floors[++level];
    }
    double kept_mass = 0.0;  // the band's kept tokens' probability
    for (const Candidate& c : *kept) {
      kept_mass += c.prob;
    }
    const double total = above + kept_mass;
    double target = std::min(u * total, std::nextafter(total, 0.0));
    if (target < above) {  // a token at or above ``high``: eos (when there) first, then the columns in order
      if (eos_at_or_above(high)) {
        if (target < eos_prob || !(survival > 0.0)) {
          choose(eos, eos_zeta);
          return out;
        }
        target -= eos_prob;
      }
      const int64_t column = spans_walk<true>(spans, best, scale, high, target / survival * sum);
      choose(column, static_cast<double>(row[column]) * inverse);
      return out;
    }
    u = (target - above) / kept_mass;  // the draw among the band's kept tokens
  }
  cumulative->clear();
  double total = 0.0;
  for (const Candidate& c : *kept) {
    total += c.prob;
    cumulative->push_back(total);
  }
  const Candidate& drawn = (*kept)[inverse_cdf(*cumulative, u)];
  choose(drawn.column, drawn.zeta);
  return out;
}

// tokens (B,) int64, log p (B,) float64 of each under the untruncated step distribution, ST's state after the step
// (B,) float64 (undefined for NMST and VA), and the first row without a distribution (-1: none). ``logits`` (B, V)
// float32 on the CPU with unit column stride; ``steps`` (B,) int64 t per row, or absent: ``step`` for every row
// (t <= 0: context); ``state`` ST's running log(1 - alpha) before the step (B,) float64 or absent (0); one uniform in
// [0, 1) per row from ``generator`` (a CPU generator; absent: torch's default one), as torch.rand(B,
// dtype=float64) draws them, none for greedy. The outputs are allocated by at::detail::empty_cpu, not through the
// dispatcher: a decoding step's call comes after a forward pass has evicted the caches, where each dispatched call
// costs microseconds.
std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t> select_rows(
    const at::Tensor& logits, int64_t head, int64_t eos, double eps, double temperature,
    const std::optional<at::Tensor>& steps, int64_t step, const std::optional<at::Tensor>& state, int64_t top_k,
    double cut, double min_p, std::optional<at::Generator> generator) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.stride(1) == 1,
              "select_rows: logits must be a (B, V) float32 CPU tensor with unit column stride");
  const int64_t B = logits.size(0), V = logits.size(1), row_stride = logits.stride(0);
  TORCH_CHECK(0 <= head && head <= 2, "select_rows: head must be 0 (NMST), 1 (ST) or 2 (VA)");
  TORCH_CHECK(0 <= eos && eos < V && V >= 2, "select_rows: eos must be a column of logits");
  TORCH_CHECK(temperature > 0.0 && top_k >= 0 && min_p <= 1.0, "select_rows: temperature > 0, top_k >= 0, min_p <= 1");
  auto check_vector = [B](const at::Tensor& t, at::ScalarType dtype, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 1 && t.size(0) == B &&
                    t.is_contiguous(),
                "select_rows: ", name, " must be a contiguous (B,) CPU tensor of the documented dtype");
  };
  const int64_t* row_steps = nullptr;
  if (steps.has_value()) {
    check_vector(*steps, at::kLong, "steps");
    row_steps = steps->data_ptr<int64_t>();
  }
  const double* state_before = nullptr;
  if (state.has_value()) {
    check_vector(*state, at::kDouble, "state");
    state_before = state->data_ptr<double>();
  }
  at::Tensor tokens = at::detail::empty_cpu({B}, at::kLong, false);
  at::Tensor log_probs = at::detail::empty_cpu({B}, at::kDouble, false);
  at::Tensor states = head == 1 ? at::Tensor(at::detail::empty_cpu({B}, at::kDouble, false)) : at::Tensor();
  const Settings cfg{head, eos, std::log1p(-eps), temperature, top_k, cut, min_p};
  const float* base = logits.data_ptr<float>();
  std::vector<double> u(static_cast<size_t>(B), 0.0);
  if (top_k != 1) {
    auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(generator, at::detail::getDefaultCPUGenerator());
    std::lock_guard<std::mutex> lock(gen->mutex_);
    at::uniform_real_distribution<double> uniform(0.0, 1.0);
    for (double& draw : u) {
      draw = uniform(gen);
    }
  }
  int64_t* token = tokens.data_ptr<int64_t>();
  double* log_prob = log_probs.data_ptr<double>();
  double* state_after = head == 1 ? states.data_ptr<double>() : nullptr;
  std::vector<char> ok(static_cast<size_t>(B), 1);
  auto rows = [&](int64_t begin, int64_t end) {
    Workspace& work = thread_workspace();
    for (int64_t b = begin; b < end; ++b) {
      const RowResult r = select_row(base + b * row_stride, V, cfg, row_steps ? row_steps[b] : step,
                                     state_before ? state_before[b] : 0.0, u[b], work);
      ok[b] = r.ok;
      token[b] = r.ok ? r.token : 0;
      log_prob[b] = r.ok ? r.log_prob : std::numeric_limits<double>::quiet_NaN();
      if (head == 1) {
        state_after[b] = r.state;
      }
    }
  };
  // Rows in parallel where the batch holds several: each row is sequential work of a few passes.
  if (B * V >= (int64_t{1} << 18) && B > 1) {
    at::parallel_for(0, B, 1, rows);
  } else {
    rows(0, B);
  }
  int64_t first_bad = -1;
  for (int64_t b = 0; b < B; ++b) {
    if (!ok[b]) {
      first_bad = b;
      break;
    }
  }
  return {tokens, log_probs, states, first_bad};
}

// select_rows for Python callers (pybind11; a torch op's call through the dispatcher cost ~20 us where the caches
// were cold, this one ~5 us). ``logits`` any object: None where it is not a 2-D CPU tensor of float32, bfloat16 or
// float16 with ``vocab`` columns, ST's ``state`` (ignored for NMST and VA) is neither None nor a contiguous (B,)
// float64 CPU tensor of values <= 0, or ``generator`` is neither None nor a torch.Generator (the caller's checks then
// name the argument); bfloat16, float16 and strided rows are read as contiguous float32. A generator on another
// device is refused with a ValueError naming it. Returns (tokens, log p, ST's state after the step or None, the
// first row without a distribution or -1), as select_rows.
py::object select_rows_py(const py::handle& logits_obj, int64_t vocab, int64_t head, int64_t eos, double eps,
                          double temperature, std::optional<at::Tensor> steps, int64_t step,
                          const py::handle& state_obj, int64_t top_k, double cut, double min_p,
                          const py::handle& generator_obj) {
  if (!THPVariable_Check(logits_obj.ptr())) {
    return py::none();
  }
  at::Tensor logits = THPVariable_Unpack(logits_obj.ptr());
  const auto dtype = logits.scalar_type();
  if (!logits.device().is_cpu() || logits.dim() != 2 || logits.size(1) != vocab ||
      !(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf)) {
    return py::none();
  }
  std::optional<at::Tensor> state;
  if (head == 1 && !state_obj.is_none()) {  // NMST and VA have no state
    if (!THPVariable_Check(state_obj.ptr())) {
      return py::none();
    }
    state = THPVariable_Unpack(state_obj.ptr());
    if (!state->device().is_cpu() || state->scalar_type() != at::kDouble || state->dim() != 1 ||
        state->size(0) != logits.size(0) || !state->is_contiguous()) {
      return py::none();
    }
    const double* before = state->const_data_ptr<double>();
    for (int64_t b = 0; b < state->size(0); ++b) {
      if (!(before[b] <= 0.0)) {  // NaN or positive: not a log(1 - alpha)
        return py::none();
      }
    }
  }
  std::optional<at::Generator> generator;
  if (!generator_obj.is_none()) {
    if (!THPGenerator_Check(generator_obj.ptr())) {
      return py::none();
    }
    generator = reinterpret_cast<THPGenerator*>(generator_obj.ptr())->cdata;
    if (!generator->device().is_cpu()) {
      throw py::value_error("generator must be a CPU generator for CPU logits, got one on " +
                            generator->device().str());
    }
  }
  std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t> out;
  {
    py::gil_scoped_release no_gil;
    if (dtype != at::kFloat || logits.stride(1) != 1) {
      logits = logits.to(at::kFloat).contiguous();
    }
    out = select_rows(logits, head, eos, eps, temperature, steps, step, state, top_k, cut, min_p, generator);
  }
  const at::Tensor& states = std::get<2>(out);
  return py::make_tuple(std::get<0>(out), std::get<1>(out), states.defined() ? py::cast(states) : py::none(),
                        std::get<3>(out));
}

}  // namespace

namespace nmst_fast_cpu {

bool draw_row(const float* row, int64_t V, int64_t head, int64_t eos, double log1m_eps, double temperature,
              int64_t top_k, double cut, double min_p, int64_t step, double state_before, double u, int64_t* token,
              double* state_after) {
  const Settings cfg{head, eos, log1m_eps, temperature, top_k, cut, min_p};
  const RowResult r = select_row(row, V, cfg, step, state_before, u, thread_workspace());
  *token = r.token;
  *state_after = r.state;
  return r.ok;
}

}  // namespace nmst_fast_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("select_rows", &select_rows_py,
        "One decoding step's token per row: (tokens, log p, ST's state or None, first row without a distribution or "
        "-1), or None where the logits or the generator are not ones it serves",
        py::arg("logits"), py::arg("vocab"), py::arg("head"), py::arg("eos"), py::arg("eps"), py::arg("temperature"),
        py::arg("steps"), py::arg("step"), py::arg("state"), py::arg("top_k"), py::arg("cut"), py::arg("min_p"),
        py::arg("generator"));
}
