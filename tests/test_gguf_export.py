"""nmst-fast export-gguf: what the file holds, read back with the gguf package's reader (llama.cpp itself decodes
the files in tests_llama_cpp/, in their own virtualenv)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nmst_fast.integrations.hf import apply_nmst
from nmst_fast.integrations.llama_cpp import export_gguf
from nmst_fast.integrations.llama_cpp.metadata import read_head

from hf_models import bpe_tokenizer, llama3_style_tokenizer, sentencepiece_style_tokenizer, tiny_model, word_tokenizer

gguf = pytest.importorskip("gguf")

FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2"}


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer()


def save(directory, family, tokenizer, *, head="nmst", eps=0.05, seed=0, **extra):
    """A tiny ``family`` model over ``tokenizer`` saved with the head (``head`` None: without)."""
    model = tiny_model(family, seed=seed, dtype=torch.float32, eos=tokenizer.eos_token_id, vocab_size=len(tokenizer),
                       **extra)
    if head is not None:
        apply_nmst(model, head=head, eps=eps)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


def fields(path):
    reader = gguf.GGUFReader(path)
    return reader, {key: field.contents() for key, field in reader.fields.items()}


equal = np.testing.assert_array_equal


def hf_weight(model, name):
    return model.state_dict()[name].float()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_writes_llama_cpps_names_and_keys_under_the_nmst_architecture(family, tokenizer, tmp_path):
    model = save(tmp_path / "m", family, tokenizer, head="st", eps=1e-3)
    out = export_gguf(tmp_path / "m", tmp_path / "m.gguf", dtype="f32")
    reader, kv = fields(out)
    base = FAMILIES[family]
    assert kv["general.architecture"] == f"nmst-{base}"
    settings, recorded_base = read_head(kv)
    assert (settings.head, settings.eps, settings.eos_token_id, recorded_base) == ("st", 1e-3,
                                                                                   tokenizer.eos_token_id, base)
    config = model.config
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    assert kv[f"{base}.block_count"] == layers
    assert kv[f"{base}.vocab_size"] == config.vocab_size
    assert kv["general.file_type"] == gguf.LlamaFileType.ALL_F32
    names = {t.name for t in reader.tensors}
    per_layer = {n.split(".", 2)[2] for n in names if n.startswith("blk.0.")}
    expected = {"llama": {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                          "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}}
    expected["qwen2"] = expected["llama"] | {"attn_q.bias", "attn_k.bias", "attn_v.bias"}
    expected["qwen3"] = expected["llama"] | {"attn_q_norm.weight", "attn_k_norm.weight"}
    expected["gpt2"] = {"attn_norm.weight", "attn_norm.bias", "attn_qkv.weight", "attn_qkv.bias", "attn_output.weight",
                        "attn_output.bias", "ffn_norm.weight", "ffn_norm.bias", "ffn_up.weight", "ffn_up.bias",
                        "ffn_down.weight", "ffn_down.bias"}
    assert per_layer == expected[base]
    assert len([n for n in names if n.startswith("blk.")]) == layers * len(expected[base])
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert ("output.weight" in names) == (not tied)  # llama.cpp reads a tied output layer from token_embd
    assert {"token_embd.weight", "output_norm.weight"} <= names


def as_pickle(directory) -> None:
    """The checkpoint's weights as torch's pickle, ``pytorch_model.bin``, as transformers 4 could save them (5 writes
    safetensors only)."""
    from safetensors.torch import load_file

    path = directory / "model.safetensors"
    torch.save(load_file(path), directory / "pytorch_model.bin")
    path.unlink()


# How the checkpoint is saved (one safetensors file, shards and their index, torch's pickle) and how many bytes of
# float32 the export converts per block (the default: whole tensors here; 512: a few rows per block).
SAVED_AS = {"one file": {}, "shards": {"max_shard_size": "100KB"}, "pickle": {}}


@pytest.mark.parametrize("saved_as, block_bytes", [("one file", None), ("one file", 512), ("shards", 512),
                                                   ("pickle", None)])
def test_f32_tensors_are_the_weights_permuted_as_llama_cpps_rotary_layout_needs(saved_as, block_bytes, tokenizer,
                                                                                 tmp_path, monkeypatch):
    """Llama's q / k rows: each head's halves interleaved (row 2i of a head is its row i, row 2i+1 its row i + d/2);
    v and every other tensor as saved (GGUF lists the dimensions innermost first); from every way a checkpoint is
    saved, streamed in blocks of rows."""
    import nmst_fast.integrations.llama_cpp.export as export

    model = save(tmp_path / "m", "llama", tokenizer)
    if saved_as != "one file":
        model.save_pretrained(tmp_path / "s", **SAVED_AS[saved_as])
        tokenizer.save_pretrained(tmp_path / "s")
        if saved_as == "pickle":
            as_pickle(tmp_path / "s")
        (tmp_path / "m").rename(tmp_path / "unused")
        (tmp_path / "s").rename(tmp_path / "m")
        assert (tmp_path / "m" / ("model.safetensors.index.json" if saved_as == "shards" else "pytorch_model.bin")
                ).is_file()
    if block_bytes:
        monkeypatch.setattr(export, "BLOCK_BYTES", block_bytes)
    reader, _ = fields(export_gguf(tmp_path / "m", tmp_path / "m.gguf", dtype="f32"))
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    q = hf_weight(model, "model.layers.1.self_attn.q_proj.weight").numpy()
    heads, rows = model.config.num_attention_heads, q.shape[0]
    d = rows // heads
    order = [h * d + (j // 2 if j % 2 == 0 else d // 2 + j // 2) for h in range(heads) for j in range(d)]
    equal(tensors["blk.1.attn_q.weight"], q[order])
    k = hf_weight(model, "model.layers.0.self_attn.k_proj.weight").numpy()
    kv_heads = model.config.num_key_value_heads
    order = [h * d + (j // 2 if j % 2 == 0 else d // 2 + j // 2) for h in range(kv_heads) for j in range(d)]
    equal(tensors["blk.0.attn_k.weight"], k[order])
    equal(tensors["blk.0.attn_v.weight"], hf_weight(model, "model.layers.0.self_attn.v_proj.weight"))
    equal(tensors["output.weight"], hf_weight(model, "lm_head.weight"))
    equal(tensors["token_embd.weight"], hf_weight(model, "model.embed_tokens.weight"))


def test_gpt2s_conv1d_weights_are_transposed_and_qwen_keeps_its_layout(tokenizer, tmp_path, monkeypatch):
    import nmst_fast.integrations.llama_cpp.export as export

    monkeypatch.setattr(export, "BLOCK_BYTES", 700)  # a few columns of the source per block
    model = save(tmp_path / "g", "gpt2", tokenizer)
    reader, _ = fields(export_gguf(tmp_path / "g", tmp_path / "g.gguf", dtype="f32"))
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    equal(tensors["blk.0.attn_qkv.weight"], hf_weight(model, "transformer.h.0.attn.c_attn.weight").T)
    equal(tensors["blk.1.ffn_down.weight"], hf_weight(model, "transformer.h.1.mlp.c_proj.weight").T)
    model = save(tmp_path / "q", "qwen3", tokenizer)
    reader, _ = fields(export_gguf(tmp_path / "q", tmp_path / "q.gguf", dtype="f32"))
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    equal(tensors["blk.0.attn_q.weight"], hf_weight(model, "model.layers.0.self_attn.q_proj.weight"))
    equal(tensors["blk.0.attn_q_norm.weight"], hf_weight(model, "model.layers.0.self_attn.q_norm.weight"))


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_f16_and_q8_0_hold_the_weights_to_their_precision_and_keep_vectors_f32(dtype, tokenizer, tmp_path):
    model = save(tmp_path / "m", "qwen2", tokenizer)
    reader, kv = fields(export_gguf(tmp_path / "m", tmp_path / "m.gguf", dtype=dtype))
    file_types = {"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    assert kv["general.file_type"] == file_types[dtype]
    matrix = {"f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[dtype]
    for t in reader.tensors:  # GGUF lists a tensor's dimensions innermost first: shape[0] is a row's length
        expected = gguf.GGMLQuantizationType.F32 if len(t.shape) == 1 else \
            matrix if t.shape[0] % 32 == 0 else gguf.GGMLQuantizationType.F16  # q8_0 needs rows of 32-value blocks
        assert t.tensor_type == expected, t.name
    assert {t.name for t in reader.tensors if t.tensor_type == matrix} >= {"token_embd.weight", "blk.0.ffn_up.weight"}
    weight = {t.name: t for t in reader.tensors}["blk.0.ffn_up.weight"]
    values = gguf.quants.dequantize(weight.data, weight.tensor_type).reshape(-1)
    saved = hf_weight(model, "model.layers.0.mlp.up_proj.weight").numpy().reshape(-1)
    # f16: rounding to 11 significant bits (subnormals: to 2^-24); q8_0: per block of 32, a scale of the block's
    # largest magnitude / 127 (stored f16) and values rounded to it.
    if dtype == "f16":
        bound = np.maximum(np.abs(saved) * 2.0 ** -11, 2.0 ** -25)
    else:
        bound = np.repeat(np.abs(saved.reshape(-1, 32)).max(1) / 127 * (0.5 + 127 * 2.0 ** -11), 32)
    assert (np.abs(values - saved) <= bound * (1 + 1e-6)).all()
    assert np.abs(values - saved).max() > 0


def test_the_byte_level_tokenizer_is_written_as_llama_cpps_gpt2_model(tokenizer, tmp_path):
    save(tmp_path / "m", "llama", tokenizer)
    _, kv = fields(export_gguf(tmp_path / "m", tmp_path / "m.gguf"))
    vocab = tokenizer.get_vocab()
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "gpt-2"
    assert kv["tokenizer.ggml.tokens"] == sorted(vocab, key=vocab.get)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    assert kv["tokenizer.ggml.merges"] == [" ".join(m) for m in merges]
    eos = tokenizer.eos_token_id
    assert kv["tokenizer.ggml.token_type"][eos] == gguf.TokenType.CONTROL
    assert kv["tokenizer.ggml.token_type"].count(gguf.TokenType.NORMAL) == len(vocab) - 1
    assert kv["tokenizer.ggml.eos_token_id"] == eos and kv["tokenizer.ggml.add_bos_token"] is False


def test_llama3s_split_is_named_and_a_sentencepiece_style_vocabulary_is_scored_by_merge_rank(tmp_path):
    llama3 = llama3_style_tokenizer()
    save(tmp_path / "a", "llama", llama3)
    _, kv = fields(export_gguf(tmp_path / "a", tmp_path / "a.gguf"))
    assert (kv["tokenizer.ggml.model"], kv["tokenizer.ggml.pre"]) == ("gpt2", "llama-bpe")

    spm = sentencepiece_style_tokenizer()
    save(tmp_path / "b", "mistral", spm)
    _, kv = fields(export_gguf(tmp_path / "b", tmp_path / "b.gguf"))
    assert kv["tokenizer.ggml.model"] == "llama" and kv["tokenizer.ggml.add_space_prefix"] is True
    assert kv["tokenizer.ggml.add_bos_token"] is True and kv["tokenizer.ggml.bos_token_id"] == 1
    types, scores, tokens = kv["tokenizer.ggml.token_type"], kv["tokenizer.ggml.scores"], kv["tokenizer.ggml.tokens"]
    assert types[:3] == [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    assert types[3:259] == [gguf.TokenType.BYTE] * 256 and tokens[3] == "<0x00>"
    merges = json.loads(spm.backend_tokenizer.to_str())["model"]["merges"]
    for rank, (left, right) in enumerate(merges[:50]):
        assert scores[tokens.index(left + right)] == -(rank + 1)


@pytest.mark.parametrize("case, message", [
    ("plain", "holds no NMST head"),
    ("gemma2", "no writer for the model type 'gemma2'"),
    ("rope", "rotary embedding is scaled"),
    ("word", "is a WordLevel model"),
    ("split", "llama.cpp has no split known to equal it"),
    ("dtype", "dtype must be one of"),
])
def test_what_the_export_cannot_write_is_refused_by_name_and_leaves_no_file(case, message, tokenizer, tmp_path):
    from tokenizers import Regex, pre_tokenizers

    directory = tmp_path / "m"
    if case == "plain":
        save(directory, "llama", tokenizer, head=None)
    elif case == "gemma2":
        save(directory, "gemma2", tokenizer)
    elif case == "rope":
        save(directory, "llama", tokenizer, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    elif case == "word":
        save(directory, "llama", word_tokenizer())
    elif case == "split":
        odd = bpe_tokenizer()
        odd.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\d"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        save(directory, "llama", odd)
    else:
        save(directory, "llama", tokenizer)
    with pytest.raises(ValueError, match=message):
        export_gguf(directory, tmp_path / "m.gguf", dtype="q4" if case == "dtype" else "f16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_the_command_writes_the_file_and_refuses_with_a_message(tokenizer, tmp_path):
    save(tmp_path / "m", "gpt2", tokenizer)
    done = subprocess.run([sys.executable, "-m", "nmst_fast.cli", "export-gguf", str(tmp_path / "m"),
                           str(tmp_path / "m.gguf"), "--type", "q8_0"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "architecture nmst-gpt2 (plain llama.cpp refuses it)" in done.stdout
    assert fields(tmp_path / "m.gguf")[1]["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    save(tmp_path / "p", "gpt2", tokenizer, head=None)
    done = subprocess.run([sys.executable, "-m", "nmst_fast.cli", "export-gguf", str(tmp_path / "p"),
                           str(tmp_path / "p.gguf")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "nmst-fast export-gguf:" in done.stderr and "no NMST head" in done.stderr


def test_the_export_streams_the_checkpoint_and_never_builds_the_model(tokenizer, tmp_path, monkeypatch):
    """The weights are read from the checkpoint's files a block of rows at a time: no model class is instantiated,
    and no read is larger than a block (BLOCK_BYTES of float32, or one head's rows of q / k)."""
    import transformers

    import nmst_fast.integrations.llama_cpp.export as export

    save(tmp_path / "m", "qwen3", tokenizer)
    for auto in ("AutoModel", "AutoModelForCausalLM"):
        monkeypatch.setattr(getattr(transformers, auto), "from_pretrained", None)
    monkeypatch.setattr(export, "BLOCK_BYTES", 2048)
    largest = []
    read = export._Checkpoint.read
    monkeypatch.setattr(export._Checkpoint, "read",
                        lambda self, *a: largest.append((t := read(self, *a)).numel() * 4) or t)
    out = export_gguf(tmp_path / "m", tmp_path / "m.gguf", dtype="q8_0")
    head_rows = 16 * 32 * 4  # one q / k head: head_dim rows of hidden_size
    assert len(gguf.GGUFReader(out).tensors) > 10 and max(largest) <= max(2048, head_rows)


# A case is a process of the console script (7-12 s each: torch and transformers imported): one per command in the
# fast set, the others in the slow set.
@pytest.mark.parametrize("command, message", [
    (["export-gguf", "{missing}", "{tmp}/out.gguf"], "{missing} has no config.json: not a saved model directory"),
    pytest.param(["export-gguf", "{empty}", "{tmp}/out.gguf"],
                 "{empty} has no config.json: not a saved model directory", marks=pytest.mark.slow),
    pytest.param(["export-gguf", "{model}", "{missing}/out.gguf"],
                 "{missing} does not exist: the GGUF file's directory must", marks=pytest.mark.slow),
    pytest.param(["export-gguf", "{config_only}", "{tmp}/out.gguf"], "{config_only} holds no weights",
                 marks=pytest.mark.slow),
    pytest.param(["export-plain", "{missing}", "{tmp}/plain"],
                 "{missing} has no config.json: not a saved model directory", marks=pytest.mark.slow),
    (["export-plain", "{model}", "{model}"], "{model} exists: export-plain writes a new directory"),
    (["upgrade", "{missing}"], "{missing} has no config.json: not a saved model directory"),
])
def test_a_wrong_path_gets_one_line_naming_it_and_exit_status_2(command, message, tokenizer, tmp_path):
    """As a user runs the command (the installed console script): one line on stderr, no traceback."""
    paths = {"tmp": tmp_path, "missing": tmp_path / "nonexistent", "empty": tmp_path / "empty",
             "model": tmp_path / "m", "config_only": tmp_path / "c"}
    (tmp_path / "empty").mkdir()
    save(tmp_path / "m", "llama", tokenizer)
    (tmp_path / "c").mkdir()
    shutil.copy(tmp_path / "m" / "config.json", tmp_path / "c" / "config.json")
    done = subprocess.run([Path(sys.executable).with_name("nmst-fast"), *[a.format(**paths) for a in command]],
                          capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines[0].startswith(f"nmst-fast {command[0]}: {message.format(**paths)}"), lines


def test_the_head_is_read_from_the_header_alone(tokenizer, tmp_path):
    """read_file_keys (what load() reads before llama.cpp opens the file) gives the keys gguf's reader gives, and
    stops after the head's last key, written before the tokenizer's arrays: bytes after it are never read. A file
    with the head's keys after other arrays (written otherwise) is read through to them."""
    from nmst_fast.integrations.llama_cpp.metadata import ARCHITECTURE, KEYS, T_CONVENTION, read_file_keys

    save(tmp_path / "m", "qwen3", tokenizer, eps=0.125)
    path = export_gguf(tmp_path / "m", tmp_path / "m.gguf", dtype="f32")
    _, kv = fields(path)
    want = {key: value for key, value in kv.items() if key == ARCHITECTURE or key.startswith("nmst.")}
    assert read_file_keys(path) == want and want[KEYS["eps"]] == "0.125"
    data = bytearray(path.read_bytes())
    end = data.index(T_CONVENTION.encode()) + len(T_CONVENTION)
    data[end:end + 4096] = b"\xff" * 4096  # the tokenizer's arrays, garbled
    garbled = tmp_path / "garbled.gguf"
    garbled.write_bytes(bytes(data))
    assert read_file_keys(garbled) == want

    writer = gguf.GGUFWriter(tmp_path / "later.gguf", "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"token{i}" for i in range(1000)])
    writer.add_array("tokenizer.ggml.scores", [0.5] * 1000)
    for key, value in want.items():
        if key != ARCHITECTURE:
            writer.add_string(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert read_file_keys(tmp_path / "later.gguf") == {**want, ARCHITECTURE: "llama"}
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_file_keys(tmp_path / "not.gguf")
