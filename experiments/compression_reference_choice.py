"""Which part of a NoLoCo message to sparsify, when pairs change every round (docs/compression.md).

A NumPy simulation of NoLoCo's outer loop on a noisy quadratic (no JAX, seconds to run), comparing:

  dense   c = β·θ + (γ−β)·φ sent in float32;
  split   (option b, the default of outer.codec.compression=topk): top-k per chunk of the fresh part β·(θ−φ)
          plus an error-feedback residual, 2-bit values; γ·φ sent in int8;
  peer    (option a): per-peer references. Replica i keeps, for every j, R[i][j] = the reconstruction
          of j's message that both sides agree on; j sends top-k(c_j − R[·][j] as j knows it for i), both
          add the decoded difference. Exact bookkeeping, 2(N−1) message copies of memory per replica;
          no φ part at all, so the fewest bytes.
  none    no communication.

Loss = mean over replicas of f(φ_i), f(x) = ½ Σ_k h_k (x_k − x*_k)², h log-uniform in [1e-3, 1]; each inner
step is SGD with gradient noise. Prints one JSON line per option (with --json, one object holding them
all): final loss, replica spread, bytes per replica per round relative to dense float32.

    python experiments/compression_reference_choice.py [--rounds 60] [--replicas 8] [--seeds 0,1,2] [--noise 0.5]
"""

from __future__ import annotations

import json

import numpy as np

from experiments.lib import harness

CHUNK, DENSITY, BITS = 4096, 0.01, 2


def quantize(x_CxW, bits):
  levels = 2 ** bits - 1
  m = np.abs(x_CxW).max(-1, keepdims=True)
  u = np.clip(np.round((x_CxW / np.where(m > 0, m, 1) + 1) * levels / 2), 0, levels)
  return (2 * u - levels) * m / levels


def topk(x, density=DENSITY, bits=BITS):
  x_CxW = x.reshape(-1, CHUNK)
  k = int(np.ceil(density * CHUNK))
  keep = np.argpartition(-np.abs(x_CxW), k - 1, axis=-1)[:, :k]
  out = np.zeros_like(x_CxW)
  np.put_along_axis(out, keep, quantize(np.take_along_axis(x_CxW, keep, -1), bits), -1)
  return out.reshape(x.shape)


def int8(x):
  return quantize(x.reshape(-1, CHUNK), 8).reshape(x.shape)


def simulate(option, *, seed, replicas, rounds, dim=4 * CHUNK, inner=20, lr=0.5, noise=0.5,
             alpha=0.5, beta=0.7, gamma=0.7):
  rng = np.random.default_rng(seed)
  h = np.exp(rng.uniform(np.log(1e-3), 0, dim))
  optimum = rng.normal(size=dim)  # away from 0, so that a message lost to zero is not rewarded
  phi = np.broadcast_to(rng.normal(size=dim), (replicas, dim)).copy()
  delta = np.zeros_like(phi)
  residual = np.zeros_like(phi)
  # peer_ref[i, j]: j's message as i and j both know it; all replicas start from the same φ, so the first
  # reference is γ·φ₀ (the message of a replica that has not moved), known to everyone without sending.
  peer_ref = np.broadcast_to(gamma * phi[0], (replicas, replicas, dim)).copy()
  for _ in range(rounds):
    theta = phi.copy()
    for _ in range(inner):
      theta -= lr * (h * (theta - optimum) + noise * np.sqrt(h) * rng.normal(size=theta.shape))
    c = beta * theta + (gamma - beta) * phi
    perm = rng.permutation(replicas)
    partner = np.empty(replicas, int)
    partner[perm[0::2]], partner[perm[1::2]] = perm[1::2], perm[0::2]
    if option == "none":
      phi = theta
      continue
    if option == "dense":
      received = c[partner]
    elif option == "split":
      fresh = beta * (theta - phi) + residual
      sparse = np.stack([topk(f) for f in fresh])
      residual = fresh - sparse
      received = (sparse + np.stack([int8(gamma * p) for p in phi]))[partner]
    elif option == "peer":
      received = np.empty_like(c)
      for i in range(replicas):
        j = partner[i]
        peer_ref[i, j] += topk(c[j] - peer_ref[i, j])  # j computes the same sum on its side
        received[i] = peer_ref[i, j]
    delta = alpha * delta + (c + received) / 2 - gamma * phi
    phi = phi + delta
  loss = float(np.mean(0.5 * (h * (phi - optimum) ** 2).sum(-1)))
  spread = float(np.sqrt(((phi - phi.mean(0)) ** 2).sum(-1).mean()))
  return loss, spread


def bytes_ratio(option, dim=4 * CHUNK):
  k = int(np.ceil(DENSITY * CHUNK))
  chunks = dim // CHUNK
  sparse = chunks * (k * 2 + k * BITS / 8 + 4)
  return {"dense": 1.0, "none": 0.0, "peer": sparse / (4 * dim),
          "split": (sparse + dim + 4 * chunks) / (4 * dim)}[option]


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__)
  bench.add_argument("--rounds", type=int, default=60)
  bench.add_argument("--replicas", type=int, default=8)
  bench.add_argument("--seeds", default="0,1,2")
  bench.add_argument("--noise", type=float, default=0.5, help="gradient noise scale (0.5: noise-dominated)")
  args = bench.parse(argv)
  seeds = [int(s) for s in args.seeds.split(",")]
  rows = []
  for option in ("dense", "split", "peer", "none"):
    runs = [simulate(option, seed=s, replicas=args.replicas, rounds=args.rounds, noise=args.noise) for s in seeds]
    losses, spreads = np.array(runs).T
    rows.append({"option": option, "noise": args.noise, "replicas": args.replicas, "rounds": args.rounds,
                 "seeds": seeds, "final_loss_mean": float(losses.mean()), "final_loss_std": float(losses.std()),
                 "spread_mean": float(spreads.mean()), "bytes_vs_dense_f32": round(bytes_ratio(option), 5),
                 "extra_state_copies_per_replica": {"peer": 2 * (args.replicas - 1), "split": 1}.get(option, 0)})
  return bench.finish({"options": rows}, text=lambda r: "\n".join(json.dumps(row) for row in r["options"]))


if __name__ == "__main__":
  harness.run(main)
