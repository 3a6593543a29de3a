"""Will this run fit? Compile its steps for a described topology without allocating anything.

    python -m noloco_jax.main --dry_run --topology=64x80GB --config=configs/paper.py:model=large,...

builds the mesh the run would use on `64` devices of `80 GB`, lowers and compiles the inner step, the
outer round and the evaluation step from abstract shapes (jax.ShapeDtypeStruct with the state's real
shardings; no array is ever created), and prints the parameter count, each program's per-device memory
from XLA's own buffer assignment (`compiled.memory_analysis()`: arguments, temporaries, outputs, the
part of the outputs aliased to donated arguments), and the bytes each replica sends and receives on
the wire per round and per inner step, and puts into collective operands, both from the formulas of
outer/wire.py and counted in the compiled programs' collectives (tools/hlo.py: `wire_bytes`, the same
formulas applied to each collective XLA emitted). It exits non-zero, saying what did not fit, when a
program's peak exceeds the devices' memory.

Devices: when the default backend has at least that many devices (a real cluster) they are used;
otherwise `fake_devices` must have run before JAX started, creating that many CPU devices, and the
programs are compiled by XLA:CPU. The figures are then XLA:CPU's buffer assignment for the same
partitioned program: a close estimate, not the GPU compiler's exact one (fusion and scheduling
differ; see experiments/RESULTS.md).
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from noloco_jax.tools import hlo as hlo_lib
from noloco_jax.training import build as build_lib
from noloco_jax.outer import programs as programs_lib
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.parallel import sharding as sharding_lib
from noloco_jax.parallel.mesh import REPLICA

_UNITS = {"kb": 10 ** 3, "kib": 2 ** 10, "mb": 10 ** 6, "mib": 2 ** 20, "gb": 10 ** 9, "gib": 2 ** 30,
          "tb": 10 ** 12, "tib": 2 ** 40}


class DoesNotFit(RuntimeError):
  pass


@dataclasses.dataclass(frozen=True)
class Topology:
  num_devices: int
  bytes_per_device: int
  text: str


def parse_topology(text: str) -> Topology:
  """'64x80GB' = 64 devices of 80·10⁹ bytes ('GiB' = 2³⁰; also KB, KiB, MB, MiB, TB, TiB)."""
  m = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*", text or "")
  if not m or m.group(3).lower() not in _UNITS or int(m.group(1)) < 1:
    raise ValueError(f"--topology={text!r} is not valid: write DEVICESxMEMORY, e.g. 64x80GB or 8x16GiB.")
  return Topology(int(m.group(1)), int(float(m.group(2)) * _UNITS[m.group(3).lower()]), text)


def fake_devices(topology: Topology) -> None:
  """Creates topology.num_devices CPU devices. Call before anything initialises JAX's backends."""
  jax.config.update("jax_num_cpu_devices", topology.num_devices)


def _devices(n: int) -> list:
  default = jax.devices()
  if len(default) >= n and default[0].platform != "cpu":
    return default[:n]
  cpu = jax.devices("cpu")
  if len(cpu) < n:
    raise RuntimeError(f"The dry run needs {n} devices but JAX has {len(cpu)} CPU devices: call "
                       "dryrun.fake_devices(topology) before JAX starts (main.py --dry_run does).")
  return cpu[:n]


