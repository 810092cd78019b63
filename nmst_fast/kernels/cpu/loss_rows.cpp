// The fused loss's row pass on CPU (nmst_fast.row_ops.CpuRowOps): one chunk of logits stored vocabulary-major,
// z (V, R) with unit stride along its R rows (the chunk's tokens) and any stride between vocabulary entries, as
// the chunk's GEMM W·hᵀ writes it. float32, bfloat16, float16 or float64; float64 computes in float64, the others
// in float32 (a bfloat16 / float16 value is read once into float32 and the gradient rounded once on its way out).
//
// Vocabulary-major, a chunk's rows are contiguous lanes: every vector instruction serves 8-32 tokens at one
// vocabulary entry. Each thread takes a stretch of the vocabulary entries and walks their rows whole (one stream
// of memory per thread, prefetched a few rows ahead), its tokens' running statistics in arrays that stay in L1;
// the threads' partial statistics merge in float64.
//
//   chunk_lse(z, eos, softcap) -> (L, m):  (R,) float64 L = log sum_{v != eos} exp(y[v, r]) and (R,) float64 m =
//     the max of those y, y = z, or c·tanh(z / c) with a softcap c > 0 (0: none); both NaN on a row where any z
//     (before the cap) is NaN or infinite: the fused loss's data check. One read of the chunk: each block of up to
//     256 vocabulary entries (kBlockBytes) is read twice while it sits in cache (its max, then the sum of
//     exp(y - block max)), and the blocks merge in float64.
//   chunk_grad_(z, shift, scale, eos, targets, values, softcap):  in place, z[v, r] <- scale[r]·exp(y[v, r] -
//     shift[r]) · (sech²(z / c) with a softcap) for every v != eos, rounded once to z's dtype; then z[eos, r] <- 0
//     (eos >= 0) and z[targets[r], r] <- values[r] where targets[r] >= 0. shift is taken as the nearest value of
//     the compute type and scale corrected for that rounding, so shift may be L itself. With ``entry_max`` (V,)
//     and ``block_sums`` (ceil(V / block), R), both float32: entry_max[v] <- max over r of |z[v, r]| and
//     block_sums[b, r] <- the sum of z[v, r] over the b-th ``block`` entries, as first written (before the eos and
//     target entries): what the gradient filter (nmst_fast.fused) reads to skip the vocabulary blocks whose
//     products add little, and to add back their block means.
//   chunk_statistics(z, eos, softcap, shift) -> (R, 5) float64:  per row, over y[v] for v != eos: sum exp(y - shift)·y,
//     sum exp(2·(y - shift)), sum y, max y and its first v (the entropy's, log sum p²'s and the mean's sums and the
//     most probable token, nmst_fast.head_math.row_statistics; shift is the row's L). One read of the chunk.
//   accumulate_(acc, src, first):  acc <- src or acc + src for a float32 acc and a bfloat16 / float16 src (a dW
//     block's product), in one pass.
//   block_row_sums(w, block) -> (ceil(V / block), H) float32:  the sum of each ``block`` consecutive rows of a
//     contiguous (V, H) float32 / bfloat16 / float16 w, in float32, in one read of w (the gradient filter's block
//     means; torch's sum over the middle dimension of a (blocks, block, H) bf16 view first copies w to float32, and
//     at 50257 x 768 took 87 ms against this kernel's few).
//   transpose_rows(w) -> out:  (H, V) = wᵀ for a contiguous (V, H) bfloat16 / float16 w, by 16 x 16 blocks (AVX2
//     unpacks where built for AVX2 or AVX-512) within stretches of 64 vocabulary rows, into memory advised to use huge
//     pages: at Gemma's 256000 x 2304, torch's copy of the transposed view by blocks of 128 rows took 0.69 s, this 0.47
//     s (of which ~0.1 s is the fresh memory's zeroing by the kernel: 4 KiB pages' faults took 0.17 s).
//   scale_cast(src, scale, dtype) -> out:  a gradient (a float32 accumulator, or a bf16 dW of one GEMM) times scale
//     in float32, rounded once to dtype (bfloat16 or float16), in one pass. torch's mul into an output of another dtype computes into a
//     float32 temporary first and casts it in a second pass: at Gemma's 256000 × 2304 weight, 6× slower.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using at::vec::Vectorized;

// How compute values (float, or double for double storage) are read from and written to storage T, kStep lanes
// at a time as two vectors a, b; ``n`` < kStep lanes at the end of a row (the rest read as 0, not
// written).
template <typename T>
struct Lanes {
  using C = float;
  using V = Vectorized<float>;
  static constexpr int64_t kStep = Vectorized<T>::size();  // two float vectors
  static void load(const T* p, int64_t n, V& a, V& b) {
    const auto x = n == kStep ? Vectorized<T>::loadu(p) : Vectorized<T>::loadu(p, static_cast<int16_t>(n));
    std::tie(a, b) = at::vec::convert_to_float<T>(x);
  }
  static void store(T* p, V a, V b, int64_t n) { at::vec::convert_from_float<T>(a, b).store(p, static_cast<int>(n)); }
  static V exp(V x) { return x.exp_u20(); }  // within bfloat16 / float16's rounding of the result
};

