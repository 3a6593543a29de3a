"""Model sizes and the α–β communication cost model, for the latency study (experiments/lib/latency.py).

Sizes come from the model interface (noloco_jax/models/): the paper's three Llama sizes as presets.
The α–β model prices a message of S bytes at α + S·β seconds (α: latency per message, β: seconds
per byte of the link) and compares a ring or tree all-reduce with NoLoCo's pair exchange. The bytes
and the messages of each exchange are noloco_jax/outer/wire.py's, the definitions the training
metrics use (comm/bytes_sent_per_replica): an exchange's time is wire.Traffic.seconds(α, β).
"""

from __future__ import annotations

from typing import Sequence

from noloco_jax import models
from noloco_jax.outer import wire

# ----------------------------------------------------------------------------------------------------
# Model sizes
# ----------------------------------------------------------------------------------------------------

#: Vocabulary of the reference code (Llama-3 tokenizer plus two added tokens).
PAPER_VOCAB_SIZE = 128_002

#: The paper's three models: presets of the Llama implementation (noloco_jax/models/llama.py).
PAPER_MODELS = ("small", "medium", "large")
#: Sequence length of the paper's runs (the parameter count does not depend on it).
PAPER_SEQ_LEN = 1024

#: Bytes per parameter of the dtypes a model copy may be sent in.
BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2}


def paper_model_params(name: str, vocab_size: int = PAPER_VOCAB_SIZE, arch: str = "llama") -> int:
  """Parameter count of one of the paper's models ("small", "medium", "large"), from the model interface."""
  return models.get(arch).from_preset(name, vocab_size=vocab_size, seq_len=PAPER_SEQ_LEN).num_params()


def model_bytes(num_params: int, dtype: str) -> int:
  """S in the α–β model: bytes of one full model copy in `dtype`."""
  return num_params * BYTES_PER_PARAM[dtype]


# ----------------------------------------------------------------------------------------------------
# α–β cost model
# ----------------------------------------------------------------------------------------------------
# A message of m bytes costs α + m·β (α: per-message latency in s, β: s per byte = 8 / link bits/s).
# P workers, S bytes per model copy. Formulas as in docs/method.md §6, each wire.Traffic.seconds of the
# exchange in outer/wire.py (messages in sequence · α + bytes along the critical path · β):
#   ring all-reduce   2(P−1)·α + 2(P−1)/P·S·β   (each worker sends and receives 2(P−1)/P·S ≈ 2·S)
#   tree all-reduce   2·log2(P)·(α + S·β)        (whole copies up and down the tree)
#   pair exchange     α + S·β                    (lean: each member sends one copy, both directions at
#                                                 once on a full-duplex link)
#   pair, reference   2·(α + 2·S·β)              (the reference code: φ and Δ, i.e. 2·S, go to the
#                                                 root member, and 2·S come back, one after the other;
#                                                 not an exchange of this code, so not in wire.py)
# This model has no variability: it shows the bandwidth-bound regime, where the pair's advantage over
# a ring is at most about 2x per round, and none per inner step if it syncs twice as often.


def seconds_per_byte(link_bits_per_second: float) -> float:
  """β for a link of the given bandwidth in bits per second."""
  return 8.0 / link_bits_per_second


def ring_allreduce_alpha_beta(p: int, s_bytes: float, alpha: float, beta: float) -> float:
  """Ring all-reduce: 2(P−1)·α + 2(P−1)/P·S·β."""
  return wire.allreduce(s_bytes, p, "ring").seconds(alpha, beta)


def tree_allreduce_alpha_beta(p: int, s_bytes: float, alpha: float, beta: float) -> float:
  """Binary-tree all-reduce: 2·⌊log2 P⌋·(α + S·β)."""
  return wire.allreduce(s_bytes, p, "tree").seconds(alpha, beta)


def pair_exchange_alpha_beta(s_bytes: float, alpha: float, beta: float) -> float:
  """Lean NoLoCo pair exchange, one copy each way at once: α + S·β (independent of P)."""
  return wire.permute(s_bytes).seconds(alpha, beta)


def pair_exchange_reference_alpha_beta(s_bytes: float, alpha: float, beta: float) -> float:
  """Reference-code pair exchange, 2·S to the root member and 2·S back: 2·(α + 2·S·β)."""
  return 2 * (alpha + 2 * s_bytes * beta)


def bytes_sent_per_replica_per_round(method: str, p: int, s_bytes: float) -> float:
  """Bytes one replica sends per exchange, mean over replicas (it receives as many): wire.Traffic.sent.

  ring: 2(P−1)/P·S; tree: 2(P−1)/P·S as well (N − 1 tree edges, one copy each way; a leaf sends S, an
  interior node 3S); pair: S; pair_reference: 2·S (each member sends 2·S: φ and Δ up, or the result down).
  """
  if method in wire.ALLREDUCE_ALGORITHMS:
    return wire.allreduce(s_bytes, p, method).sent
  return {"pair": wire.permute(s_bytes).sent, "pair_reference": 2 * s_bytes}[method]


def latency_share(latency_term: float, total: float) -> float:
  """Fraction of a cost that is per-message latency (α terms): near 1 latency-bound, near 0 bandwidth-bound."""
  return latency_term / total


def alpha_beta_table(ns: Sequence[int], link_bps: Sequence[float], dtypes: Sequence[str],
                     alpha: float, models: Sequence[str] = ("small", "medium", "large")) -> list[dict]:
  """One row per (model, dtype, link, N) with the outer-step communication time of each method."""
  rows = []
  for name in models:
    params = paper_model_params(name)
    for dtype in dtypes:
      s = model_bytes(params, dtype)
      for bps in link_bps:
        beta = seconds_per_byte(bps)
        for p in ns:
          ring = ring_allreduce_alpha_beta(p, s, alpha, beta)
          rows.append(dict(
              model=name, params=params, dtype=dtype, bytes=s, link_bps=bps, n=p,
              ring_s=ring,
              tree_s=tree_allreduce_alpha_beta(p, s, alpha, beta),
              pair_s=pair_exchange_alpha_beta(s, alpha, beta),
              pair_reference_s=pair_exchange_reference_alpha_beta(s, alpha, beta),
              ring_latency_share=latency_share(2 * (p - 1) * alpha, ring),
          ))
  return rows
