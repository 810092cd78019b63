"""Tiny TRL set-ups on CPU: datasets over the tiny models' words (hf_models.word_tokenizer), and a
float64 reference of what a TRL trainer must see from a patched model (its own logits, the head's math)."""

from __future__ import annotations

import copy

import torch

from hf_models import V, head_log_probs, reference_nll


def words(generator: torch.Generator, n: int) -> str:
    return " ".join(f"w{int(i)}" for i in torch.randint(1, V - 1, (n,), generator=generator))


def prompt_completion(seed: int = 0, n: int = 8) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"prompt": [words(g, 2 + i % 3) for i in range(n)],
            "completion": [" " + words(g, 3 + i % 4) for i in range(n)]}


def preferences(seed: int = 0, n: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"prompt": [words(g, 2 + i % 2) for i in range(n)],
            "chosen": [" " + words(g, 3 + i % 3) for i in range(n)],
            "rejected": [" " + words(g, 2 + i % 4) for i in range(n)]}


def reference_steps(targets: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """t of each target, by hand: 1 at each document's first supervised target, counting on; 0 before it and
    at a document's first token (``starts`` (B, T) bool marks the target columns where a document begins)."""
    steps = torch.zeros_like(targets)
    for b in range(targets.shape[0]):
        first = None
        for j in range(targets.shape[1]):
            if starts[b, j]:
                first = None
                continue
            if first is None and targets[b, j] != -100:
                first = j
            steps[b, j] = 0 if first is None else j - first + 1
    return steps


def reference_token_log_probs(plain: torch.nn.Module, call: dict, *, head: str, eps: float, temperature: float):
    """Float64 (B, T') log-probs of each label of one ``fused_lm_head=True`` call (its keyword arguments), from
    the unpatched model's own logits and :func:`nmst_fast.nmst_log_probs`; 0 where the label is -100. Also
    returns the (B, T', V) log-distribution, the targets and the logits it was read from."""
    plain = copy.deepcopy(plain).double()
    ids, mask, positions = call["input_ids"], call.get("attention_mask"), call.get("position_ids")
    with torch.no_grad():  # no KV cache, as training calls: transformers then masks packed documents apart
        logits = plain(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits.double()
    document_start = torch.zeros(ids.shape, dtype=torch.bool)
    document_start[:, 0] = True
    if positions is not None:
        document_start |= positions == 0
    if call.get("shift_labels") is not None:
        targets = call["shift_labels"]
        starts = torch.cat([document_start[:, 1:], torch.ones_like(document_start[:, :1])], dim=1)
    else:
        targets, logits = call["labels"][:, 1:], logits[:, :-1]
        starts = document_start[:, 1:]
    steps = reference_steps(targets, starts)
    log_p = head_log_probs(logits, head=head, eps=eps, steps=steps, temperature=temperature)
    return -reference_nll(logits, targets, steps, head=head, eps=eps, temperature=temperature), log_p, targets, logits


def record_fused_calls(model: torch.nn.Module) -> list:
    """Wrap ``model.forward`` (after a trainer installed its fused head) to keep every ``fused_lm_head=True``
    call's keyword arguments (detached) and output."""
    calls = []
    forward = model.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        if kwargs.get("fused_lm_head"):
            kept = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            calls.append((kept, out))
        return out

    model.forward = recording
    return calls
