"""Pure Triton kernels and their launch wrappers (no autograd; see ``nmst_fast`` for that)."""
