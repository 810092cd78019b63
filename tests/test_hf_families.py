"""Every model type transformers maps to ``AutoModelForCausalLM``: ``apply_nmst`` patches it exactly
or refuses it with a ValueError naming the type, never silently wrong.

Exact means the patched loss, for the nmst, st and va heads, equals a float64 reference computed
from the unpatched model's own logits under the class's own label convention, and every parameter's
gradient equals the reference's (a parameter the fused path leaves without its gradient fails).
The outcome of each type is the row docs/hf_families.md lists for it (``python
tools/hf_family_table.py`` writes the table). A few types of each kind run in the default test
command, the whole sweep under ``-m slow``.
"""

import copy
import re
from pathlib import Path

import pytest
import torch

from nmst_fast import nmst_log_probs
from nmst_fast.integrations.hf import apply_nmst

from hf_families import (
    EOS,
    NOT_BUILT,
    NOT_TEXT,
    TRAIN_MODE,
    UNSHIFTED,
    causal_lm_types,
    probe_batch,
    targets_and_steps,
    tiny_causal_lm,
)

TABLE = Path(__file__).resolve().parents[1] / "docs" / "hf_families.md"
# One of each kind: plain pre-norm, softcap (Gemma's key and RecurrentGemma's), output bias, unshifted labels (a
# decoder of an encoder-decoder), mixture of experts, a hybrid state-space stack, Llama 4 (decoder under .model),
# and refusals (an output layer with its own forward; a transform before the output layer).
FAST = {"llama", "gemma2", "recurrent_gemma", "gptj", "bart", "mixtral", "jamba", "llama4_text", "dory", "rembert"}


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
    for head in ("nmst", "st", "va"):
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
    log_p = nmst_log_probs(logits.double(), eos_index=EOS, eps=0.05, head=head, steps=None if head == "va" else steps)
    active = targets != -100
    nll = -log_p.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    want = torch.where(active, nll, 0.0).sum() / active.sum()
    want.backward()
    loss = patched(input_ids=ids, labels=labels).loss
    loss.backward()
    # A model whose own logits come out in float32 (a float64 layer's output upcast: xLSTM, mllama) is
    # exact to float32's precision; the others to float64's.
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


def test_the_fast_subset_and_the_table_cover_every_type():
    assert FAST <= set(causal_lm_types())
    assert set(listed_outcomes()) == set(causal_lm_types()), "run python tools/hf_family_table.py"
