"""The environment of the multi-process test jobs: bounds sized from what the tests prove, not from a quiet machine.

A test's bound on its job says only "this job hangs"; it is not what the test proves. On the shared
2-core machine under load (load average 13-50) a 2-process smoke job that takes about a minute when
quiet took four to five: a bound sized from a quiet machine fails tests whose behaviour is right
(issue 25 item 8). So every multi-process test waits up to JOB_TIMEOUT_S for its job; a job that works
ends long before, and only a broken one costs the whole bound.

No test here is about the runtime's heartbeat. A dead process is caught by peer_watch.py within a
second (its connection closes), and a job that hangs is bounded by the test's own wait. A short
heartbeat only adds a way to fail that has nothing to do with the behaviour under test: a process
starved of CPU while it imports or compiles misses its heartbeats, and the runtime ends the whole job,
e.g. before the start-up check printed the line the test looks for. So the heartbeat is longer than any
test's wait for its job.
"""

JOB_TIMEOUT_S = 900  # a multi-process test's bound on its job (measured: 4-5 min at load 30-50, 1 min quiet)
HEARTBEAT_S = 1200  # > JOB_TIMEOUT_S: no test job is ended by the runtime's heartbeat


def env(**extra: str) -> dict[str, str]:
  """NOLOCO_* variables for a test job's processes, plus `extra`."""
  return {"NOLOCO_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_S), **extra}
