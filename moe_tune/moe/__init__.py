"""Mixture-of-Experts building blocks: router, grouped experts, token dispatch, the MoE layer.

Shape suffixes on tensors (torchtitan's habit):
  B batch, S sequence, D model dim, T tokens on this rank (B*S), K top-k, E global experts,
  e local experts (E / ep), R routed rows (T*K before dispatch, rows received after), I expert hidden dim.
  ``x_TD`` tokens x model dim, ``ids_TK`` chosen experts, ``weights_TK`` their gates,
  ``counts_E`` rows per global expert, ``counts_e`` rows per local expert.
  In dispatch code S is the ep group size instead (ranks rows come from or go to): ``counts_Se`` rows from
  each ep rank for each local expert, ``send_S`` rows to each ep rank.

Nothing here imports hydra/omegaconf: specs are plain dataclasses.
"""
