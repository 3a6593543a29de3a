"""The accelerator check: what a lent GPU says about this code base, in one command and a few minutes.

    bash scripts/accelerator_check.sh                     # on a machine with a GPU (docs/accelerator_check.md)
    bash scripts/accelerator_check.sh --cpu --no-install  # the same sections at tiny sizes on CPU (the test)

Sections, run one after another, each in a process of its own (so that each starts with the whole GPU and
a crash or a hang ends only that section) under its own time cap, all within one budget (--budget_s):

  environment     GPU, driver, jax/jaxlib and plugin versions, each requirement of setup.py against its range
  smoke           the default job's smoke variant end to end (python -m noloco_jax.main ...:smoke)
  mfu_small       experiments/bench_mfu.py, small preset in bfloat16: MFU, tokens/s, peak memory vs the dry run
  inner_replicas  experiments/bench_inner.py: 4 small replicas on one device, replica_map vmap vs sequential
  outer_rounds    one lock-step NoLoCo round and one overlapped round (outer.overlap.steps=1): time, bytes
  async_exchange  2 processes swap a message over the transfer server (noloco_jax/asynchronous/transport.py)
  mfu_medium      as mfu_small, medium preset (remat on); last, since it is the heaviest

A section that fails or outruns its cap is recorded with its error in one line, and the check goes on. The
JSON file (--out; default $OUT/accelerator_check.json, else experiments/results_accelerator_check_*.json)
is rewritten after every section, so what has run survives a check stopped from outside; the sections'
own output goes to the log beside it. With --cpu every section runs the same code at sizes of seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GIB = 2 ** 30
# The CPU mode's model: any preset shrunk to seconds (the sections' code is the same as on a GPU).
SHRINK = ("model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.mlp_dim=64")
# Packages whose versions the environment section reports besides setup.py's requirements.
RUNTIME_PACKAGES = ("jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt")


class SectionError(RuntimeError):
  """A section failed; the message is its one line for the JSON."""


# ---------------------------------------------------------------------------------------------------
# The driver: runs the sections as subprocesses, prints each figure, writes the JSON.
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Context:
  cpu: bool
  deadline: float  # time.monotonic() at which the budget ends
  log: object  # the open log file: every section's output, in order
  workdir: str  # scratch space for this check (removed at the end)
  cap_s: float = 60  # the running section's own time limit (run_section sets it)

  @property
  def platforms(self) -> str:
    """JAX_PLATFORMS: the first is the default backend (the CPU's is there too, as on any machine)."""
    return "cpu" if self.cpu else "cuda,cpu"

  def env(self) -> dict:
    env = dict(os.environ)
    # JAX_PLATFORMS names the backend, and the environment section checks that JAX took it: where the CUDA
    # plugin is missing (JAX then goes on, on the CPU) or cannot start, the check stops there with the
    # reason in the log, instead of running every section slowly on the CPU.
    env.update(JAX_PLATFORMS=self.platforms, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
    if not self.cpu:
      # One section at a time owns the GPU: let it take 90% (JAX's default is 75%): mfu_medium needs it.
      env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
      # JAX's persistent compilation cache: a second check on the same machine (--only=... after a
      # failure, say) loads the programs the first one compiled instead of spending its minutes again.
      env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "noloco_accelerator_check_cache"))
    return env

  def run(self, argv: list[str]) -> str:
    """Runs `argv` in the repository, its output into the log; returns its output. SectionError when it
    exits non-zero (its last line) or outlives the section's cap or what is left of the budget."""
    timeout = min(self.cap_s, self.deadline - time.monotonic())
    self.log.write(f"\n$ {' '.join(argv)}\n")
    self.log.flush()
    proc = subprocess.Popen(argv, cwd=REPO, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # its own group: a timeout ends its children too
    lines: list[str] = []

    def pump():
      for line in proc.stdout:
        lines.append(line)
        self.log.write(line)
      self.log.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
      proc.wait(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
      _stop(proc)
      reader.join(timeout=5)
      raise SectionError(f"stopped after {timeout:.0f} s (its cap or the rest of the budget); "
                         f"last output: {_last_line(lines)}") from None
    finally:
      if proc.poll() is None:  # the check itself is being stopped (SIGTERM, Ctrl-C): its section too
        _stop(proc)
    reader.join(timeout=10)
    if proc.returncode != 0:
      raise SectionError(f"exit status {proc.returncode}: {_last_line(lines)}")
    return "".join(lines)

  def run_json(self, argv: list[str]) -> dict:
    """`run`, then the last line of its output that is a JSON object."""
    out = self.run(argv)
    for line in reversed(out.splitlines()):
      if line.startswith("{"):
        return json.loads(line)
    raise SectionError(f"printed no JSON line: {_last_line(out.splitlines())}")


def _stop(proc: subprocess.Popen) -> None:
  """SIGTERM to the process's group; up to 10 s later, SIGKILL to what is left of it."""
  with contextlib.suppress(ProcessLookupError):
    os.killpg(proc.pid, signal.SIGTERM)
  with contextlib.suppress(subprocess.TimeoutExpired):
    proc.wait(timeout=10)
  with contextlib.suppress(ProcessLookupError):
    os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()


def _last_line(lines: list[str]) -> str:
  """The last line worth reading (a traceback's last line names the error), at most 300 characters."""
  for line in reversed(lines):
    line = line.strip()
    if line and not line.startswith(("I0", "I1", "W0", "W1")):  # absl's INFO/WARNING lines say nothing of it
      return line[:300]
  return "(no output)"


@dataclasses.dataclass(frozen=True)
class Section:
  name: str
  # (GPU, CPU): its own time limit in seconds; the budget (--budget_s) bounds their sum. On a GPU they are
  # estimates, not measurements (no GPU was lent while they were set): compiles of tens of seconds and steps
  # well under a second at the sizes below, with room to spare. On CPU they allow for a loaded 2-core VM.
  cap_s: tuple[float, float]
  run: Callable[[Context, list[str]], dict]  # (context, extra flags) -> {"figures": ..., maybe "result": ...}
  line: Callable[[dict], str]  # its figures as one printed line
  # Flags for a second try when the first one failed (not timed out): bfloat16 attention on an NVIDIA GPU
  # is cuDNN's kernel by default, and these runs are its first; XLA's attention keeps the figures coming.
  retry_flags: tuple[str, ...] = ()


def _python(*args: str) -> list[str]:
  return [sys.executable, *args]


def _config_flags(items) -> list[str]:
  return [f"--config.{item}" for item in items]


def _sizes(ctx: Context, gpu: list[str], cpu: list[str]) -> list[str]:
  return cpu if ctx.cpu else gpu


# ---- Sections (the driver's side) ----


def environment(ctx: Context, extra: list[str]) -> dict:
  result = ctx.run_json(_python("-m", "experiments.lib.accelerator_check", "--section=environment", *extra))
  if result["backend"] != ("cpu" if ctx.cpu else "gpu"):
    raise SectionError(f"JAX's backend is {result['backend']!r}, not {'cpu' if ctx.cpu else 'gpu'} (the log says why; "
                       f"jax {result['packages']['jax']}, plugins {[k for k, v in result['packages'].items() if v and 'cuda' in k]})")
  return {"figures": result}


def smoke(ctx: Context, extra: list[str]) -> dict:
  workdir = os.path.join(ctx.workdir, "smoke")
  start = time.monotonic()
  ctx.run(_python("-m", "noloco_jax.main", "--config=configs/default.py:smoke", f"--workdir={workdir}", *extra))
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  figures = {"process_wall_s": time.monotonic() - start, "train_wall_s": summary["wall_time_s"],
             "eval_loss_first": summary["eval/loss_first"], "eval_loss": summary["eval/loss"],
             "train_loss": summary["train/loss"], "bytes_sent_per_replica": summary["comm/bytes_sent_per_replica"],
             "num_params": summary["model/num_params"]}
  return {"figures": figures, "result": summary}


def mfu(preset: str, model: list[str], gpu: list[str]) -> Callable[[Context, list[str]], dict]:
  """bench_mfu on `preset` in bfloat16 with `model`'s flags in both modes, at `gpu`'s sizes on a GPU."""
  def section(ctx: Context, extra: list[str]) -> dict:
    sizes = _sizes(ctx, gpu, ["--batch=1", "--seq_len=16", "--steps=1", "--repeats=1", *_config_flags(SHRINK)])
    r = ctx.run_json(_python("experiments/bench_mfu.py", f"--preset={preset}", "--config.model.dtype=bfloat16",
                             *model, *sizes, *extra, "--json"))

    def side(s):
      measured, predicted = s["peak_bytes_in_use"], s["predicted_peak_bytes"]
      return {"step_s": s["step_s"], "tokens_per_s": s["tokens_per_s"], "mfu": s["mfu"],
              "peak_gib": measured / GIB if measured is not None else None, "dry_run_peak_gib": predicted / GIB,
              "peak_over_dry_run": measured / predicted if measured is not None else None}

    figures = {"device_kind": r["device_kind"], "num_params": r["num_params"], "vocab_size": r["vocab_size"],
               "batch": r["batch_per_replica"], "seq_len": r["seq_len"], "dtype": r["dtype"],
               "attention": r["attention"], "remat": r["remat"], **side(r), "plain": side(r["plain"])}
    return {"figures": figures, "result": r}
  return section


def mfu_line(f: dict) -> str:
  pct = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"
  gib = lambda x: "n/a" if x is None else f"{x:.2f} GiB"
  ratio = lambda x: "" if x is None else f" = {x:.2f}x"
  p = f["plain"]
  return (f"{f['num_params'] / 1e6:.0f}M params, {f['batch']}x{f['seq_len']} tokens, {f['dtype']}, attention "
          f"{f['attention']}: MFU {pct(f['mfu'])} ({f['tokens_per_s']:,.0f} tokens/s, {1e3 * f['step_s']:.1f} ms/step); "
          f"plain jit MFU {pct(p['mfu'])}; peak memory (plain) {gib(p['peak_gib'])} against the dry run's "
          f"{gib(p['dry_run_peak_gib'])}{ratio(p['peak_over_dry_run'])}")


def inner_replicas(ctx: Context, extra: list[str]) -> dict:
  model = ["--config.model.preset=small"] + (_config_flags(SHRINK) if ctx.cpu else [])
  sizes = _sizes(ctx, ["--config.data.batch_size=4", "--config.data.seq_len=512", "--steps=5", "--repeats=3"],
                 ["--config.data.batch_size=1", "--config.data.seq_len=16", "--steps=1", "--repeats=1"])
  r = ctx.run_json(_python("experiments/bench_inner.py", "--replicas=4", "--config.num_devices=1",
                           "--config.model.dtype=bfloat16", *model, *sizes, *extra, "--json"))
  by = r["by_replica_map"]
  figures = {"replicas": r["replicas"], "devices": r["devices"], "num_params": r["num_params"],
             "batch": r["batch_per_replica"], "seq_len": r["seq_len"], "auto_resolves_to": r["replica_map"],
             "vmap_step_s": by["vmap"]["step_s"], "sequential_step_s": by["sequential"]["step_s"],
             "loop_over_vmap": r["loop_over_vmap_median"], "separate_calls_step_s": r["sequential_step_s"],
             "vmap_tokens_per_s": r["replicas"] * r["batch_per_replica"] * r["seq_len"] / by["vmap"]["step_s"]}
  return {"figures": figures, "result": r}


def inner_line(f: dict) -> str:
  return (f"{f['replicas']} replicas on {f['devices']} device: vmap {1e3 * f['vmap_step_s']:.1f} ms/step "
          f"({f['vmap_tokens_per_s']:,.0f} tokens/s), sequential {1e3 * f['sequential_step_s']:.1f} ms/step "
          f"(vmap time / loop time {f['loop_over_vmap']:.2f}), {f['replicas']} separate jit calls "
          f"{1e3 * f['separate_calls_step_s']:.1f} ms/step; auto picks {f['auto_resolves_to']}")


def outer_rounds(ctx: Context, extra: list[str]) -> dict:
  r = ctx.run_json(_python("-m", "experiments.lib.accelerator_check", "--section=outer_rounds", *extra,
                           *(["--cpu"] if ctx.cpu else [])))
  return {"figures": r}


def outer_line(f: dict) -> str:
  parts = [f"{name} {r['round_ms']:.1f} ms ({len(r['programs'])} programs, {r['bytes_sent_per_replica'] / 2**20:.1f} "
           f"MiB sent per replica, {r['bytes_accessed_per_device'] / 2**20:.0f} MiB through memory)"
           for name, r in f["rounds"].items()]
  return f"{f['replicas']} replicas ({f['num_params'] / 1e6:.0f}M params) on one device: " + "; ".join(parts)


def async_exchange(ctx: Context, extra: list[str]) -> dict:
  # Its 2-process job gets 15 s less than the section, to stop the job itself and say which process failed.
  limit = min(ctx.cap_s, ctx.deadline - time.monotonic())
  r = ctx.run_json(_python("-m", "experiments.lib.accelerator_check", "--section=async_exchange",
                           f"--job_timeout_s={max(limit - 15, 5):.0f}", *extra, *(["--cpu"] if ctx.cpu else [])))
  return {"figures": r}


def async_line(f: dict) -> str:
  return (f"2 processes, {f['message_mb']:.0f} MB each way on {f['platform']} ({f['device_kind']}): transfer "
          f"server up in {f['server_start_s']:.2f} s, first exchange {f['first_exchange_s']:.2f} s, then "
          f"{f['steady_median_s']:.3f} s ({f['mb_per_s_each_way']:,.0f} MB/s each way)")


def smoke_line(f: dict) -> str:
  return (f"eval loss {f['eval_loss_first']:.4f} -> {f['eval_loss']:.4f}, train loss {f['train_loss']:.4f}, "
          f"training {f['train_wall_s']:.1f} s of a {f['process_wall_s']:.1f} s process")


def environment_line(f: dict) -> str:
  outside = [name for name, p in f["requirements"].items() if p["in_range"] is not True]
  return (f"{f['device_count']} x {f['device_kind']} ({f['backend']}), driver {f['nvidia_smi'] or 'n/a'}; "
          f"Python {f['python']}, jax {f['packages'].get('jax')}, jaxlib {f['packages'].get('jaxlib')}; "
          + (f"outside setup.py's ranges or missing: {', '.join(outside)}" if outside else "every requirement in range"))


SECTIONS = (
    Section("environment", (60, 60), environment, environment_line),
    Section("smoke", (120, 120), smoke, smoke_line),
    Section("mfu_small", (150, 120), mfu("small", [], ["--vocab=128002", "--batch=8", "--seq_len=1024", "--steps=5",
                                                         "--repeats=3"]), mfu_line,
            retry_flags=("--config.model.attention=xla",)),
    Section("inner_replicas", (120, 120), inner_replicas, inner_line, retry_flags=("--config.model.attention=xla",)),
    Section("outer_rounds", (120, 120), outer_rounds, outer_line),
    Section("async_exchange", (90, 90), async_exchange, async_line),
    # Vocabulary 32000, not the paper's 128002: bench_mfu holds the plain and the mapped step's states at
    # once, and with 128002 that is 23.9 + 51.2 GiB by the dry run, more than an 80 GB GPU gives JAX.
    Section("mfu_medium", (200, 120), mfu("medium", ["--config.model.remat=true"], [
        "--vocab=32000", "--batch=8", "--seq_len=1024", "--steps=3", "--repeats=2"]),
            mfu_line, retry_flags=("--config.model.attention=xla",)),
)


def default_out(cpu: bool) -> str:
  if os.environ.get("OUT"):
    return os.path.join(os.environ["OUT"], "accelerator_check.json")
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M%S")
  return os.path.join(REPO, "experiments", f"results_accelerator_check_{'cpu' if cpu else 'gpu'}_{stamp}.json")


def drive(args, sections=SECTIONS) -> int:
  out = os.path.abspath(args.out or default_out(args.cpu))
  if os.path.exists(out) and not args.overwrite:
    _usage(f"--out={out} exists: give a new path, or --overwrite to replace it.")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  log_path = os.path.splitext(out)[0] + ".log"
  only = [s for s in args.only.split(",") if s]
  unknown = sorted(set(only) - {s.name for s in sections})
  if unknown:
    _usage(f"--only={args.only}: no section {', '.join(unknown)}; the sections are "
           f"{', '.join(s.name for s in sections)}.")
  start = time.monotonic()
  report = {"check": "accelerator_check", "mode": "cpu" if args.cpu else "gpu", "command": sys.argv,
            "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "budget_s": args.budget_s, "cpu_count": os.cpu_count(), "load_avg_start": os.getloadavg(),
            "log": log_path, "sections": {}}
  print(f"accelerator_check ({report['mode']}): budget {args.budget_s:.0f} s; JSON {out}; log {log_path}", flush=True)
  # A SIGTERM (a machine's time limit) ends the check as Ctrl-C does: the running section is stopped and
  # recorded as such, and the JSON keeps every section before it.
  previous = signal.signal(signal.SIGTERM, _interrupt)
  try:
    stopped = _run_sections(args, sections, only, report, out, log_path, start)
  finally:
    signal.signal(signal.SIGTERM, previous)
  if stopped:
    return 130
  failed = [name for name, r in report["sections"].items() if r["status"] == "error"]
  skipped = [name for name, r in report["sections"].items() if r["status"] == "skipped"]
  status = "; ".join(([f"failed: {', '.join(failed)}"] if failed else []) +
                     ([f"skipped: {', '.join(skipped)}"] if skipped else [])) or "ok"
  report.update(status=status, wall_s=time.monotonic() - start, load_avg_end=os.getloadavg())
  _write(out, report)
  print(f"accelerator_check: {report['status']} in {report['wall_s']:.0f} s; JSON {out}", flush=True)
  if args.json:
    print(json.dumps(report, default=_jsonable), flush=True)
  return 1 if failed or skipped else 0


def _run_sections(args, sections, only, report, out, log_path, start) -> bool:
  """Runs the sections into `report`, writing it after each one; True if the check was stopped from outside."""
  with open(log_path, "w") as log, tempfile.TemporaryDirectory(prefix="accelerator_check_") as workdir:
    ctx = Context(cpu=args.cpu, deadline=start + args.budget_s, log=log, workdir=workdir)
    for section in sections:
      if only and section.name not in only and section.name != "environment":
        continue
      try:
        record = run_section(ctx, section, report["sections"])
      except KeyboardInterrupt:
        report["sections"][section.name] = {"status": "error", "error": "the check was stopped from outside (SIGTERM "
                                            "or Ctrl-C) during this section"}
        report.update(status="stopped", wall_s=time.monotonic() - start)
        _write(out, report)
        print(f"accelerator_check: stopped during {section.name}; JSON {out}", flush=True)
        return True
      report["sections"][section.name] = record
      report["wall_s"] = time.monotonic() - start
      _write(out, report)
  return False


def _interrupt(signum, frame):
  del signum, frame
  raise KeyboardInterrupt


def _usage(message: str) -> None:
  print(f"accelerator_check: {message}", file=sys.stderr)
  raise SystemExit(2)


def run_section(ctx: Context, section: Section, done: dict) -> dict:
  left = ctx.deadline - time.monotonic()
  if "environment" in done and done["environment"]["status"] != "ok":
    return {"status": "skipped", "error": "the environment section failed: nothing else can run on this device"}
  if left < 10:
    return {"status": "skipped", "error": f"the budget was spent ({left:.0f} s left)"}
  ctx.cap_s = section.cap_s[1] if ctx.cpu else section.cap_s[0]
  print(f"== {section.name} (cap {min(ctx.cap_s, left):.0f} s)", flush=True)
  record, t0, tries = {}, time.monotonic(), [[]] + ([list(section.retry_flags)] if section.retry_flags else [])
  cpu0 = _children_cpu_s()
  for flags in tries:
    try:
      record.update(section.run(ctx, flags), status="ok", seconds=round(time.monotonic() - t0, 1),
                    cpu_s=round(_children_cpu_s() - cpu0, 1))
    except (SectionError, KeyError, TypeError, ValueError, OSError) as e:  # a section's own failure, in one line
      message = str(e).splitlines()[0] if str(e) else type(e).__name__
      if not isinstance(e, SectionError):
        message = f"{type(e).__name__}: {message}"
      record.setdefault("errors", []).append(message)
      print(f"   {section.name} FAILED{' (with ' + ' '.join(flags) + ')' if flags else ''}: {message}", flush=True)
      # A second try with other flags cannot help a section that ran out of time or of memory.
      if (message.startswith("stopped after") or "RESOURCE_EXHAUSTED" in message or "out of memory" in message.lower()
          or ctx.deadline - time.monotonic() < 10):
        break
      continue
    if flags:
      record["flags_added"] = flags
    try:
      print(f"   {section.name}: {section.line(record['figures'])}", flush=True)
    except (KeyError, TypeError, ValueError):  # a figure missing from the line: the JSON holds them all anyway
      print(f"   {section.name}: {json.dumps(record['figures'], default=_jsonable)[:500]}", flush=True)
    return record
  return {**record, "status": "error", "error": record["errors"][-1], "seconds": round(time.monotonic() - t0, 1)}


def _children_cpu_s() -> float:
  """CPU seconds (user + system) of this process's finished children: a section's host work."""
  import resource  # pylint: disable=g-import-not-at-top
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def _write(path: str, report: dict) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(report, f, indent=1, default=_jsonable)
  os.replace(tmp, path)


def _jsonable(x):
  return float(x) if hasattr(x, "__float__") else str(x)


# ---------------------------------------------------------------------------------------------------
# The sections that are this module's own (each runs as `--section=NAME` in a process of its own).
# ---------------------------------------------------------------------------------------------------


def _version(name: str) -> str | None:
  import importlib.metadata  # pylint: disable=g-import-not-at-top
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def setup_requirements() -> list:
  """setup.py's install_requires as packaging Requirements (read with ast: nothing is run)."""
  import ast  # pylint: disable=g-import-not-at-top
  from packaging.requirements import Requirement  # pylint: disable=g-import-not-at-top
  with open(os.path.join(REPO, "setup.py")) as f:
    call = next(n for n in ast.walk(ast.parse(f.read())) if isinstance(n, ast.keyword) and n.arg == "install_requires")
  return [Requirement(text) for text in ast.literal_eval(call.value)]


def wheels_to_install(directory: str) -> list[str]:
  """The wheels of `directory` this Python needs: each one whose package it lacks or holds at a version
  outside setup.py's range, then, until none is added, each one whose package it holds at a version that a
  wheel to be installed does not accept. What the machine has otherwise stays in use: its packages were
  installed together (jax with its CUDA plugin), and a carried wheel would only replace one of them."""
  import zipfile  # pylint: disable=g-import-not-at-top
  from packaging.requirements import Requirement  # pylint: disable=g-import-not-at-top
  from packaging.utils import canonicalize_name, parse_wheel_filename  # pylint: disable=g-import-not-at-top
  ranges = {canonicalize_name(r.name): r.specifier for r in setup_requirements()}
  carried = {}  # package -> (version, path)
  for name in sorted(os.listdir(directory)):
    if name.endswith(".whl"):
      dist, version, _, _ = parse_wheel_filename(name)
      carried[canonicalize_name(dist)] = (str(version), os.path.join(directory, name))
  picked = {}  # package -> why

  def requires(path):
    with zipfile.ZipFile(path) as wheel:
      meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
      lines = wheel.read(meta).decode().splitlines()
    reqs = [Requirement(line.split(":", 1)[1]) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]

  for dist, (version, _) in carried.items():
    found = _version(dist)
    if found is None or (dist in ranges and not ranges[dist].contains(found, prereleases=True)):
      picked[dist] = "missing" if found is None else f"{found} is outside setup.py's {ranges[dist]}"
  unmet, grew = [], True
  while grew:
    grew = False
    for dist in list(picked):
      for req in requires(carried[dist][1]):
        name = canonicalize_name(req.name)
        found = _version(name)
        if name in picked or (found is not None and req.specifier.contains(found, prereleases=True)):
          continue
        why = f"{found or 'missing'}; {dist} {carried[dist][0]} wants {req.name}{req.specifier}"
        if name in carried and req.specifier.contains(carried[name][0], prereleases=True):
          picked[name], grew = why, True
        elif why not in unmet:
          unmet.append(why)
  for dist, (version, _) in carried.items():
    if dist in picked:
      print(f"  installing {dist} {version} ({picked[dist]})", file=sys.stderr)
    else:
      print(f"  keeping this Python's {dist} {_version(dist)} (carried: {version})", file=sys.stderr)
  for why in unmet:
    print(f"  WARNING, no wheel carried for it: {why}", file=sys.stderr)
  return [carried[dist][1] for dist in sorted(picked)]


def environment_figures() -> dict:
  """What the machine and its Python hold: the device, the driver, and every version the results depend on."""
  import platform  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top

  requirements = {}
  try:
    for req in setup_requirements():
      found = _version(req.name)
      requirements[req.name] = {"wants": str(req.specifier), "found": found,
                                "in_range": found is not None and req.specifier.contains(found, prereleases=True)}
  except ImportError as e:  # no `packaging`: the versions go unchecked, the check goes on (this section gates it)
    requirements = {"not checked": {"wants": "", "found": None, "in_range": None, "why": str(e)}}
  devices = jax.devices()
  stats = devices[0].memory_stats() or {}
  smi = None
  with contextlib.suppress(OSError, subprocess.SubprocessError):
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20).stdout.strip() or None
  return {"python": platform.python_version(), "executable": sys.executable, "backend": jax.default_backend(),
          "device_count": len(devices), "device_kind": devices[0].device_kind,
          "memory_limit_gib": stats["bytes_limit"] / GIB if "bytes_limit" in stats else None, "nvidia_smi": smi,
          "packages": {name: _version(name) for name in ("jax", *RUNTIME_PACKAGES)}, "requirements": requirements,
          "pythonpath": os.environ.get("PYTHONPATH", ""), "jax_platforms": os.environ.get("JAX_PLATFORMS", ""),
          "compilation_cache": os.environ.get("JAX_COMPILATION_CACHE_DIR", "")}


def outer_round_figures(cpu: bool, repeats: int) -> dict:
  """One lock-step NoLoCo round and one overlapped round (message, exchange, merge: the parts the training
  loop runs around τ inner steps, here back to back), 4 small replicas on one device: time per round, the
  bytes each replica sends (the method's count, what a run logs), the collectives' operand bytes in the
  compiled programs, and the bytes the programs move through memory (XLA's cost analysis)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from experiments.lib import harness  # pylint: disable=g-import-not-at-top
  from noloco_jax.outer import base as outer_base  # pylint: disable=g-import-not-at-top
  from noloco_jax.outer import programs as programs_lib  # pylint: disable=g-import-not-at-top
  from noloco_jax.tools import hlo as hlo_lib  # pylint: disable=g-import-not-at-top
  from noloco_jax.training import build as build_lib  # pylint: disable=g-import-not-at-top

  rounds, num_params = {}, None
  for name, overlap in (("lockstep", 0), ("overlapped", 1)):
    cfg = harness.apply_overrides(harness.load_config("configs/default.py"), [
        "num_replicas=4", "num_devices=1", "outer.kind=noloco", f"outer.overlap.steps={overlap}", "model.preset=small",
        *(SHRINK if cpu else ())])
    setup = build_lib.build(cfg, vocab_size=257)
    state = setup.init_state()
    one_replica = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.params)
    num_params = setup.model.num_params()
    if overlap:  # the programs of streaming overlap, as the training loop builds them (training/rounds/overlapped.py)
      round_programs = programs_lib.RoundPrograms(setup.method, setup.mesh, setup.schedule, setup.state_shardings,
                                                  where="exchange", mix=cfg.outer.overlap.mix)
      _, route = round_programs.plan(0)
      programs = round_programs.compile(state, 0)

      def run(s, r, p=programs):
        s, sent, _ = p["message"](s)
        mean = p["exchange"](*sent, r)
        return p["merge"](s.replace(outer={**s.outer, outer_base.INFLIGHT: mean}))
    else:
      programs, (_, route) = setup.rounds.compile(state, 0), setup.rounds.plan(0)
      run = lambda s, r, fn=programs_lib.lockstep_round(programs): fn(s, r)[0]
    route = jax.numpy.asarray(route, jax.numpy.int32)
    times = []
    for i in range(repeats + 1):  # the first call is a warm-up
      t0 = time.perf_counter()
      state = jax.block_until_ready(run(state, route))
      if i:
        times.append(time.perf_counter() - t0)
    text = "\n".join(p.as_text() for p in programs.values())
    rounds[name] = {"round_ms": 1e3 * float(np.median(times)), "round_ms_all": [1e3 * t for t in times],
                    "programs": sorted(programs), "bytes_sent_per_replica": int(setup.method.message_bytes(one_replica)),
                    "collective_operand_bytes": hlo_lib.all_collective_bytes(text),
                    "bytes_accessed_per_device": sum(hlo_lib.bytes_accessed(p) for p in programs.values()),
                    "model_bytes_f32": outer_base.tree_bytes(one_replica, np.float32)}
    del state, setup
  device = jax.devices()[0]
  return {"replicas": 4, "devices": 1, "num_params": num_params, "platform": device.platform,
          "device_kind": device.device_kind, "repeats": repeats, "rounds": rounds}


def async_exchange_figures(cpu: bool, job_timeout_s: float) -> dict:
  """Two processes on this machine's first device, each JAX on its own (control.connect: the asynchronous
  schedule's control plane, as the trainer joins it), swap a float32 message over their transfer servers
  with transport.Transport.exchange, the trainer's data plane: the first exchange (connecting), then the
  steady median; every received message checked."""
  from noloco_jax.runtime import launch_local  # pylint: disable=g-import-not-at-top
  megabytes, reps = (1, 2) if cpu else (256, 5)
  with tempfile.TemporaryDirectory(prefix="accelerator_check_async_") as out:
    job = launch_local.Job(2, 1, ["--async_worker", f"--dir={out}", f"--megabytes={megabytes}", f"--reps={reps}"],
                           module="experiments.lib.accelerator_check", log_dir=os.path.join(out, "logs"), cwd=REPO,
                           # launch_local pins its processes to the CPU; this job runs where the check runs.
                           # Two processes share the device: neither may preallocate most of its memory.
                           env={"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", ""),
                                "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})

    def stop(signum, frame):  # the driver's watchdog: the job's processes have a process group of their own
      del signum, frame
      job.forward(signal.SIGKILL)
      raise SystemExit(143)

    signal.signal(signal.SIGTERM, stop)
    codes = job.wait(timeout_s=job_timeout_s, grace_s=5)
    results = []
    for slot in range(2):
      path = os.path.join(out, f"slot_{slot}.json")
      if os.path.exists(path):
        with open(path) as f:
          results.append(json.load(f))
    if len(results) < 2:
      tails = " | ".join(_last_line(open(p).read().splitlines()) for p in job.log_paths if os.path.exists(p))
      raise SectionError(f"{launch_local.describe(codes)}; {tails}")
  first = results[0]
  return {**first, "message_mb": megabytes, "reps": reps, "exit_statuses": codes,
          "both_received_what_was_sent": all(r["received_ok"] for r in results),
          "slot_1": {k: results[1][k] for k in ("first_exchange_s", "steady_median_s", "received_ok")}}


def async_worker(out_dir: str, megabytes: float, reps: int) -> None:
  """One of the two processes of `async_exchange_figures`."""
  from noloco_jax.asynchronous import control, matchmaking, transport  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  slot, other = int(os.environ["NOLOCO_PROCESS_ID"]), 1 - int(os.environ["NOLOCO_PROCESS_ID"])
  conn = control.connect(os.environ["NOLOCO_COORDINATOR_ADDRESS"], 2, slot, heartbeat_timeout_s=30)
  kv = conn.kv
  device = jax.local_devices()[0]
  t0 = time.perf_counter()
  tx = transport.Transport(kv, slot, conn.incarnation)
  server_start_s = time.perf_counter() - t0
  kv.set(f"check/incarnation/{slot}", str(conn.incarnation))
  partner = matchmaking.Member(other, int(kv.wait(f"check/incarnation/{other}", 60.0)), 0, 0)
  n = int(megabytes * 2 ** 20 / 4)
  message = {"x": jax.device_put(jnp.full((n,), slot + 1.0, jnp.float32), device)}

  def barrier(name):  # both processes start each exchange together, so each time is the exchange's own
    kv.increment(f"check/barrier/{name}", 1)
    while kv.increment(f"check/barrier/{name}", 0) < 2:
      time.sleep(0.002)

  times, ok = [], True
  for r in range(reps + 1):
    barrier(f"exchange_{r}")
    t0 = time.perf_counter()
    got = tx.exchange(message, [partner], tag=r, timeout_s=60.0)[0]["x"]
    jax.block_until_ready(got)
    times.append(time.perf_counter() - t0)
    ok = ok and bool(np.all(np.asarray(got) == other + 1.0))
  steady = float(np.median(times[1:]))
  result = {"slot": slot, "platform": device.platform, "device_kind": device.device_kind,
            "received_on": list(got.devices())[0].platform, "server_start_s": server_start_s,
            "first_exchange_s": times[0], "steady_median_s": steady, "steady_s_all": times[1:],
            "mb_per_s_each_way": megabytes / steady, "bytes_each_way": 4 * n, "received_ok": ok,
            "transport_stats": tx.stats.as_dict()}
  with open(os.path.join(out_dir, f"slot_{slot}.json"), "w") as f:
    json.dump(result, f)
  # Slot 0 hosts the coordination service: it leaves last, or slot 1 would be aborted (control.py).
  barrier("written")
  if slot == 0:
    kv.wait("check/left/1", 30.0)
    time.sleep(0.2)
  else:
    kv.set("check/left/1", "1")
  sys.stdout.flush()
  os._exit(0)  # pylint: disable=protected-access  (no shutdown barrier: the partner may be gone)


# ---------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU (the test's mode)")
  parser.add_argument("--out", default="", help="the JSON file (default: $OUT/accelerator_check.json, else "
                      "experiments/results_accelerator_check_MODE_TIME.json); the log goes beside it (.log)")
  parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
  parser.add_argument("--budget_s", type=float, default=0, help="all sections together (default 450 on a GPU, "
                      "600 with --cpu)")
  parser.add_argument("--only", default="", help="comma-separated sections to run (the environment always runs)")
  parser.add_argument("--json", action="store_true", help="also print the whole report as the last line of stdout")
  parser.add_argument("--section", default="", help=argparse.SUPPRESS)  # run one of this module's own sections
  parser.add_argument("--job_timeout_s", type=float, default=75, help=argparse.SUPPRESS)
  parser.add_argument("--repeats", type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument("--pick_wheels", default="", metavar="DIR", help="print the wheels of DIR this Python needs "
                      "(scripts/accelerator_check.sh --offline-wheels)")
  parser.add_argument("--async_worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--dir", default="", help=argparse.SUPPRESS)
  parser.add_argument("--megabytes", type=float, default=1, help=argparse.SUPPRESS)
  parser.add_argument("--reps", type=int, default=1, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.pick_wheels:
    print("\n".join(wheels_to_install(args.pick_wheels)))
    return 0
  if args.async_worker:
    async_worker(args.dir, args.megabytes, args.reps)
    return 0
  if args.section:
    own = {"environment": environment_figures,
           "outer_rounds": lambda: outer_round_figures(args.cpu, args.repeats or (1 if args.cpu else 5)),
           "async_exchange": lambda: async_exchange_figures(args.cpu, args.job_timeout_s)}
    print(json.dumps(own[args.section](), default=_jsonable), flush=True)
    return 0
  if args.budget_s <= 0:
    args.budget_s = 600 if args.cpu else 450
  return drive(args)


if __name__ == "__main__":
  sys.exit(main())
