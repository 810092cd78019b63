"""``python -m nmst_fast.integrations.lm_eval [run] --model nmst --model_args pretrained=DIR --tasks …``:
lm-eval's own command line (every option of ``lm-eval``), with the ``"nmst"`` model registered."""

from lm_eval.__main__ import cli_evaluate

from . import NMSTLM  # noqa: F401  (importing the package registers the model "nmst")

if __name__ == "__main__":
    cli_evaluate()