template <typename T, typename Vec>
struct WideLanes {  // float and double: two vectors of their own type
  using C = T;
  using V = Vec;
  static constexpr int64_t kStep = 2 * V::size();
  static void load(const T* p, int64_t n, V& a, V& b) {
    constexpr int64_t W = V::size();
    a = n >= W ? V::loadu(p) : V::loadu(p, n);
    b = n == kStep ? V::loadu(p + W) : V::loadu(p + W, std::max<int64_t>(n - W, 0));
  }
  static void store(T* p, V a, V b, int64_t n) {
    constexpr int64_t W = V::size();
    a.store(p, static_cast<int>(std::min(n, W)));
    if (n > W) {
      b.store(p + W, static_cast<int>(n - W));
    }
  }
  static V exp(V x) { return x.exp(); }
};

template <>
struct Lanes<float> : WideLanes<float, Vectorized<float>> {};
template <>
struct Lanes<double> : WideLanes<double, Vectorized<double>> {};

// y = c·tanh(x / c) and, if wanted, sech²(x / c), from e = exp(-2|x / c|): tanh|u| = (1 - e) / (1 + e) and
// sech² u = 4e / (1 + e)², accurate at any |u| (1 - tanh² would round to 0 where tanh rounds to 1).
template <typename L>
inline typename L::V capped(typename L::V x, typename L::C cap, typename L::C inv_cap, typename L::V* sech2) {
  using V = typename L::V;
  const V one(1), u = x * V(inv_cap);
  const V e = L::exp(V(-2) * u.abs());
  const V denom = one + e;
  const V t = (one - e) / denom;
  if (sech2 != nullptr) {
    *sech2 = V(4) * e / (denom * denom);
  }
  return V(cap) * V::blendv(t, V(0) - t, u < V(0));
}

// Threads split the chunk's vocabulary entries: each walks whole rows (its R lanes contiguous), so every thread
// streams its own stretch of memory, and software prefetches kAhead entries ahead keep that stream in flight. (Split
// by columns instead, each thread read half of every row and skipped the other half: the in-place gradient pass ran
// at half the rate of torch's exp_ on the same memory.)
constexpr int64_t kAhead = 2;
constexpr int64_t kBlockBytes = int64_t{512} << 10;  // a block of chunk_lse's entries stays in L2 between its two reads
constexpr int64_t kTaskEntries = int64_t{1} << 15;   // at least this many of the chunk's values per task

// f(v0, v1, part) over [0, V_) in parallel: the stretches' bounds multiples of ``unit`` (but the last), ``part`` the
// stretch's index in [0, parts) and the stretches in order of part; returns parts, the most f may be called with.
template <typename F>
inline int64_t parallel_entries(int64_t V_, int64_t R, int64_t unit, const F& f) {
  const int64_t units = (V_ + unit - 1) / unit;
  const int64_t grain = std::max<int64_t>(1, kTaskEntries / std::max<int64_t>(unit * R, 1));
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (units + grain - 1) / grain));
  const int64_t per_part = (units + parts - 1) / parts;
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t v0 = std::min(V_, p * per_part * unit), v1 = std::min(V_, (p + 1) * per_part * unit);
      if (v0 < v1) {
        f(v0, v1, p);
      }
    }
  });
  return parts;
}

// Vocabulary entries per block of chunk_lse and chunk_statistics: one block of a thread's rows fits kBlockBytes.
inline int64_t entries_per_block(int64_t R, int64_t bytes) {
  return std::clamp<int64_t>(kBlockBytes / std::max<int64_t>(R * bytes, 1), 8, 256);
}

// body(c, lanes) for each step of kStep lanes of a row of R, with the row ``ahead`` (or none) prefetched alongside.
template <typename L, typename T, typename F>
inline void each_step(const T* ahead, int64_t R, F&& body) {
  for (int64_t c = 0; c < R; c += L::kStep) {
    if (ahead != nullptr) {
      for (int64_t byte = 0; byte < L::kStep * static_cast<int64_t>(sizeof(T)); byte += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(ahead + c) + byte);
      }
    }
    body(c, std::min(L::kStep, R - c));
  }
}

// Folds a part's (max, sum of exp(y - max)) into a running pair, in float64: NaN from either stays NaN.
inline void merge_exp_sum(double& run_max, double& run_sum, double m, double s) {
  if (std::isnan(m) || std::isnan(s) || std::isnan(run_max)) {
    run_max = run_sum = std::numeric_limits<double>::quiet_NaN();
  } else if (m > run_max) {
    run_sum = run_sum * std::exp(run_max - m) + s;
    run_max = m;
  } else if (m != -std::numeric_limits<double>::infinity()) {
    run_sum += s * std::exp(m - run_max);
  }
}

