"""Faults inside an exchange of the asynchronous schedule (issue 38.3): a partner killed or stopped in the
middle of a transfer, a transfer that times out, a process whose clock jumps; and a partner whose heartbeat
goes silent, given up on after outer.asynchronous.partner_silence_s rather than the timeout (issue 33.7).

What must hold: the survivor's state is bit for bit what it was before that exchange, the exchange is
logged as failed, and the process that was late or stopped, when it goes on, is either paired again or
told that it was left behind, never merged with a partner that had given up on it. Faults are placed
at exact points of the exchange with NOLOCO_FAULTS (runtime/faults.py: xkill, xstop, xdelay, xclock at
offered | announced | pulled). Two transfer servers in one process test the protocol in seconds; the
toy job of experiments/async_demo.py on real processes over loopback tests the whole schedule.
"""

import json
import os
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from noloco_jax.asynchronous import liveness, matchmaking, transport
from noloco_jax.runtime import faults, launch_local
import memory_kv  # pylint: disable=g-bad-import-order  (tests/memory_kv.py)


def _member(slot, incarnation):
  return matchmaking.Member(slot, incarnation, 0, 0)


def _run(fn):
  """fn() on a thread; returns a dict that holds its result ("ok") or its exception ("error") once joined."""
  out = {}

  def target():
    try:
      out["ok"] = fn()
    except Exception as e:  # pylint: disable=broad-except
      out["error"] = e
  t = threading.Thread(target=target)
  t.start()
  return t, out


def test_exchange_faults_parse_and_fire_at_their_round_and_point():
  spec = ("xdelay:process=1,round=2,at=announced,seconds=0.3;xkill:process=0,round=1,at=offered;delay:seconds=0.1;"
          "xdelay:process=1,round=3,at=ticketed,seconds=0.3")
  hook = faults.ExchangeFaults(faults.parse(spec), 1)
  assert [f.kind for f in hook.faults] == ["xdelay", "xdelay"]
  assert [f.kind for f in faults.Injector(faults.parse(spec), 1).faults] == ["delay"]  # the step hook ignores x*
  slept = []

  def at(round_, phase):
    start = time.monotonic()
    hook.at(phase)
    slept.append((round_, phase, time.monotonic() - start > 0.25))

  for r in range(1, 4):
    at(r, "ticketed")  # the pairing before exchange r (matchmaking.py), two tickets: it fires once
    at(r, "ticketed")
    hook.begin()
    for phase in ("offered", "announced", "pulled"):  # transport.py's, inside exchange r
      at(r, phase)
  assert [(r, p) for r, p, late in slept if late] == [(2, "announced"), (3, "ticketed")]


@pytest.mark.parametrize("spec, message", [
    ("xkill:round=1", "at=None is not valid (valid: ticketed, offered, announced, pulled)"),
    ("xstop:round=1,at=later,seconds=1", "at=later is not valid"),
    ("kill:step=3,at=offered", "at= is for xkill"),
    ("xdelay:round=1,at=pulled", "needs ['round', 'seconds']"),
])
def test_bad_exchange_fault_specs_name_the_entry(spec, message):
  with pytest.raises(ValueError) as e:
    faults.parse(spec)
  assert message in str(e.value) and "\n" not in str(e.value)


def _exchange_pair(hook_spec, timeout_a, timeout_b, lag_s=0.0):
  """Slots 0 and 1 exchange under tag 7 (slot 1 with the exchange fault `hook_spec`, `lag_s` after slot 0);
  returns each side's outcome: {"ok": messages} or {"error": ExchangeFailed}."""
  kv = memory_kv.MemoryKV()
  a = transport.Transport(kv, 0, 10)
  b = transport.Transport(kv, 1, 11, hook=faults.ExchangeFaults(faults.parse(hook_spec), 1))
  ta, out_a = _run(lambda: a.exchange({"x": jnp.ones(4)}, [_member(1, 11)], 7, timeout_s=timeout_a))
  time.sleep(lag_s)
  tb, out_b = _run(lambda: b.exchange({"x": 2 * jnp.ones(4)}, [_member(0, 10)], 7, timeout_s=timeout_b))
  ta.join(120)
  tb.join(120)
  return out_a, out_b, kv


