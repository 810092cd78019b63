"""Training and evaluation entry points for the paper's experiments (``python -m train``).

corpus      the built-in prefix corpus (no download)
config      TrainConfig: model, head, ε and the paper's optimization recipe
loop        the training loop (AdamW, LR halving, early stopping, atomic checkpoints, resume)
evaluate    perplexity, r_nt(L) under every decoder, p(eos) vs t, examples
report      results.json, report.md and PNG plots
"""
