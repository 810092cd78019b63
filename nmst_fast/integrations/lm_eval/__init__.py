"""lm-evaluation-harness (0.4.13) on a model's NMST / ST / VA head: the lm-eval model ``"nmst"``.

Importing this package registers :class:`~.model.NMSTLM` with lm-eval under the name ``"nmst"``; the
command line runs lm-eval's own CLI with it registered (every lm-eval option passes through)::

    python -m nmst_fast.integrations.lm_eval run --model nmst --model_args pretrained=DIR --tasks TASK ...

What it scores and how: :mod:`.model`.
"""

from .model import NMSTLM, head_settings

__all__ = ["NMSTLM", "head_settings"]
