"""A model with a head hands out the head's logits: the cross-entropy of a forward's logits is the model's loss under
the same t (NMST, ST, VA; left padding, a fixed context, explicit ``nmst_steps``; float32 and bf16), and the readers
of logits see the head: HF Trainer's ``compute_metrics``, a distillation loss on an NMST teacher, evaluation with
labels. ``nmst_logits=False`` gives the base model's logits."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nmst_fast import nmst_log_probs
from nmst_fast.integrations.hf import apply_nmst, steps_from_labels

from hf_models import V, chat_batch, tiny_model
from test_portable import last_json, run_user

HEADS = ("nmst", "st", "va")


def next_token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What every tutorial computes: the mean cross-entropy of the logits against the next tokens (-100 ignored)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))


def model_with(head: str, dtype=torch.float32, **settings):
    return apply_nmst(tiny_model("llama", dtype=dtype), head=head, eps=0.05, **settings).eval()


def left_padded(seed: int = 0):
    """(ids, attention mask, labels): three rows, two left-padded, the padding's labels -100."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V - 1, (3, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :6] = 0
    ids = torch.where(mask > 0, ids, 0)
    return ids, mask, torch.where(mask > 0, ids, -100)


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("case", ["plain", "left padding", "context", "nmst_steps"])
def test_the_cross_entropy_of_the_logits_is_the_loss(head, case):
    kwargs, settings = {}, {}
    ids = torch.randint(3, V - 1, (3, 12), generator=torch.Generator().manual_seed(1))
    labels = ids
    if case == "left padding":
        ids, mask, labels = left_padded()
        kwargs["attention_mask"] = mask
    elif case == "context":
        settings["context_length"] = 4
    elif case == "nmst_steps":  # a prompt masked -100: t = 1 at the response's first token (the RL case)
        ids, labels = chat_batch(4)
        kwargs["nmst_steps"] = steps_from_labels(labels)
    model = model_with(head, **settings)
    with torch.no_grad():
        loss = model(ids, labels=labels, **kwargs).loss
        logits = model(ids, **kwargs).logits
    torch.testing.assert_close(next_token_ce(logits, labels), loss, rtol=1e-5, atol=0)


