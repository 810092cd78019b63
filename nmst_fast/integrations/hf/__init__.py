"""Any Hugging Face causal LM with an NMST / ST / VA head.

* :func:`apply_nmst` — put a head on a ``…ForCausalLM``: it trains with the fused loss (no (B, T, V) logits),
  ``generate()`` decodes the head, ``save_pretrained`` writes a checkpoint that opens with the head
  (:mod:`.checkpoint`, :mod:`nmst_fast.integrations.nmst_config`) and that tools which cannot know the head refuse;
  :func:`class_labels` — labels aligned with the input ids in the convention the model's class scores.
* :func:`score_labels` — the one scoring core: labels under the head on the output layer (the patched forward,
  TRL and lm-eval call it).
* :func:`steps_from_labels`, :func:`steps_from_positions`, :func:`steps_from_attention_mask` — the
  step t of every token, aligned with ``labels``.
* :class:`HFDecoder` — the model under :func:`nmst_fast.generate` (greedy, top-k, nucleus, beam).

Modules: :mod:`.structure` (the decoder stack, the output layer, the config's post-processing), :mod:`.settings`
(which head a model carries), :mod:`.probe` (the check that the fused path sees the model's own logits),
:mod:`.steps` (the step rules), :mod:`.scoring` (the core), :mod:`.patch` (the NMST model classes),
:mod:`.generation` (decoding), :mod:`.checkpoint` (saved models: opening, upgrading, exporting).
"""

from .checkpoint import export_plain, upgrade_checkpoint
from .generation import HFDecoder
from .patch import NMSTModelMixin, apply_nmst, class_labels, has_head, patched_call
from .scoring import STATISTICS, LabelScores, score_labels
from .settings import nmst_settings, stop_token_ids
from .steps import default_steps, steps_from_attention_mask, steps_from_labels, steps_from_positions
from .structure import SOFTCAP_KEYS, decoder_hidden, decoder_stack, logit_postprocessing, output_head

__all__ = ["HFDecoder", "LabelScores", "NMSTModelMixin", "SOFTCAP_KEYS", "STATISTICS", "apply_nmst",
           "class_labels", "decoder_hidden", "decoder_stack", "default_steps", "export_plain", "has_head",
           "logit_postprocessing", "nmst_settings", "output_head", "patched_call", "score_labels",
           "steps_from_attention_mask", "steps_from_labels", "steps_from_positions", "stop_token_ids",
           "upgrade_checkpoint"]