// Entries [v0, v1) of a (V, R) chunk: each column's max and sum of exp(y - max) over them, into run_max / run_sum (R,).
template <typename T>
void span_lse(const T* z, int64_t ld, int64_t R, int64_t v0, int64_t v1, int64_t eos, double softcap, double* run_max,
              double* run_sum) {
  using L = Lanes<T>;
  using V = typename L::V;
  using C = typename L::C;
  constexpr int64_t W = V::size();
  const int64_t padded = (R + L::kStep - 1) / L::kStep * L::kStep, block = entries_per_block(R, sizeof(T));
  const C cap = static_cast<C>(softcap), inv_cap = softcap > 0 ? static_cast<C>(1.0 / softcap) : C(0);
  const C lowest = -std::numeric_limits<C>::infinity();
  std::vector<C> block_max(padded), shift(padded), block_sum(padded);
  std::fill(run_max, run_max + R, -std::numeric_limits<double>::infinity());
  std::fill(run_sum, run_sum + R, 0.0);
  for (int64_t b0 = v0; b0 < v1; b0 += block) {
    const int64_t b1 = std::min(v1, b0 + block);
    std::fill(block_max.begin(), block_max.end(), lowest);
    std::fill(block_sum.begin(), block_sum.end(), C(0));
    for (int64_t v = b0; v < b1; ++v) {  // the block's max, read from memory (the next rows prefetched)
      if (v == eos) continue;
      const T* row = z + v * ld;
      each_step<L>(v + kAhead < v1 ? row + kAhead * ld : nullptr, R, [&](int64_t c, int64_t lanes) {
        V a, b;
        L::load(row + c, lanes, a, b);
        if (softcap > 0) {
          a = capped<L>(a, cap, inv_cap, nullptr);
          b = capped<L>(b, cap, inv_cap, nullptr);
        }
        C* m = block_max.data() + c;
        at::vec::maximum(V::loadu(m), a).store(m);
        at::vec::maximum(V::loadu(m + W), b).store(m + W);
      });
    }
    for (int64_t k = 0; k < padded; ++k) {  // a column of -inf only (or none) in the block: exp(-inf - 0) = 0
      shift[k] = block_max[k] == lowest ? C(0) : block_max[k];
    }
    // The sum, read from cache (the next block's rows prefetched alongside, for its max pass), also takes z - z of
    // the raw logits (before a cap): 0 while every one is finite, NaN from the first NaN or infinite one on, which
    // the merge below carries to L and m.
    for (int64_t v = b0; v < b1; ++v) {
      if (v == eos) continue;
      const T* row = z + v * ld;
      each_step<L>(v + block < v1 ? row + block * ld : nullptr, R, [&](int64_t c, int64_t lanes) {
        V a, b;
        L::load(row + c, lanes, a, b);
        const V raw_a = a - a, raw_b = b - b;
        if (softcap > 0) {
          a = capped<L>(a, cap, inv_cap, nullptr);
          b = capped<L>(b, cap, inv_cap, nullptr);
        }
        C* sum = block_sum.data() + c;
        (V::loadu(sum) + (L::exp(a - V::loadu(shift.data() + c)) + raw_a)).store(sum);
        (V::loadu(sum + W) + (L::exp(b - V::loadu(shift.data() + c + W)) + raw_b)).store(sum + W);
      });
    }
    for (int64_t k = 0; k < R; ++k) {
      merge_exp_sum(run_max[k], run_sum[k], block_max[k], block_sum[k]);
    }
  }
}

// Entries [v0, v1) of a (V, R) chunk, in place: z[v, r] <- scales[r]·exp(y[v, r] - shifts[r]) (· sech²(z / c) with a
// softcap) for v != eos. With entry_max: entry_max[v] <- max over r of |that| (0 for eos), and block_sums[b, r] <- its
// sum over the b-th ``block`` entries (v0 a multiple of block).
template <typename T>
void span_grad(T* z, int64_t ld, int64_t R, int64_t v0, int64_t v1, int64_t eos, double softcap,
               const typename Lanes<T>::C* shifts, const typename Lanes<T>::C* scales, float* entry_max,
               float* block_sums, int64_t block) {
  using L = Lanes<T>;
  using V = typename L::V;
  using C = typename L::C;
  constexpr int64_t W = V::size();
  const int64_t padded = (R + L::kStep - 1) / L::kStep * L::kStep;
  const C cap = static_cast<C>(softcap), inv_cap = softcap > 0 ? static_cast<C>(1.0 / softcap) : C(0);
  std::vector<C> sums(entry_max != nullptr ? padded : 0);  // the current block's sums, one per column
  for (int64_t v = v0; v < v1; ++v) {
    if (entry_max != nullptr && v > v0 && v % block == 0) {
      std::copy(sums.begin(), sums.begin() + R, block_sums + (v / block - 1) * R);
      std::fill(sums.begin(), sums.end(), C(0));
    }
    if (v == eos) {
      if (entry_max != nullptr) {
        entry_max[v] = 0.f;
      }
      continue;
    }
    T* row = z + v * ld;
    V peak(0);  // the entry's running max |dz| (padded lanes hold 0)
    each_step<L>(v + kAhead < v1 ? row + kAhead * ld : nullptr, R, [&](int64_t c, int64_t lanes) {
      V a, b;
      L::load(row + c, lanes, a, b);
      const V sh_a = V::loadu(shifts + c), sh_b = V::loadu(shifts + c + W);
      const V sc_a = V::loadu(scales + c), sc_b = V::loadu(scales + c + W);
      if (softcap > 0) {
        V sech_a, sech_b;
        const V ya = capped<L>(a, cap, inv_cap, &sech_a), yb = capped<L>(b, cap, inv_cap, &sech_b);
        a = L::exp(ya - sh_a) * sc_a * sech_a;
        b = L::exp(yb - sh_b) * sc_b * sech_b;
      } else {
        a = L::exp(a - sh_a) * sc_a;
        b = L::exp(b - sh_b) * sc_b;
      }
      L::store(row + c, a, b, lanes);
      if (entry_max != nullptr) {
        C* sum = sums.data() + c;
        (V::loadu(sum) + a).store(sum);
        (V::loadu(sum + W) + b).store(sum + W);
        peak = at::vec::maximum(peak, at::vec::maximum(a.abs(), b.abs()));
      }
    });
    if (entry_max != nullptr) {  // std::max keeps 0 where the max is NaN
      const auto top = at::vec::vec_reduce_all<C>([](V& x, V& y) { return at::vec::maximum(x, y); }, peak);
      entry_max[v] = std::max(0.f, static_cast<float>(top));
    }
  }
  if (entry_max != nullptr && v0 < v1) {
    std::copy(sums.begin(), sums.begin() + R, block_sums + ((v1 - 1) / block) * R);
  }
}

