"""Every model type transformers maps to ``AutoModelForCausalLM``: ``apply_nmst`` patches it exactly
or refuses it with a ValueError naming the type, never silently wrong.

Exact means the patched loss, for the nmst, st and va heads, equals a float64 reference computed
from the unpatched model's own logits under the class's own label convention, and every parameter's
gradient equals the reference's (a parameter the fused path leaves without its gradient fails).
The outcome of each type is the row docs/hf_families.md lists for it (``python
tools/hf_family_table.py`` writes the table). Every patched type is checked again at large logits
(the output layer scaled so that max |logit| ≈ 12), one case per type and head. A few types of each
kind run in the default test command, the whole sweep under ``-m slow``.
"""

import copy
import re
from pathlib import Path

import pytest
import torch

from nmst_fast.integrations.hf import apply_nmst

from hf_families import (
    EOS,
    NOT_BUILT,
    NOT_TEXT,
    TRAIN_MODE,
    UNSHIFTED,
    causal_lm_types,
    probe_batch,
    spread_logits,
    targets_and_steps,
    tiny_causal_lm,
)
from hf_models import reference_nll

TABLE = Path(__file__).resolve().parents[1] / "docs" / "hf_families.md"
# One of each kind: plain pre-norm, softcap (Gemma's key and RecurrentGemma's), output bias, unshifted labels (a
# decoder of an encoder-decoder), mixture of experts, a hybrid state-space stack, Llama 4 (decoder under .model),
# and refusals (an output layer with its own forward; a transform before the output layer).
FAST = {"llama", "gemma2", "recurrent_gemma", "gptj", "bart", "mixtral", "jamba", "llama4_text", "dory", "rembert"}
HEADS = ("nmst", "st", "va")

# The large-logit case: random init gives max |logit| ≈ 0.5 on the probe batch, near-uniform distributions whose
# loss and gradients barely see an error in the logits' tail or in the eos terms; at 12 the probabilities span
# e^±24 and the eos logit drives p(eos) towards 0 or 1, where a logit computed differently from the model's
# (another cap, scale or hidden state) or a dtype lost on the way shows.
LARGE_SPAN = 12.0
# The default command runs three cheap (type, head) pairs of the fast subset, one per head: plain pre-norm, a
# softcap and an output bias (the unshifted kind: BigBird-Pegasus's own test below, under every head); -m slow
# runs every patched type under every head.
FAST_LARGE = {"llama": "nmst", "gemma2": "st", "gptj": "va"}


def listed_outcomes() -> dict[str, str]:
    """model_type -> "patched" | "refused" | "not a text LM" | "not built", from docs/hf_families.md's table."""
    rows = re.findall(r"^\| `([^`]+)` \| (patched|refused|not a text LM|not built) \|", TABLE.read_text(), flags=re.M)
    return dict(rows)


def outcome(model_type: str) -> tuple[str, str]:
    """(outcome, reason) of ``apply_nmst`` on a tiny ``model_type``, with every check of a patched type
    run (raises AssertionError where the patch is not exact)."""
    for kind, table in (("not a text LM", NOT_TEXT), ("not built", NOT_BUILT)):
        if model_type in table:
            with pytest.raises(Exception):
                tiny_causal_lm(model_type)(input_ids=probe_batch()[0], use_cache=False)
            return kind, table[model_type]
    base = tiny_causal_lm(model_type)
    try:
        apply_nmst(copy.deepcopy(base), head="va", eps=0.05, eos_token_id=EOS)
    except ValueError as error:
        assert model_type in str(error), f"the refusal does not name the model type: {error}"
        return "refused", str(error)
    for head in HEADS:
        check_exact(base, model_type, head)
    return "patched", "labels shifted" if model_type not in UNSHIFTED else "labels not shifted"


