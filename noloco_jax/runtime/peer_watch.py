"""Ends every process of a multi-process job within a second of one of them dying, with one line.

Why: left to itself, a survivor learns of a dead peer from the distributed runtime once the peer has
missed heartbeats for heartbeat_timeout_s, and the runtime then aborts it (a C++ LOG(FATAL): "Terminating
process because the JAX distributed service detected fatal errors", a stack dump, status 134). The
runtime's hook for that moment (`missed_heartbeat_callback`) cannot take a Python function: the
binding cannot pass the status to Python, and the call itself aborts (`std::bad_cast`).

So the processes watch each other directly: at start-up every process opens one TCP connection to
process 0, and a thread on each end blocks reading it. When a process dies, however it dies (kill -9
included), its operating system closes the connection and the other end reads EOF at once; the
survivor then logs `Process i of P failed: …` and exits with status 1. Process 0 watches every other
process, the others watch process 0, so with more than two processes the rest follow when process 0
exits. A process that finishes normally first sends "bye" (`PeerWatch.leave`), after which its EOF
means nothing. A host that vanishes without closing its connections (power loss, a cut cable) is
still caught by the runtime's heartbeats, as before.

One race remains: when process 0 dies, JAX's coordination service (which it hosts) dies with it, and
the runtime in each survivor sees its link to the service break at the same instant as the watch sees
EOF. The runtime's thread needs no Python lock, the watch's does, so the runtime often aborts the
survivor first (its own message, status 134), as quickly. Measured: process 1 killed -> process 0
exits with this line in 0.5 s; process 0 killed -> process 1 ends in 0.5 s, by either path.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading

import jax

from noloco_jax.runtime import job_checks
from noloco_jax.runtime.failures import EXIT_FAILED

_BYE = b"bye\n"
_LOST = threading.Event()  # set when a watch reads EOF from a peer that did not say goodbye
_ID_BYTES = 8  # a connecting process first sends its index, zero-padded to this many digits


class PeerWatch:
  """The open connections of this process to its peers, each read by a daemon thread."""

  def __init__(self, peers: dict[int, socket.socket]):
    self.index, self.count = jax.process_index(), jax.process_count()
    self._peers = peers
    self._leaving = threading.Event()
    for peer, conn in peers.items():
      threading.Thread(target=self._watch, args=(peer, conn), name=f"peer-watch-{peer}", daemon=True).start()

  def leave(self) -> None:
    """This process is finishing normally: tell the peers, so that its exit ends nobody."""
    self._leaving.set()
    for conn in self._peers.values():
      try:
        conn.sendall(_BYE)
      except OSError:
        pass  # that peer is gone already

  def _watch(self, peer: int, conn: socket.socket) -> None:
    received = b""
    try:
      while _BYE not in received:
        chunk = conn.recv(64)
        if not chunk:
          break  # EOF: the peer's process has ended
        received += chunk
      else:
        return  # the peer said goodbye: it is finishing normally
    except OSError:
      pass
    if self._leaving.is_set():
      return
    _LOST.set()
    logging.error("Process %d of %d failed: its connection to process %d closed without a goodbye: another "
                  "process of the job has most likely died or been killed; its log shows why. Exiting with "
                  "status %d.", self.index, self.count, peer, EXIT_FAILED)
    for stream in (sys.stdout, sys.stderr):
      stream.flush()
    os._exit(EXIT_FAILED)  # pylint: disable=protected-access  (the main thread may be stuck in a collective)


def peer_lost(timeout_s: float) -> bool:
  """Waits up to `timeout_s` for a watch to see a peer die; True if one did (its thread then ends this
  process with its own line). distributed.fail_fast asks, after a collective failed: the same dead peer
  breaks both, and the watch's line names it."""
  return _LOST.wait(timeout_s)


def start(host: str | None = None, timeout_s: float = 60.0) -> PeerWatch | None:
  """Collective: connects the processes (see the module docstring). None in a single-process job.

  `host`: how the other processes reach process 0 (the coordinator's host); default its host name.
  """
  if jax.process_count() == 1:
    return None
  me = jax.process_index()
  server = None
  address = ""
  if me == 0:
    server = socket.create_server(("", 0))
    server.settimeout(timeout_s)
    address = f"{host or socket.gethostname()}:{server.getsockname()[1]}"
  address = job_checks.gather_texts(address)[0]  # after process 0 listens, so no connect comes too early
  if server is not None:
    peers = {}
    with server:
      for _ in range(jax.process_count() - 1):
        conn, _ = server.accept()
        conn.settimeout(timeout_s)
        peer = int(_recv_exactly(conn, _ID_BYTES))
        conn.settimeout(None)
        peers[peer] = conn
  else:
    name, port = address.rsplit(":", 1)
    conn = socket.create_connection((name, int(port)), timeout=timeout_s)
    conn.sendall(f"{me:0{_ID_BYTES}d}".encode())
    conn.settimeout(None)
    peers = {0: conn}
  logging.info("Peer watch: process %d watches processes %s.", me, sorted(peers))
  return PeerWatch(peers)


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
  data = b""
  while len(data) < n:
    chunk = conn.recv(n - len(data))
    if not chunk:
      raise ConnectionError("a peer closed its connection during the peer-watch start-up")
    data += chunk
  return data
