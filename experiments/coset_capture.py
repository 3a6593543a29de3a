"""How much of the partners' difference a coset code delivers, on the default job's own messages.

Trains the default job (8 replicas, tiny) to one step before its last-but-one round (`--steps`, default
449: nine rounds done, 49 inner steps into the tenth), takes every replica's message c = β·θ + (γ − β)·φ
and, for six pairs, the difference D = c_j − c_i, and prints:

- per leaf: rms(c), rms(D) and its slow (γ·(φ_j − φ_i)) and fresh (β·(Δ_j − Δ_i)) parts, rms of the round's
  progress β·Δ, the kurtosis of D and the share of |D| beyond 3 rms;
- the capture 1 − ms(ĉ_j − c_j) / ms(D) of coset codes of b = 1…4 bits (outer/coset.py's coset_encode /
  coset_decode, shared dither) with ε = κ·rms(D) of the leaf (the best κ of a grid), and with ε = κ·rms(D)
  of every block of 256 values: what DEFAULT_KAPPA in outer/coset.py was chosen from.

    python experiments/coset_capture.py [--steps 449] [--json]
"""

from __future__ import annotations

import json

from experiments.lib import harness

KAPPAS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.3, 1.6, 2.0, 2.5, 3.0)
PAIRS = ((0, 1), (2, 3), (4, 5), (6, 7), (1, 2), (3, 6))


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__, cpu_devices=8, cpu_only=True, quick={"steps": 12})
  bench.add_argument("--steps", type=int, default=449, help="inner steps to train before looking")
  args = bench.parse(argv)
  import tempfile  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from experiments.lib import experiment  # pylint: disable=g-import-not-at-top
  from noloco_jax.outer import coset  # pylint: disable=g-import-not-at-top
  from noloco_jax.training import loop  # pylint: disable=g-import-not-at-top

  config = experiment.load_default_config("smoke" if args.quick else None)
  config.num_steps, config.eval_every = args.steps, 0
  with tempfile.TemporaryDirectory() as workdir:
    state = loop.train_and_evaluate(config, workdir)["state"]
  beta, gamma = config.outer.outer_lr or 0.7, config.outer.consensus_weight or 0.7
  names = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(state.params)]
  thetas = [np.asarray(x, np.float32) for x in jax.tree.leaves(state.params)]
  phis = [np.asarray(x, np.float32) for x in jax.tree.leaves(state.outer["slow"])]
  rng = np.random.default_rng(0)
  leaves, pairs_c, pairs_d = [], [], []
  for name, theta, phi in zip(names, thetas, phis):
    c = (np.float32(beta) * theta + np.float32(gamma - beta) * phi).reshape(theta.shape[0], -1)
    d = np.stack([c[j] - c[i] for i, j in PAIRS]).astype(np.float64)
    slow = np.stack([gamma * (phi[j] - phi[i]).ravel() for i, j in PAIRS])
    fresh = np.stack([beta * ((theta[j] - phi[j]) - (theta[i] - phi[i])).ravel() for i, j in PAIRS])
    rms = float(np.sqrt(np.mean(d ** 2)))
    leaves.append({"leaf": name, "values": int(c.shape[1]), "rms_c": float(np.sqrt(np.mean(c.astype(np.float64) ** 2))),
                   "rms_D": rms, "rms_D_slow": float(np.sqrt(np.mean(slow ** 2))),
                   "rms_D_fresh": float(np.sqrt(np.mean(fresh ** 2))),
                   "rms_progress": float(np.sqrt(np.mean((beta * (theta - phi).astype(np.float64)) ** 2))),
                   "kurtosis_D": float(np.mean((d / max(rms, 1e-30)) ** 4)),
                   "beyond_3rms": float(np.mean(np.abs(d) > 3 * rms))})
    pairs_c.append(c)
    pairs_d.append(d)

  def capture(bits, kappa, per_block):
    lost = total = 0.0
    for c, d in zip(pairs_c, pairs_d):
      for p, (i, j) in enumerate(PAIRS):
        D = d[p]
        if per_block:
          blocks = np.pad(D, (0, -D.size % 256)).reshape(-1, 256)
          scale = np.repeat(np.sqrt(np.mean(blocks ** 2, axis=1)), 256)[:D.size]
        else:
          scale = np.full(D.size, np.sqrt(np.mean(D ** 2)))
        eps = np.maximum(kappa * scale, 1e-30).astype(np.float32)
        u = rng.uniform(-0.5, 0.5, D.size).astype(np.float32)
        decoded = np.asarray(coset.coset_decode(coset.coset_encode(c[j], eps, u, bits), c[i], eps, u, bits))
        lost += float(np.sum((decoded.astype(np.float64) - c[j]) ** 2))
        total += float(np.sum(D ** 2))
    return 1.0 - lost / total

  rows = []
  for per_block in (False, True):
    for bits in (1, 2, 3, 4):
      best = max((capture(bits, k, per_block), k) for k in KAPPAS)
      rows.append({"scale": "block of 256" if per_block else "leaf", "bits": bits, "best_kappa": best[1],
                   "capture": round(best[0], 4), "capture_per_bit": round(best[0] / bits, 4)})
  return bench.finish({"steps": args.steps, "leaves": leaves, "capture": rows},
                      text=lambda r: "\n".join(json.dumps(x) for x in r["leaves"] + r["capture"]))


if __name__ == "__main__":
  harness.run(main)
