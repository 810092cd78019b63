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
// min-p, then one uniform of its own generator) and marks it selected, the chain's only sampler; there the chain's
// sample call comes to nmst_head_sampler_sample instead, which draws from the context's logits row without the
// records. t advances by one per step. A failure (error codes below) leaves the candidates as they are and is kept
// in the state for the caller to raise once llama.cpp returns; later steps do nothing until the state is reset.
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
  kNoLogits = 4,        // llama.cpp has no logits for the step's output index
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

static void fail(nmst_head_sampler_state* state, int32_t code) {
  state->error = code;
  state->error_step = state->step;
}

// The token the head draws from ``row`` (the step's V logits, contiguous), advancing t, ST's sum and the generator;
// -1 after keeping the failure in the state.
static int64_t draw_step(nmst_head_sampler_state* state, const float* row) {
  const int64_t V = state->vocabulary;
  int64_t token = 0;
  double after = state->st_sum;
  if (!nmst_fast_cpu::draw_row(row, V, state->head, state->eos, state->log1m_eps, state->temperature, state->top_k,
                               state->cut, state->min_p, state->step, state->st_sum, next_uniform(&state->rng), &token,
                               &after)) {
    fail(state, std::isnan(nmst_fast_cpu::span_max(row, V)) ? kNaN : kNoDistribution);
    return -1;
  }
  state->st_sum = after;
  state->step += 1;
  return token;
}

// The llama.h functions the direct draw calls, their addresses taken on the Python side from the libllama
// llama-cpp-python loaded.
struct nmst_llama_calls {
  const float* (*logits_ith)(void* context, int32_t idx);          // llama_get_logits_ith
  int32_t (*sampled_token_ith)(void* context, int32_t idx);        // llama_get_sampled_token_ith
  const float* (*sampled_logits_ith)(void* context, int32_t idx);  // llama_get_sampled_logits_ith
  const float* (*sampled_probs_ith)(void* context, int32_t idx);   // llama_get_sampled_probs_ith
  void (*accept)(void* sampler, int32_t token);                    // llama_sampler_accept
};

// llama_sampler_sample(chain, context, idx) for a chain whose only sampler is this one, drawing: the head draws from
// the context's logits row itself, with no candidate records (llama_sampler_sample writes V (id, logit, p) records
// and the head would copy the logits back out of them: 12 of every 16 bytes it moves are not logits), then the chain
// accepts the token as llama_sampler_sample does. A step a backend sampler of the context has sampled or cut fails
// as candidates that are not the whole row do in apply. Returns the token; 0 after a failure, which the state keeps
// for the caller to raise (as apply's selection of entry 0).
int32_t nmst_head_sampler_sample(nmst_llama_sampler* sampler, void* chain, void* context, int32_t idx,
                                 const nmst_llama_calls* calls) {
  auto* state = static_cast<nmst_head_sampler_state*>(sampler->ctx);
  if (state->error != 0 || state->draw == 0) {
    return 0;
  }
  if (calls->sampled_token_ith(context, idx) != -1 || calls->sampled_logits_ith(context, idx) != nullptr ||
      calls->sampled_probs_ith(context, idx) != nullptr) {
    fail(state, kCandidates);
    return 0;
  }
  const float* row = calls->logits_ith(context, idx);
  if (row == nullptr) {
    fail(state, kNoLogits);
    return 0;
  }
  const int64_t token = draw_step(state, row);
  if (token < 0) {
    return 0;
  }
  calls->accept(chain, static_cast<int32_t>(token));
  return static_cast<int32_t>(token);
}

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
  if (static_cast<int64_t>(candidates->size) != V || candidates->sorted || data[0].id != 0 || data[eos].id != eos ||
      data[V - 1].id != V - 1) {
    fail(state, kCandidates);
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
    const int64_t token = draw_step(state, row.data());
    // the candidates are the row in token order; after a failure llama.cpp still asserts a selection, and the caller
    // raises the kept error instead
    candidates->selected = token < 0 ? 0 : token;
    return;
  }
  if (state->head == 2) {
    const float best = nmst_fast_cpu::span_max(row.data(), V);
    if (std::isnan(best)) {
      fail(state, kNaN);
      return;
    }
    if (!std::isfinite(best)) {
      fail(state, kNoDistribution);
      return;
    }
  } else {
    const double s = static_cast<double>(row[eos]);
    const double L = nmst_fast_cpu::row_lse(row.data(), V, eos, 1.0 / temperature);
    if (std::isnan(L) || std::isnan(s)) {
      fail(state, kNaN);
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
      fail(state, kNoDistribution);
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
