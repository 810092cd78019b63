"""Fine-tune GPT-2 with a VA / ST / NMST head on WikiText with GPT-2 BPE (the paper's GPT-2 setup).

    python -m train.gpt2 --model-dir GPT2_DIR --tokenizer-dir GPT2_DIR --data-dir WIKITEXT103_DIR \\
        --head nmst --eps 1e-5 --device cuda

The GPT-2 preset of ``python -m train.hf`` (see its help for the recipe, resuming and evaluation):
the model and its tokenizer come from local directories, and the first 10 tokens of every line are
the context.
"""

from __future__ import annotations

from pathlib import Path

from . import hf


def main(argv: list[str] | None = None) -> Path:
    return hf.main(argv, command=hf.parser("python -m train.gpt2", __doc__, preset=True), entry="train.gpt2")


if __name__ == "__main__":
    main()
