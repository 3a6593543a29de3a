"""The control plane's store on etcd: a Raft-replicated cluster, so that no one machine is the job's.

Why etcd. JAX's coordination service (control.JaxKV) is one process: when it exits every client aborts
(a limit of JAX's runtime), and it takes a fixed number of clients, so a job cannot grow past the
slots it reserved at start-up. etcd keeps the same small key-value store on 3 (or 5) members that
agree through Raft: a write is committed once a majority holds it, so the store, and every job on it,
survives the loss of any one member of three; and a client is anyone who can reach a member, so a
process that was never part of the job can join it. The schedule's modules (liveness.py,
matchmaking.py, transport.py, churn.py) run on it unchanged, through the `KV` interface of control.py.

What each operation is on etcd (v3 API, through each member's JSON gateway):

- `create`: a transaction "if the key's create revision is 0, put it": etcd serialises transactions,
  so exactly one of several racing creators wins (a closed batch, a slot claim);
- `increment`: a compare-and-swap loop, "if the key's mod revision is still the one I read, put n + by";
- `wait`: a read, then a *watch* from the revision of that read: the caller sleeps in the member's
  stream until the key is written, so nothing polls; a write between the read and the watch is
  replayed by the watch (it starts at that revision);
- liveness: the process holds one etcd *lease* (TTL = outer.asynchronous.lease_s, renewed every third of it by a
  daemon thread), and the keys that live as long as the process (`OWNED`: its heartbeat, its
  transfer server's address, its config, its slot claim) are bound to it. When the process dies, the
  cluster deletes them TTL seconds after its last renewal; when it leaves, it revokes the lease and
  they go at once. Its incarnation is the lease's id (unique in the cluster's lifetime). The heartbeat
  counters of liveness.py still move every beat, so that every observer judges by its own clock, as
  on JAX's service.

Failover. The client (etcd3gw: pure Python over HTTP, so none of its dependencies meets JAX's grpcio or
protobuf) talks to one member at a time; a request that fails or does not answer within
`request_timeout_s` goes to the next member, for at most `retry_s`. A member that died, is stopped or
lost the majority is left within a request timeout; during a new leader's election (about a second
after the leader dies) requests wait and retry. What the caller can see: an operation that takes up
to `retry_s` longer, or, when no member answers for that long, `Unavailable` naming each member and
why. An increment whose answer was lost after it committed may be applied twice (a ticket number then
stays unused: the matchmaker waits for it at most its ticket grace, matchmaking.py).

Slots. A job on etcd has no fixed list of clients: a process takes a slot by creating `slot/<n>`
under its lease (one winner); its own slot when it was given one (`--process_id`, e.g. from
launch_local or SLURM; a restarted process first waits for its dead incarnation's lease to run out),
else the highest free one below the job's capacity (`config.num_replicas`: one data shard per slot), so
that a newcomer does not race the processes started with ids 0, 1, … for theirs.
`used/<n>` (never deleted) records that slot n has held a process in this job, so a restarted process
knows to take its weights from a live peer (churn.py).

Every key of a job lives under `noloco_async/<job>/`: several jobs share one cluster by name, and a
job started again under its name finds its slots' history (a whole job stopped and started again: each
process resumes from its own checkpoint, the first one up trains on, those after it take the state of
a live peer, as a restarted process does).
"""

from __future__ import annotations

import base64
import logging
import math
import threading
import time

from noloco_jax.asynchronous import control, liveness

SCHEME = "etcd://"
SLOT = "slot/"  # slot/<n> = incarnation of the process holding slot n (bound to its lease)
USED = "used/"  # used/<n>: slot n has held a process in this job (kept: a restart of it rejoins)
# The keys that live as long as the process that wrote them: bound to its lease.
OWNED = (liveness.PREFIX, "tx/", "config/", SLOT)
WATCH_CHUNK_S = 2.0  # a watch is re-opened (after a fresh read) this often, so a stalled member is noticed


