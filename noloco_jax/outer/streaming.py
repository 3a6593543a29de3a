"""Fragment streaming (`outer.streaming.*`): a round's message cut into F fragments, each exchanged at its
own offset within the round (Streaming DiLoCo's schedule), so that the bytes of a round are spread over it.

With H inner steps per round, fragment f has its round at the steps t with (t − f·H/F) mod H = 0: every
fragment still once per H steps, one fragment every H/F steps. A fragment is a part of every parameter
leaf (`Cut`: a slice of the leaf's flattened values, or of its leading layer axis, or the whole leaf):

- `slices`: the message's values end to end (every leaf flattened, in tree order) cut into F equal
  contiguous ranges, so at most F − 1 leaves are split (the peak bytes per step are the whole message's ÷ F,
  up to the codecs' per-chunk scales of the split leaves);
- `layers`: the stacked layers (the model's "layers" collection, models/base.py) cut into F contiguous
  blocks of layers, the "first" collections (the embedding) in fragment 0 and the "last" (the head) in
  fragment F − 1.

A fragment's round is the method's own round on that part of the state (`fragment_method`): the message,
the codec (its error-feedback residual: the fragment's part of it), the exchange and the rule, built once
by the one round layer (outer/programs.py) for the fragment's leaves. Every update of NoLoCo's family is
elementwise, so a fragment's round is the whole round restricted to the fragment's values, and F = 1 is
the unfragmented round (the config then builds none of this). The state's layout is the same whatever F:
every fragment reads and writes its part of the same φ, δ, residual and in-flight buffer.

Who pairs with whom (`Pairing`): `shared`, fragment f's j-th round uses the grouping of the unfragmented
round j (the pairing schedule's index j); `own`, every fragment round q (counted over all fragments, as
the loop counts rounds) draws its own grouping, the schedule's index q: a new seeded draw from the same
law, so each fragment's partner is as random as the unfragmented round's and independent of the other
fragments'.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from noloco_jax.config.fields import fail
from noloco_jax.outer import base
from noloco_jax.outer.base import OuterMethod


@dataclasses.dataclass(frozen=True)
class Cut:
  """One leaf's part of a fragment: values [start, stop) of the flattened leaf (`flat`), or of its leading
  (layer) axis."""
  flat: bool
  start: int
  stop: int


# Per parameter leaf, in tree order: its Cut, or None when the fragment holds none of it.
Fragment = tuple


def _bounds(size: int, F: int) -> list[int]:
  return [size * f // F for f in range(F + 1)]


def cut(params, roles, *, fragments: int, split: str) -> tuple[Fragment, ...]:
  """The F fragments of one replica's `params` (arrays or shape structs); `roles`: each leaf's stage role
  ("first" | "layers" | "last", models/base.Model.stage_role), read by split='layers'. Every value of every
  leaf is in exactly one fragment. More fragments than the model has slices: one line naming the field."""
  leaves = jax.tree.leaves(params)
  F = fragments
  if split == "slices":  # the leaves' values end to end, cut into F equal ranges: at most F − 1 leaves are split
    sizes = [int(np.prod(x.shape)) for x in leaves]
    if F > sum(sizes):
      fail("outer.streaming.fragments", F, f"at most {sum(sizes)} (the model's values) with outer.streaming.split='slices'")
    starts, bounds = np.cumsum([0] + sizes), _bounds(sum(sizes), F)
    cuts = lambda lo, hi: tuple(Cut(True, max(lo, s) - s, min(hi, s + n) - s) if max(lo, s) < min(hi, s + n) else None
                                for s, n in zip(starts[:-1].tolist(), sizes))
    return tuple(cuts(bounds[f], bounds[f + 1]) for f in range(F))
  layers = [x.shape[0] for x, role in zip(leaves, roles) if role == "layers"]
  if not layers or F > layers[0]:
    fail("outer.streaming.fragments", F, f"at most {layers[0] if layers else 1} with outer.streaming.split='layers' "
         "(the model's layers)")
  b = _bounds(layers[0], F)
  whole = lambda x: Cut(True, 0, int(np.prod(x.shape)))
  out = []
  for f in range(F):
    out.append(tuple(Cut(False, b[f], b[f + 1]) if role == "layers" else
                     whole(x) if (role == "first" and f == 0) or (role == "last" and f == F - 1) else None
                     for x, role in zip(leaves, roles)))
  return tuple(out)


def take(tree_k, fragment: Fragment) -> list:
  """The fragment's values of a [k, ...] stack of parameter-shaped leaves: one array per leaf it holds
  ([k, n] for a flat cut, [k, layers, ...] for a layer cut); of shape structs, theirs; of shardings, the
  stack's."""
  out = []
  for x, c in zip(jax.tree.leaves(tree_k), fragment):
    if c is None:
      continue
    if isinstance(x, jax.sharding.NamedSharding):  # a tree of shardings (programs.py's layout): split as the stack
      out.append(jax.sharding.NamedSharding(x.mesh, jax.sharding.PartitionSpec(x.spec[0] if x.spec else None),
                                            memory_kind=x.memory_kind))
    elif isinstance(x, jax.ShapeDtypeStruct):  # abstract values (jax.eval_shape's)
      rest = () if c.flat else tuple(x.shape[2:])
      out.append(jax.ShapeDtypeStruct((x.shape[0], c.stop - c.start) + rest, x.dtype))
    else:
      out.append((x.reshape(x.shape[0], -1) if c.flat else x)[:, c.start:c.stop])
  return out