def program_memory(compiled, host_arguments: int = 0) -> dict[str, int]:
  """Per-device bytes of a compiled program. `host_arguments`: bytes of its arguments that live in
  pinned host memory (outer.offload), subtracted from the device peak when XLA does not report them
  apart (XLA:CPU counts every memory kind as one: its 'device' memory is host RAM)."""
  m = compiled.memory_analysis()
  out = {"arguments": m.argument_size_in_bytes, "temporaries": m.temp_size_in_bytes,
         "outputs": m.output_size_in_bytes, "aliased": m.alias_size_in_bytes}
  # Peak of one device while the program runs: its inputs, outputs not written into donated inputs,
  # and its scratch space (XLA's buffer assignment already overlaps temporaries that do not coexist).
  # The quantity jax.Device.memory_stats()["peak_bytes_in_use"] measures over one step of a process
  # that holds nothing else (experiments/bench_mfu.py prints both, measured and predicted).
  out["peak"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
  host = getattr(m, "host_argument_size_in_bytes", 0) + getattr(m, "host_output_size_in_bytes", 0)
  host -= getattr(m, "host_alias_size_in_bytes", 0)
  out["host"] = host + getattr(m, "host_temp_size_in_bytes", 0)
  if host_arguments and not out["host"]:
    out["peak"] -= host_arguments
    out["host"] = host_arguments
  return out


def analyse(config: ml_collections.ConfigDict, topology: Topology, *, vocab_size: int | None = None,
            include_eval: bool = True) -> dict[str, Any]:
  """Compiles the run's programs on `topology` from shapes only; returns figures (see `report`)."""
  devices = _devices(topology.num_devices)
  fsdp = config.fsdp
  mesh = mesh_lib.make_mesh(config.num_replicas, config.num_devices, devices=devices, fsdp=fsdp,
                            stages=config.num_stages)
  # Fake CPU devices stand in for accelerators: a device's replicas are built as an accelerator run
  # builds them (inner.replica_map=auto is vmap there, a loop on CPU), so that the memory figures are
  # the run's (a loop holds one replica's activations at a time, vmap all of them).
  target = "gpu" if devices[0].platform == "cpu" else None
  setup = build_lib.build(config, mesh=mesh, vocab_size=vocab_size or config.model.vocab_size or None,
                      check_data=False, platform=target)
  config = setup.config  # validated: every field resolved (the per-kind outer fields included)
  n, b, l1 = config.num_replicas, config.data.batch_size, config.data.seq_len + 1

  state = programs_lib.abstract(jax.eval_shape(setup.init_state), setup.state_shardings)
  batch = jax.ShapeDtypeStruct((n, b, l1), jnp.int32, sharding=sharding_lib.batch_sharding(mesh, (n, b, l1)))
  one_replica = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.params)
  counted_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(one_replica)))

  result: dict[str, Any] = {
      "mesh": dict(mesh.shape), "devices_used": int(mesh.devices.size), "platform": devices[0].platform,
      "replica_map": setup.replica_map,  # how each device runs its replicas (inner/replicas.py)
      # The compiler that produced the figures: XLA for this backend (cpu = an estimate for accelerators).
      "backend": f"{devices[0].platform} ({devices[0].device_kind})",
      "num_params": setup.model.num_params(), "num_params_counted": counted_params,
      "flops_per_token": setup.model.flops_per_token(config.data.seq_len),
      "state_bytes_per_replica": sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state)) // n,
      "state_bytes_per_device": sharding_lib.bytes_per_device(state, setup.state_shardings),
      "programs": {}, "compile_s": {},
  }
  # Between replicas, per replica (outer/wire.py), under the config's all-reduce algorithm.
  per_round, per_step = setup.method.traffic(one_replica, n)
  result["bytes_per_round_formula"], result["bytes_per_step_formula"] = per_round.operand, per_step.operand
  result["allreduce_algorithm"] = config.outer.rule.allreduce_algorithm
  result["wire_per_round_formula"] = dataclasses.asdict(per_round)
  result["wire_per_step_formula"] = dataclasses.asdict(per_step)
  # The devices of one replica group (fsdp × stages).
  per_group = mesh.devices.size // mesh.shape[REPLICA]

  def counted(text: str) -> dict[str, dict[str, float]]:
    """Per replica: the program's collectives across replica groups (`across`) and within one (`within`:
    fsdp gathers and reductions, pipeline sends), summed over the replica's devices. Replicas that share
    a device exchange by local copies, which no collective shows."""
    tally = hlo_lib.wire_bytes(text, mesh.devices.size, config.outer.rule.allreduce_algorithm, block=per_group)
    return {side: {k: float(getattr(w, k).sum()) / n for k in ("sent", "received", "operand")}
            for side, w in tally.items()}

  host_bytes = sum(int(np.prod(s.shard_shape(tuple(x.shape)))) * x.dtype.itemsize
                   for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(setup.state_shardings))
                   if s.memory_kind == sharding_lib.PINNED_HOST)
  result["state_bytes_on_host_per_device"] = host_bytes

  def compile_(name, fn, *args, host_arguments=0):
    start = time.time()
    compiled = fn.lower(*args).compile()
    result["compile_s"][name] = time.time() - start
    result["programs"][name] = program_memory(compiled, host_arguments)
    return compiled

  resident = result["state_bytes_per_device"] - host_bytes
  result["capacity_bytes"] = topology.bytes_per_device
  if resident > topology.bytes_per_device:
    # The state alone does not fit: no program can, and compiling one (minutes for the large model
    # on CPU) would only say so again.
    result.update(peak_bytes=resident, fits=False, worst="the training state alone")
    return result

  inner_compiled = compile_("inner_step", setup.inner_step, state, batch, host_arguments=host_bytes)
  # Collective ops in the inner step's program, per device: fsdp all-gathers and gradient reductions,
  # ddp's all-reduce. Static: an op inside a loop (micro-batches, the pipeline) is counted once.
  result["inner_collectives_per_device"] = hlo_lib.all_collective_bytes(inner_compiled.as_text())
  inner_wire = counted(inner_compiled.as_text())
  result["wire_per_step_counted"], result["wire_within_replica_per_step_counted"] = inner_wire["across"], inner_wire["within"]
  if setup.method.has_rounds:
    # One round with one grouping (what a `fresh` round compiles; a `pool` round is a switch over
    # such branches of the same size), so the collectives in the program are exactly one round's.
    groups = setup.schedule.groups(0) if setup.schedule is not None else ()
    round_fn = programs_lib.make_round_fn(setup.method, mesh, (groups,), setup.state_shardings)
    # With offload the round copies φ and δ to the device for its arithmetic, so its device peak is
    # counted with them (nothing subtracted); XLA:CPU's copy to 'device' memory is free and unseen.
    round_compiled = compile_("outer_round", round_fn, state, jax.ShapeDtypeStruct((), jnp.int32))
    if host_bytes and not result["programs"]["outer_round"]["host"]:
      result["programs"]["outer_round"]["host"] = host_bytes
    per_device = hlo_lib.all_collective_bytes(round_compiled.as_text())
    result["round_collectives_per_device"] = per_device
    # A replica's group of devices each send their own shard: the replica's bytes are the sum over its
    # devices (mesh.devices.size / replica groups of them).
    result["bytes_per_round_counted"] = per_group * per_device.get(
        "collective-permute" if setup.schedule is not None else "all-reduce", 0)
    result["wire_per_round_counted"] = counted(round_compiled.as_text())["across"]
  if include_eval:
    eval_batch = jax.ShapeDtypeStruct((b, l1), jnp.int32, sharding=mesh_lib.replicated(mesh))
    compile_("eval_step", setup.eval_step, state.params, eval_batch)

  worst = max(result["programs"], key=lambda k: result["programs"][k]["peak"])
  result.update(peak_bytes=result["programs"][worst]["peak"], worst=worst)
  result["fits"] = result["peak_bytes"] <= topology.bytes_per_device
  return result