def test_a_partner_that_gave_up_is_never_merged_by_the_late_one():
  """Slot 0 waits 1.5 s for slot 1's message and gives up (its state stays). Slot 1 started its exchange
  0.8 s later and is late at the `offered` point (xdelay 1.2 s): when it announces, slot 0's own offer is
  still on its server and slot 1's deadline has not passed, so it could pull it and merge alone with a
  partner that did not merge with it (it did, before the group's record). It must fail, told why."""
  out_a, out_b, kv = _exchange_pair("xdelay:round=1,at=offered,seconds=1.2", 1.5, 3.0, lag_s=0.8)
  assert isinstance(out_a.get("error"), transport.ExchangeFailed), out_a
  assert isinstance(out_b.get("error"), transport.ExchangeFailed), f"slot 1 merged slot 0's message: {out_b}"
  assert "the group aborted the exchange (abort: slot 0" in str(out_b["error"])
  assert kv.get("x/7/decided/0").startswith("abort: slot 0: exchange with slot 1 failed: it did not offer")


def test_a_member_that_gave_up_after_it_pulled_aborts_the_group():
  """Slot 1 pulls slot 0's message, then stops short (`pulled`, 2 s) while slot 0, holding slot 1's
  message, waits 1 s for its acknowledgement and gives up. Neither merges (slot 1 would have, alone)."""
  out_a, out_b, kv = _exchange_pair("xdelay:round=1,at=pulled,seconds=2", 1.0, 60.0)
  assert isinstance(out_a.get("error"), transport.ExchangeFailed), out_a
  assert "did not acknowledge" in str(out_a["error"])
  assert isinstance(out_b.get("error"), transport.ExchangeFailed), f"slot 1 merged slot 0's message: {out_b}"
  assert kv.get("x/7/decided/0").startswith("abort: slot 0")


def test_a_late_member_whose_partner_still_waits_completes_the_exchange_on_both_sides():
  """Slot 1 is slowed past its own 0.5 s deadline after pulling, but slot 0 (60 s) still waits: both
  acknowledged, the record says commit, and both merge (each holds the other's message)."""
  out_a, out_b, kv = _exchange_pair("xdelay:round=1,at=pulled,seconds=1", 60.0, 0.5)
  np.testing.assert_array_equal(np.asarray(out_a["ok"][0]["x"]), 2 * np.ones(4))
  np.testing.assert_array_equal(np.asarray(out_b["ok"][0]["x"]), np.ones(4))
  assert kv.get("x/7/decided/0") == transport.COMMIT


def test_a_process_silent_past_its_lease_is_told_it_was_left_behind():
  """Its own heartbeat's gap (by its own monotonic clock) tells a process that the others held it lost."""
  now = [0.0]
  kv = memory_kv.MemoryKV()
  me = liveness.Liveness(kv, 0, 5, beat_s=0.5, lease_s=3.0, clock=lambda: now[0])
  for t in (0.0, 0.5, 1.0, 5.5, 6.0):  # stopped from 1.0 to 5.5: 4.5 s > lease
    now[0] = t
    me.beat()
  behind = [e for e in me.events if e["event"] == "left_behind"]
  assert len(behind) == 1 and behind[0]["slot"] == 0 and behind[0]["silent_s"] == pytest.approx(4.5)


# ---- A silent partner (issue 33 item 7): given up on once its heartbeat is silent past the bound ----


class _Freeze:
  """An exchange fault on one process's threads: at `phase` its heartbeat stops beating (as a SIGSTOP would
  stop it) and its exchange sleeps `seconds`, then both go on. `beating=True`: only the exchange sleeps (a
  partner that is slow, its heartbeat alive)."""

  def __init__(self, live, phase, seconds, beating=False):
    self.live, self.phase, self.seconds, self.beating = live, phase, seconds, beating
    self.frozen_at = None  # monotonic time the freeze began

  def begin(self):
    pass

  def at(self, phase):
    if phase != self.phase:
      return
    self.frozen_at = time.monotonic()
    if not self.beating:
      self.live._stop.set()  # pylint: disable=protected-access
      self.live._thread.join(timeout=5)  # pylint: disable=protected-access
    time.sleep(self.seconds)
    if not self.beating:
      self.live._stop.clear()  # pylint: disable=protected-access
      self.live.start()


