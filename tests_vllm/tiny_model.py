"""A tiny random Llama saved with a local byte-level tokenizer, for the vLLM tests (no model hub)."""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

VOCAB = 256 + 8  # 256 bytes, then specials: <s> 256, </s> 257, padding up to 264
BOS, EOS = 256, 257
ST_EOS = 258  # a second eos-like token, for ST requests (ST continues while its eos logit is high)


def save_tokenizer(directory: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    specials = ["<s>", "</s>"] + [f"<extra_{i}>" for i in range(VOCAB - 258)]
    for i, name in enumerate(specials):
        vocab[name] = 256 + i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)


def build_model(seed: int = 0, eos_scale: float = 0.2, eos_shift: float = 12.0, layers: int = 2,
                st_eos_shift: float = -8.0):
    """A random-init Llama (hidden 128, 2 heads of 64, V = 264) in float32 whose logits are spread
    (output-layer weights of std 0.5: logits of std ~5, clear greedy margins) and whose eos logit is
    about ``eos_scale``·(a random logit) − ``eos_shift``: eos is chosen now and then, not at once (NMST
    stops when the eos logit is high). ST_EOS's logit is shifted by ``st_eos_shift`` (ST stops when its
    eos logit is low)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                         bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.normal_(0.0, 0.5)
        head[EOS] *= eos_scale
        # The mean final hidden state h̄ (over random inputs): adding −shift·h̄/|h̄|² to eos's row lowers its
        # logit by about ``eos_shift`` wherever the hidden state is near h̄.
        ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(seed))
        mean = model.model(input_ids=ids).last_hidden_state.reshape(-1, config.hidden_size).mean(0)
        head[EOS] -= eos_shift * mean / mean.dot(mean)
        head[ST_EOS] *= eos_scale
        head[ST_EOS] -= st_eos_shift * mean / mean.dot(mean)
    return model


def save_model(directory: str, *, head: Optional[str], eps: float = 1e-5, seed: int = 0) -> str:
    """Save the tiny model (with ``apply_nmst(head, eps)`` recorded when ``head`` is given) and its
    tokenizer into ``directory``; returns it."""
    from nmst_fast.integrations.hf import apply_nmst

    model = build_model(seed)
    if head is not None:
        apply_nmst(model, head=head, eps=eps, eos_token_id=EOS)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    save_tokenizer(directory)
    with open(os.path.join(directory, "config.json")) as f:
        assert head is None or json.load(f)["nmst"]["head"] == head
    return directory


def load_model(directory: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval()
