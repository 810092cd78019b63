"""Pure Triton kernels and their launch wrappers: no autograd, and no imports from the rest of
``nmst_fast`` (the autograd Functions, modules and decoding there call into these)."""