def _silent_pair(phase, seconds, bound_s, beating=False):
  """Slots 0 and 1 exchange under tag 7 (deadline 60 s each), each with a heartbeat; slot 0 gives up on a
  partner silent past `bound_s`; slot 1 freezes at `phase` (_Freeze). Returns each side's outcome, how long
  slot 0 went on after slot 1 froze, and the store."""
  kv = memory_kv.MemoryKV()
  lives = [liveness.Liveness(kv, s, 10 + s, beat_s=0.05, lease_s=30.0).start() for s in range(2)]
  a = transport.Transport(kv, 0, 10, silent=lambda p: lives[0].silent_past(p, bound_s), check_s=0.1)
  freeze = _Freeze(lives[1], phase, seconds, beating)
  b = transport.Transport(kv, 1, 11, hook=freeze)
  try:
    ta, out_a = _run(lambda: a.exchange({"x": jnp.ones(4)}, [_member(1, 11)], 7, timeout_s=60.0))
    tb, out_b = _run(lambda: b.exchange({"x": 2 * jnp.ones(4)}, [_member(0, 10)], 7, timeout_s=60.0))
    ta.join(120)
    a_s = time.monotonic() - freeze.frozen_at
    tb.join(120)
    return out_a, out_b, a_s, kv
  finally:
    for live in lives:
      live.leave()


@pytest.mark.parametrize("phase", ("offered", "announced", "pulled"))
def test_a_partner_whose_heartbeat_stops_mid_exchange_is_given_up_on_within_the_silence_bound(phase):
  """Slot 1's heartbeat stops for 4 s at `phase` of the exchange (offered: slot 0 waits for its message;
  announced, pulled: for its acknowledgement). Slot 0, whose deadline is 60 s, fails the exchange once slot
  1 has been silent for 0.5 s (plus a margin for a loaded machine), and neither merges: slot 1, going on,
  finds the group's record says abort (without the bound, slot 0 waited the 4 s and both merged)."""
  out_a, out_b, a_s, kv = _silent_pair(phase, 4.0, 0.5)
  assert isinstance(out_a.get("error"), transport.ExchangeFailed), out_a
  assert "heartbeat has been silent" in str(out_a["error"]), out_a
  assert a_s < 0.5 + 2.5, a_s  # the bound + a loaded machine's margin, short of the 4 s stop
  assert isinstance(out_b.get("error"), transport.ExchangeFailed), f"slot 1 merged alone: {out_b}"
  assert "the group aborted the exchange (abort: slot 0" in str(out_b["error"])


def test_a_slow_partner_whose_heartbeat_beats_is_waited_for():
  """Slot 1 is slow (3 s at `offered`, three times the 1 s bound) but its heartbeat beats: it is not silent,
  slot 0 waits for it, and both merge."""
  out_a, out_b, a_s, kv = _silent_pair("offered", 3.0, 1.0, beating=True)
  np.testing.assert_array_equal(np.asarray(out_a["ok"][0]["x"]), 2 * np.ones(4))
  np.testing.assert_array_equal(np.asarray(out_b["ok"][0]["x"]), np.ones(4))
  assert kv.get("x/7/decided/0") == transport.COMMIT and a_s > 2.9  # it waited out the 3 s


