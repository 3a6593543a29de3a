"""The training state of one replica. The trainer stacks N of them on a leading `replica` axis."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32: inner steps taken.
  params: Any  # θ: the fast weights the inner optimizer trains.
  opt_state: Any  # the inner optimizer's state (private to the replica, kept across rounds).
  outer: Any  # owned by the outer rule: e.g. {"slow": φ, "momentum": δ}; () when it keeps nothing.
