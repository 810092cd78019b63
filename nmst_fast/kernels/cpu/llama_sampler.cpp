// The NMST / ST / VA head as a llama.cpp sampler: its apply function, called by llama.cpp's sampler
// chain with the step's candidates, turns them into the head's step distribution at temperature T
// in place (log q_T up to a constant), with no Python on the way. Python fills the sampler's
// interface through llama-cpp-python's own ctypes structures (the llama.cpp it was built with) and
// puts it first in the chain (nmst_fast.integrations.llama_cpp.sampler).
//
// The candidates' logits are copied out of their (id, logit, p) records into a contiguous row for
// head_row.h's row pass; the eos entry then becomes T * zeta_eos and every logit is divided by T, as
// nmst_fast.integrations.llama_cpp.decoding.NMSTLogitsProcessor.apply does. Where the state says ``draw``, the
// sampler instead draws the step's token itself (select_rows.cpp's row selection: temperature, top-k, top-p,
// min-p, then one uniform of its own generator) and marks it selected, the chain's only sampler. t advances by one
// per apply. A failure (error codes below) leaves the candidates as they are and is kept in the state for
// the caller to raise once llama.cpp returns; later applies do nothing until the state is reset.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "head_row.h"

extern "C" {

// llama.h's llama_token_data, llama_token_data_array and llama_sampler (stable since llama.cpp's
// sampler API).
struct nmst_llama_token_data {
  int32_t id;
  float logit;
  float p;
};

struct nmst_llama_token_data_array {
  nmst_llama_token_data* data;
  size_t size;
  int64_t selected;
  bool sorted;
};

struct nmst_llama_sampler {
  const void* iface;
  void* ctx;
};

// The sampler's state (its llama_sampler ctx), mirrored by a ctypes structure on the Python side.
struct nmst_head_sampler_state {
  int32_t head;        // 0 NMST, 1 ST, 2 VA
  int32_t eos;         // eos token id
  int64_t vocabulary;  // the model's vocabulary V
  double log1m_eps;    // log1p(-eps)
  double max_gap;      // nmst_fast.decoding.eos_column.MAX_EOS_LOGIT_GAP
  double temperature;  // T > 0 (1 for greedy)
  int64_t step;        // t of the next apply (1 at the first generated token)
  double st_sum;       // ST's running sum before the next apply
  int32_t error;       // 0, or the code of the first failure
  int32_t reserved;
  int64_t error_step;  // t of that failure
  // The draw, where the chain's other samplers are ones select_rows.cpp covers (set by the Python side, which then
  // leaves this sampler alone in the chain): 1 to draw the token here.
  int32_t draw;
  int32_t reserved2;
  int64_t top_k;  // 0: none
  double cut;     // top-p's p less its slack; >= 1: none
  double min_p;   // <= 0: none
  uint64_t rng;   // splitmix64's state: one uniform per step
};

// Error codes.
enum : int32_t {
  kCandidates = 1,      // not the model's whole row in token order
  kNaN = 2,             // NaN logits
  kNoDistribution = 3,  // no finite non-eos logit (NMST / ST), no finite logit (VA)
};

size_t nmst_head_sampler_state_size() { return sizeof(nmst_head_sampler_state); }

// A uniform double in [0, 1) from splitmix64 (53 random bits), advancing ``state``.
static double next_uniform(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

// llama_sampler_i.name (llama.cpp prints it where it lists a chain).
const char* nmst_head_sampler_name(const nmst_llama_sampler*) { return "nmst-head"; }

void nmst_head_sampler_apply(nmst_llama_sampler* sampler, nmst_llama_token_data_array* candidates) {
  auto* state = static_cast<nmst_head_sampler_state*>(sampler->ctx);
  if (state->error != 0) {
    if (state->draw != 0) {
      candidates->selected = 0;  // as below: the kept error is raised before this token reaches the caller
    }
    return;
  }
  const int64_t V = state->vocabulary, eos = state->eos;
  nmst_llama_token_data* data = candidates->data;
  auto fail = [state](int32_t code) {
    state->error = code;
    state->error_step = state->step;
  };
  if (static_cast<int64_t>(candidates->size) != V || candidates->sorted || data[0].id != 0 || data[eos].id != eos ||
      data[V - 1].id != V - 1) {
    fail(kCandidates);
    if (state->draw != 0 && candidates->size > 0) {
      candidates->selected = 0;
    }
    return;
  }
  thread_local std::vector<float> row;
  row.resize(static_cast<size_t>(V));
  for (int64_t v = 0; v < V; ++v) {
    row[v] = data[v].logit;
  }
  const double temperature = state->temperature;
  if (state->draw != 0) {
    int64_t token = 0;
    double after = state->st_sum;
    if (!nmst_fast_cpu::draw_row(row.data(), V, state->head, eos, state->log1m_eps, temperature, state->top_k,
                                 state->cut, state->min_p, state->step, state->st_sum, next_uniform(&state->rng),
                                 &token, &after)) {
      const bool nan = std::isnan(nmst_fast_cpu::span_max(row.data(), V));
      fail(nan ? kNaN : kNoDistribution);
      candidates->selected = 0;  // llama.cpp asserts a selection; the caller raises the kept error instead
      return;
    }
    candidates->selected = token;  // the candidates are the row in token order
    state->st_sum = after;
    state->step += 1;
    return;
  }
  if (state->head == 2) {
    const float best = nmst_fast_cpu::span_max(row.data(), V);
    if (std::isnan(best)) {
      fail(kNaN);
      return;
    }
    if (!std::isfinite(best)) {
      fail(kNoDistribution);
      return;
    }
  } else {
    const double s = static_cast<double>(row[eos]);
    const double L = nmst_fast_cpu::row_lse(row.data(), V, eos, 1.0 / temperature);
    if (std::isnan(L) || std::isnan(s)) {
      fail(kNaN);
      return;
    }
    const bool st = state->head == 1;
    double value = 0.0, after = state->st_sum;
    float eos_logit = data[eos].logit;
    if (nmst_fast_cpu::head_eos_value(L, s, state->step, temperature, st, state->st_sum, state->log1m_eps,
                                      state->max_gap, &value, &after)) {
      eos_logit = static_cast<float>(value);
    }
    if (!std::isfinite(eos_logit)) {
      fail(kNoDistribution);
      return;
    }
    data[eos].logit = eos_logit;
    state->st_sum = after;
  }
  if (temperature != 1.0) {
    const float scale = static_cast<float>(1.0 / temperature);
    for (int64_t v = 0; v < V; ++v) {
      data[v].logit *= scale;
    }
  }
  state->step += 1;
}

}  // extern "C"
