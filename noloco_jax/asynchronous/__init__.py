"""The asynchronous schedule's engine: processes that train at their own pace and pair at run time.

Built on JAX's own runtime (docs/async.md): the coordination service of `jax.distributed` (with
recoverability on) is the control plane, or an etcd cluster where the job must outlive any one machine;
`jax.experimental.transfer` is the data plane.

  control.py      the store (the only module touching JAX's private distributed client), start-up,
                  a standalone coordination service, reserved slots
  etcd_kv.py      the same store on an etcd cluster (--control=etcd://...): replicated, and a job on it
                  admits processes that were never part of it
  liveness.py     who is alive: leases on heartbeat counters
  law.py          the pairing law, pure (and its simulation)
  matchmaking.py  the law as a protocol over the store
  transport.py    one exchange of messages within a group, bounded in time
  churn.py        joining from a live peer; the membership log
  session.py      what a round driver holds and calls

The update rule a driver applies after an exchange is noloco_jax/outer/async_rules.py.
"""