class Unavailable(RuntimeError):
  """No member of the etcd cluster answered within the retry budget (names each member and why)."""


class SlotError(RuntimeError):
  """This process cannot take the slot it asked for, or the job has no free slot (one line)."""


def parse_url(url: str) -> tuple[list[tuple[str, int]], str]:
  """([(host, port), ...], job) of `etcd://HOST:PORT[,HOST:PORT...][/JOB]`; ValueError naming the value."""
  usage = (f"--control={url!r} is not valid: etcd://HOST:PORT[,HOST:PORT...][/JOB] (the client URLs of the "
           "cluster's members, e.g. etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379/my-run), or 'jax'.")
  if not url.startswith(SCHEME):
    raise ValueError(usage)
  members, _, job = url[len(SCHEME):].partition("/")
  job = job.strip("/") or "default"
  endpoints = []
  for part in members.split(","):
    host, _, port = part.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise ValueError(usage)
    endpoints.append((host.strip("[]"), int(port)))
  if not job.replace("-", "").replace("_", "").replace(".", "").isalnum():
    raise ValueError(usage.replace("is not valid:", f"is not valid (job name {job!r}: letters, digits, '-', '_', "
                                   "'.'):"))
  return endpoints, job


def _b64(text: str) -> str:
  return base64.b64encode(text.encode()).decode()


def _why(error: Exception) -> str:
  """A short reason for a failed request (the client's messages hold whole URLs and tracebacks)."""
  text = " ".join(str(x) for x in (getattr(error, "detail_text", None), error) if x)
  for needle, why in (("Connection refused", "connection refused"), ("timed out", "no answer in time"),
                      ("Read timed out", "no answer in time"), ("no leader", "no leader (quorum lost?)"),
                      ("leader changed", "leader changed")):
    if needle in text:
      return why
  return (text.splitlines() or [type(error).__name__])[0][:120] or type(error).__name__


def _etcd3gw():
  try:
    import etcd3gw  # pylint: disable=g-import-not-at-top  (an optional dependency: the `etcd` extra)
    import requests  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(f"--control=etcd://... needs the etcd client: pip install 'noloco_jax[etcd]' ({e}).") from None
  return etcd3gw, requests