def test_members_close_a_batch_whose_opener_went_silent_within_the_silence_bound():
  """The opener of batch 0 (slot 5) took its ticket and stopped: its lease still holds (30 s) but its
  heartbeat does not move. Its two members close the batch once it has been silent 1 s, not after their
  close grace (30 s), and leave it out: they pair with each other."""
  kv = memory_kv.MemoryKV()
  lives = [liveness.Liveness(kv, s, 100 + s, beat_s=0.05, lease_s=30.0).start() for s in (0, 1, 5)]
  lives[2]._stop.set()  # pylint: disable=protected-access  (slot 5 stops beating: its lease holds 30 s)
  lives[2]._thread.join(timeout=5)  # pylint: disable=protected-access
  kv.increment(matchmaking.TICKET, 1)
  kv.set("mm/t/1", "[5, 105, 0]")
  makers = [matchmaking.Matchmaker(kv, s, 100 + s, seed=0, window_s=0.05, max_wait_s=20.0, live=lives[s].poll,
                                   close_grace_s=30.0, silent=lambda p, s=s: lives[s].silent_past(p, 1.0),
                                   check_s=0.1) for s in range(2)]
  out = {}
  threads = [threading.Thread(target=lambda s=s: out.__setitem__(s, makers[s].ready(3))) for s in range(2)]
  start = time.monotonic()
  try:
    [t.start() for t in threads]
    [t.join(timeout=90) for t in threads]
    took = time.monotonic() - start
  finally:
    for live in lives[:2]:
      live.leave()
  assert 5 in lives[0].poll()  # held alive all along: only its silence kept it out
  assert out[0] is not None and [m.slot for m in out[0].group] == [0, 1], out
  assert out[1] is not None and out[1].batch == out[0].batch == 0
  assert took < 1.0 + 5.0, took  # the bound + a loaded machine's margin, not the 30 s grace


# ---- The whole schedule on real processes (experiments/async_demo.py's toy job, loopback) ----

DEMO = "experiments.async_demo"
FAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"



