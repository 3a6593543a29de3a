"""The data plane: one exchange of messages within a group, over `jax.experimental.transfer`.

Why the transfer server and not a program over the pair's sub-mesh (measured, docs/async.md):
a `shard_map` + `ppermute` program over the two processes' devices runs (a compile and a gloo
rendezvous per pair, then fast), and a partner that dies *during* it makes the call raise within a
fraction of a second; but a partner that is alive and never calls blocks the caller for as long as
it stays away (measured 70 s, no timeout, and nothing on the CPU backend can cancel a running
collective), a partner that died *before* calling costs a 30 s gloo timeout, and two processes whose
counts of calls differ (one skipped an exchange) are silently out of step. The transfer server is
pull-based: each message is offered under an id and fetched by id, so no exchange can be confused with
another, a skipped exchange costs nothing, and a waiting pull can be ended at any moment.

The protocol of one exchange (group = the Match from matchmaking.py, tag = its batch index):

1. Offer: `await_pull(uuid(tag, me, partner), leaves)` for each partner (the server keeps references
   to the arrays; it returns at once); then the store entry `x/<tag>/<me>` = the message's signature
   (shapes and dtypes) says "offered".
2. For each partner: wait for its entry (bounded by the deadline: a partner that skipped, is stalled
   or is dead never writes it), check the signatures agree, then `pull` its message by id.
3. A watchdog bounds every pull: pulls ignore their own `timeout` when nothing was offered (measured:
   a 3 s deadline still blocked after 22 s), so at the deadline a timer poisons the connection
   (`TransferConnection._poison_connection`, which ends the pull with an error at once) and the next
   exchange with that partner opens a new connection. A partner whose process died makes the pull
   fail by itself ("Connection closed", about 1 s).
4. Commit: each member, once it holds every partner's message, writes `x/<tag>/<me>/ack` and waits
   (to the deadline) for its partners' acks. Then the group's record `x/<tag>/decided/<least slot>` is
   *created* by the first member to decide, "commit" when it saw every ack, else "abort: why"; the store
   lets exactly one creator win and every member follows that record: either every member merges the
   exchange or none does. A member that comes late (stopped, slowed, its clock stepped) finds the record
   written: "abort" if its partners gave up on it (it is told so, and merges nothing), "commit" if they
   had all acknowledged before it stopped (it merges, as they did). No process merges with a partner that
   did not merge with it, whatever the timing (issue 38.3; tests/test_async_exchange_faults.py). A
   record lives until its least slot has made 16 more exchanges (keep_tags); one stopped longer finds
   none, writes "abort" and merges nothing.

5. A silent partner ends the wait early. A partner that is stopped (SIGSTOP, a frozen host) is alive to the
   store and to its transfer server until a lease or the deadline says otherwise, which would hold its
   peers for up to `timeout_s`. So every wait on a partner (its offer, its message, its ack) asks
   `silent(partner)` (liveness.Liveness.silent_past: how long its heartbeat, a thread that beats while the
   process computes, has not moved) every `check_s` and gives up as soon as it is silent past the bound
   (outer.asynchronous.partner_silence_s): then the exchange fails exactly as a timed-out one does, the
   group's record says abort, and the stopped partner, resumed, finds it and merges nothing.

Any failure is an `ExchangeFailed` naming the partner and the reason, raised at most `timeout_s`
after the call (plus a few store calls), or once the partner has been silent past the bound (plus
`check_s`): the caller skips the exchange and trains on, its state as it was. Faults can be placed
inside an exchange for tests (runtime/faults.py: xkill, xstop, xdelay, xclock at offered | announced |
pulled; matchmaking.py's pairing before it: ticketed).

Where the server listens: the address this host's name resolves to (`data_host`), as JAX's CPU
collectives (gloo) bind theirs in the lock-step schedule: 127.0.0.1 on a machine whose name maps there,
the node's own address on a cluster, or in a network namespace of its own (experiments/lib/node_links.py,
where weights then cross the node's shaped link).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import socket
import threading
import time
from typing import Callable

import jax

from noloco_jax.asynchronous.control import KV
from noloco_jax.runtime import faults as faults_lib

COMMIT = "commit"  # the group's record of an exchange every member completed (else "abort: why")
_SLOTS = 1 << 12  # slots (and so processes) an id can name; tags take the remaining 40 bits


class ExchangeFailed(RuntimeError):
  """An exchange did not complete in time; the message names the partner and why."""

  def __init__(self, partner: int, reason: str):
    super().__init__(f"exchange with slot {partner} failed: {reason}")
    self.partner, self.reason = partner, reason


def data_host() -> str:
  """The address this host's name resolves to (gloo's rule for its own collectives); 127.0.0.1 if none."""
  try:
    return socket.gethostbyname(socket.gethostname())
  except OSError:
    return "127.0.0.1"


def uuid(tag: int, owner: int, puller: int) -> int:
  """The transfer id of `owner`'s message for `puller` in exchange `tag` (unique per owner's server)."""
  if not (0 <= owner < _SLOTS and 0 <= puller < _SLOTS and 0 <= tag < (1 << 40)):
    raise ValueError(f"tag={tag}, owner={owner}, puller={puller}: slots must be < {_SLOTS} and tags < 2**40.")
  return (tag * _SLOTS + owner) * _SLOTS + puller


def _decision_key(tag: int, slots) -> str:
  """The store key of a group's record for exchange `tag` (groups of one batch are disjoint: the least slot
  names the group)."""
  return f"x/{tag}/decided/{min(slots)}"


def signature(leaves) -> str:
  return json.dumps([[list(x.shape), str(x.dtype)] for x in leaves])


@dataclasses.dataclass
class Stats:
  exchanges: int = 0
  failures: int = 0
  bytes_sent: int = 0  # offered and announced (whether pulled or not is the partner's side)
  bytes_received: int = 0  # pulled
  seconds: float = 0.0

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


class Transport:
  """This process's transfer server, its address in the store, and its connections to partners."""

  def __init__(self, kv: KV, slot: int, incarnation: int, *, host: str | None = None, keep_tags: int = 16,
               hook: faults_lib.ExchangeFaults | None = None, silent: Callable[[int], float | None] | None = None,
               check_s: float = 0.25):
    """`host`: where the server listens (None: `data_host()`); `hook`: faults placed inside its exchanges
    (tests; default: NOLOCO_FAULTS' x* kinds, usually none); `silent(slot)`: how long that partner's
    heartbeat has been silent, when past the bound (liveness.Liveness.silent_past), else None: every wait on
    a partner asks it every `check_s` seconds and ends when it answers (module docstring, step 5)."""
    from jax.experimental import transfer  # pylint: disable=g-import-not-at-top
    self.kv, self.slot, self.incarnation, self.keep_tags = kv, slot, incarnation, keep_tags
    self.silent, self.check_s = silent, check_s
    host = host or data_host()
    client = jax.local_devices()[0].client
    self.server = transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])
    kv.set(f"tx/{slot}", json.dumps([incarnation, self.server.address()]))
    self._conns: dict[int, tuple[int, object]] = {}  # slot -> (incarnation, connection)
    self._tags: list[int] = []
    self.stats = Stats()
    self.hook = hook if hook is not None else faults_lib.exchange_from_env(slot)

  def _at(self, phase: str) -> None:
    if self.hook is not None:
      self.hook.at(phase)

  def exchange(self, message, partners, tag: int, timeout_s: float) -> list:
    """Sends `message` (a pytree of arrays) to each partner (matchmaking.Member) and returns theirs, in order.

    Raises ExchangeFailed at most `timeout_s` after the call (plus a few store calls) when the group does not
    commit it (module docstring, step 4); a late member (stopped, slowed) follows the group's record.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    leaves, treedef = jax.tree.flatten(message)
    sig = signature(leaves)
    if self.hook is not None:
      self.hook.begin()
    for p in partners:
      self.offer(leaves, tag, p.slot, timeout_s + 5.0)  # an offer outlives our own wait
    self._at("offered")
    self.kv.set(f"x/{tag}/{self.slot}", sig)
    self._at("announced")
    self._remember(tag)
    nbytes = sum(x.nbytes for x in leaves)
    self.stats.bytes_sent += nbytes * len(partners)
    record = _decision_key(tag, [self.slot, *(p.slot for p in partners)])
    received, failure = [], None
    try:
      for p in partners:
        if self.kv.get(record) is not None:  # the group has decided without us (we are late): follow it
          raise ExchangeFailed(p.slot, "the group decided before this process had pulled every message")
        theirs = self._wait(f"x/{tag}/{p.slot}", p.slot, deadline)
        if theirs is None:
          raise ExchangeFailed(p.slot, f"it did not offer its message within {timeout_s:.3g} s (stalled, dead, or "
                                       "it gave up on the exchange)")
        if theirs != sig:
          raise ValueError(f"slot {p.slot} offered a message of shapes and dtypes {theirs}, this process {sig}: "
                           "every process must send the same structure (same config).")
        specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves]
        got = self.fetch(p, tag, specs, deadline)
        self.stats.bytes_received += sum(x.nbytes for x in got)
        received.append(jax.tree.unflatten(treedef, got))
      self._at("pulled")
      self.kv.set(f"x/{tag}/{self.slot}/ack", "1")
      for p in partners:
        if self._wait(f"x/{tag}/{p.slot}/ack", p.slot, deadline) is None:
          raise ExchangeFailed(p.slot, f"it did not acknowledge our message within {timeout_s:.3g} s (stalled, dead, "
                                       "or it gave up)")
    except ExchangeFailed as e:
      failure = e
    # The group's one record: the first member to decide writes it (create: exactly one wins), every member
    # follows it, so either all of them merge this exchange or none does.
    want = COMMIT if failure is None else f"abort: slot {self.slot}: {failure}"
    self.kv.create(record, want)
    decided = self.kv.get(record)
    if decided != COMMIT:
      self.stats.failures += 1
      if failure is None or decided != want:
        failure = ExchangeFailed(failure.partner if failure else partners[0].slot,
                                 f"the group aborted the exchange ({decided}); this process was late, nothing is merged")
      raise failure
    self.stats.exchanges += 1
    self.stats.seconds += time.monotonic() - start
    return received

  def _wait(self, key: str, partner: int, deadline: float) -> str | None:
    """`key`'s value once a partner writes it; None at `deadline`; ExchangeFailed as soon as the partner's
    heartbeat has been silent past the bound (`silent`): the store's wait, in slices of `check_s`."""
    while True:
      left = deadline - time.monotonic()
      if self.silent is None or left <= self.check_s:
        return self.kv.wait(key, left)
      value = self.kv.wait(key, self.check_s)
      if value is not None:
        return value
      self._check_silence(partner)

  def _check_silence(self, partner: int) -> None:
    silent_s = self.silent(partner) if self.silent is not None else None
    if silent_s is not None:
      raise ExchangeFailed(partner, f"its heartbeat has been silent for {silent_s:.3g} s (stopped or dead: "
                                    "outer.asynchronous.partner_silence_s)")

  def offer(self, leaves, tag: int, puller: int, expiry_s: float) -> None:
    """Makes `leaves` fetchable once by slot `puller` under `tag` for `expiry_s` seconds (returns at once)."""
    expiry = datetime.datetime.now() + datetime.timedelta(seconds=expiry_s)
    self.server.await_pull(uuid(tag, self.slot, puller), list(leaves), timeout=expiry)

  def fetch(self, partner, tag: int, specs, deadline: float) -> list:
    """Pulls what `partner` (.slot, .incarnation) offered this slot under `tag`; ExchangeFailed at `deadline`."""
    pull_id = uuid(tag, partner.slot, self.slot)
    conn = self._connection(partner)
    done, poisoned = threading.Event(), []  # poisoned: why the watchdog ended the pull

    def watchdog():
      # Wakes every check_s (or once, at the deadline, without a silence test) until the pull is done.
      while not done.wait(self.check_s if self.silent is not None else max(deadline - time.monotonic(), 0.0)):
        if time.monotonic() >= deadline:
          why = "no message by the deadline"
        else:
          try:
            self._check_silence(partner.slot)
            continue
          except ExchangeFailed as e:
            why = e.reason
          except Exception:  # pylint: disable=broad-except  (the store failed: the deadline still bounds the pull)
            continue
        poisoned.append(why)
        conn._poison_connection()  # pylint: disable=protected-access  (the one way to end a waiting pull)
        return

    timer = threading.Thread(target=watchdog, name="noloco-pull-watchdog", daemon=True)
    timer.start()
    try:
      got = conn.pull(pull_id, specs)
      jax.block_until_ready(got)
      return got
    except Exception as e:  # pylint: disable=broad-except  (the transfer library raises JaxRuntimeError)
      self._conns.pop(partner.slot, None)
      why = poisoned[0] if poisoned else str(e).splitlines()[0]
      raise ExchangeFailed(partner.slot, f"pull failed: {why}") from e
    finally:
      done.set()
      timer.join()
      if poisoned:
        self._conns.pop(partner.slot, None)  # a poisoned connection is never used again

  def _connection(self, partner):
    cached = self._conns.get(partner.slot)
    if cached is not None and cached[0] == partner.incarnation:
      return cached[1]
    raw = self.kv.get(f"tx/{partner.slot}")
    if raw is None:
      raise ExchangeFailed(partner.slot, "it has no transfer server in the store")
    inc, address = json.loads(raw)
    if int(inc) != partner.incarnation:
      raise ExchangeFailed(partner.slot, f"its transfer server belongs to incarnation {inc}, not {partner.incarnation} "
                                         "(it restarted)")
    conn = self.server.connect(address)
    self._conns[partner.slot] = (partner.incarnation, conn)
    return conn

  def _remember(self, tag: int) -> None:
    self._tags.append(tag)
    while len(self._tags) > self.keep_tags:
      old = self._tags.pop(0)
      for key in (f"x/{old}/{self.slot}", f"x/{old}/{self.slot}/ack", f"x/{old}/decided/{self.slot}"):
        self.kv.delete(key)  # the last: the record of a group this slot was the least of