// Entries [v0, v1) of a (V, R) chunk: out (R, 5) <- each column's sum exp(y - shift)·y, sum exp(2·(y - shift)),
// sum y, max y and its first v (-1: none), over v != eos; the shift as the compute type holds it.
template <typename T>
void span_statistics(const T* z, int64_t ld, int64_t R, int64_t v0, int64_t v1, int64_t eos, double softcap,
                     const typename Lanes<T>::C* shift, double* out) {
  using L = Lanes<T>;
  using V = typename L::V;
  using C = typename L::C;
  constexpr int64_t W = V::size();
  const int64_t padded = (R + L::kStep - 1) / L::kStep * L::kStep, block = entries_per_block(R, sizeof(T));
  const C cap = static_cast<C>(softcap), inv_cap = softcap > 0 ? static_cast<C>(1.0 / softcap) : C(0);
  const C lowest = -std::numeric_limits<C>::infinity();
  std::vector<C> weighted(padded), squares(padded), total(padded);
  std::vector<C> best(padded, lowest), where(padded, C(-1));
  std::vector<double> run_weighted(R, 0.0), run_squares(R, 0.0), run_total(R, 0.0);
  for (int64_t b0 = v0; b0 < v1; b0 += block) {
    const int64_t b1 = std::min(v1, b0 + block);
    std::fill(weighted.begin(), weighted.end(), C(0));
    std::fill(squares.begin(), squares.end(), C(0));
    std::fill(total.begin(), total.end(), C(0));
    for (int64_t v = b0; v < b1; ++v) {
      if (v == eos) continue;
      const T* row = z + v * ld;
      const V column(static_cast<C>(v));  // exact: V < 2^24
      each_step<L>(v + kAhead < v1 ? row + kAhead * ld : nullptr, R, [&](int64_t c, int64_t lanes) {
        V y[2];
        L::load(row + c, lanes, y[0], y[1]);
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t at = c + h * W;
          if (softcap > 0) {
            y[h] = capped<L>(y[h], cap, inv_cap, nullptr);
          }
          const V e = L::exp(y[h] - V::loadu(shift + at));
          (V::loadu(weighted.data() + at) + e * y[h]).store(weighted.data() + at);
          (V::loadu(squares.data() + at) + e * e).store(squares.data() + at);
          (V::loadu(total.data() + at) + y[h]).store(total.data() + at);
          const V top = V::loadu(best.data() + at);
          const V higher = y[h] > top;  // strictly: the first v of the max stays
          V::blendv(top, y[h], higher).store(best.data() + at);
          V::blendv(V::loadu(where.data() + at), column, higher).store(where.data() + at);
        }
      });
    }
    for (int64_t k = 0; k < R; ++k) {
      run_weighted[k] += weighted[k];
      run_squares[k] += squares[k];
      run_total[k] += total[k];
    }
  }
  for (int64_t k = 0; k < R; ++k) {
    double* row = out + k * 5;
    row[0] = run_weighted[k];
    row[1] = run_squares[k];
    row[2] = run_total[k];
    row[3] = best[k];
    row[4] = where[k];
  }
}