def put(tree_k, fragment: Fragment, values: list):
  """`tree_k` with the fragment's values replaced by `values` (as `take` gives them)."""
  leaves, treedef = jax.tree.flatten(tree_k)
  values = iter(values)
  new = []
  for x, c in zip(leaves, fragment):
    if c is None:
      new.append(x)
    elif c.flat:
      new.append(x.reshape(x.shape[0], -1).at[:, c.start:c.stop].set(next(values)).reshape(x.shape))
    else:
      new.append(x.at[:, c.start:c.stop].set(next(values)))
  return jax.tree.unflatten(treedef, new)


def take_shapes(params, fragment: Fragment) -> list:
  """`take` of one replica's shape structs (no stack axis): the fragment's message as the wire counts it."""
  out = []
  for x, c in zip(jax.tree.leaves(params), fragment):
    if c is not None:
      shape = (c.stop - c.start,) if c.flat else (c.stop - c.start,) + tuple(x.shape[1:])
      out.append(jax.ShapeDtypeStruct(shape, x.dtype))
  return out


def fragment_method(method: OuterMethod, fragment: Fragment) -> OuterMethod:
  """`method`'s round on one fragment: its parts run on the fragment's part of the state (θ and every
  parameter-shaped tree of the outer state: φ, δ, the residual, the in-flight mean) and write it back; the
  rest of the state is untouched. Its bytes are the fragment's message's."""
  parts = method.parts
  if parts is None:
    raise ValueError(f"outer.kind={method.kind!r} has no round in parts: it cannot be streamed.")

  def sliced(states) -> set:
    structure = jax.tree.structure(states.params)
    return {k for k, v in states.outer.items() if jax.tree.structure(v) == structure}

  def restrict(states):
    keys = sliced(states)
    outer = {k: take(v, fragment) if k in keys else v for k, v in states.outer.items()}
    return states.replace(params=take(states.params, fragment), outer=outer)

  def scatter(states, sub):
    keys = sliced(states)
    outer = {k: put(states.outer[k], fragment, sub.outer[k]) if k in keys else sub.outer[k] for k in states.outer}
    return states.replace(params=put(states.params, fragment, sub.params), outer=outer)

  def message(states):
    sub, own, payload, metrics = parts.message(restrict(states))
    return scatter(states, sub), own, payload, metrics

  def merge(states, mean_c, mix):
    # The overlapped merge hands the whole in-flight buffer (programs.py, where="exchange"): its fragment is read.
    if jax.tree.structure(mean_c) == jax.tree.structure(states.params):
      mean_c = take(mean_c, fragment)
    return scatter(states, parts.merge(restrict(states), mean_c, mix))

  def commit(states, codec_state):
    return scatter(states, parts.commit(restrict(states), codec_state))

  fparts = dataclasses.replace(parts, message=message, own=lambda states: parts.own(restrict(states)), merge=merge,
                               codec_state=lambda states: parts.codec_state(restrict(states)), commit=commit)
  traffic = None
  if method.traffic is not None:
    traffic = lambda params, n: method.traffic(take_shapes(params, fragment), n)
  return dataclasses.replace(method, parts=fparts, make_round=base.round_of(fparts),
                             message_bytes=lambda params: method.message_bytes(take_shapes(params, fragment)),
                             traffic=traffic)


def hold(fragment: Fragment, key: str):
  """(state, the fragment's in-flight mean) -> the state with it in the fragment's part of outer[key]."""
  return lambda states, mean: states.replace(outer={**states.outer, key: put(states.outer[key], fragment, mean)})


# ---- the schedule: which fragment a step's round is, and whom it pairs with ----


def boundary_fragment(boundary: int, fragments: int) -> tuple[int, int]:
  """(f, j) of the round at boundary b (the step b·H/F, b ≥ 1): fragment f = b mod F, its j-th round (j ≥ 0).
  Fragment 0's first round is at b = F (step H), fragment f > 0's at b = f (step f·H/F)."""
  f = boundary % fragments
  return f, (boundary - f) // fragments - (f == 0)


def rounds_done(f: int, boundaries: int, fragments: int) -> int:
  """Rounds of fragment f at the first `boundaries` boundaries (the b ≤ boundaries with b ≡ f mod F, b ≥ 1)."""
  return max(0, (boundaries - f) // fragments + (f > 0))


class Pairing:
  """The pairing schedule of a streamed run, by fragment round q (0, 1, ... over all fragments, as the loop
  counts rounds: q = b − 1 at boundary b): plan, groups and record as the base schedule's
  (outer/pairing.PairingSchedule), at its index `draw(q)`: j (partners='shared') or q ('own')."""

  def __init__(self, base, *, fragments: int, partners: str):
    self.base, self.fragments, self.partners = base, fragments, partners

  def __getattr__(self, name):  # group_size, num_replicas, mode, record, ...
    if name == "base":  # not set yet (a copy being built): no recursion through __getattr__
      raise AttributeError(name)
    return getattr(self.base, name)

  def draw(self, q: int) -> int:
    if self.partners == "own":
      return q
    return boundary_fragment(q + 1, self.fragments)[1]

  def plan(self, q: int, num_devices: int):
    return self.base.plan(self.draw(q), num_devices)

  def groups(self, q: int):
    return self.base.groups(self.draw(q))

  def of_fragment(self, f: int) -> "FragmentPairing":
    return FragmentPairing(self, f)


class FragmentPairing:
  """One fragment's schedule by its own round j (what its RoundPrograms compiles ahead: round j + 1 next)."""

  def __init__(self, pairing: Pairing, f: int):
    self.pairing, self.f = pairing, f

  def __getattr__(self, name):
    if name == "pairing":
      raise AttributeError(name)
    return getattr(self.pairing.base, name)

  def q(self, j: int) -> int:
    F = self.pairing.fragments
    return self.f + F * (j + (self.f == 0)) - 1

  def plan(self, j: int, num_devices: int):
    return self.pairing.plan(self.q(j), num_devices)

  def groups(self, j: int):
    return self.pairing.groups(self.q(j))
