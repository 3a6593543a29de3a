"""A stand-in for a training process, for tests/test_launch_local.py: ends as its argument says.

Run by the launcher as `python -m launch_exit_child HOW0 HOW1 ...`: process i takes HOWi, either an
exit status (`0`, `1`), `kill` (it sends itself SIGKILL, as the kernel's OOM killer or a `kill -9` would),
or `after:S` (it exits S once the launcher has seen a peer die: a survivor failing because of that peer).
With LAUNCH_EXIT_CHILD_DIR set, an `after:S` process writes ready_<i> there once its SIGTERM handler is in
place, and a `kill` process waits for every such peer's file first: otherwise, on a loaded machine, the
launcher's SIGTERM could reach a peer still starting Python, which the default action then kills.
`outlive` (with LAUNCH_EXIT_CHILD_DIR) waits until a `kill` peer has died and been reaped by the launcher,
then 2 s more (long enough for a launcher without --keep_going to stop it), and exits 0.
"""

import os
import signal
import sys
import time

me = int(os.environ["NOLOCO_PROCESS_ID"])
how = sys.argv[1 + me]
ready_dir = os.environ.get("LAUNCH_EXIT_CHILD_DIR")
if how == "kill":
  if ready_dir:
    waiting = [os.path.join(ready_dir, f"ready_{i}") for i, h in enumerate(sys.argv[1:]) if h.startswith("after:")]
    deadline = time.time() + 300  # a hung start only
    while not all(os.path.exists(w) for w in waiting) and time.time() < deadline:
      time.sleep(0.02)
    with open(os.path.join(ready_dir, f"pid_{me}"), "w") as f:
      f.write(str(os.getpid()))
  os.kill(os.getpid(), signal.SIGKILL)
if how.startswith("after:"):
  # The launcher stops the rest with SIGTERM once it has seen the failure: this process exits then, with
  # status S, as a peer's failure would end it (no timing guess; SIGTERM never reaches here otherwise).
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(int(how.split(":")[1])))
  if ready_dir:
    with open(os.path.join(ready_dir, f"ready_{me}"), "w") as f:
      f.write("ready")
  time.sleep(300)
  sys.exit(3)
if how == "outlive":
  deadline = time.time() + 300  # a hung start only
  pid_files = [os.path.join(ready_dir, f"pid_{i}") for i, h in enumerate(sys.argv[1:]) if h == "kill"]
  while time.time() < deadline:
    if all(os.path.exists(p) and open(p).read() for p in pid_files):
      if not any(os.path.exists(f"/proc/{open(p).read()}") for p in pid_files):  # dead and reaped
        break
    time.sleep(0.02)
  time.sleep(2.0)
  sys.exit(0)
sys.exit(int(how))
