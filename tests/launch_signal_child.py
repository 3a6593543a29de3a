"""A stand-in for a training process, for tests/test_launch_local.py: records the signals it receives.

Run by the launcher as `python -m launch_signal_child OUTDIR`. Writes OUTDIR/child_<i>.ready (its pid)
once its handlers are installed; on SIGTERM, SIGINT or SIGHUP it writes the signal's name to
OUTDIR/child_<i>.signals, takes 1 s (as a process saving a checkpoint would) and exits 0.
"""

import os
import signal
import sys
import time

out = sys.argv[1]
me = os.environ["NOLOCO_PROCESS_ID"]


def on_signal(signum, frame):
  del frame
  with open(os.path.join(out, f"child_{me}.signals"), "a") as f:
    f.write(signal.Signals(signum).name + "\n")
  time.sleep(1.0)
  sys.exit(0)


for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
  signal.signal(sig, on_signal)
with open(os.path.join(out, f"child_{me}.ready"), "w") as f:
  f.write(str(os.getpid()))
time.sleep(300)  # a training run that would outlive its launcher
sys.exit(3)
