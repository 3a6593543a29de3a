"""Command line: python -m noloco_jax.main --config=configs/default.py --workdir=DIR [--config.x=y ...]

Flags and platform set-up only; the work happens in training.train_and_evaluate. Multi-process jobs
(SLURM, TPU pods, launch_local.py) are set up by noloco_jax/runtime/distributed.py: see its docstring for the
flags --distributed, --coordinator_address, --num_processes, --process_id and their NOLOCO_* variables.
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

# Only what defines and checks the command line is imported here (no JAX): a mistyped flag, config
# field or value is answered in about 0.2 s. JAX and everything built on it are imported in main(),
# once the config is known to be valid (tests/test_config.py pins that a bad command line imports no JAX).
from noloco_jax.runtime import failures
from noloco_jax import config as config_lib
from noloco_jax.config import cli
from noloco_jax.runtime import options as options_lib

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for metrics, TensorBoard events, checkpoints and the config.")
config_flags.DEFINE_config_file("config", None, "Training config file (ml_collections).", lock_config=True)
flags.DEFINE_bool("dry_run", False, "Compile the run's steps from shapes on --topology and report per-device "
                  "memory and bytes sent, without training or allocating (noloco_jax/tools/dryrun.py). Exits 1 if it "
                  "does not fit.")
flags.DEFINE_string("topology", "8x80GB", "With --dry_run: DEVICESxMEMORY, e.g. 64x80GB (faked with CPU devices "
                    "when this machine has fewer).")
flags.DEFINE_string("compile_cache", None, "Directory of JAX's persistent compilation cache (on by default: "
                    "$NOLOCO_COMPILE_CACHE, else ~/.cache/noloco_jax/jax_compile_cache); '' or 'off' disables. "
                    "See noloco_jax/runtime/compile_cache.py.")
flags.mark_flags_as_required(["config"])
options_lib.define_flags()


def _fake_cpu_devices(num_replicas: int, multi_process: bool) -> None:
  """On a CPU-only single-process run, create one CPU device per replica (unless the user chose a count).

  Harmless where an accelerator exists: it sizes only the CPU backend, not the default one. Never in a
  multi-process job: there each process's JAX_NUM_CPU_DEVICES (or XLA_FLAGS) decides its own count.
  """
  if multi_process or "JAX_NUM_CPU_DEVICES" in os.environ or (
      "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")):
    return
  import jax
  jax.config.update("jax_num_cpu_devices", max(num_replicas, 1))


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  try:  # an invalid config is one line and exit status 2, before anything starts
    # Parsed and checked once: the schema, the outer method's own checks and its stability analysis (refused
    # unless outer.allow_unstable; noloco_jax/outer/methods/). Everything below receives this typed config
    # (or its sections), never the ConfigDict.
    config = config_lib.load(FLAGS.config)
  except config_lib.ConfigError as e:
    cli.exit_usage(str(e))
  if not FLAGS.workdir and not FLAGS.dry_run:
    cli.exit_usage("--workdir is required (except with --dry_run).")
  options = options_lib.options_from_flags(FLAGS)
  # pylint: disable=g-import-not-at-top  (the command line is valid: now JAX and what is built on it)
  from noloco_jax.runtime import compile_cache
  from noloco_jax.tools import dryrun
  # A restarted job loads its compiled programs instead of compiling them again.
  cache_dir = compile_cache.enable(FLAGS.compile_cache)
  logging.info("Persistent compilation cache: %s", cache_dir or "off")
  if FLAGS.dry_run:
    topology = dryrun.parse_topology(FLAGS.topology)
    dryrun.fake_devices(topology)  # before anything starts JAX's backends
    try:
      dryrun.run(config, FLAGS.topology)
    except dryrun.DoesNotFit as e:
      raise SystemExit(f"noloco_jax dry run: {e}") from None
    return
  from noloco_jax import training
  from noloco_jax.runtime import distributed, peer_watch, preemption
  # Before anything starts JAX's backends: jax.distributed must come first.
  if config.outer.schedule == "async":
    return _run_async_process(config, options)
  if options.control != options_lib.Options.control:
    cli.exit_usage(f"--control={options.control!r} is not valid with config.outer.schedule="
                   f"{config.outer.schedule!r}: a lock-step job runs on JAX's coordination service ('jax'); an etcd "
                   "control plane is for outer.schedule='async'.")
  multi_process = distributed.initialize(options)
  # One fake CPU device per device of the mesh: replicas × stages × fsdp.
  _fake_cpu_devices(config.num_replicas * config.num_stages * config.fsdp, multi_process)

  # SIGTERM (preemption): finish the current step, save a checkpoint, exit 0. Installed after
  # jax.distributed, so that this handler, not the runtime's, receives the signal.
  preemption.install_preemption_handler()
  # A failure ends in its cause and one last line saying what to do, exit status 1 (runtime/failures.py).
  with failures.exit_on_failure(FLAGS.workdir), distributed.fail_fast():
    watch = None
    if multi_process:  # a dead peer ends this process within a second, with one line (peer_watch.py)
      host = options.coordinator_address.rsplit(":", 1)[0] if options.coordinator_address else None
      watch = peer_watch.start(host)
    try:
      training.train_and_evaluate(config, FLAGS.workdir)
    except config_lib.ConfigError as e:  # found by the checks that need files or devices (data, mesh)
      cli.exit_usage(str(e))
  if watch is not None:
    watch.leave()  # finished (or preempted and saved): this process's exit ends nobody


def _run_async_process(config, options) -> None:
  """One process of an asynchronous job: a JAX program of its own on the job's control plane, trained in
  WORKDIR/process_<i> (noloco_jax/asynchronous/job.py says why). The process hosting the coordination
  service stays until the others have left: its exit would end them."""
  # pylint: disable=g-import-not-at-top  (see the imports at the top)
  from noloco_jax import training
  from noloco_jax.asynchronous import job as async_job
  from noloco_jax.asynchronous import result as async_result
  from noloco_jax.runtime import distributed, preemption
  if options.control == async_job.JAX:  # fixed slots: every process needs its id (flags, environment, cluster)
    address, count, pid = distributed.process_coordinates(options)
  else:  # etcd: no fixed slots; a process started without --process_id takes a free one
    address, count, pid = None, options.num_processes, options.process_id
  try:
    process = async_job.start(config, address, count, pid, heartbeat_timeout_s=options.heartbeat_timeout_s,
                              initialization_timeout_s=options.initialization_timeout_s,
                              standalone_service=bool(options.standalone_service), control_plane=options.control)
  except config_lib.ConfigError as e:
    cli.exit_usage(str(e))
  preemption.install_preemption_handler()  # SIGTERM: this process saves and stops; the others train on
  with failures.exit_on_failure(FLAGS.workdir):
    training.train_and_evaluate(async_job.process_config(config), process.workdir(FLAGS.workdir), process)
  process.finish(lease_s=config.outer.asynchronous.lease_s)
  if process.connection.hosts_service:  # it waited for every other process: the job's own result (spread, consensus)
    async_result.at_job_end(FLAGS.workdir)
  # Leave without the interpreter's finalisers: the control-plane client's destructor would say goodbye to
  # a service that may be gone by now (it then aborts the process); the run is saved and its logs closed.
  logging.flush()
  for stream in (sys.stdout, sys.stderr):
    stream.flush()
  os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