def check_exact(base, model_type: str, head: str) -> None:
    ids, labels = probe_batch()
    shifted = model_type not in UNSHIFTED
    plain, patched = copy.deepcopy(base), apply_nmst(copy.deepcopy(base), head=head, eps=0.05, eos_token_id=EOS)
    if model_type in TRAIN_MODE:
        plain.train(), patched.train()
    own = plain(input_ids=ids, labels=labels, use_cache=False)
    logits = own.logits[:, :-1] if shifted else own.logits
    targets, steps = targets_and_steps(labels, shifted)
    want = reference_nll(logits, targets, steps, head=head, eps=0.05, eos=EOS).sum() / (targets != -100).sum()
    want.backward()
    loss = patched(input_ids=ids, labels=labels).loss
    loss.backward()
    # A model whose own logits come out in float32 (a float64 layer's output upcast: xLSTM, mllama) is
    # exact to float32's precision; the others to float64's.
    # The same tolerances hold at large logits (the large-logit case), for every patched type: float64's error
    # grows with the logits' magnitude (≈ 1e-16·12 on each), far inside rtol; float32's own logits are rounded
    # to within 6e-8·12 ≈ 7e-7, which moves a loss of about 12 by ≈ 1e-6 (rtol 2e-5 · 12 = 2.4e-4 allowed).
    rtol, atol = (1e-9, 1e-9) if own.logits.dtype == torch.float64 else (2e-5, 1e-6)
    torch.testing.assert_close(loss.double(), want, rtol=rtol, atol=atol,
                               msg=lambda m: f"{model_type} {head}: loss: {m}")
    if head == "va":  # the class's own loss (HF computes it from float32 logits)
        torch.testing.assert_close(loss.float(), own.loss.float(), rtol=2e-6, atol=2e-6,
                                   msg=lambda m: f"{model_type}: the class's own loss: {m}")
    grads = dict(patched.named_parameters())
    for name, p in plain.named_parameters():
        mine = grads[name].grad
        if p.grad is None or not bool(p.grad.any()):
            assert mine is None or not bool(mine.any()), f"{model_type} {head}: {name} gets a gradient it should not"
            continue
        assert mine is not None, f"{model_type} {head}: {name} gets no gradient"
        torch.testing.assert_close(mine, p.grad, rtol=100 * rtol, atol=atol,
                                   msg=lambda m: f"{model_type} {head}: gradient of {name}: {m}")


@pytest.mark.parametrize("model_type", [pytest.param(t, marks=() if t in FAST else pytest.mark.slow)
                                        for t in causal_lm_types()])
def test_every_causal_lm_is_patched_exactly_or_refused_clearly(model_type):
    result, reason = outcome(model_type)
    listed = listed_outcomes().get(model_type)
    assert listed == result, (f"{model_type}: {result} ({reason}), but docs/hf_families.md lists {listed}: "
                              "run python tools/hf_family_table.py")


def large_logit_cases() -> list:
    """(model_type, head) of every type docs/hf_families.md lists as patched, under each head; the
    pairs of :data:`FAST_LARGE` in the default command, the others under ``-m slow``."""
    patched = sorted(t for t, result in listed_outcomes().items() if result == "patched")
    return [pytest.param(t, head, marks=() if FAST_LARGE.get(t) == head else pytest.mark.slow)
            for t in patched for head in HEADS]


def spread(model_type: str):
    """A tiny ``model_type`` with its output layer scaled so that max |logit| ≈ :data:`LARGE_SPAN`."""
    base = tiny_causal_lm(model_type)
    reached = spread_logits(base, LARGE_SPAN, train=model_type in TRAIN_MODE)
    assert abs(reached - LARGE_SPAN) <= 0.02 * LARGE_SPAN, (
        f"{model_type}: scaling the output layer reaches max |logit| {reached:.3g}, not {LARGE_SPAN}")
    return base


@pytest.mark.parametrize("model_type,head", large_logit_cases())
def test_every_patched_causal_lm_is_exact_at_large_logits(model_type, head):
    check_exact(spread(model_type), model_type, head)


@pytest.mark.parametrize("head", HEADS)
def test_bigbird_pegasus_at_large_logits_in_float64_and_float32(head):
    """BigBirdPegasusForCausalLM (an unshifted decoder; its decoder's attention is full, not block-sparse) at
    max |logit| ≈ 12: the patched float64 model equals the float64 reference on the unpatched model's own
    logits, loss and every gradient (check_exact); the patched float32 model equals the patched float64
    one to float32's precision."""
    base = spread("bigbird_pegasus")
    check_exact(base, "bigbird_pegasus", head)
    ids, labels = probe_batch()
    runs = []
    for dtype in (torch.float64, torch.float32):
        model = apply_nmst(copy.deepcopy(base).to(dtype), head=head, eps=0.05, eos_token_id=EOS)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        runs.append((loss, dict(model.named_parameters())))
    (loss64, params64), (loss32, params32) = runs
    torch.testing.assert_close(loss32.double(), loss64, rtol=1e-6, atol=0)
    # Float32's unit roundoff is 6e-8; the forward and backward through two layers round each 64- or 96-wide
    # sum about a dozen times, so an entry is off by ~1e-6 of the gradient's largest (at most 8.1e-7 measured
    # over every parameter and head): 5e-6 of it leaves a 6x margin, and a 1e-3 error fails it 200 times over.
    for name, p in params64.items():
        if p.grad is None:  # the cross-attention, without encoder states (check_exact checks who gets one)
            assert params32[name].grad is None, f"{head}: float32: {name} gets a gradient float64 does not"
            continue
        torch.testing.assert_close(params32[name].grad.double(), p.grad, rtol=0, atol=5e-6 * float(p.grad.abs().max()),
                                   msg=lambda m: f"{head}: float32 against float64: gradient of {name}: {m}")


def test_the_fast_subset_and_the_table_cover_every_type():
    assert FAST <= set(causal_lm_types())
    assert set(FAST_LARGE) <= FAST and set(FAST_LARGE.values()) == set(HEADS)
    assert all(listed_outcomes()[t] == "patched" for t in FAST_LARGE), "FAST_LARGE holds patched types only"
    assert set(listed_outcomes()) == set(causal_lm_types()), "run python tools/hf_family_table.py"


