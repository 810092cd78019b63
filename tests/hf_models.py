"""The tests' one set of model and tokenizer builders, and the float64 reference of the head on a model's own logits:
tiny random Hugging Face causal LMs of many families; a word-level tokenizer over their vocabulary (TRL); a tiny Llama
over the project's byte-level BPE (lm-eval, the portable checkpoints); and a Llama that vLLM's CPU build serves, over
a byte-level tokenizer (tests_vllm)."""

import json
import os
from typing import Optional

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
    """A random ``family`` model of :data:`FAMILIES`' tiny config (``extra`` keys, bos and pad ids too, override
    it), logits spread."""
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(family, **{**FAMILIES[family], "bos_token_id": 0, "pad_token_id": 0,
                                                          **extra}, eos_token_id=eos)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    with torch.no_grad():  # random init gives near-uniform logits: spread them so the heads differ
        model.get_output_embeddings().weight.mul_(8.0)
        if model.get_output_embeddings().bias is not None:
            model.get_output_embeddings().bias.normal_()
    return model


def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The tiny models' words: "w1" … "w59" are ids 1 … 59; "<pad>" is 0 and "<eos>" is 60 (their eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, **{f"w{i}": i for i in range(1, V - 1)}, "<eos>": EOS}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


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


def llama3_style_tokenizer(vocab_size: int = 320) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE that splits text with Llama 3's regex (``Split`` then ``ByteLevel`` without its own regex)
    and looks whole words up first (``ignore_merges``), trained on WikiText-shaped lines; eos = bos =
    ``<|end_of_text|>``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from nmst_fast.integrations.llama_cpp.vocabulary import SPLITS

    llama3 = next(pattern for pattern, name in SPLITS.items() if name == "llama-bpe")
    tokenizer = Tokenizer(models.BPE(ignore_merges=True))  # as Llama 3's: a whole word in the vocabulary is one token
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(llama3), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(generated_lines("valid", 400), trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|end_of_text|>",
                                                eos_token="<|end_of_text|>")


def sentencepiece_style_tokenizer(vocab_size: int = 400) -> transformers.PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer: BPE with byte fallback (``<0x00>`` … ``<0xFF>``), spaces written "▁" and one
    put before the text, ``<unk>`` 0, ``<s>`` 1 (added before every text), ``</s>`` 2; trained on WikiText-shaped
    lines."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    specials = ["<unk>", "<s>", "</s>"]
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    trained.train_from_iterator(generated_lines("valid", 400),
                                trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=specials))
    learned = json.loads(trained.to_str())["model"]
    # The byte tokens are ordinary vocabulary entries (as in Llama 2), after the specials, before the merges' tokens.
    order = specials + [f"<0x{i:02X}>" for i in range(256)]
    order += [text for text, _ in sorted(learned["vocab"].items(), key=lambda item: item[1]) if text not in specials]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={text: i for i, text in enumerate(order)}, merges=merges,
                                     unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizer
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(specials)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", 1)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")


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



PEAKED = 64.0  # late_eos_model's output-layer scale: a clear greedy token at most steps