void check_chunk(const at::Tensor& z, int64_t eos, const char* op) {
  TORCH_CHECK(z.device().is_cpu() && z.dim() == 2 && (z.size(1) <= 1 || z.stride(1) == 1) &&
                  (z.size(0) <= 1 || z.stride(0) >= z.size(1)),
              op, ": the chunk must be a (V, R) CPU tensor with unit stride along R");
  TORCH_CHECK(z.scalar_type() == at::kFloat || z.scalar_type() == at::kDouble || z.scalar_type() == at::kBFloat16 ||
                  z.scalar_type() == at::kHalf,
              op, ": the chunk must be float32, float64, bfloat16 or float16");
  TORCH_CHECK(-1 <= eos && eos < z.size(0), op, ": eos must be a row of the chunk, or -1");
}

const double* rows_of(const at::Tensor& t, int64_t R, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kDouble && t.dim() == 1 && t.size(0) == R &&
                  t.is_contiguous(),
              op, ": ", name, " must be a contiguous (R,) float64 CPU tensor");
  return t.data_ptr<double>();
}

std::tuple<at::Tensor, at::Tensor> chunk_lse(const at::Tensor& z, int64_t eos, double softcap) {
  check_chunk(z, eos, "chunk_lse");
  const int64_t V_ = z.size(0), R = z.size(1), ld = z.stride(0);
  at::Tensor lse = at::empty({R}, z.options().dtype(at::kDouble));
  at::Tensor row_max = at::empty({R}, z.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, z.scalar_type(), "chunk_lse", [&] {
    const int64_t threads = at::get_num_threads();
    std::vector<double> part_max(threads * R, -std::numeric_limits<double>::infinity()), part_sum(threads * R, 0.0);
    const int64_t parts = parallel_entries(V_, R, entries_per_block(R, sizeof(scalar_t)),
                                           [&](int64_t v0, int64_t v1, int64_t part) {
      span_lse<scalar_t>(z.const_data_ptr<scalar_t>(), ld, R, v0, v1, eos, softcap, part_max.data() + part * R,
                         part_sum.data() + part * R);
    });
    double* lse_out = lse.data_ptr<double>();
    double* max_out = row_max.data_ptr<double>();
    for (int64_t r = 0; r < R; ++r) {
      double m = -std::numeric_limits<double>::infinity(), sum = 0.0;
      for (int64_t part = 0; part < parts; ++part) {
        merge_exp_sum(m, sum, part_max[part * R + r], part_sum[part * R + r]);
      }
      lse_out[r] = std::isfinite(m) ? m + std::log(sum) : m;
      max_out[r] = m;
    }
  });
  return {lse, row_max};
}

at::Tensor chunk_statistics(const at::Tensor& z, int64_t eos, double softcap, const at::Tensor& shift) {
  check_chunk(z, eos, "chunk_statistics");
  const int64_t V_ = z.size(0), R = z.size(1), ld = z.stride(0);
  TORCH_CHECK(V_ < (int64_t{1} << 24), "chunk_statistics: the chunk's vocabulary must be under 2^24 entries");
  const double* shift_in = rows_of(shift, R, "chunk_statistics", "shift");
  at::Tensor out = at::empty({R, 5}, z.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, z.scalar_type(), "chunk_statistics", [&] {
    using C = typename Lanes<scalar_t>::C;
    // the shift as the compute type holds it (0 where it is not finite); the sums are corrected for its rounding
    std::vector<C> shifts((R + Lanes<scalar_t>::kStep - 1) / Lanes<scalar_t>::kStep * Lanes<scalar_t>::kStep, C(0));
    for (int64_t k = 0; k < R; ++k) {
      if (std::isfinite(shift_in[k])) {
        shifts[k] = static_cast<C>(shift_in[k]);
      }
    }
    const int64_t threads = at::get_num_threads();
    std::vector<double> parts_out(threads * R * 5);
    for (int64_t k = 0; k < threads * R; ++k) {  // an empty part: no sum, no max
      double* row = parts_out.data() + k * 5;
      row[0] = row[1] = row[2] = 0.0;
      row[3] = -std::numeric_limits<double>::infinity();
      row[4] = -1.0;
    }
    const int64_t parts = parallel_entries(V_, R, entries_per_block(R, sizeof(scalar_t)),
                                           [&](int64_t v0, int64_t v1, int64_t part) {
      span_statistics<scalar_t>(z.const_data_ptr<scalar_t>(), ld, R, v0, v1, eos, softcap, shifts.data(),
                                parts_out.data() + part * R * 5);
    });
    double* result = out.data_ptr<double>();
    for (int64_t k = 0; k < R; ++k) {
      double* row = result + k * 5;
      std::copy_n(parts_out.data() + k * 5, 5, row);
      for (int64_t part = 1; part < parts; ++part) {
        const double* other = parts_out.data() + (part * R + k) * 5;
        row[0] += other[0];
        row[1] += other[1];
        row[2] += other[2];
        if (other[3] > row[3]) {  // strictly: the first v of the max stays
          row[3] = other[3];
          row[4] = other[4];
        }
      }
      const double rounding = std::exp(static_cast<double>(shifts[k]) - shift_in[k]);
      row[0] *= rounding;
      row[1] *= rounding * rounding;
    }
  });
  return out;
}

