"""A stand-in for a training process, for tests/test_launch_local.py: ends as its argument says.

Run by the launcher as `python -m launch_exit_child HOW0 HOW1 ...`: process i takes HOWi, either an
exit status (`0`, `1`) or `kill` (it sends itself SIGKILL, as the kernel's OOM killer or a `kill -9` would).
"""

import os
import signal
import sys

how = sys.argv[1 + int(os.environ["NOLOCO_PROCESS_ID"])]
if how == "kill":
  os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(how))
