"""A stand-in for a training process, for tests/test_launch_local.py: ends as its argument says.

Run by the launcher as `python -m launch_exit_child HOW0 HOW1 ...`: process i takes HOWi, either an
exit status (`0`, `1`), `kill` (it sends itself SIGKILL, as the kernel's OOM killer or a `kill -9` would),
or `after:S` (it exits S once the launcher has seen a peer die: a survivor failing because of that peer).
"""

import os
import signal
import sys
import time

how = sys.argv[1 + int(os.environ["NOLOCO_PROCESS_ID"])]
if how == "kill":
  os.kill(os.getpid(), signal.SIGKILL)
if how.startswith("after:"):
  # The launcher stops the rest with SIGTERM once it has seen the failure: this process exits then, with
  # status S, as a peer's failure would end it (no timing guess; SIGTERM never reaches here otherwise).
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(int(how.split(":")[1])))
  time.sleep(300)
  sys.exit(3)
sys.exit(int(how))