def _fmt(x: int, unit: int) -> str:
  return f"{x / unit:8.2f}"


def report(config: ml_collections.ConfigDict, topology: Topology, result: dict[str, Any]) -> str:
  mesh = " × ".join(f"{k} {v}" for k, v in result["mesh"].items())
  lines = [
      f"Dry run on {topology.text}: {topology.num_devices} devices of {topology.bytes_per_device / 2 ** 30:.1f} GiB "
      f"({result['platform']}); mesh {mesh} = {result['devices_used']} devices used.",
      f"Compiled by XLA for backend {result['backend']}"
      + (": the CPU compiler's buffer assignment, an estimate of an accelerator's (fusion and scheduling differ)."
         if result["platform"] == "cpu" else "."),
      f"Model {config.model.preset}: {result['num_params']:,} parameters per replica "
      f"({result['num_params_counted']:,} in the initialised tree); {config.num_replicas} replicas, "
      f"{config.data.batch_size} × {config.data.seq_len} tokens per replica per step, outer {config.outer.kind}.",
      f"State (θ, Adam, φ, δ, counters): {result['state_bytes_per_replica'] / 2 ** 30:.2f} GiB per replica, "
      f"{result['state_bytes_per_device'] / 2 ** 30:.2f} GiB per device"
      + (f", of which {result['state_bytes_on_host_per_device'] / 2 ** 30:.2f} GiB in pinned host memory (φ, δ)."
         if result["state_bytes_on_host_per_device"] else "."),
      "",
  ]
  unit, name_ = (2 ** 30, "GiB") if result["peak_bytes"] >= 2 ** 30 else (2 ** 20, "MiB")
  if result["programs"]:
    lines.append(f"per device ({name_})      arguments  temporaries   outputs    aliased   peak       host   compile s")
  for name, p in result["programs"].items():
    cells = "  ".join(_fmt(p[k], unit) for k in ("arguments", "temporaries", "outputs", "aliased", "peak", "host"))
    lines.append(f"  {name:<18}{cells}   {result['compile_s'][name]:7.1f}")
  lines.append("")
  algorithm = result["allreduce_algorithm"]
  for what, key in (("outer round", "per_round"), ("inner step", "per_step")):
    formula, got = result[f"wire_{key}_formula"], result.get(f"wire_{key}_counted")
    if not formula["operand"] and not (got and got["operand"]):
      continue
    line = (f"Per {what}, between replicas, per replica (outer/wire.py, all-reduce as {algorithm}): sends "
            f"{formula['sent']:,.0f} and receives {formula['received']:,.0f} bytes on the wire, "
            f"{formula['operand']:,} bytes of collective operands")
    if got is not None:
      line += (f"; counted in the compiled program: {got['sent']:,.0f} sent, {got['received']:,.0f} received, "
               f"{got['operand']:,.0f} operand")
    lines.append(line + ".")
  if "bytes_per_round_counted" in result:
    lines.append(f"Outer round collectives, operand bytes per device: {result['round_collectives_per_device']}.")
  within = result.get("wire_within_replica_per_step_counted")
  if within and within["operand"]:
    lines.append(f"Per inner step within each replica (fsdp / stages, counted): {within['sent']:,.0f} bytes sent, "
                 f"{within['received']:,.0f} received per replica (all its devices together).")
  if "inner_collectives_per_device" in result:
    lines.append(f"Collective ops in the inner step, operand bytes per device (a loop body counted once): "
                 f"{result['inner_collectives_per_device']}.")
  if result["state_bytes_on_host_per_device"] and result["platform"] == "cpu":
    lines.append("outer.offload: XLA:CPU does not report host memory apart, so 'host' and the peaks above are "
                 "derived from the state's shardings: φ and δ are taken off the inner step's device peak, and "
                 "counted on the device during the round (which copies them there).")
  lines.append("peak = arguments + outputs − aliased + temporaries: what memory_stats()['peak_bytes_in_use'] "
               "measures during that program (compare: experiments/bench_mfu.py).")
  verdict = "FITS" if result["fits"] else f"DOES NOT FIT ({result['worst']})"
  lines.append(f"{verdict}: peak {result['peak_bytes'] / unit:.2f} {name_} of {result['capacity_bytes'] / unit:.2f} "
               f"{name_} per device ({100 * result['peak_bytes'] / result['capacity_bytes']:.0f}%).")
  return "\n".join(lines)


def run(config: ml_collections.ConfigDict, topology_text: str) -> dict[str, Any]:
  """Analyses, prints the report, and raises DoesNotFit when the peak exceeds a device's memory."""
  topology = parse_topology(topology_text)
  result = analyse(config, topology)
  print(report(config, topology, result), flush=True)
  check(result, topology)
  return result


def check(result: dict[str, Any], topology: Topology) -> None:
  """Raises DoesNotFit, naming the program and what to change, when a peak exceeds the capacity."""
  if not result["fits"]:
    unit, name = (2 ** 30, "GiB") if result["peak_bytes"] >= 2 ** 30 else (2 ** 20, "MiB")
    raise DoesNotFit(f"{result['worst']} needs {result['peak_bytes'] / unit:,.2f} {name} per device, more than the "
                     f"{result['capacity_bytes'] / unit:,.2f} {name} of {topology.text}: shard more (config.fsdp), "
                     "turn on model.remat, more inner.microbatches, or outer.offload / outer.state_dtype.")
