"""Write docs/hf_families.md: what ``apply_nmst`` does with every model type that transformers maps to
``AutoModelForCausalLM`` (patched exactly, refused with its reason, or not a text LM), from the family
sweep of tests/test_hf_families.py run on tiny random configs. The sweep's slow tests check each row.

    python tools/hf_family_table.py            # about 5 minutes on 2 cores
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import transformers  # noqa: E402

from hf_families import causal_lm_types  # noqa: E402
from test_hf_families import TABLE, outcome  # noqa: E402


def row(model_type: str) -> str:
    result, reason = outcome(model_type)
    reason = reason.split("): ", 1)[-1]  # the refusal names the class and type: the row does already
    return f"| `{model_type}` | {result} | {reason.replace('|', '/')} |"


def main() -> None:
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    rows = []
    for model_type in causal_lm_types():
        rows.append(row(model_type))
        print(rows[-1], flush=True)
    write_table(rows)


def write_table(rows: list[str]) -> None:
    kinds = ("patched", "refused", "not a text LM", "not built")
    counts = {kind: sum(f"| {kind} |" in line for line in rows) for kind in kinds}
    TABLE.write_text(
        "# Hugging Face causal LMs under `apply_nmst`\n\n"
        f"Every model type that transformers {transformers.__version__} maps to `AutoModelForCausalLM`, built "
        "from a tiny random config (`tests/hf_families.py`) and patched with `apply_nmst`. *Patched*: the loss "
        "and every parameter's gradient equal a float64 reference on the unpatched model's own logits for the "
        "nmst, st and va heads, under the class's own label convention, and the va loss equals the class's own "
        "loss. *Refused*: `apply_nmst` raises a `ValueError` naming the type, with the reason below. *Not a text "
        "LM*: the class does not run on a batch of token ids alone. *Not built*: no tiny config of the type builds "
        "and runs here (the reason says why); the sweep checks that it still fails.\n\n"
        f"{counts['patched']} patched, {counts['refused']} refused, {counts['not a text LM']} not text LMs, "
        f"{counts['not built']} not built. "
        "Written by `python tools/hf_family_table.py`; `python -m pytest tests/test_hf_families.py -m slow` "
        "checks every row.\n\n"
        "| model type | outcome | note |\n|---|---|---|\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