def _run_demo(out, port, common, per_slot, env_of) -> list:
  """The async demo's processes, one per slot of `per_slot` (its own flags; `env_of(slot)`: extra
  environment), logs in OUT/logs; their exit codes (a process still running after the bound is killed)."""
  n, procs, logs = len(per_slot), [], []
  try:
    for slot in range(n):
      log = open(os.path.join(out, "logs", f"process_{slot}.log"), "w")
      logs.append(log)
      procs.append(subprocess.Popen([sys.executable, "-m", DEMO, *common, *per_slot[slot]],
                                    env=launch_local.process_env(slot, n, 1, port, env_of(slot)),
                                    stdout=log, stderr=subprocess.STDOUT))
    return [p.wait(timeout=400) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for log in logs:
      log.close()

def _jsonl(path):
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _logs(out):
  d = os.path.join(out, "logs")
  return "\n".join(f"--- {n}\n" + open(os.path.join(d, n)).read()[-2500:] for n in sorted(os.listdir(d)))


def test_a_partner_killed_or_stopped_mid_exchange_leaves_the_survivors_state_bit_for_bit(tmp_path):
  """Three processes (lease 3 s, exchange timeout 2 s). Slot 2 is SIGKILLed in its 3rd exchange right after
  announcing its message (its partners are pulling from it); later slot 1 is SIGSTOPped in its 9th exchange
  for 7 s, past its lease, after offering and before announcing (by then slot 0 is its only partner: the stop
  comes six exchanges after the kill, so a slot 2 that started a few rounds late on a loaded machine is dead
  by then; with the 6th, a start three rounds late once put all three in the stopped batch).
  Every round that did not exchange leaves its process's state bit for bit as it was before the round's
  message (digests of the whole state); the failed exchanges are logged as failed on both sides; slot 1,
  resumed, is told it was left behind (its group's record says abort; a `left_behind` event), merges
  nothing from that exchange, is seen `returned` by slot 0, and pairs with it again."""
  out = str(tmp_path)
  os.makedirs(os.path.join(out, "logs"))
  port = launch_local.free_port()
  common = ["--log_dir", out, "--lease_s", "3", "--max_wait_s", "1.5", "--exchange_timeout_s", "2", "--dim", "256"]
  per_slot = {0: ["--run_s", "300", "--until_file", os.path.join(out, "result_1.json"), "--rounds", "1"],
              1: ["--rounds", "16"], 2: ["--rounds", "16"]}
  fault = "xkill:process=2,round=3,at=announced;xstop:process=1,round=9,at=offered,seconds=7"
  codes = _run_demo(out, port, common, per_slot, lambda slot: {"NOLOCO_FAULTS": fault})
  assert codes == [0, 0, -9], _logs(out)
  rounds = {s: _jsonl(os.path.join(out, f"rounds_{s}.jsonl")) for s in range(3)}
  pairings = {s: _jsonl(os.path.join(out, f"pairings_{s}.jsonl")) for s in range(3)}
  for slot in (0, 1):
    for r in rounds[slot]:
      if r["status"] == "exchanged":
        assert r["after"] != r["before"], r  # the check below can tell a merge from none
      else:
        assert r["after"] == r["before"], (slot, r)  # failed or skipped: bit for bit as before the round
  # Slot 2's death: every partner of its last (3rd) exchange failed that exchange.
  killed_batch = [p for p in pairings[2] if p["status"] == "exchanged"]
  assert len(killed_batch) == 2, pairings[2]  # two exchanges completed; the 3rd never logged
  failed_with_2 = [p for s in (0, 1) for p in pairings[s] if p["status"] == "failed" and 2 in p["group"]]
  assert failed_with_2 and all(p["batch"] == failed_with_2[0]["batch"] for p in failed_with_2), failed_with_2
  # Slot 1's stop: its 9th exchange failed on both sides, and it was told so on resuming.
  tried = [p for p in pairings[1] if p["status"] in ("exchanged", "failed")]
  stopped = tried[8]
  assert stopped["status"] == "failed" and stopped["group"] == [0, 1], stopped
  assert "the group aborted the exchange (abort: slot 0" in stopped["reason"], stopped
  same = [p for p in pairings[0] if p["batch"] == stopped["batch"]]
  assert len(same) == 1 and same[0]["status"] == "failed", same
  events1 = _jsonl(os.path.join(out, "membership_1.jsonl"))
  behind = [e for e in events1 if e.get("event") == "left_behind"]
  assert behind and behind[0]["silent_s"] > 3, events1
  events0 = [(e["slot"], e["event"]) for e in _jsonl(os.path.join(out, "membership_0.jsonl")) if "slot" in e]
  assert (1, "lost") in events0 and (1, "returned") in events0 and (2, "lost") in events0, events0
  again = [p for p in pairings[1] if p["time"] > stopped["time"] and p["status"] == "exchanged" and 0 in p["group"]]
  assert again, pairings[1][-5:]  # paired again with slot 0 after it resumed


def test_a_partner_stopped_mid_exchange_costs_the_survivor_the_silence_bound_not_the_timeout(tmp_path):
  """Issue 33 item 7. Two processes (exchange timeout 60 s, lease 30 s, partner_silence_s 1.5 s). Slot 1 is
  SIGSTOPped for 12 s in its 3rd exchange right after announcing its message (slot 0 is pulling from it).
  Slot 0 gives up once slot 1's heartbeat has been silent 1.5 s: its exchange fails within the bound plus a
  loaded machine's margin (without the bound it waited the whole stop, and both merged), its state bit for
  bit as before that round, and it trains on (rounds of its own while slot 1 is stopped). Slot 1, resumed,
  merges nothing from that exchange (the group's record says abort) and pairs with slot 0 again."""
  out = str(tmp_path)
  os.makedirs(os.path.join(out, "logs"))
  port = launch_local.free_port()
  bound_s, stop_s = 1.5, 12.0
  common = ["--log_dir", out, "--lease_s", "30", "--max_wait_s", "1.5", "--exchange_timeout_s", "60",
            "--partner_silence_s", str(bound_s), "--dim", "256"]
  per_slot = {0: ["--run_s", "300", "--until_file", os.path.join(out, "result_1.json"), "--rounds", "1"],
              1: ["--rounds", "8"]}
  fault = f"xstop:process=1,round=3,at=announced,seconds={stop_s:g}"
  codes = _run_demo(out, port, common, per_slot, lambda slot: {"NOLOCO_FAULTS": fault})
  assert codes == [0, 0], _logs(out)
  pairings = {s: _jsonl(os.path.join(out, f"pairings_{s}.jsonl")) for s in range(2)}
  tried = [p for p in pairings[1] if p["status"] in ("exchanged", "failed")]
  stopped = tried[2]
  assert stopped["status"] == "failed" and "the group aborted the exchange (abort: slot 0" in stopped["reason"], stopped
  [survivor] = [p for p in pairings[0] if p["batch"] == stopped["batch"]]
  assert survivor["status"] == "failed" and "heartbeat has been silent" in survivor["reason"], survivor
  assert survivor["exchange_s"] < bound_s + 6.0, survivor  # the bound + a loaded machine's margin, not the 12 s stop
  rounds0 = _jsonl(os.path.join(out, "rounds_0.jsonl"))
  [failed] = [r for r in rounds0 if r["batch"] == stopped["batch"]]
  assert failed["after"] == failed["before"], failed
  assert any(failed["time"] < r["time"] < stopped["time"] for r in rounds0), "slot 0 did not train on meanwhile"
  again = [p for p in pairings[1] if p["time"] > stopped["time"] and p["status"] == "exchanged" and 0 in p["group"]]
  assert again, pairings[1][-5:]


# A real component (libfaketime, preloaded into a process): the real tier, whose script installs it as root.
@pytest.mark.real
@pytest.mark.skipif(not os.path.exists(FAKETIME), reason=f"libfaketime is not installed ({FAKETIME}: apt-get install "
                    "libfaketime)")
def test_a_process_whose_clock_jumps_mid_exchange_corrupts_no_state(tmp_path):
  """Two processes; slot 1 runs under libfaketime, and in its 3rd exchange, right after announcing its
  message, its clocks (wall and monotonic, for the C++ runtime too) jump 60 s forward: to it, its deadline
  has passed and its partner has been silent for 20 leases; to its transfer server, its offer has expired.
  No state changes in any round that did not exchange, the two processes agree on every exchange (each
  exchanged batch logged exchanged by both, each failed one failed by both), and they pair again after it."""
  out = str(tmp_path)
  os.makedirs(os.path.join(out, "logs"))
  port = launch_local.free_port()
  clock = os.path.join(out, "faketime")
  with open(clock, "w") as f:
    f.write("+0\n")
  common = ["--log_dir", out, "--lease_s", "3", "--max_wait_s", "1.5", "--exchange_timeout_s", "2", "--dim", "256"]
  per_slot = {0: ["--run_s", "300", "--until_file", os.path.join(out, "result_1.json"), "--rounds", "1"],
              1: ["--rounds", "10"]}
  # libfaketime's "real monotonic clock" mode breaks Python's sleeps (EINVAL), so both clocks jump.
  jump = {"NOLOCO_FAULTS": "xclock:process=1,round=3,at=announced,seconds=60", "LD_PRELOAD": FAKETIME,
          "FAKETIME_TIMESTAMP_FILE": clock, "FAKETIME_NO_CACHE": "1"}
  codes = _run_demo(out, port, common, per_slot, lambda slot: jump if slot == 1 else {})
  assert codes == [0, 0], _logs(out)
  rounds = {s: _jsonl(os.path.join(out, f"rounds_{s}.jsonl")) for s in range(2)}
  for slot in (0, 1):
    for r in rounds[slot]:
      assert (r["after"] != r["before"]) == (r["status"] == "exchanged"), (slot, r)
  status = [{p["batch"]: p["status"] for p in _jsonl(os.path.join(out, f"pairings_{s}.jsonl")) if p["batch"] is not None}
            for s in range(2)]
  shared = set(status[0]) & set(status[1])
  assert shared and all(status[0][b] == status[1][b] for b in shared), status
  tried = [b for b, st in sorted(status[1].items()) if st in ("exchanged", "failed")]
  jumped = tried[2]
  print("the exchange with the jump:", status[0].get(jumped), status[1][jumped])
  assert any(st == "exchanged" and b > jumped for b, st in status[1].items()), status[1]  # paired again