void chunk_grad_(at::Tensor& z, const at::Tensor& shift, const at::Tensor& scale, int64_t eos,
                 const at::Tensor& targets, const at::Tensor& values, double softcap,
                 const std::optional<at::Tensor>& entry_max, const std::optional<at::Tensor>& block_sums,
                 int64_t block) {
  check_chunk(z, eos, "chunk_grad_");
  const int64_t V_ = z.size(0), R = z.size(1), ld = z.stride(0);
  const double* shift_in = rows_of(shift, R, "chunk_grad_", "shift");
  const double* scale_in = rows_of(scale, R, "chunk_grad_", "scale");
  const double* value = rows_of(values, R, "chunk_grad_", "values");
  TORCH_CHECK(targets.device().is_cpu() && targets.scalar_type() == at::kLong && targets.dim() == 1 &&
                  targets.size(0) == R && targets.is_contiguous(),
              "chunk_grad_: targets must be a contiguous (R,) int64 CPU tensor");
  const int64_t* target = targets.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(-1 <= target[r] && target[r] < V_, "chunk_grad_: target ", target[r], " is not a row of the chunk");
  }
  float* peaks = nullptr;
  if (entry_max.has_value()) {
    TORCH_CHECK(entry_max->device().is_cpu() && entry_max->scalar_type() == at::kFloat && entry_max->dim() == 1 &&
                    entry_max->size(0) == V_ && entry_max->is_contiguous(),
                "chunk_grad_: entry_max must be a contiguous (V,) float32 CPU tensor");
    peaks = entry_max->data_ptr<float>();
    TORCH_CHECK(block > 0 && block_sums.has_value() && block_sums->device().is_cpu() &&
                    block_sums->scalar_type() == at::kFloat && block_sums->dim() == 2 &&
                    block_sums->size(0) == (V_ + block - 1) / block && block_sums->size(1) == R &&
                    block_sums->is_contiguous(),
                "chunk_grad_: with entry_max, block_sums must be a contiguous (ceil(V / block), R) float32 CPU tensor "
                "and block positive");
    TORCH_CHECK(R == 0 || z.size(0) <= 1 || ld == R, "chunk_grad_: with entry_max, the chunk's rows must be dense");
  }
  float* sums_out = peaks == nullptr ? nullptr : block_sums->data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, z.scalar_type(), "chunk_grad_", [&] {
    using C = typename Lanes<scalar_t>::C;
    // the shift as the compute type holds it; the scale takes the difference: exp(y - s) = exp(y - s_C)·exp(s_C - s)
    const int64_t padded = (R + Lanes<scalar_t>::kStep - 1) / Lanes<scalar_t>::kStep * Lanes<scalar_t>::kStep;
    std::vector<C> shifts(padded, C(0)), scales(padded, C(0));
    for (int64_t k = 0; k < R; ++k) {
      if (std::isfinite(shift_in[k])) {
        shifts[k] = static_cast<C>(shift_in[k]);
        scales[k] = static_cast<C>(scale_in[k] * std::exp(static_cast<double>(shifts[k]) - shift_in[k]));
      }
    }
    scalar_t* base = z.data_ptr<scalar_t>();
    parallel_entries(V_, R, peaks == nullptr ? 64 : block, [&](int64_t v0, int64_t v1, int64_t) {
      span_grad<scalar_t>(base, ld, R, v0, v1, eos, softcap, shifts.data(), scales.data(), peaks, sums_out, block);
    });
    if (eos >= 0) {
      std::fill(base + eos * ld, base + eos * ld + R, scalar_t(0));
    }
    for (int64_t r = 0; r < R; ++r) {
      if (target[r] >= 0) {
        base[target[r] * ld + r] = static_cast<scalar_t>(value[r]);
      }
    }
  });
}

template <typename In, typename Out>
void scale_cast_span(const In* src, Out* out, int64_t n, float scale) {
  using L = Lanes<In>;
  using V = Vectorized<float>;
  constexpr int64_t W = V::size();
  static_assert(L::kStep == 2 * W, "two float vectors a step");
  const V s(scale);
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    V a, b;
    L::load(src + i, 2 * W, a, b);
    at::vec::convert_from_float<Out>(a * s, b * s).store(out + i);
  }
  for (; i < n; ++i) {
    out[i] = static_cast<Out>(static_cast<float>(src[i]) * scale);
  }
}

