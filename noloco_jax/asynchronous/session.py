"""One process's asynchronous schedule: the object a round driver holds (liveness, matchmaking, transport, churn).

The driver's calls (training/rounds/asynchronous.py), in a process that trains at its own pace:

    session = Session.from_connection(process, Options(...), pairings=log, events=log)
    state = session.join(template) if restarted else state          # churn.py: weights from a live peer
    every H inner steps:
        result = session.round(payload, progress=steps_done, step=step)  # never waits for anyone but its group
        if result.exchanged: the method's merge with the group's weighted mean of result.messages
        session.serve_joins(lambda: state, progress)                # a joiner may be waiting for us
                                                                    # (or join_requests() read elsewhere, passed in)
    session.close()                                                 # others see us leave at once

`round` answers exchanged (the group's messages, own first, with their progress), skipped (no partner
within max_wait_s) or failed (a partner did not deliver within exchange_timeout_s, or its heartbeat was
silent for partner_silence_s: stopped); the last two leave the state as it was. A message is any
pytree of arrays (a codec's payload). Every round goes to the `pairings` log, every membership event
(joined, left, lost, returned; a join served or taken) to the `events` log, per process (whoever reads
them merges them: asynchronous/logs.py); their rows carry the step the driver is at (`step`), as the
run's other logs do.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import jax

from noloco_jax.asynchronous import churn, control, law, liveness, matchmaking
from noloco_jax.asynchronous import transport as transport_lib


@dataclasses.dataclass(frozen=True)
class Options:
  seed: int = 0
  window_s: float = 0.05  # how long a batch of ready processes stays open for more (law.py)
  max_wait_s: float = 5.0  # a process's budget for finding a partner in one round
  exchange_timeout_s: float = 60.0  # how long one exchange may take before it counts as failed
  odd: str = "triple"  # an odd batch: one triple (noloco's group mean over three) or one left out
  beat_s: float = 0.5  # heartbeat interval
  lease_s: float = 10.0  # silent this long: lost
  close_grace_s: float = 5.0  # members close a batch whose opener did not, after window_s + this
  # A partner whose heartbeat has not moved for this long (stopped) is given up on at once, in an exchange
  # or as a batch's opener, rather than after exchange_timeout_s or close_grace_s (liveness.silent_past).
  partner_silence_s: float = 3.0
  join_timeout_s: float = 120.0  # how long a joiner waits for one donor
  # Fragment streaming (outer.streaming.fragments = F > 1): fragment f's rounds are matched among the
  # processes ready for fragment f (a matchmaker per fragment), exchange tags b·F + f (b: its batch).
  fragments: int = 1

  def check(self) -> None:
    """One line naming the field for a bad value."""
    if self.window_s < 0:
      raise ValueError(f"outer.asynchronous.match_window_s={self.window_s} is not valid: seconds ≥ 0.")
    if self.max_wait_s <= 0:
      raise ValueError(f"outer.asynchronous.max_wait_s={self.max_wait_s} is not valid: seconds > 0.")
    if self.exchange_timeout_s <= 0:
      raise ValueError(f"outer.asynchronous.exchange_timeout_s={self.exchange_timeout_s} is not valid: seconds > 0.")
    if self.fragments < 1:
      raise ValueError(f"outer.streaming.fragments={self.fragments} is not valid: an integer ≥ 1.")
    if self.odd not in law.ODD_RULES:
      raise ValueError(f"outer.asynchronous.match_odd={self.odd!r} is not valid; choose one of {law.ODD_RULES}.")
    if not self.partner_silence_s > self.beat_s:
      raise ValueError(f"outer.asynchronous.partner_silence_s={self.partner_silence_s} is not valid with a heartbeat "
                       f"every {self.beat_s} s: seconds longer than the heartbeat interval (a few beats).")
    if not 0 < self.beat_s < self.lease_s:
      raise ValueError(f"outer.asynchronous.lease_s={self.lease_s} is not valid with a heartbeat every {self.beat_s} s: "
                       "a lease longer than the heartbeat interval.")


@dataclasses.dataclass
class RoundResult:
  status: str  # exchanged | skipped | failed
  batch: int | None = None
  group: tuple[int, ...] = ()  # slots, this one included
  incarnations: tuple[int, ...] = ()  # of the group's members, in `group` order
  messages: list = dataclasses.field(default_factory=list)  # own message first, then the partners', in `group` order
  progress: list[int] = dataclasses.field(default_factory=list)  # the same order
  waited_s: float = 0.0  # ready → matched (or gave up)
  exchange_s: float = 0.0
  reason: str = ""
  # What this exchange put on the wire and took off it (the transport's counts: the arrays offered to each
  # partner, and those pulled), bytes.
  bytes_sent: int = 0
  bytes_received: int = 0

  @property
  def exchanged(self) -> bool:
    return self.status == "exchanged"


class Session:

  def __init__(self, kv: control.KV, slot: int, incarnation: int, options: Options, *, pairings=None, events=None,
               heartbeat: liveness.Liveness | None = None):
    """`pairings`, `events`: the logs of its rounds and of the membership events it sees (anything with
    `append(row)`: io/checkpoint/logs.JsonlLog), or None; they stay open after `close` (their owner closes
    them). `heartbeat`: this process's lease, already beating (started at connect time, so that a process
    still starting up is not taken for dead: asynchronous/job.py); else one is started here."""
    options.check()
    self.kv, self.slot, self.incarnation, self.options = kv, slot, incarnation, options
    self.step = 0  # the step the driver is at: every row of the logs carries it
    self._pairings, self._events, self._lock = pairings, events, threading.Lock()
    if heartbeat is None:
      heartbeat = liveness.Liveness(kv, slot, incarnation, beat_s=options.beat_s, lease_s=options.lease_s).start()
    if events is not None:
      heartbeat.attach(self._event)  # what it has seen since it started, then every new event
    self.liveness = heartbeat
    # Every wait on a partner ends once its heartbeat has been silent past the bound (asked every check_s).
    silent = lambda peer: heartbeat.silent_past(peer, options.partner_silence_s)
    check_s = min(0.25, options.partner_silence_s / 8)
    self.transport = transport_lib.Transport(kv, slot, incarnation, silent=silent, check_s=check_s)
    F = options.fragments
    self.matchmakers = [matchmaking.Matchmaker(
        kv, slot, incarnation, seed=options.seed, window_s=options.window_s, max_wait_s=options.max_wait_s,
        live=self.liveness.poll, odd=options.odd, close_grace_s=options.close_grace_s, silent=silent, check_s=check_s,
        hook=self.transport.hook, fragment=f if F > 1 else None) for f in range(F)]
    self.matchmaker = self.matchmakers[0]
    self.donor = churn.Donor(kv, self.transport, slot)
    self.failed = 0

  @classmethod
  def from_connection(cls, connection, options: Options, **logs) -> "Session":
    """For a process of the trainer's asynchronous schedule (asynchronous/job.Process: its store, slot,
    incarnation and the heartbeat it started when it connected); `logs`: pairings=, events=."""
    return cls(connection.kv, connection.slot, connection.incarnation, options, heartbeat=connection.heartbeat, **logs)

  def _event(self, record: dict) -> None:
    """A membership event into its log (from the heartbeat's thread or the round's), stamped with the step;
    a peer held lost, or back from lost, also in a log line (what it means for the rounds)."""
    with self._lock:
      if self._events is not None:
        self._events.append({"step": self.step, **record})
    peer, event = record.get("slot"), record.get("event")
    if event == "lost" and peer != self.slot:
      logging.warning("Slot %d: slot %s (incarnation %s) is held lost: dead, or silent for more than lease_s=%.3g s; "
                      "it is not grouped while it is (one that was only stopped returns).", self.slot, peer,
                      record.get("incarnation"), self.options.lease_s)
    elif event == "returned":
      logging.warning("Slot %d: slot %s (incarnation %s) returned: its heartbeat moves again (it was stopped, not "
                      "dead); it is grouped again.", self.slot, peer, record.get("incarnation"))

  def round(self, message, progress: int, step: int | None = None, fragment: int = 0) -> RoundResult:
    """Finds this round's group and exchanges `message` (a pytree of arrays) with it; see the module docstring.
    `step`: the step the round was sent at (its log row's), else the driver's current one. `fragment`: with
    fragment streaming, the fragment this round is (its group: processes ready for the same fragment)."""
    matchmaker, F = self.matchmakers[fragment], self.options.fragments
    match = matchmaker.ready(progress)
    if match is None:
      result = RoundResult("skipped", waited_s=matchmaker.history[-1]["waited_s"],
                           reason=f"no partner within {self.options.max_wait_s:.3g} s")
    else:
      start = time.monotonic()
      stats = self.transport.stats
      sent, received = stats.bytes_sent, stats.bytes_received
      try:
        # One exchange tag per (fragment, batch): the fragments' batches are counted apart.
        tag = match.batch * F + fragment
        theirs = self.transport.exchange(message, match.partners, tag, self.options.exchange_timeout_s)
        result = RoundResult("exchanged", match.batch, tuple(m.slot for m in match.group),
                             tuple(m.incarnation for m in match.group), [message, *theirs],
                             [match.own.progress, *(m.progress for m in match.partners)], match.waited_s,
                             time.monotonic() - start, bytes_sent=stats.bytes_sent - sent,
                             bytes_received=stats.bytes_received - received)
      except transport_lib.ExchangeFailed as e:
        self.failed += 1
        logging.warning("Slot %d: %s; the exchange of batch %d is skipped.", self.slot, e, match.batch)
        result = RoundResult("failed", match.batch, tuple(m.slot for m in match.group),
                             tuple(m.incarnation for m in match.group), waited_s=match.waited_s,
                             exchange_s=time.monotonic() - start, reason=str(e))
    if self._pairings is not None:
      self._pairings.append({"step": self.step if step is None else step, "time": time.time(), "slot": self.slot,
                             "incarnation": str(self.incarnation), "progress": int(progress), "status": result.status,
                             "batch": result.batch, "group": list(result.group),
                             "incarnations": [str(i) for i in result.incarnations],
                             "partner_progress": result.progress[1:], "waited_s": round(result.waited_s, 6),
                             "exchange_s": round(result.exchange_s, 6), "reason": result.reason,
                             **({"fragment": fragment} if F > 1 else {})})
    return result

  def join_requests(self) -> dict[str, str]:
    """The requests of joiners that picked this process as their donor, not served yet (one store read, from
    any thread: the driver reads them on its round's thread and serves them on the loop's)."""
    return self.donor.requests()

  def serve_joins(self, state_fn, progress: int, requests: dict[str, str] | None = None) -> int:
    """Offers `state_fn()` to joiners that picked this process as their donor: `requests` (join_requests'),
    or, None, those a store read finds now."""
    served = self.donor.serve(state_fn, progress, offer_s=self.options.join_timeout_s, requests=requests)
    for s in self.donor.served[-served:] if served else ():
      self._event({**s, "slot": self.slot, "event": "served_join"})
    return served

  def join(self, template):
    """As a (re)started process: (state, donor slot, donor progress) from a live peer (churn.join)."""
    live = self.liveness.beating()  # not poll(): a dead donor's stale lease would cost a whole join timeout
    state, donor, progress = churn.join(self.kv, self.transport, self.slot, self.incarnation, template, live,
                                        seed=self.options.seed, timeout_s=self.options.join_timeout_s)
    self._event({"time": time.time(), "slot": self.slot, "incarnation": self.incarnation, "event": "joined_from",
                 "donor": donor, "donor_progress": progress, "digest": churn.digest(jax.tree.leaves(state))})
    return state, donor, progress

  def others_alive(self) -> list[int]:
    return sorted(s for s in self.liveness.poll() if s != self.slot)

  def summary(self) -> dict:
    return {"slot": self.slot, "incarnation": str(self.incarnation), "matchmaking": self.matchmaker.stats.as_dict(),
            "transport": self.transport.stats.as_dict(), "failed_exchanges": self.failed,
            "membership": list(self.liveness.events)}

  def close(self, linger_s: float = 0.0, keep_beating: bool = False) -> None:
    """Leaves (the others see it at once). `linger_s`: first wait up to this long for the others to be gone
    (what the process hosting the coordination service must do, or its exit ends them). `keep_beating`: the
    heartbeat goes on ("left", liveness.Liveness.leave) until the process exits (asynchronous/job.py)."""
    self.liveness.leave(keep_beating=keep_beating)
    self.liveness.detach()  # it may go on beating (and observing): not into its log, which its owner closes
    with self._lock:
      self._events = self._pairings = None
    end = time.monotonic() + linger_s
    while linger_s > 0 and time.monotonic() < end and self.others_alive():
      time.sleep(min(self.options.beat_s, 0.5))
