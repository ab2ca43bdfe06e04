"""Mixture-of-Experts building blocks: router, grouped experts, token dispatch, the MoE layer.

Shape suffixes on tensors (torchtitan's habit), one meaning per letter across moe_tune:
  B batch, S sequence, D model dim, T tokens on this rank (B*S), K top-k, E global experts,
  e local experts (E / ep), R routed rows (T*K before dispatch, rows received after), I expert hidden dim,
  G ranks of the ep group (where rows come from or go to), N tokens received by DeepEP (each once, with
  every local expert it chose), P (received token, top-k slot) pairs (N*K), C a rank's fixed receive capacity
  in rows (symm_mem), L MoE layers, V vocabulary.
  ``x_TD`` tokens x model dim, ``ids_TK`` chosen experts, ``weights_TK`` their gates,
  ``counts_E`` rows per global expert, ``counts_e`` rows per local expert, ``counts_Ge`` rows from each ep
  rank for each local expert, ``send_G`` rows to each ep rank, ``counts_LE`` per layer and expert.

Nothing here imports hydra/omegaconf: specs are plain dataclasses.
"""
