"""The environment of the multi-process test jobs: timeouts sized from what the tests prove.

No test here is about the runtime's heartbeat. A dead process is caught by peer_watch.py within a
second (its connection closes), and a job that hangs is bounded by the test's own wait. A short
heartbeat only adds a way to fail that has nothing to do with the behaviour under test: on a loaded
machine (load 13-32 on 2 cores) a process starved of CPU while it imports or compiles misses its
heartbeats, and the runtime ends the whole job, e.g. before the start-up check printed the line the
test looks for (issue 25 item 8). So the heartbeat is longer than any test's wait for its job.
"""

HEARTBEAT_S = 600  # > every multi-process test's own bound on its job (at most 480 s)


def env(**extra: str) -> dict[str, str]:
  """NOLOCO_* variables for a test job's processes, plus `extra`."""
  return {"NOLOCO_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_S), **extra}
