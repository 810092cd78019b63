"""Pure Triton kernels and their launch wrappers, and the C++ CPU row kernels (:mod:`.cpu`): no
autograd, and no imports from the rest of ``nmst_fast`` (the autograd Functions, modules, decoding
and integrations there call into these)."""
