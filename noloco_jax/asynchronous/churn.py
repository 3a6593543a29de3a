"""Live churn: a process that joins a running job takes its weights from one live peer.

Leaving needs nothing here: a process that dies stops renewing its lease (liveness.py), the others
see it lost within a lease, no batch admits it again (matchmaking.py keeps only members whose lease
is held), and an exchange it was part of fails within its timeout (transport.py). Every process logs
the membership events it sees (who joined, left or was lost, and when: session.py).

Joining. JAX fixes the number of processes at `jax.distributed.initialize`, so a job is started with
P *slots*; a process that (re)starts takes a slot whose process is gone, with the same process id
(measured with recoverability on: the service accepts the new incarnation whether the old one's
death has been noticed or not, and the backend starts; docs/async.md). It then:

1. picks a donor among the slots whose heartbeat moves (liveness.Liveness.beating: a just-started
   process cannot yet tell a dead peer's last lease from a live one's) by a seeded draw (seed, slot,
   incarnation), peers that are themselves joining (a request of theirs is posted) tried last: a
   joiner serves no one until it has joined (measured under churn: a joiner that picked another
   joiner waited for that one's whole join, 7.3 s instead of 1.5 s); and posts a request
   `join/<donor>/<slot>` = {incarnation, tag};
2. the donor, at its next round boundary (`Donor.serve`, one store read per round), offers its state
   through its transfer server and answers `joinok/<slot>/<tag>` = {donor, progress}; a request is
   told from an earlier one of the same joiner by its value (a new tag every time), not its key;
3. the joiner pulls the state (bounded, as every pull: transport.py); if the donor does not answer
   in `timeout_s`, it tries the next donor of its draw.

What is copied is the rule of `checkpoint.elastic=grow` (io/checkpoint/resize.py): the peer's slow
weights φ, which become the new process's θ and φ, outer momentum δ = 0 (a member that has taken no
outer step has no momentum; copying the peer's would repeat the peer's next outer step), and the
peer's inner optimiser state (its step count keeps the learning-rate schedule in step; its moments
keep Adam's bias correction right). The method says what its new replica is (OuterMethod.new_replica:
NoLoCo's gives θ = φ, δ = 0); the round driver applies it to what was copied.
"""

from __future__ import annotations

import hashlib
import json
import time

import jax
import numpy as np

from noloco_jax.asynchronous import transport as transport_lib
from noloco_jax.asynchronous.control import KV
from noloco_jax.parallel import permutations

JOIN_TAGS = 1 << 39  # join transfers use tags from here up; exchanges use batch indices below


def digest(leaves) -> str:
  """A short SHA-256 of arrays' bytes (what a donor served, what a joiner received: logged on both sides)."""
  h = hashlib.sha256()
  for x in leaves:
    h.update(np.ascontiguousarray(np.asarray(x)).tobytes())
  return h.hexdigest()[:16]


def donor_order(live_slots, me: int, seed: int, incarnation: int) -> list[int]:
  """The live peers in the seeded order a joiner tries them (uniform first choice)."""
  peers = sorted(s for s in live_slots if s != me)
  perm = permutations.generator(permutations.STREAM_ASYNC_DONOR, seed, me, incarnation % (1 << 62)).permutation(len(peers))
  return [peers[i] for i in perm]


def joining(kv: KV) -> set[int]:
  """The slots with a join request posted (`join/<donor>/<joiner>`): processes that serve no one yet."""
  return {int(parts[2]) for parts in (k.split("/") for k in kv.dir("join/")) if len(parts) == 3 and parts[2].isdigit()}


def settled_first(order: list[int], joining_slots) -> list[int]:
  """`order` with the slots in `joining_slots` moved to its end (each part keeps its order)."""
  return [s for s in order if s not in joining_slots] + [s for s in order if s in joining_slots]


class Donor:
  """The serving side: called by the driver at every round boundary with a function giving its state."""

  def __init__(self, kv: KV, transport: transport_lib.Transport, slot: int):
    self.kv, self.transport, self.slot = kv, transport, slot
    # (key, value) of every request served: a joiner that comes back posts the same key with a new tag, which
    # is a new request (keyed by the key alone, it was never served, and the joiner waited its whole timeout).
    self._served: set[tuple[str, str]] = set()
    self.served: list[dict] = []

  def requests(self) -> dict[str, str]:
    """The joiners' requests to this slot not served yet (one store read; any thread may ask)."""
    return {k: v for k, v in self.kv.dir(f"join/{self.slot}/").items() if (k, v) not in self._served}

  def serve(self, state_fn, progress: int, offer_s: float = 120.0, requests: dict[str, str] | None = None) -> int:
    """Offers `state_fn()` (a pytree of arrays) to every new joiner that asked this slot (`requests`, as
    `requests()` read them; None: read now); returns how many."""
    fresh = {k: v for k, v in (self.requests() if requests is None else requests).items() if (k, v) not in self._served}
    for key, raw in fresh.items():
      self._served.add((key, raw))
      request = json.loads(raw)
      joiner, tag = int(key.rsplit("/", 1)[1]), int(request["tag"])
      leaves = jax.tree.leaves(state_fn())
      self.transport.offer(leaves, tag, joiner, offer_s)
      self.kv.set(f"joinok/{joiner}/{tag}", json.dumps({"donor": self.slot, "incarnation": self.transport.incarnation,
                                                        "progress": int(progress),
                                                        "signature": transport_lib.signature(leaves)}))
      self.served.append({"time": time.time(), "joiner": joiner, "incarnation": request["incarnation"], "tag": tag,
                          "digest": digest(leaves)})
    return len(fresh)


def join(kv: KV, transport: transport_lib.Transport, slot: int, incarnation: int, template, live_slots, *,
         seed: int, timeout_s: float):
  """As a (re)started process: (state, donor slot, donor progress) copied from a live peer.

  `template`: a pytree of arrays with the structure, shapes, dtypes and shardings of what donors
  serve. Raises RuntimeError naming the donors tried when none answered.
  """
  tried = []
  for donor in settled_first(donor_order(live_slots, slot, seed, incarnation), joining(kv)):
    tag = JOIN_TAGS + kv.increment("join/tags", 1)
    kv.set(f"join/{donor}/{slot}", json.dumps({"incarnation": incarnation, "tag": tag}))
    raw = kv.wait(f"joinok/{slot}/{tag}", timeout_s)
    if raw is None:
      kv.delete(f"join/{donor}/{slot}")
      tried.append(f"{donor} (no answer in {timeout_s:.3g} s)")
      continue
    answer = json.loads(raw)
    leaves, treedef = jax.tree.flatten(template)
    if answer["signature"] != transport_lib.signature(leaves):
      raise ValueError(f"donor slot {donor} serves a state of shapes and dtypes {answer['signature']}, this process "
                       f"expects {transport_lib.signature(leaves)}: every process must run the same config.")
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves]
    member = _Peer(donor, int(answer["incarnation"]))
    try:
      got = transport.fetch(member, tag, specs, time.monotonic() + timeout_s)
    except transport_lib.ExchangeFailed as e:
      tried.append(f"{donor} ({e.reason})")
      continue
    finally:
      kv.delete(f"join/{donor}/{slot}")
    return jax.tree.unflatten(treedef, got), donor, int(answer["progress"])
  raise RuntimeError(f"slot {slot} could not join: no live peer served its state (tried {', '.join(tried) or 'none'}).")


class _Peer:
  def __init__(self, slot: int, incarnation: int):
    self.slot, self.incarnation = slot, incarnation
