"""A Hugging Face tokenizer directory rebuilt from a GGUF file's byte-level BPE vocabulary (``tokenizer.ggml.model``
"gpt2": its tokens, merges, token types and bos / eos / padding ids), for machines that reach a package registry
but no model hub. llama-cpp-python's sdist ships llama.cpp's vocabulary-only GGUF files
(``vendor/llama.cpp/models/ggml-vocab-NAME.gguf``, each with test strings and their ids beside it); Command-R's
there is a 256000-token vocabulary, Gemma 2's size, which the gradient filter's trained workload at
8192×2304×256000 takes:

    pip download --no-deps --no-binary :all: -d DIR llama-cpp-python==0.3.36
    python tools/gguf_tokenizer.py DIR/llama_cpp_python-0.3.36.tar.gz command-r OUT_DIR

The pre-tokenizer is llama.cpp's for the file's ``tokenizer.ggml.pre`` (:data:`PRE_TOKENIZERS`: GPT-2's split, and
Command-R's, which first isolates each digit); a vocabulary of another kind or pre-tokenizer is refused. Control
tokens become special tokens, user-defined ones added tokens (matched before BPE, as llama.cpp does). The result
encodes llama.cpp's test strings to llama.cpp's ids (the test checks every one).
"""

from __future__ import annotations

import argparse
import tarfile
import tempfile
from pathlib import Path

# llama.cpp's token types (llama_token_type).
CONTROL, USER_DEFINED = 3, 4

# tokenizer.ggml.pre -> whether each digit is split off first (llama.cpp's "\p{N}" expression before GPT-2's).
PRE_TOKENIZERS = {"gpt-2": False, "default": False, "command-r": True}


def read_vocabulary(path: Path) -> dict:
    """The GGUF file's tokenizer fields: {"model", "pre", "tokens", "merges", "types", "bos", "eos", "pad"}."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def value(name: str, default=None):
        field = reader.fields.get(name)
        return default if field is None else field.contents()

    return dict(model=value("tokenizer.ggml.model"), pre=value("tokenizer.ggml.pre", "default"),
                tokens=value("tokenizer.ggml.tokens"), merges=value("tokenizer.ggml.merges"),
                types=value("tokenizer.ggml.token_type"), bos=value("tokenizer.ggml.bos_token_id"),
                eos=value("tokenizer.ggml.eos_token_id"), pad=value("tokenizer.ggml.padding_token_id"))


def build_tokenizer(vocabulary: dict):
    """A ``PreTrainedTokenizerFast`` of :func:`read_vocabulary`'s fields; ValueError for a vocabulary this tool does
    not rebuild."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocabulary["model"] != "gpt2" or not vocabulary["merges"]:
        raise ValueError(f"tokenizer.ggml.model {vocabulary['model']!r}: only byte-level BPE ('gpt2', with merges) "
                         "is rebuilt")
    if vocabulary["pre"] not in PRE_TOKENIZERS:
        raise ValueError(f"tokenizer.ggml.pre {vocabulary['pre']!r}: the pre-tokenizers rebuilt are "
                         f"{sorted(PRE_TOKENIZERS)}")
    tokens = vocabulary["tokens"]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("the vocabulary lists a token twice")
    merges = [tuple(merge.split(" ", 1)) for merge in vocabulary["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{N}"), "isolated"), byte_level])
                               if PRE_TOKENIZERS[vocabulary["pre"]] else byte_level)
    tokenizer.decoder = decoders.ByteLevel()
    types = vocabulary["types"] or [1] * len(tokens)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == CONTROL])
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    named = {key: tokens[vocabulary[key]] for key in ("bos", "eos", "pad") if vocabulary[key] is not None}
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=named.get("bos"),
                                   eos_token=named.get("eos"), pad_token=named.get("pad"))


def vocabulary_file(source: Path, name: str, scratch: Path) -> Path:
    """``source`` itself if it is a .gguf file, else llama.cpp's ``ggml-vocab-NAME.gguf`` extracted from
    llama-cpp-python's sdist ``source`` into ``scratch``."""
    if source.suffix == ".gguf":
        return source
    wanted = f"vendor/llama.cpp/models/ggml-vocab-{name}.gguf"
    with tarfile.open(source) as archive:
        for member in archive.getmembers():
            if member.name.endswith(wanted):
                out = scratch / Path(wanted).name
                out.write_bytes(archive.extractfile(member).read())
                return out
    raise FileNotFoundError(f"{str(source)!r} holds no {wanted}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path, help="llama-cpp-python's sdist (.tar.gz), or a .gguf file")
    p.add_argument("name", help="the vocabulary in the sdist: ggml-vocab-NAME.gguf (ignored for a .gguf source)")
    p.add_argument("out_dir", type=Path, help="where the tokenizer's files go (save_pretrained)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = build_tokenizer(read_vocabulary(vocabulary_file(args.source, args.name, Path(scratch))))
    tokenizer.save_pretrained(args.out_dir)
    print(f"{args.out_dir}: {len(tokenizer)} tokens")


if __name__ == "__main__":
    main()
