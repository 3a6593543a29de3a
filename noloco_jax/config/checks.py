"""The checks that need more than one section, all here: run after every section has checked itself."""

import logging

from noloco_jax.config.fields import fail
from noloco_jax.config.run import Config

_LOGGED: set[str] = set()  # the stability warnings and notes already given by this process


def check_across_sections(config: Config) -> None:
  """Raises ConfigError on the first field that does not fit another section's."""
  c, batch = config, config.data.batch_size
  if batch % c.fsdp:
    fail("fsdp", c.fsdp, f"a divisor of data.batch_size={batch} (each of a replica's fsdp devices computes "
         "batch_size / fsdp sequences)")
  layers = c.model.size("num_layers")
  if layers % c.num_stages:
    fail("num_stages", c.num_stages, f"a divisor of the model's {layers} layers (every stage gets as many)")
  if c.pipeline.microbatches and batch % c.pipeline.microbatches:
    fail("pipeline.microbatches", c.pipeline.microbatches,
         f"0 (one sequence per micro-batch) or a divisor of data.batch_size={batch}")
  if batch % (c.inner.microbatches * c.fsdp):
    fail("inner.microbatches", c.inner.microbatches,
         f"a number M with M × fsdp dividing data.batch_size={batch} (fsdp={c.fsdp}): every micro-batch is "
         "split evenly over the replica's fsdp devices")
  if c.inner.microbatches > 1 and c.num_stages > 1:
    fail("inner.microbatches", c.inner.microbatches,
         "1 with num_stages > 1 (the pipeline cuts the batch itself: pipeline.microbatches)")
  if c.inner.replica_map == "sequential" and c.num_stages > 1:
    fail("inner.replica_map", c.inner.replica_map,
         "'auto' or 'vmap' with num_stages > 1 (the pipeline maps its replicas itself, with vmap)")
  if c.model.max_seq_len and c.model.max_seq_len < c.data.seq_len:
    fail("data.seq_len", c.data.seq_len, f"at most model.max_seq_len={c.model.max_seq_len}")
  if c.nan_policy == "skip_round" and c.checkpoint_every % c.outer.inner_steps:
    fail("checkpoint_every", c.checkpoint_every,
         f"a multiple of outer.inner_steps={c.outer.inner_steps} with nan_policy='skip_round' (saves then fall "
         "at round ends, after the round has been checked)")
  if c.outer.overlap.steps and c.nan_policy == "skip_round":
    fail("outer.overlap.steps", c.outer.overlap.steps,
         "0 with nan_policy='skip_round' (a round undone at its end cannot take back an exchange in flight)")
  if c.outer.schedule == "async":
    _check_async(c)
  spec = c.outer.spec
  if spec.grouped and c.num_replicas % c.outer.rule.group_size and c.outer.schedule != "async":
    fail("outer.rule.group_size", c.outer.rule.group_size,
         f"a divisor of num_replicas={c.num_replicas} (the replicas are cut into equal groups)")
  if spec.check is not None:
    spec.check(c.outer, c.num_replicas)  # what only the method knows (noloco_jax/outer/methods/)


def _check_async(c: Config) -> None:
  """What the asynchronous schedule (docs/async.md) does not combine with. (Its layout, one replica per
  process, is checked at start-up against the job's process count: asynchronous/job.check_layout.)"""
  unsupported = lambda what: f"{what} with outer.schedule='async' (not supported by the asynchronous schedule)"
  if c.num_stages != 1:
    fail("num_stages", c.num_stages, unsupported("1"))
  if c.nan_policy != "error":
    fail("nan_policy", c.nan_policy, unsupported("'error'") + ": a round cannot be undone once a partner has "
         "merged its message")
  if c.checkpoint.elastic:
    fail("checkpoint.elastic", c.checkpoint.elastic, "'' with outer.schedule='async' (a process that restarts "
         "while the job runs takes its weights from a live peer by itself)")


def check_stability(config: Config) -> None:
  """Refuses a rule whose cross-replica spread is mean-square unstable (ConfigError, one line) unless
  outer.allow_unstable, by the method's own analysis (its spec's `stability`, docs/stability.md); a method
  that declares none is run as configured, and the log says its stability is not analysed."""
  o = config.outer
  if o.spec.stability is None:
    _once(logging.INFO, f"config.outer.kind={o.kind!r}: the stability of the replicas' spread is not analysed for "
                        "this method (docs/stability.md analyses NoLoCo's update); nothing is refused.")
    return
  problem = o.spec.stability(o, config.num_replicas)
  if problem is None:
    return
  if not o.allow_unstable:
    fail(problem.field, problem.value, f"{problem.why}. {problem.remedy}, or set outer.allow_unstable=True to run it "
         "anyway")
  _once(logging.WARNING, f"outer.allow_unstable=True: {problem.why}.")


def _once(level: int, message: str) -> None:  # main.py and training/build.py both load the config
  if message not in _LOGGED:
    _LOGGED.add(message)
    logging.log(level, "%s", message)