def late_eos_model(family: str, tokenizer, *, seed: int, eos_offset: float, dtype=torch.float32):
    """A random ``family`` model (:data:`FAMILIES`' tiny config; Llama-like decoders and GPT-2) over ``tokenizer``,
    logits spread so that most steps have a likely token, whose eos logit is about ``eos_offset`` plus a fifth of a
    random logit, as :func:`tiny_llama` does for Llama: a final-norm feature that is constant (Llama-like: embedding
    column 0 constant and written by no layer; GPT-2: the final LayerNorm's feature 0 is its bias) and that only the
    eos row reads."""
    eos = tokenizer.eos_token_id
    model = tiny_model(family, seed, dtype, eos=eos, vocab_size=len(tokenizer), bos_token_id=eos, pad_token_id=eos)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.mul_(PEAKED / 8.0)
        if family == "gpt2":
            model.transformer.ln_f.weight[0], model.transformer.ln_f.bias[0] = 0.0, 1.0
        else:
            embedding = model.get_input_embeddings().weight
            embedding[:, 0] = embedding.std()
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight[0] = 0.0
                layer.mlp.down_proj.weight[0] = 0.0
        head[:, 0] = 0.0
        head[eos] *= 0.2  # the rest of eos's logit small beside the offset
        stack = model.transformer if family == "gpt2" else model.model
        ids = torch.arange(len(tokenizer) // 32 * 32).view(-1, 32)  # within every family's position table
        feature = stack(ids).last_hidden_state[..., 0].mean()
        head[eos, 0] = eos_offset / float(feature)
    return model

# --- a Llama that vLLM's CPU build serves, over a byte-level tokenizer -------------------------------------------

SERVED_V = 256 + 8  # 256 bytes, then specials: <s> 256, </s> 257, padding up to 264
SERVED_BOS, SERVED_EOS = 256, 257
SERVED_ST_EOS = 258  # a second eos-like token, for ST requests (ST continues while its eos logit is high)


def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Byte-level tokens 0 … 255 (no merges), then "<s>" (bos), "</s>" (eos) and extras up to :data:`SERVED_V`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    specials = ["<s>", "</s>"] + [f"<extra_{i}>" for i in range(SERVED_V - 258)]
    for i, name in enumerate(specials):
        vocab[name] = 256 + i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


def served_llama(seed: int = 0, eos_scale: float = 0.2, eos_shift: float = 12.0, layers: int = 2,
                 st_eos_shift: float = -8.0):
    """A random-init Llama (hidden 128, 2 heads of 64: vLLM's CPU attention needs head dimension ≥ 32, V =
    :data:`SERVED_V`) in float32 whose logits are spread (output-layer weights of std 0.5: logits of std ~5, clear
    greedy margins) and whose eos logit is about ``eos_scale``·(a random logit) − ``eos_shift``: eos is chosen now
    and then, not at once (NMST stops when the eos logit is high). :data:`SERVED_ST_EOS`'s logit is shifted by
    ``st_eos_shift`` (ST stops when its eos logit is low)."""
    model = tiny_model("llama", seed, torch.float32, eos=SERVED_EOS, vocab_size=SERVED_V, hidden_size=128,
                       intermediate_size=256, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                       head_dim=64, max_position_embeddings=2048, bos_token_id=SERVED_BOS, pad_token_id=None,
                       tie_word_embeddings=False)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.normal_(0.0, 0.5)
        head[SERVED_EOS] *= eos_scale
        # The mean final hidden state h̄ (over random inputs): adding −shift·h̄/|h̄|² to eos's row lowers its
        # logit by about ``eos_shift`` wherever the hidden state is near h̄.
        ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(seed))
        mean = model.model(input_ids=ids).last_hidden_state.reshape(-1, model.config.hidden_size).mean(0)
        head[SERVED_EOS] -= eos_shift * mean / mean.dot(mean)
        head[SERVED_ST_EOS] *= eos_scale
        head[SERVED_ST_EOS] -= st_eos_shift * mean / mean.dot(mean)
    return model


def save_served(directory: str, *, head: Optional[str], eps: float = 1e-5, seed: int = 0) -> str:
    """Save :func:`served_llama` (with ``apply_nmst(head, eps)`` recorded when ``head`` is given) and
    :func:`byte_tokenizer` into ``directory``; returns it."""
    from nmst_fast.integrations.hf import apply_nmst

    model = served_llama(seed)
    if head is not None:
        apply_nmst(model, head=head, eps=eps, eos_token_id=SERVED_EOS)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    with open(os.path.join(directory, "config.json")) as f:
        assert head is None or json.load(f)["nmst"]["head"] == head
    return directory


def load_saved(directory: str):
    """A saved model, float32, in eval mode."""
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


# Qwen3-0.6B's shape: its width, heads and vocabulary (tied embeddings), at any depth (28 layers in the real model).
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=40960,
                 rms_norm_eps=1e-6)


def real_size_qwen3(tokenizer, *, layers: int = 2, seed: int = 0) -> transformers.PreTrainedModel:
    """A random float32 Qwen3 of Qwen3-0.6B's width and vocabulary with ``layers`` layers, eos ``tokenizer``'s (the
    ids beyond the tokenizer's are rows it never produces)."""
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**QWEN3_06B, num_hidden_layers=layers, eos_token_id=tokenizer.eos_token_id,
                                      bos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 1e6}
    return transformers.AutoModelForCausalLM.from_config(config).eval()