at::Tensor scale_cast(const at::Tensor& src, double scale, at::ScalarType dtype) {
  TORCH_CHECK(src.device().is_cpu() && src.is_contiguous() &&
                  (src.scalar_type() == at::kFloat || src.scalar_type() == at::kBFloat16 ||
                   src.scalar_type() == at::kHalf),
              "scale_cast: src must be a contiguous float32, bfloat16 or float16 CPU tensor");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "scale_cast: dtype must be bfloat16 or float16");
  at::Tensor out = at::empty(src.sizes(), src.options().dtype(dtype));
  const int64_t n = src.numel();
  auto cast = [&](const auto* from, auto* to) {
    using In = std::remove_const_t<std::remove_pointer_t<decltype(from)>>;
    using Out = std::remove_pointer_t<decltype(to)>;
    at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
      scale_cast_span<In, Out>(from + begin, to + begin, end - begin, static_cast<float>(scale));
    });
  };
  auto to = [&](const auto* from) {
    if (dtype == at::kBFloat16) {
      cast(from, out.data_ptr<at::BFloat16>());
    } else {
      cast(from, out.data_ptr<at::Half>());
    }
  };
  if (src.scalar_type() == at::kFloat) {
    to(src.const_data_ptr<float>());
  } else if (src.scalar_type() == at::kBFloat16) {
    to(src.const_data_ptr<at::BFloat16>());
  } else {
    to(src.const_data_ptr<at::Half>());
  }
  return out;
}

// acc <- src (first) or acc + src, src's bfloat16 / float16 values read into float32: the sum of a dW block's product
// into its float32 accumulator in one pass (torch's add_ of another dtype first copies src into a float32 temporary).
void accumulate_(at::Tensor& acc, const at::Tensor& src, bool first) {
  TORCH_CHECK(acc.device().is_cpu() && acc.scalar_type() == at::kFloat && acc.is_contiguous() && src.device().is_cpu() &&
                  src.is_contiguous() && src.sizes() == acc.sizes() &&
                  (src.scalar_type() == at::kBFloat16 || src.scalar_type() == at::kHalf),
              "accumulate_: acc must be a contiguous float32 CPU tensor and src a contiguous bfloat16 / float16 one of "
              "its shape");
  float* out = acc.data_ptr<float>();
  const int64_t n = acc.numel();
  AT_DISPATCH_REDUCED_FLOATING_TYPES(src.scalar_type(), "accumulate_", [&] {
    const scalar_t* from = src.const_data_ptr<scalar_t>();
    using L = Lanes<scalar_t>;
    using V = Vectorized<float>;
    constexpr int64_t W = V::size();
    at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
      int64_t i = begin;
      for (; i + 2 * W <= end; i += 2 * W) {
        V a, b;
        L::load(from + i, 2 * W, a, b);
        if (!first) {
          a = a + V::loadu(out + i);
          b = b + V::loadu(out + i + W);
        }
        a.store(out + i);
        b.store(out + i + W);
      }
      for (; i < end; ++i) {
        out[i] = (first ? 0.f : out[i]) + static_cast<float>(from[i]);
      }
    });
  });
}

// out (H,) <- the sum of rows [v0, v1) of a contiguous (V, H) w, in float32, walking each row contiguously.
template <typename T>
void sum_rows(const T* w, int64_t H, int64_t v0, int64_t v1, float* out) {
  using L = Lanes<T>;
  using V = Vectorized<float>;
  constexpr int64_t W = V::size();
  static_assert(L::kStep == 2 * W, "two float vectors a step");
  std::fill(out, out + H, 0.f);
  for (int64_t v = v0; v < v1; ++v) {
    const T* row = w + v * H;
    int64_t c = 0;
    for (; c + L::kStep <= H; c += L::kStep) {
      V a, b;
      L::load(row + c, L::kStep, a, b);
      (V::loadu(out + c) + a).store(out + c);
      (V::loadu(out + c + W) + b).store(out + c + W);
    }
    for (; c < H; ++c) {
      out[c] += static_cast<float>(row[c]);
    }
  }
}

at::Tensor block_row_sums(const at::Tensor& w, int64_t block) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf),
              "block_row_sums: w must be a contiguous (V, H) float32, bfloat16 or float16 CPU tensor");
  TORCH_CHECK(block > 0, "block_row_sums: block must be positive, got ", block);
  const int64_t V = w.size(0), H = w.size(1), blocks = (V + block - 1) / block;
  at::Tensor out = at::empty({blocks, H}, w.options().dtype(at::kFloat));
  float* sums = out.data_ptr<float>();
  auto run = [&](const auto* from) {
    at::parallel_for(0, blocks, std::max<int64_t>(1, kTaskEntries / std::max<int64_t>(block * H, 1)),
                     [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        sum_rows(from, H, b * block, std::min(V, (b + 1) * block), sums + b * H);
      }
    });
  };
  if (w.scalar_type() == at::kFloat) {
    run(w.const_data_ptr<float>());
  } else if (w.scalar_type() == at::kBFloat16) {
    run(w.const_data_ptr<at::BFloat16>());
  } else {
    run(w.const_data_ptr<at::Half>());
  }
  return out;
}

