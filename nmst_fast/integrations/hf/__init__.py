"""Any Hugging Face causal LM with an NMST / ST / VA head.

* :func:`apply_nmst` — train a ``…ForCausalLM`` with the fused loss (no (B, T, V) logits), t per row;
  :func:`class_labels` — labels aligned with the input ids in the convention the model's class scores.
* :func:`score_labels` — the one scoring core: labels under the head on the output layer (the patched forward,
  TRL and lm-eval call it).
* :func:`steps_from_labels`, :func:`steps_from_positions`, :func:`steps_from_attention_mask` — the
  step t of every token, aligned with ``labels``.
* :class:`HFDecoder` — the model under :func:`nmst_fast.generate` (greedy, top-k, nucleus, beam).
* :class:`NMSTLogitsProcessor` — HF ``generate()`` greedy / sampling on the head's distribution.

Modules: :mod:`.structure` (the decoder stack, the output layer, the config's post-processing), :mod:`.settings`
(which head a model carries), :mod:`.probe` (the check that the fused path sees the model's own logits),
:mod:`.steps` (the step rules), :mod:`.scoring` (the core), :mod:`.statistics` (entropy and friends of the head's
distribution), :mod:`.patch` (the patched forward), :mod:`.generation` (decoding).
"""

from .generation import HFDecoder, NMSTLogitsProcessor
from .patch import apply_nmst, class_labels, patched_call
from .scoring import STATISTICS, LabelScores, score_labels
from .settings import nmst_settings, stop_token_ids
from .steps import default_steps, steps_from_attention_mask, steps_from_labels, steps_from_positions
from .structure import SOFTCAP_KEYS, decoder_hidden, decoder_stack, logit_postprocessing, output_head

__all__ = ["HFDecoder", "LabelScores", "NMSTLogitsProcessor", "SOFTCAP_KEYS", "STATISTICS", "apply_nmst",
           "class_labels", "decoder_hidden", "decoder_stack", "default_steps", "logit_postprocessing", "nmst_settings",
           "output_head", "patched_call", "score_labels", "steps_from_attention_mask", "steps_from_labels",
           "steps_from_positions", "stop_token_ids"]