class EtcdKV:
  """The KV interface (control.KV) over an etcd cluster, every key under `prefix`; holds this process's lease."""

  def __init__(self, endpoints, *, prefix: str, lease_s: float, request_timeout_s: float = 2.0,
               retry_s: float = 20.0, startup_s: float | None = None):
    """Grants this process's lease (TTL = ⌈lease_s⌉ s, at least 2) on the first member that answers
    within `startup_s` (default `retry_s`), else raises Unavailable; renews it from a daemon thread."""
    etcd3gw, requests = _etcd3gw()
    self._errors = (etcd3gw.exceptions.Etcd3Exception, requests.exceptions.RequestException)
    self._watch_timed_out = etcd3gw.exceptions.WatchTimedOut
    self._lease_type = etcd3gw.Lease
    self.endpoints = [f"{h}:{p}" for h, p in endpoints]
    self.prefix, self.request_timeout_s, self.retry_s = prefix, request_timeout_s, retry_s
    self._clients = [etcd3gw.client(host=h, port=p, api_path="/v3/", timeout=request_timeout_s,
                                    session=_bounded_session(requests, request_timeout_s)) for h, p in endpoints]
    self._current = 0
    self._lock = threading.Lock()
    self.ttl = max(2, math.ceil(lease_s))
    self._owned: dict[str, str] = {}  # key -> value of the keys bound to the lease (re-bound if it is lost)
    self._lost_slot: str | None = None
    self._lease_id = self._grant(startup_s if startup_s is not None else retry_s)
    self.incarnation = self._lease_id  # this process's identity in the job: its first lease
    self._stop = threading.Event()
    self._keeper = threading.Thread(target=self._keep_alive, name="noloco-etcd-lease", daemon=True)
    self._keeper.start()

  # ---- Requests, with failover between members ----

  def _call(self, what: str, fn, budget_s: float | None = None):
    """fn(client) on the current member, else on the next ones, for at most `budget_s` (default retry_s)."""
    budget_s = self.retry_s if budget_s is None else budget_s
    deadline = time.monotonic() + budget_s
    why: dict[str, str] = {}
    attempts = 0
    while True:
      index = self._current
      try:
        return fn(self._clients[index])
      except self._errors as e:
        why[self.endpoints[index]] = _why(e)
        with self._lock:
          if self._current == index:
            self._current = (index + 1) % len(self._clients)
        attempts += 1
        if time.monotonic() >= deadline:
          raise Unavailable(f"etcd: no member answered ({what}) within {budget_s:.3g} s: "
                            + "; ".join(f"{ep}: {why.get(ep, 'not tried')}" for ep in self.endpoints)) from None
        if attempts % len(self._clients) == 0:  # every member failed once: back off a little
          time.sleep(min(0.05 * 2 ** (attempts // len(self._clients)), 0.5))

  def _post(self, what: str, path: str, payload: dict, budget_s: float | None = None) -> dict:
    return self._call(what, lambda c: c.post(c.get_url(path), json=payload), budget_s)

  def _lease(self, client, key: str):
    return self._lease_type(self._lease_id, client) if key.startswith(OWNED) else None

  # ---- The KV interface ----

  def set(self, key: str, value: str) -> None:
    self._check_slot(key)
    self._call("put", lambda c: c.put(self.prefix + key, value, lease=self._lease(c, key)))
    if key.startswith(OWNED):
      self._owned[key] = value

  def create(self, key: str, value: str) -> bool:
    """Puts `key` only if it does not exist (one transaction); True if this call created it."""
    self._check_slot(key)
    created = self._call("create", lambda c: c.create(self.prefix + key, value, lease=self._lease(c, key)))
    if created and key.startswith(OWNED):
      self._owned[key] = value
    return bool(created)

  def get(self, key: str) -> str | None:
    return self._range(key)[0]

  def wait(self, key: str, timeout_s: float) -> str | None:
    """The value of `key` once it exists, or None after `timeout_s`: a read, then a watch from its revision."""
    end = time.monotonic() + max(timeout_s, 0.0)
    while True:
      value, revision = self._range(key)
      left = end - time.monotonic()
      if value is not None or left <= 0:
        return value
      event = self._watch(key, revision, min(left, WATCH_CHUNK_S), ["NODELETE"])
      if event is not None:
        return event["kv"].get("value", b"").decode()

  def wait_absent(self, key: str, timeout_s: float) -> bool:
    """True once `key` does not exist (e.g. a dead process's lease ran out), False after `timeout_s`."""
    end = time.monotonic() + max(timeout_s, 0.0)
    while True:
      value, revision = self._range(key)
      left = end - time.monotonic()
      if value is None:
        return True
      if left <= 0:
        return False
      self._watch(key, revision, min(left, WATCH_CHUNK_S), ["NOPUT"])

  def increment(self, key: str, by: int) -> int:
    """Adds `by` to the integer at `key` (absent: 0) atomically: compare-and-swap on its mod revision."""
    full = _b64(self.prefix + key)
    while True:
      response = self._post("range", "/kv/range", {"key": full})
      kvs = response.get("kvs", [])
      old = int(base64.b64decode(kvs[0].get("value", "")).decode() or 0) if kvs else 0
      if by == 0:
        return old
      compare = ({"key": full, "result": "EQUAL", "target": "MOD", "mod_revision": int(kvs[0]["mod_revision"])} if kvs
                 else {"key": full, "result": "EQUAL", "target": "CREATE", "create_revision": 0})
      txn = {"compare": [compare], "success": [{"request_put": {"key": full, "value": _b64(str(old + by))}}]}
      if self._post("increment", "/kv/txn", txn).get("succeeded"):
        return old + by

  def dir(self, prefix: str) -> dict[str, str]:
    rows = self._call("range", lambda c: c.get_prefix(self.prefix + prefix))
    return {meta["key"].decode()[len(self.prefix):]: value.decode() for value, meta in rows}

  def delete(self, key: str) -> None:
    self._owned.pop(key, None)
    self._call("delete", lambda c: c.delete(self.prefix + key))

  def close(self) -> None:
    """Revokes the lease: this process's keys go at once (the others see it leave, its slot is free)."""
    self._stop.set()
    try:
      self._post("revoke", "/kv/lease/revoke", {"ID": self._lease_id}, budget_s=2 * self.request_timeout_s)
    except Unavailable as e:
      logging.warning("etcd: the lease of this process was not revoked (%s); its keys go when it runs out.", e)

  # ---- Helpers ----

  def _range(self, key: str) -> tuple[str | None, int]:
    """(value or None, the store's revision at this read): a linearisable read through the current member."""
    response = self._post("range", "/kv/range", {"key": _b64(self.prefix + key)})
    kvs = response.get("kvs", [])
    value = base64.b64decode(kvs[0].get("value", "")).decode() if kvs else None
    return value, int(response["header"]["revision"])

  def _watch(self, key: str, revision: int, timeout_s: float, filters: list[str]):
    """The first event on `key` after `revision` within `timeout_s` (None when none came, or on a member
    failure: the caller reads again, through the next member)."""
    index = self._current
    try:
      return self._clients[index].watch_once(self.prefix + key, timeout=timeout_s, start_revision=revision + 1,
                                             filters=filters)
    except self._watch_timed_out:
      return None
    except self._errors:
      with self._lock:
        if self._current == index:
          self._current = (index + 1) % len(self._clients)
      return None

  def _grant(self, budget_s: float) -> int:
    return int(self._post("lease grant", "/lease/grant", {"TTL": self.ttl, "ID": 0}, budget_s)["ID"])

  def _keep_alive(self) -> None:
    """Renews the lease every TTL/3; if it ran out (the cluster was out of reach longer than a TTL), takes a
    new one and binds this process's keys to it again (its slot only if nobody took it meanwhile)."""
    while not self._stop.wait(self.ttl / 3):
      try:
        answer = self._post("lease keepalive", "/lease/keepalive", {"ID": self._lease_id}, budget_s=self.ttl)
        if int(answer.get("result", {}).get("TTL", -1)) <= 0:
          self._rebind()
      except Unavailable as e:
        logging.warning("etcd: the lease of this process could not be renewed: %s", e)

  def _rebind(self) -> None:
    logging.warning("etcd: the lease of this process ran out; binding its keys to a new one.")
    self._lease_id = self._grant(self.retry_s)
    for key, value in list(self._owned.items()):
      if key.startswith(SLOT):
        if not self._call("create", lambda c, k=key, v=value: c.create(self.prefix + k, v, lease=self._lease(c, k))):
          self._lost_slot = key
          logging.error("etcd: %s was taken by another process while this one was out of reach; this process "
                        "no longer holds a slot of the job.", key)
      else:
        self._call("put", lambda c, k=key, v=value: c.put(self.prefix + k, v, lease=self._lease(c, k)))

  def _check_slot(self, key: str) -> None:
    if self._lost_slot is not None and key.startswith(OWNED):
      raise SlotError(f"this process lost {self._lost_slot} to another process while it was out of reach of the "
                      "etcd cluster; it is no longer part of the job.")

  def unreachable(self) -> list[str]:
    """The members that do not answer a status request now (each within the request timeout)."""
    down = []
    for endpoint, client in zip(self.endpoints, self._clients):
      try:
        client.status()
      except self._errors as e:
        down.append(f"{endpoint} ({_why(e)})")
    return down


def _bounded_session(requests, timeout_s: float):
  """A requests session whose every request has a time limit, the watch's stream included (etcd3gw opens
  it without one: a stopped member would hold the caller for ever)."""

  class Bounded(requests.adapters.HTTPAdapter):

    def send(self, request, stream=False, timeout=None, **kwargs):  # pylint: disable=arguments-differ
      if timeout is None:
        timeout = (timeout_s, WATCH_CHUNK_S + timeout_s) if stream else timeout_s
      return super().send(request, stream=stream, timeout=timeout, **kwargs)

  session = requests.Session()
  session.mount("http://", Bounded())
  session.mount("https://", Bounded())
  return session


# ---- Joining a job ----


def connect(url: str, *, capacity: int, slot: int | None, lease_s: float, startup_s: float = 10.0,
            retry_s: float = 20.0) -> control.Connection:
  """This process's place in the job on the etcd cluster of `url`: its lease, its slot, whether it rejoins.

  `slot`: the slot to take (it may be held by this slot's dead incarnation for up to a lease: waited
  for), or None for a newcomer (the highest free slot below `capacity`). Raises Unavailable when no
  member answers within `startup_s`, SlotError when the slot stays held or the job is full.
  """
  endpoints, job = parse_url(url)
  kv = EtcdKV(endpoints, prefix=f"{control.NAMESPACE}{job}/", lease_s=lease_s, retry_s=retry_s, startup_s=startup_s)
  down = kv.unreachable()
  if down:
    logging.warning("etcd: %d of %d members do not answer: %s (the job runs while a majority does).", len(down),
                    len(kv.endpoints), ", ".join(down))
  newcomer = slot is None
  mine = str(kv.incarnation)
  if newcomer:
    held = kv.dir(SLOT)
    # From the top: processes started with their ids (launch_local, SLURM: 0, 1, ...) take the low slots.
    slot = next((n for n in reversed(range(capacity)) if f"{SLOT}{n}" not in held and kv.create(f"{SLOT}{n}", mine)),
                None)
    if slot is None:
      kv.close()
      raise SlotError(f"config.num_replicas={capacity} is not valid for one more process: the job on {url} holds "
                      f"{capacity} processes already (one per data shard); start the job with a larger "
                      "--config.num_replicas to let it grow further.")
  elif not kv.create(f"{SLOT}{slot}", mine):
    wait_s = kv.ttl + 2 * kv.request_timeout_s  # a restarted process: its dead incarnation's lease runs out
    holder = kv.get(f"{SLOT}{slot}")
    logging.info("etcd: slot %d is held by incarnation %s; waiting up to %.0f s for its lease to run out.", slot,
                 holder, wait_s)
    if not (kv.wait_absent(f"{SLOT}{slot}", wait_s) and kv.create(f"{SLOT}{slot}", mine)):
      kv.close()
      raise SlotError(f"--process_id={slot} is not valid: slot {slot} of the job on {url} is held by a live process "
                      f"(incarnation {holder}); leave --process_id out to take a free slot.")
  used_before = not kv.create(f"{USED}{slot}", mine)
  # Another process alive (its lease-bound heartbeat is there and has not left): a running job to join from.
  others = [k for k, v in kv.dir(liveness.PREFIX).items()
            if k != f"{liveness.PREFIX}{slot}" and not liveness.is_left(v.partition(":")[2])]
  rejoining = bool(others) and (newcomer or used_before)
  logging.info("etcd: slot %d of job %r (incarnation %d, %s) on %s.", slot, job, kv.incarnation,
               "a newcomer" if newcomer else ("used before" if used_before else "new"), ", ".join(kv.endpoints))
  return control.Connection(kv, slot, capacity, kv.incarnation, client=None, service=None, rejoining=rejoining)