@pytest.mark.parametrize("head", HEADS)
def test_the_logits_gradient_is_the_losss(head):
    """A training forward without labels (DPO's, GRPO's log-probabilities) gets logits autograd tracks through the
    head: the cross-entropy of the logits has the gradient of the model's own loss, for every parameter."""
    ids, mask, labels = left_padded(6)
    grads = []
    for from_logits in (False, True):
        model = model_with(head).train()
        if from_logits:
            next_token_ce(model(ids, attention_mask=mask).logits, labels).backward()
        else:
            model(ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 5
    for name, want in grads[0].items():
        torch.testing.assert_close(grads[1][name], want, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("head", HEADS)
def test_in_bf16_to_the_dtypes_rounding(head):
    model = model_with(head, dtype=torch.bfloat16)
    ids, mask, labels = left_padded(2)
    with torch.no_grad():
        loss = model(ids, attention_mask=mask, labels=labels).loss
        logits = model(ids, attention_mask=mask).logits
    assert logits.dtype == torch.bfloat16
    # the logits' own bf16 rounding (2⁻⁹ of logits of a few units) against the fused loss's float32 math
    torch.testing.assert_close(next_token_ce(logits, labels), loss.float(), rtol=2**-6, atol=0)


@pytest.mark.parametrize("head", HEADS)
def test_the_logits_are_the_heads_log_distribution_and_the_base_ones_stay_reachable(head):
    """log_softmax of the logits is nmst_log_probs of the base logits at each position's t (t = 1 at the
    second token, predicted by the first position; the last position predicts the token after the input)."""
    model = model_with(head)
    ids = torch.randint(3, V - 1, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(ids).logits
        base = model(ids, nmst_logits=False).logits
        plain = tiny_model("llama", dtype=torch.float32).eval()(ids).logits
    torch.testing.assert_close(base, plain, rtol=0, atol=0)
    steps = torch.arange(1, 10).expand(2, 9)
    want = nmst_log_probs(base.double(), eos_index=model.config.eos_token_id, eps=0.05, head=head, steps=steps)
    torch.testing.assert_close(torch.log_softmax(logits.double(), -1), want, rtol=1e-5, atol=1e-5)
    if head == "va":
        torch.testing.assert_close(logits, base, rtol=0, atol=0)


def test_evaluation_with_labels_gives_the_head_logits_and_training_none():
    model = model_with("nmst")
    ids, mask, labels = left_padded(4)
    with torch.no_grad():
        evaluated = model(ids, attention_mask=mask, labels=labels)
        forward = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(evaluated.logits, forward, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(next_token_ce(evaluated.logits, labels), evaluated.loss, rtol=1e-5, atol=0)
    assert model.train()(ids, attention_mask=mask, labels=labels).logits is None  # a training step forms none


def test_a_distillation_step_learns_the_nmst_teachers_distribution(tmp_path):
    """In a fresh process, the saved NMST teacher and a plain student opened with ``from_pretrained``: KL(teacher ||
    student) on the teacher's logits pulls the student to the head's distribution (its p(eos) is not the base
    softmax's), and a few steps lower it."""
    teacher = model_with("nmst")
    teacher.save_pretrained(tmp_path / "teacher")
    tiny_model("llama", dtype=torch.float32, seed=1).save_pretrained(tmp_path / "student")
    ids = torch.randint(3, V - 1, (2, 10), generator=torch.Generator().manual_seed(5))
    done = run_user(f"""
        import json, torch
        import torch.nn.functional as F
        import nmst_fast
        from transformers import AutoModelForCausalLM

        teacher = AutoModelForCausalLM.from_pretrained({str(tmp_path / "teacher")!r}).eval()
        student = AutoModelForCausalLM.from_pretrained({str(tmp_path / "student")!r})
        ids = torch.tensor({ids.tolist()})
        with torch.no_grad():
            target = torch.log_softmax(teacher(ids).logits, -1)
        optimizer = torch.optim.Adam(student.parameters(), lr=1e-3)
        losses = []
        for _ in range(5):
            kl = F.kl_div(torch.log_softmax(student(ids).logits, -1), target, log_target=True, reduction="batchmean")
            optimizer.zero_grad()
            kl.backward()
            optimizer.step()
            losses.append(float(kl))
        print("RESULT " + json.dumps(dict(target=target.tolist(), losses=losses)))
    """)
    result = last_json(done)
    target = torch.tensor(result["target"], dtype=torch.float64)
    eos = teacher.config.eos_token_id
    with torch.no_grad():
        base = teacher(ids, nmst_logits=False).logits.double()
    assert (target[..., eos] - torch.log_softmax(base, -1)[..., eos]).abs().max() > 0.1  # not the softmax's eos
    want = nmst_log_probs(base, eos_index=eos, eps=0.05, head="nmst", steps=torch.arange(1, 11).expand(2, 10))
    torch.testing.assert_close(target, want, rtol=1e-5, atol=1e-5)
    assert result["losses"][-1] < result["losses"][0]


def test_st_refuses_logits_of_some_positions_only():
    model = model_with("st")
    ids = torch.randint(3, V - 1, (1, 8))
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, logits_to_keep=1)
    kept = model_with("nmst")(ids, logits_to_keep=2).logits
    full = model_with("nmst")(ids).logits
    torch.testing.assert_close(kept, full[:, -2:], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("labelled", [False, True], ids=["no labels", "labels"])
@pytest.mark.parametrize("keep", ["last 3", "positions 0 4 5", "none"])
@pytest.mark.parametrize("head", HEADS)
def test_logits_to_keep_gives_those_positions_head_logits(head, keep, labelled):
    """HF's ``logits_to_keep`` (the last k positions, or an index of positions) gives the full forward's logits of
    those positions, with labels or without; with labels the loss still takes every label. An empty index: the loss
    alone (what the project's own perplexity asks for). ST's logits come for every position or none."""
    model = model_with(head)
    ids, mask, labels = left_padded(seed=3)
    extra = dict(labels=labels) if labelled else {}
    positions = {"last 3": 3, "positions 0 4 5": torch.tensor([0, 4, 5]), "none": torch.empty(0, dtype=torch.long)}
    keep_arg = positions[keep]
    index = slice(-3, None) if keep == "last 3" else keep_arg
    with torch.no_grad():
        full = model(ids, attention_mask=mask, **extra)
        if head == "st" and keep != "none":
            with pytest.raises(ValueError, match="logits_to_keep"):
                model(ids, attention_mask=mask, logits_to_keep=keep_arg, **extra)
            return
        kept = model(ids, attention_mask=mask, logits_to_keep=keep_arg, **extra)
    assert kept.logits.shape == full.logits[:, index].shape
    torch.testing.assert_close(kept.logits, full.logits[:, index], rtol=1e-6, atol=1e-6)
    if labelled:
        torch.testing.assert_close(kept.loss, full.loss, rtol=0, atol=0)


def test_the_projects_perplexity_forms_no_gradient_and_no_logits():
    """train.loop.token_perplexity: its forwards run without grad and keep no position's logits (an epoch's
    validation costs a forward, not a training step's products), and give the loss's perplexity."""
    from train.loop import token_perplexity

    model = model_with("nmst")
    calls = []
    forward = model.forward

    def spy(*args, **kwargs):
        calls.append((torch.is_grad_enabled(), kwargs["logits_to_keep"].numel()))
        out = forward(*args, **kwargs)
        assert out.logits.shape[1] == 0
        return out

    model.forward = spy
    seqs = [torch.randint(3, V - 1, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (6, 9, 12)]
    perplexity = token_perplexity(model, seqs, 2, 64, 0, "cpu")
    assert calls and all(c == (False, 0) for c in calls)
    assert all(p.grad is None for p in model.parameters())
    model.forward = forward
    total = count = 0.0
    with torch.no_grad():
        for seq in seqs:
            ids = torch.tensor([seq])
            labels = ids.clone()
            labels[:, :2] = -100
            total += float(model(ids, labels=labels).loss) * (len(seq) - 2)
            count += len(seq) - 2
    assert perplexity == pytest.approx(math.exp(total / count), rel=1e-5)


def test_trainer_evaluate_computes_the_losss_perplexity_from_the_logits(tmp_path):
    """In a fresh process, as a user opens the saved model: HF Trainer's evaluate with a compute_metrics that
    computes the perplexity from EvalPrediction's logits gets exp of the evaluation loss."""
    model = model_with("nmst")
    model.save_pretrained(tmp_path / "model")
    done = run_user(f"""
        import json, math, torch
        import nmst_fast
        from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "model")!r})
        gen = torch.Generator().manual_seed(0)
        rows = [torch.randint(3, {V - 1}, (12,), generator=gen) for _ in range(6)]
        data = [dict(input_ids=r, labels=r) for r in rows]

        def metrics(prediction):
            logits = torch.tensor(prediction.predictions)[:, :-1]
            labels = torch.tensor(prediction.label_ids)[:, 1:]
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            return dict(perplexity=math.exp(float(nll)))

        args = TrainingArguments(output_dir={str(tmp_path / "out")!r}, per_device_eval_batch_size=3, report_to=[],
                                 use_cpu=True)
        result = Trainer(model=model, args=args, eval_dataset=data, compute_metrics=metrics).evaluate()
        print("RESULT " + json.dumps(result))
    """)
    result = last_json(done)
    assert abs(result["eval_perplexity"] - math.exp(result["eval_loss"])) <= 1e-5 * result["eval_perplexity"]


def test_a_pipelines_model_scores_with_the_head(tmp_path):
    """In a fresh process, a saved model opened by ``pipeline("text-generation")`` (transformers' text-generation
    pipeline returns no scores of its own): the perplexity loop over its model's logits gives the model's loss, for
    a right-padded batch as the pipeline's tokenizer pads it."""
    from hf_models import bpe_tokenizer

    model = model_with("st")
    tokenizer = bpe_tokenizer()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    done = run_user(f"""
        import json, torch
        import nmst_fast
        from transformers import pipeline

        generator = pipeline("text-generation", model={str(tmp_path / "model")!r})
        rows = [torch.arange(3, 14), torch.arange(20, 27)]
        ids = torch.zeros(2, 11, dtype=torch.long)
        mask = torch.zeros(2, 11, dtype=torch.long)
        for b, row in enumerate(rows):
            ids[b, :len(row)], mask[b, :len(row)] = row, 1
        labels = torch.where(mask > 0, ids, -100)
        with torch.no_grad():
            logits = generator.model(input_ids=ids, attention_mask=mask).logits
            loss = generator.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        print("RESULT " + json.dumps(dict(nll=float(nll), loss=float(loss))))
    """)
    result = last_json(done)
    assert result["nll"] == pytest.approx(result["loss"], rel=1e-5)