# --- a model type the library has never seen ------------------------------------------------------------------------

class _UnseenGate(torch.nn.Module):
    """A learned gate on the decoder stack's output: a component no transformers type has."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate = torch.nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden * torch.sigmoid(self.gate) * 2


def _register_unseen_types():
    """Two model types registered the way a third-party package registers its own (``AutoConfig.register``,
    ``AutoModelForCausalLM.register``), as a newer transformers would bring new ones: ``nmst_unseen_exact``,
    whose logits are W h of its stack's gated last hidden state, and ``nmst_unseen_capped``, whose forward
    caps its logits with a key of its own (``unseen_cap``) that no probe rule knows. The first one's class derives
    from no transformers causal LM class: only its registration makes it one."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        GenerationMixin,
        LlamaConfig,
        LlamaForCausalLM,
        LlamaModel,
        LlamaPreTrainedModel,
    )
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class UnseenExactConfig(LlamaConfig):
        model_type = "nmst_unseen_exact"

    class UnseenExactModel(LlamaModel):
        config_class = UnseenExactConfig

        def __init__(self, config):
            super().__init__(config)
            self.unseen_gate = _UnseenGate(config.hidden_size)

        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.last_hidden_state = self.unseen_gate(out.last_hidden_state)
            return out

    class UnseenExactForCausalLM(LlamaPreTrainedModel, GenerationMixin):
        """Its own causal LM class (no transformers …ForCausalLM among its bases): stack, output layer, the
        shifted cross-entropy."""
        config_class = UnseenExactConfig

        def __init__(self, config):
            super().__init__(config)
            self.model = UnseenExactModel(config)
            self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

        def get_output_embeddings(self):
            return self.lm_head

        def forward(self, input_ids=None, labels=None, **kwargs):
            out = self.model(input_ids=input_ids, **kwargs)
            logits = self.lm_head(out.last_hidden_state)
            loss = None if labels is None else self.loss_function(logits, labels, vocab_size=self.config.vocab_size)
            return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)

    class UnseenCappedConfig(LlamaConfig):
        model_type = "nmst_unseen_capped"

        def __init__(self, unseen_cap: float = 2.0, **kwargs):
            self.unseen_cap = unseen_cap
            super().__init__(**kwargs)

    class UnseenCappedForCausalLM(LlamaForCausalLM):
        config_class = UnseenCappedConfig

        def forward(self, *args, labels=None, **kwargs):
            out = super().forward(*args, **kwargs)
            cap = self.config.unseen_cap
            out.logits = cap * torch.tanh(out.logits / cap)
            if labels is not None:
                out.loss = self.loss_function(out.logits, labels, vocab_size=self.config.vocab_size)
            return out

    for config, model in ((UnseenExactConfig, UnseenExactForCausalLM), (UnseenCappedConfig, UnseenCappedForCausalLM)):
        AutoConfig.register(config.model_type, config, exist_ok=True)
        AutoModelForCausalLM.register(config, model, exist_ok=True)


@pytest.mark.parametrize("head", HEADS)
def test_a_type_the_library_has_never_seen_goes_through_the_probe(head):
    """A type outside transformers' own mapping (registered in this test, as a newer transformers or a third-party
    package brings one) is patched exactly when the probe finds its logits (check_exact, the sweep's own check, at
    the model's logits and at large ones), and refused, naming the type, when its logits are post-processed in a way
    no rule knows."""
    _register_unseen_types()
    assert "nmst_unseen_exact" not in causal_lm_types()
    check_exact(tiny_causal_lm("nmst_unseen_exact"), "nmst_unseen_exact", head)
    check_exact(spread("nmst_unseen_exact"), "nmst_unseen_exact", head)
    capped = tiny_causal_lm("nmst_unseen_capped")
    spread_logits(capped, LARGE_SPAN)  # the cap bends logits only where they are large
    with pytest.raises(ValueError, match="nmst_unseen_capped.*would not see the model's own logits"):
        apply_nmst(capped, head=head, eps=0.05, eos_token_id=EOS)


# Types whose small copy does not build from the generic shrink (their sizes must agree in ways the shrink does not
# know: the tests' tiny configs set them by hand): the probe runs on the model itself.
NO_SMALL_COPY = {"dory", "kolibri1_1", "mamba2", "zaya"}


@pytest.mark.slow
def test_the_probe_runs_on_a_small_copy_of_every_other_type():
    from nmst_fast.integrations.hf.patch import own_class
    from nmst_fast.integrations.hf.shrink import small_copy

    without = set()
    for model_type in causal_lm_types():
        if model_type in NOT_BUILT or model_type in NOT_TEXT:
            continue
        model = tiny_causal_lm(model_type)
        if small_copy(model, own_class(model)) is None:
            without.add(model_type)
    assert without == NO_SMALL_COPY
