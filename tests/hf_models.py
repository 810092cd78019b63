"""Tiny random Hugging Face causal LMs of many families, a tiny Llama over a real tokenizer, and a float64 reference
loss on their own logits."""

import torch
import transformers

from nmst_fast import nmst_log_probs
from nmst_fast.data.bpe import train_byte_level_bpe

from wikitext_text import generated_lines

V, EOS = 61, 60
SHARED = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
               max_position_embeddings=64)
GQA = dict(SHARED, num_key_value_heads=2)
# Tiny configs of each family: the logit post-processing (softcap, scale, bias) is what varies.
FAMILIES = {
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=V),
    "llama": GQA,
    "qwen2": GQA,
    "qwen3": dict(GQA, head_dim=8),
    "mistral": GQA,
    "gemma2": dict(GQA, head_dim=8, final_logit_softcapping=3.0),
    "gemma3_text": dict(GQA, head_dim=8, final_logit_softcapping=3.0),
    "gpt_neox": SHARED,
    "gptj": dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4, vocab_size=V),  # lm_head bias
    "opt": dict(SHARED, ffn_dim=48, word_embed_proj_dim=32),
    "granite": dict(GQA, logits_scaling=4.0),
    "cohere": dict(SHARED, logit_scale=0.25),
    "phi3": SHARED,
    "olmo2": SHARED,
}


def tiny_model(family: str, seed: int = 0, dtype=torch.float64, eos=EOS, **extra):
    """A random ``family`` model of :data:`FAMILIES`' tiny config (``extra`` keys override it), logits spread."""
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(family, **{**FAMILIES[family], **extra}, bos_token_id=0, pad_token_id=0,
                                               eos_token_id=eos)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    with torch.no_grad():  # random init gives near-uniform logits: spread them so the heads differ
        model.get_output_embeddings().weight.mul_(8.0)
        if model.get_output_embeddings().bias is not None:
            model.get_output_embeddings().bias.normal_()
    return model


def chat_batch(seed=0, B=3, T=12):
    """Prompts masked with -100 (lengths 2, 5, 0) and one row right-padded: each row starts its own t."""
    ids = torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(seed))
    ids[1, 8] = EOS  # an eos target
    labels = ids.clone()
    labels[0, :2], labels[1, :5] = -100, -100
    labels[2, -3:] = -100
    return ids, labels


# --- the float64 reference of the head on a model's own logits -------------------------------------------------------

def head_log_probs(logits, *, head, eps, eos=EOS, steps=None, temperature=1.0):
    """(B, T, V) float64 log-distribution of the head on a model's own ``logits`` (B, T, V) at the steps ``steps``
    (B, T) (VA reads none): the library's reference, :func:`nmst_fast.nmst_log_probs`."""
    return nmst_log_probs(logits.double(), eos_index=eos, eps=eps, head=head, steps=None if head == "va" else steps,
                          temperature=temperature)


def reference_nll(logits, targets, steps, *, head, eps, eos=EOS, temperature=1.0):
    """(B, T) float64 NLL of ``targets`` (B, T; -100 ignored, NLL 0 there) under the head on ``logits`` (B, T, V),
    position i scoring ``targets[:, i]`` at step ``steps[:, i]``."""
    log_p = head_log_probs(logits, head=head, eps=eps, eos=eos, steps=steps, temperature=temperature)
    nll = -log_p.gather(-1, targets.clamp(min=0).long().unsqueeze(-1)).squeeze(-1)
    return torch.where(targets != -100, nll, 0.0)


def reference_loss(logits, labels, steps, head, eps):
    """Float64 mean NLL of the shifted labels under the head, from the unpatched model's own logits."""
    targets = labels[:, 1:]
    nll = reference_nll(logits[:, :-1], targets, steps[:, 1:], head=head, eps=eps)
    return nll.sum() / (targets != -100).sum()


# --- a tiny Llama over the project's byte-level BPE ------------------------------------------------------------------

SPREAD = 16.0  # the output layer's scale over its random init
POSITIONS = 512  # the random Llamas' max_position_embeddings: lm-eval's max_length unless a test sets one


def bpe_tokenizer(vocab_size: int = 320):
    """The project's byte-level BPE (eos = bos = pad = ``<|endoftext|>``), trained on WikiText-shaped valid lines."""
    return train_byte_level_bpe(generated_lines("valid", 400), vocab_size=vocab_size)


def tiny_llama(tokenizer, *, seed: int, eos_offset: float, dtype=torch.float64):
    """A random 2-layer Llama over ``tokenizer``'s vocabulary, eos its eos, with readable generations.

    Random init gives near-uniform logits, so the output layer is spread (×SPREAD); and the eos logit
    gets an offset of about ``eos_offset`` (negative: NMST / VA keep p(eos) small early, positive:
    ST's survival factor σ(s) stays near 1), so greedy decoding runs several tokens before eos.
    Llama's output layer has no bias: residual feature 0 is made constant instead (embedding
    column 0 constant, no attention / MLP output writes it), so the final norm's feature 0 is always
    positive, and only the eos row reads it: its weight there acts as the offset."""
    torch.manual_seed(seed)
    eos = tokenizer.eos_token_id
    config = transformers.AutoConfig.for_model("llama", **{**GQA, "vocab_size": len(tokenizer),
                                                           "max_position_embeddings": POSITIONS},
                                               bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding[:, 0] = embedding.std()  # about the other features' size: the final norm keeps them readable
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        head = model.get_output_embeddings().weight
        head.mul_(SPREAD)
        head[:, 0] = 0.0  # feature 0 reaches the eos logit alone
        feature = model.model(torch.arange(len(tokenizer))[None]).last_hidden_state[..., 0].mean()
        head[eos, 0] = eos_offset / float(feature)
    return model
