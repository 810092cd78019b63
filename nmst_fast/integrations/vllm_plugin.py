"""vLLM's general plugin (entry-point group ``vllm.general_plugins``, run in every vLLM process): vLLM opens the
NMST checkpoint type (:mod:`nmst_fast.integrations.nmst_config`).

vLLM reads a model's config through transformers' ``AutoConfig`` (which knows ``"nmst"`` once ``nmst_fast`` is
imported) and picks its model class by ``architectures``: ``NMST<Arch>`` is registered for every architecture
vLLM serves, as that architecture's own class, so the base model runs as vLLM runs it. The head itself is the
logits processor of :mod:`nmst_fast.integrations.vllm` (entry-point group ``vllm.logits_processors``), which
reads the config's ``nmst`` entry. Without this plugin (nmst-fast not installed, or ``VLLM_PLUGINS`` naming
others only), vLLM refuses the directory: it knows neither the type nor the architecture.

This module imports no vLLM code until :func:`register` runs, and nothing of the processor's.
"""

from __future__ import annotations


def register() -> None:
    """Idempotent: ``NMST<Arch>`` for every architecture vLLM serves; transformers' ``AutoConfig`` knows "nmst"."""
    from vllm import ModelRegistry

    import nmst_fast  # noqa: F401  (its import hooks register "nmst" with AutoConfig)

    served = set(ModelRegistry.get_supported_archs())
    for arch in sorted(served):
        name = f"NMST{arch}"
        if arch.startswith("NMST") or name in served:
            continue
        entry = ModelRegistry.models[arch]
        module, cls = getattr(entry, "module_name", None), getattr(entry, "class_name", None)
        ModelRegistry.register_model(name, f"{module}:{cls}" if module and cls else entry.model_cls)