// out[c * ld_out + r] = src[r * ld_src + c] for one 16 x 16 block of 16-bit entries.
inline void transpose16(const uint16_t* src, int64_t ld_src, uint16_t* out, int64_t ld_out) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  // Each half of the rows is transposed within the 128-bit lanes (unpacks of 16-, 32- then 64-bit pairs): lane 0 of
  // half[h][c] holds column c of the half's rows, lane 1 column c + 8; output row c pairs the halves' lanes 0, c + 8
  // their lanes 1.
  __m256i half[2][8];
  for (int h = 0; h < 2; ++h) {
    __m256i r[8], t[8], u[8];
    for (int i = 0; i < 8; ++i) {
      r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (8 * h + i) * ld_src));
    }
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {  // t[0..3] hold rows 0-3, t[4..7] rows 4-7
      u[4 * i] = _mm256_unpacklo_epi32(t[4 * i], t[4 * i + 2]);
      u[4 * i + 1] = _mm256_unpackhi_epi32(t[4 * i], t[4 * i + 2]);
      u[4 * i + 2] = _mm256_unpacklo_epi32(t[4 * i + 1], t[4 * i + 3]);
      u[4 * i + 3] = _mm256_unpackhi_epi32(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; ++i) {
      half[h][2 * i] = _mm256_unpacklo_epi64(u[i], u[i + 4]);
      half[h][2 * i + 1] = _mm256_unpackhi_epi64(u[i], u[i + 4]);
    }
  }
  for (int c = 0; c < 8; ++c) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c * ld_out),
                        _mm256_permute2x128_si256(half[0][c], half[1][c], 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (c + 8) * ld_out),
                        _mm256_permute2x128_si256(half[0][c], half[1][c], 0x31));
  }
#else
  for (int64_t c = 0; c < 16; ++c) {
    for (int64_t r = 0; r < 16; ++r) {
      out[c * ld_out + r] = src[r * ld_src + c];
    }
  }
#endif
}

// An uninitialized CPU tensor of ``sizes`` and 2-byte ``options``, from 2 MiB on in memory advised to use huge pages
// (Linux; a plain allocation elsewhere): the faults of a fresh gigabyte's 4 KiB pages cost a third of its transpose.
at::Tensor empty_huge(at::IntArrayRef sizes, const at::TensorOptions& options) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr size_t kHuge = size_t{2} << 20;
  int64_t numel = 1;
  for (const int64_t n : sizes) {
    numel *= n;
  }
  if (static_cast<size_t>(numel) * 2 < kHuge) {
    return at::empty(sizes, options);
  }
  const size_t bytes = (static_cast<size_t>(numel) * 2 + kHuge - 1) / kHuge * kHuge;
  void* data = nullptr;
  TORCH_CHECK(posix_memalign(&data, kHuge, bytes) == 0, "transpose_rows: out of memory for ", bytes, " bytes");
  madvise(data, bytes, MADV_HUGEPAGE);
  return at::from_blob(data, sizes, [](void* p) { std::free(p); }, options);
#else
  return at::empty(sizes, options);
#endif
}

// Vocabulary rows per task of transpose_rows: each output row gets 128 contiguous bytes of a task.
constexpr int64_t kTransposeRows = 64;

at::Tensor transpose_rows(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous() &&
                  (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf),
              "transpose_rows: w must be a contiguous (V, H) bfloat16 or float16 CPU tensor");
  const int64_t V = w.size(0), H = w.size(1);
  at::Tensor out = empty_huge({H, V}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(w.const_data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t full_h = H / 16 * 16;
  at::parallel_for(0, (V + kTransposeRows - 1) / kTransposeRows, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t v0 = b * kTransposeRows, v1 = std::min(V, v0 + kTransposeRows);
      const int64_t full_v = v0 + (v1 - v0) / 16 * 16;
      for (int64_t h = 0; h < full_h; h += 16) {
        for (int64_t v = v0; v < full_v; v += 16) {
          transpose16(src + v * H + h, H, dst + h * V + v, V);
        }
      }
      for (int64_t h = 0; h < H; ++h) {  // the edges: rows past the last whole block, columns past the last
        for (int64_t v = h < full_h ? full_v : v0; v < v1; ++v) {
          dst[h * V + v] = src[v * H + h];
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nmst_fast_cpu, m) {
  m.def("chunk_lse(Tensor z, int eos, float softcap) -> (Tensor, Tensor)");
  m.def("chunk_grad_(Tensor(a!) z, Tensor shift, Tensor scale, int eos, Tensor targets, Tensor values, "
        "float softcap, Tensor(b!)? entry_max=None, Tensor(c!)? block_sums=None, int block=0) -> ()");
  m.def("chunk_statistics(Tensor z, int eos, float softcap, Tensor shift) -> Tensor");
  m.def("transpose_rows(Tensor w) -> Tensor");
  m.def("scale_cast(Tensor src, float scale, ScalarType dtype) -> Tensor");
  m.def("accumulate_(Tensor(a!) acc, Tensor src, bool first) -> ()");
  m.def("block_row_sums(Tensor w, int block) -> Tensor");
}

TORCH_LIBRARY_IMPL(nmst_fast_cpu, CPU, m) {
  m.impl("chunk_lse", &chunk_lse);
  m.impl("chunk_grad_", &chunk_grad_);
  m.impl("chunk_statistics", &chunk_statistics);
  m.impl("transpose_rows", &transpose_rows);
  m.impl("scale_cast", &scale_cast);
  m.impl("accumulate_", &accumulate_);
  m.impl("block_row_sums", &block_row_sums);
}
