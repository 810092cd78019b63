"""The patched HF model with what its users combine it with: PEFT LoRA, gradient checkpointing,
torch.autocast bf16 and HF Trainer's gradient accumulation."""

import pytest
import torch
import transformers

from nmst_fast.integrations.hf import apply_nmst, steps_from_labels

from hf_models import EOS, V, chat_batch, reference_loss, tiny_model

peft = pytest.importorskip("peft")  # a test dependency (pyproject.toml extra "test"): present in CI


def _lora(model):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"],
                             init_lora_weights=False)  # nonzero adapters: they change the hidden states
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("head", ["nmst", "va"])
def test_lora_with_the_output_layer_under_modules_to_save(head):
    ids, labels = chat_batch(2)
    torch.manual_seed(1)
    plain = _lora(tiny_model("llama"))
    want = reference_loss(plain(ids).logits, labels, steps_from_labels(labels), head, 0.05)
    want.backward()
    torch.manual_seed(1)
    patched = _lora(apply_nmst(tiny_model("llama"), head=head, eps=0.05))
    loss = patched(input_ids=ids, labels=labels).loss
    loss.backward()
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-10)
    grads = {n: p.grad for n, p in patched.named_parameters() if p.requires_grad}
    want_grads = {n: p.grad for n, p in plain.named_parameters() if p.requires_grad}
    assert grads.keys() == want_grads.keys() and any("lora_A" in n for n in grads)
    assert any("modules_to_save" in n and "lm_head" in n for n in grads)  # the trained copy, not the frozen one
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-8, atol=1e-10, msg=name)


def test_an_adapter_on_the_output_layer_is_refused():
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"])
    model = peft.get_peft_model(apply_nmst(tiny_model("llama")), config)
    ids, labels = chat_batch()
    with pytest.raises(ValueError, match="modules_to_save"):
        model(input_ids=ids, labels=labels)


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    ids, labels = chat_batch(3)
    runs = []
    for checkpointing in (False, True):
        model = apply_nmst(tiny_model("qwen3"), head="st", eps=0.05).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        loss = model(ids, labels=labels).loss
        loss.backward()
        runs.append((loss, [p.grad for p in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = runs
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=0)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_autocast_bf16_matches_the_models_own_bf16_logits(family):
    """Under autocast the fused loss runs in bf16 with fp32 accumulation and returns fp32, as AMP's
    losses do; it is as close to the float64 reference as a loss on the model's own autocast logits."""
    ids, labels = chat_batch(4)
    exact = reference_loss(tiny_model(family)(ids).logits, labels, steps_from_labels(labels), "nmst", 0.05)
    model = apply_nmst(tiny_model(family, dtype=torch.float32), head="nmst", eps=0.05)
    plain = tiny_model(family, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=labels).loss
        own = reference_loss(plain(ids).logits.float(), labels, steps_from_labels(labels), "nmst", 0.05)
    assert loss.dtype == torch.float32
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert abs(float(loss) - float(exact)) <= 2 * abs(float(own) - float(exact)) + 2e-3


def test_autocast_reaches_the_cpu_bf16_path(monkeypatch):
    """torch.autocast("cpu", bf16) around an HF training step (the usual CPU recipe): the fused loss's chunks are
    bf16 (the bf16 GEMMs) and its row pass is the C++ kernels', and the output layer's float32 weight gets a
    float32 gradient."""
    from nmst_fast import row_ops

    seen = []
    original = row_ops.CpuRowOps.lse_and_grad_

    def spy(self, z, *args, **kwargs):
        seen.append(z.dtype)
        return original(self, z, *args, **kwargs)

    monkeypatch.setattr(row_ops.CpuRowOps, "lse_and_grad_", spy)
    model = apply_nmst(tiny_model("llama", dtype=torch.float32), head="nmst", eps=0.05)
    ids, labels = chat_batch(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=labels).loss
    loss.backward()
    weight = model.get_output_embeddings().weight
    assert seen and set(seen) == {torch.bfloat16}
    assert weight.grad.dtype == torch.float32 and torch.isfinite(weight.grad).all()


def test_trainer_gradient_accumulation_makes_the_big_batch_update(tmp_path):
    """Ragged examples (token counts differ between micro-batches): 2 accumulated batches of 2 give
    the parameters of one batch of 4 — the loss is normalized by the global supervised-token count."""
    gen = torch.Generator().manual_seed(5)
    lengths = (5, 11, 7, 9)
    examples = []
    for n in lengths:
        ids = torch.randint(1, V - 1, (n,), generator=gen)
        ids[-1] = EOS
        labels = ids.clone()
        labels[: n // 3] = -100  # a prompt
        examples.append(dict(input_ids=ids, labels=labels))

    def collate(batch):
        width = max(len(e["input_ids"]) for e in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, e in enumerate(batch):
            n = len(e["input_ids"])
            ids[i, :n], labels[i, :n], mask[i, :n] = e["input_ids"], e["labels"], 1
        return dict(input_ids=ids, labels=labels, attention_mask=mask)

    params = []
    for batch, accumulate in ((4, 1), (2, 2)):
        model = apply_nmst(tiny_model("llama", dtype=torch.float32), head="nmst", eps=0.05)
        args = transformers.TrainingArguments(output_dir=str(tmp_path / f"b{batch}"), per_device_train_batch_size=batch,
                                              gradient_accumulation_steps=accumulate, max_steps=1, learning_rate=0.5,
                                              optim="sgd", lr_scheduler_type="constant", report_to=[],
                                              save_strategy="no",
                                              use_cpu=True, dataloader_drop_last=False, seed=0, max_grad_norm=0.0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=examples, data_collator=collate)
        trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(examples)
        trainer.train()
        params.append([p.detach().clone() for p in model.parameters()])
    start = tiny_model("llama", dtype=torch.float32).parameters()
    moved = sum(float((a - b).abs().max()) for a, b in zip(params[0], start))
    assert moved > 1e-3  # the step did something
    for a, b in zip(*params):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
