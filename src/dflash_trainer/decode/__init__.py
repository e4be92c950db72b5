"""Decoding with the target: one sampler, one draft-and-accept step, one decode loop.

Layered below train | data | checkpoint and above models: `data/generate.py` (N rows, plain
autoregressive) and `eval/` (1 row, speculative; tau_sim's replay) decode through the same code.
"""
