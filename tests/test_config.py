"""Config validation: every constrained field fails before anything is compiled, naming field and value.

`build_lib.build` is the one entry point that runs all the checks (config.validate, then the data
section's own validation, then the mesh's device count); it compiles nothing, so each case costs
milliseconds.
"""

import logging
import os
import re

import ml_collections
import pytest

from configs import default
from noloco_jax import config as config_lib
from noloco_jax.config import checks as config_checks
from noloco_jax.training import build as build_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (dotted field, bad value, words the message must hold besides "field=value").
BAD_VALUES = [
    # Top level.
    ("num_steps", 0, "≥ 1"),
    ("num_replicas", 0, "≥ 1"),
    ("num_devices", -1, "≥ 0"),
    ("num_devices", 3, "divisor of num_replicas=8"),  # replicas vs devices
    ("eval_every", -1, "≥ 0"),
    ("log_every", -1, "≥ 0"),
    ("checkpoint_every", -1, "≥ 0"),
    ("nan_policy", "ignore", "skip_round"),
    ("fsdp", 0, "≥ 1"),
    ("fsdp", 3, "divisor of data.batch_size=2"),
    ("num_stages", 0, "≥ 1"),
    ("num_stages", 2, "divisor of the model's 1 layers"),
    ("checkpoint.keep", 0, "≥ 1"),
    ("checkpoint.warm_start", "/nonexistent/run", "existing directory"),
    # Model.
    ("model.preset", "huge", "tiny"),
    ("model.d_model", -1, "≥ 0"),
    ("model.num_layers", -1, "≥ 0"),
    ("model.num_heads", 3, "divisor of d_model=32"),
    ("model.mlp_dim", -1, "≥ 0"),
    ("model.vocab_size", -1, "≥ 0"),
    ("model.attention", "flash", "einsum"),
    ("model.attention", "cudnn", "model.dtype='bfloat16'"),  # the smoke config computes in float32
    ("model.loss_chunk", -1, "≥ 0"),
    ("model.remat_policy", "everything", "dots"),
    ("model.max_seq_len", -1, "≥ 0"),
    ("model.dtype", "float16", "bfloat16"),
    ("model.param_dtype", "int8", "float32"),
    ("model.rope_theta", 0.0, "> 0"),
    ("model.norm_eps", 0.0, "> 0"),
    # Inner optimizer.
    ("inner.optimizer", "sgd", "adamw"),
    ("inner.lr", 0.0, "> 0"),
    ("inner.warmup_steps", -1, "≥ 0"),
    ("inner.min_lr_ratio", 1.5, "[0, 1]"),
    ("inner.b1", 1.0, "[0, 1)"),
    ("inner.b2", -0.1, "[0, 1)"),
    ("inner.eps", 0.0, "> 0"),
    ("inner.weight_decay", -0.1, "≥ 0"),
    ("inner.grad_clip", -1.0, "≥ 0"),
    ("inner.microbatches", 0, "≥ 1"),
    ("inner.microbatches", 3, "dividing data.batch_size=2"),
    ("inner.replica_map", "pmap", "sequential"),
    # Outer step.
    ("outer.kind", "fedavg", "noloco"),
    ("outer.inner_steps", 0, "≥ 1"),  # H < 1
    ("outer.rule.group_size", 1, "≥ 2"),  # n < 2
    ("outer.rule.group_size", 3, "divisor of num_replicas=8"),
    ("outer.rule.outer_momentum", 1.0, "[0, 1)"),
    ("outer.rule.outer_momentum", -0.1, "[0, 1)"),
    ("outer.rule.outer_lr", 0.0, "> 0"),
    ("outer.rule.consensus_weight", 0.0, "> 0"),
    ("outer.codec.message_dtype", "int8", "bfloat16"),
    ("outer.pairing", "random", "fresh"),
    ("outer.state_dtype", "float16", "bfloat16"),
    # Pipeline stages.
    ("pipeline.routing", "x", "random"),
    ("pipeline.clip", "x", "per_stage"),
    ("pipeline.microbatches", -1, "≥ 0"),
    ("pipeline.microbatches", 3, "divisor of data.batch_size=2"),
    # Data (validated by noloco_jax.io.data, called from build before anything is compiled).
    ("data.seq_len", 0, "≥ 1"),
    ("data.batch_size", 0, "≥ 1"),
    ("data.eval_batches", -1, "≥ 0"),
    ("data.prefetch", -1, "≥ 0"),
    ("data.shuffle_buffer", 0, "≥ 1"),
    ("data.source", "nope", "stdlib"),
    ("data.tokenizer", "nope", "bytes"),
    ("data.mode", "x", "stream"),
    ("data.shard_by", "x", "document"),
    ("model.arch", "gpt", "llama"),
]
# Values of the wrong type (a ConfigDict refuses them, a config read from JSON or a dict may hold them).
BAD_TYPES = [("num_steps", True, "an integer"), ("outer.rule.outer_lr", "0.7", "a number"),
             ("checkpoint.async_save", 1, "True or False"), ("data.seq_len", 3.0, "an integer")]


def smoke() -> ml_collections.ConfigDict:
  return default.get_config("smoke")


def set_field(config, dotted: str, value) -> None:
  *parents, leaf = dotted.split(".")
  node = config
  for part in parents:
    node = node[part]
  node[leaf] = value


def build_error(config) -> str:
  with pytest.raises(ValueError) as info:
    build_lib.build(config)
  return str(info.value)


def test_the_default_and_smoke_configs_are_valid():
  config_lib.validate(default.get_config())
  build_lib.build(smoke())


@pytest.mark.parametrize("field,value,valid", BAD_VALUES, ids=[f"{f}={v!r}" for f, v, _ in BAD_VALUES])
def test_a_bad_value_names_field_value_and_what_is_valid(field, value, valid):
  config = smoke()
  set_field(config, field, value)
  message = build_error(config)
  assert message.startswith(f"config.{field}={value!r} is not valid: "), message
  assert valid in message and "\n" not in message, message


@pytest.mark.parametrize("field,value,valid", BAD_TYPES, ids=[f"{f}={v!r}" for f, v, _ in BAD_TYPES])
def test_a_value_of_the_wrong_type_names_field_value_and_type(field, value, valid):
  config = smoke().to_dict()
  set_field(config, field, value)
  with pytest.raises(config_lib.ConfigError) as info:
    config_lib.validate(config)
  assert str(info.value) == f"config.{field}={value!r} is not valid: {valid}.", info.value


# (section, misspelt field, the message's end: the nearest field, or the section's fields).
UNKNOWN_FIELDS = [
    ("", "num_step", "did you mean config.num_steps?"),
    ("", "momentun", "the fields of config are checkpoint, checkpoint_every,"),
    ("model", "d_modle", "did you mean config.model.d_model?"),
    ("inner", "warmup", "did you mean config.inner.warmup_steps?"),
    ("outer", "momentun", "did you mean config.outer.rule.outer_momentum?"),  # the new name of a renamed field
    ("outer", "consensus", "did you mean config.outer.rule.consensus_weight?"),
    ("checkpoint", "keeep", "did you mean config.checkpoint.keep?"),
    ("pipeline", "routin", "did you mean config.pipeline.routing?"),
    ("data", "seq_lenght", "did you mean config.data.seq_len?"),
]


@pytest.mark.parametrize("section,name,ending", UNKNOWN_FIELDS, ids=[f"{s}.{n}" for s, n, _ in UNKNOWN_FIELDS])
def test_an_unknown_field_at_any_level_is_an_error(section, name, ending):
  config = smoke()
  node = config[section] if section else config
  node[name] = 0.9  # a typo must never be silently ignored
  message = build_error(config)
  where = f"config.{section}.{name}" if section else f"config.{name}"
  assert message.startswith(f"{where} is not a field; "), message
  assert ending in message, message


# (old name, new name, value): α, β and γ of the outer step under their pre-schema names.
RENAMED = [("outer.momentum", "outer.rule.outer_momentum", 0.3), ("outer.lr", "outer.rule.outer_lr", 0.9),
           ("outer.gamma", "outer.rule.consensus_weight", 0.8)]


def _get(node, dotted):
  for part in dotted.split("."):
    node = node[part]
  return node


@pytest.mark.parametrize("old,new,value", RENAMED, ids=[old for old, _, _ in RENAMED])
def test_an_old_field_name_still_works_with_a_one_line_warning(caplog, old, new, value):
  config = smoke()
  set_field(config, old, value)  # on the placeholder configs/default.py keeps for the old name
  with caplog.at_level(logging.WARNING):
    resolved = config_lib.validate(config)
  short_new, short_old = new.split(".", 1)[1], old.split(".")[1]
  assert _get(resolved, new) == value and short_old not in resolved.outer
  warnings = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
  assert warnings == [f"config.{old} is deprecated: use config.{new} (same meaning); taking "
                      f"{short_new}={value!r}."], warnings
  # A config file written before the rename (no placeholder, no new field) reads the same way.
  legacy = smoke().to_dict()
  del legacy["outer"]["rule"][new.split(".")[-1]]
  legacy["outer"][short_old] = value
  assert _get(config_lib.validate(ml_collections.ConfigDict(legacy)), new) == value


@pytest.mark.parametrize("old,new,value", RENAMED, ids=[old for old, _, _ in RENAMED])
def test_old_and_new_names_set_differently_is_an_error(old, new, value):
  config = smoke()
  set_field(config, old, value)
  set_field(config, new, value / 2)
  message = build_error(config)
  short_new = new.split(".", 1)[1]
  assert message == (f"config.{old}={value!r} and config.{new}={value / 2!r} are both set; {old.split('.')[1]} "
                     f"is the old name of {short_new}: set only {short_new}."), message
  set_field(config, new, value)  # the same value under both names is no conflict
  assert _get(config_lib.validate(config), new) == value


# ---- Each kind at its own defaults (its spec's, noloco_jax/outer/methods/; resolved at validation) ----

PAPER = {"noloco": dict(outer_momentum=0.5, outer_lr=0.7, consensus_weight=0.7, group_size=2, inner_steps=50),
         "diloco": dict(outer_momentum=0.3, outer_lr=0.7, nesterov=False, inner_steps=100),
         "gossip": dict(group_size=2, inner_steps=50), "epidemic": dict(fanout=1, inner_steps=50),
         "epidemic_adam": dict(group_size=2, inner_steps=50)}


def _outer_values(outer, names):
  return {k: outer.value(k) for k in names}


@pytest.mark.parametrize("kind", sorted(PAPER))
def test_choosing_a_kind_gives_its_paper_values_and_says_so(caplog, monkeypatch, kind):
  from noloco_jax.config import outer as outer_schema  # pylint: disable=g-import-not-at-top
  from noloco_jax.outer import methods  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(outer_schema, "_logged", set())  # logged once per process: forget earlier tests' lines
  config = default.get_config()
  config.outer.kind = kind  # what --config.outer.kind=KIND does
  with caplog.at_level(logging.INFO):
    outer = config_lib.load(config).outer
  assert _outer_values(outer, PAPER[kind]) == PAPER[kind]
  assert dict(methods.get(kind).defaults) == PAPER[kind]  # the one table configs/paper.py and the notebooks use
  where = f"(noloco_jax/outer/methods/{kind if kind != 'gossip' else 'noloco'}.py)"
  logged = [r.getMessage() for r in caplog.records if where in r.getMessage()]
  assert len(logged) == 1, logged
  if kind == "diloco":
    assert logged[0] == ("config.outer.kind='diloco': rule.outer_momentum=0.3, rule.outer_lr=0.7, rule.nesterov=False, "
                         "inner_steps=100 from the paper's defaults for diloco (noloco_jax/outer/methods/diloco.py); set "
                         "a field to override it.")
  # Only NoLoCo and DiLoCo are run in the paper: the other kinds' values are not called the paper's.
  assert ("from the paper's defaults" in logged[0]) == (kind in ("noloco", "diloco")), logged[0]
  if kind not in ("noloco", "diloco"):
    assert f"defaults for {kind}, which the paper does not run" in logged[0], logged[0]


def test_a_field_set_to_another_kinds_default_is_kept():
  config = default.get_config()
  config.outer.update(kind="diloco", inner_steps=50, rule=dict(outer_momentum=0.5))  # NoLoCo's values, on purpose
  outer = config_lib.validate(config).outer
  assert (outer.rule.outer_momentum, outer.inner_steps, outer.rule.outer_lr) == (0.5, 50, 0.7)
  assert config_lib.Config.parse(config).outer.from_spec() == {"outer_lr": 0.7, "nesterov": False}


def test_the_default_job_is_unchanged_and_its_file_keeps_the_fields_unset():
  config = default.get_config()
  assert config.outer.inner_steps is None and all(config.outer.rule[k] is None for k in PAPER["noloco"] if k != "inner_steps")
  resolved = config_lib.load(config).outer
  assert _outer_values(resolved, PAPER["noloco"]) == PAPER["noloco"]
  assert (resolved.rule.nesterov, resolved.rule.fanout) == (False, 1)  # the fields noloco does not use: as before
  # A config written with every field set (e.g. a run's config.json) keeps its values whatever the kind.
  written = config_lib.validate(default.get_config()).to_dict()
  written["outer"]["kind"] = "diloco"
  assert config_lib.validate(ml_collections.ConfigDict(written)).outer.rule.outer_momentum == 0.5


def test_an_old_name_beside_a_config_file_written_with_every_field():
  """Before the per-kind fields could be unset, a file held outer_momentum=0.5 as its default: the old
  name then still wins, as it did (the new field at its old default counts as not set)."""
  written = config_lib.validate(default.get_config()).to_dict()
  written["outer"]["momentum"] = 0.3
  assert config_lib.validate(ml_collections.ConfigDict(written)).outer.rule.outer_momentum == 0.3


# The flat fields of config.outer before it was cut into sections, and where each went.
FLAT = [("group_size", "rule.group_size", 4), ("fanout", "rule.fanout", 2), ("message_dtype", "codec.message_dtype", "bfloat16"),
        ("compression", "codec.compression", "int8"), ("compression_chunk", "codec.chunk", 512),
        ("overlap_steps", "overlap.steps", 2), ("overlap_mix", "overlap.mix", 0.25),
        ("max_wait_s", "asynchronous.max_wait_s", 7.0), ("allreduce_algorithm", "rule.allreduce_algorithm", "tree")]


@pytest.mark.parametrize("old,new,value", FLAT, ids=[old for old, _, _ in FLAT])
def test_a_flat_outer_field_still_works_with_a_warning_naming_its_section(caplog, old, new, value):
  config = smoke()
  config.outer[old] = value  # what --config.outer.OLD=VALUE does (the config file keeps a placeholder)
  with caplog.at_level(logging.WARNING):
    outer = config_lib.validate(config).outer
  section, name = new.split(".")
  assert outer[section][name] == value
  assert [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()] == [
      f"config.outer.{old} is deprecated: use config.outer.{new} (same meaning); taking {new}={value!r}."]
  config.outer[section][name] = value  # both set, to the same value: fine
  config_lib.validate(config)


def test_the_command_line_sets_a_per_kind_field_and_the_kind(tmp_path):
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  out = subprocess.run([sys.executable, "-m", "noloco_jax.main", "--dry_run", "--topology=8x1GB",
                        "--config=configs/default.py:smoke", "--config.outer.kind=diloco",
                        "--config.outer.rule.outer_momentum=0.5"], capture_output=True, text=True, cwd=REPO, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  assert ("config.outer.kind='diloco': rule.outer_lr=0.7, rule.nesterov=False from the paper's defaults for diloco"
          in out.stderr), out.stderr[-3000:]


def test_an_unknown_allreduce_algorithm_is_one_line():
  config = smoke()
  config.outer.rule.allreduce_algorithm = "butterfly"
  assert build_error(config) == "config.outer.rule.allreduce_algorithm='butterfly' is not valid: one of ring | tree."


def test_the_old_names_reach_the_outer_method():
  from noloco_jax.config.outer import OuterConfig  # pylint: disable=g-import-not-at-top
  from noloco_jax.outer import methods  # pylint: disable=g-import-not-at-top
  config = smoke()
  config.outer.update(kind="diloco", lr=0.25, momentum=0.1)
  outer = OuterConfig.parse(config.outer)
  assert (outer.rule.outer_lr, outer.rule.outer_momentum) == (0.25, 0.1)
  assert methods.make(config.outer).kind == "diloco"


def test_implementations_accept_exactly_the_schema_s_values():
  """The allowed values are declared once, in the schema; the implementations' tables must match."""
  from noloco_jax.config import model as model_schema, outer as outer_schema  # pylint: disable=g-import-not-at-top
  from noloco_jax.models import llama  # pylint: disable=g-import-not-at-top
  from noloco_jax.outer import base  # pylint: disable=g-import-not-at-top
  assert tuple(base.MESSAGE_DTYPES) == outer_schema.MESSAGE_DTYPES
  assert tuple(llama.DTYPES) == model_schema.DTYPES
  assert set(outer_schema.STATE_DTYPES) == {""} | set(llama.DTYPES)


def test_a_replica_loop_with_pipeline_stages_is_an_error():
  config = smoke()  # the pipeline maps its replicas itself: a loop there would be silently ignored
  config.num_stages, config.model.num_layers, config.inner.replica_map = 2, 2, "sequential"
  message = build_error(config)
  assert message.startswith("config.inner.replica_map='sequential' is not valid: ") and "num_stages" in message
  assert "\n" not in message, message


def test_more_devices_than_exist_is_an_error():
  config = smoke()  # checked by the mesh, which sees the devices; still before anything is compiled
  config.num_replicas, config.num_devices = 16, 16
  message = build_error(config)
  assert "num_devices=16" in message and "only 8 devices" in message, message


def test_a_missing_field_or_section_takes_the_schema_s_default():
  config = smoke().to_dict()
  del config["checkpoint"], config["outer"]["pairing"], config["model"]["arch"]
  resolved = config_lib.validate(ml_collections.ConfigDict(config))
  assert (resolved.checkpoint.keep, resolved.outer.pairing, resolved.model.arch) == (3, "fresh", "llama")


def test_the_config_package_imports_nothing_else_from_noloco_jax():
  """config/ is the bottom of the import graph: its modules import no other module of the package (the
  outer methods register their specs with it instead: noloco_jax/__init__.py imports them first)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("import_graph", os.path.join(REPO, "scripts", "import_graph.py"))
  graph = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(graph)
  imports = graph.analyse(graph.default_root())["imports"]
  outside = {m: [t for t in targets if not t.startswith("noloco_jax.config")]
             for m, targets in imports.items() if m.startswith("noloco_jax.config")}
  assert not any(outside.values()), outside


def test_reading_a_config_imports_no_jax():
  """What a config is read against (the schema and the methods' specs) is light: no JAX, no optax."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ("import sys, noloco_jax.config as c; from configs import default; c.load(default.get_config()); "
          "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'jaxlib', 'optax', 'flax', 'orbax'}))")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]", out.stdout


def test_a_model_vocabulary_smaller_than_the_tokenizer_s():
  config = smoke()
  config.model.vocab_size = 100  # the byte tokenizer has 257 ids
  message = build_error(config)
  assert "vocab_size 100" in message and ">= 257" in message, message


def test_data_seq_len_longer_than_the_model_allows():
  config = smoke()
  config.model.max_seq_len = 16
  message = build_error(config)
  assert "data.seq_len=32" in message and "max_seq_len=16" in message, message


@pytest.mark.parametrize("fields,named", [
    ({"data.source": "c4_json", "data.path": "/nonexistent/c4"}, "path='/nonexistent/c4'"),
    ({"data.source": "text", "data.train_files": "/nonexistent/*.txt", "data.eval_files": "/nonexistent/*.txt"},
     "train_files='/nonexistent/*.txt'"),
    ({"data.source": "tfds", "data.tfds_name": ""}, "tfds_name=''"),
    ({"data.tokenizer": "sentencepiece", "data.spm_model": "/nonexistent.model"}, "spm_model='/nonexistent.model'"),
])
def test_a_missing_dataset_or_tokenizer_path_is_named(fields, named):
  config = smoke()
  for field, value in fields.items():
    set_field(config, field, value)
  message = build_error(config)
  assert named in message, message


def test_skip_round_needs_checkpoints_at_round_ends():
  config = smoke()  # H = 3
  config.nan_policy = "skip_round"
  config.checkpoint_every = 4
  message = build_error(config)
  assert "checkpoint_every=4" in message and "outer.inner_steps=3" in message, message
  config.checkpoint_every = 6
  config_lib.validate(config)


def test_an_unstable_gamma_is_refused_unless_allowed(caplog, monkeypatch):
  """The issue's examples: α = 0.9, γ = 1.2 (inside the paper's interval) diverges; γ = 0.3 is fine. The
  method's own stability analysis (its spec) runs when the config is loaded."""
  monkeypatch.setattr(config_checks, "_LOGGED", set())  # warned once per process: start from none
  config = smoke()
  config.outer.rule.outer_momentum, config.outer.rule.consensus_weight = 0.9, 0.3  # outside the paper's interval, stable
  with caplog.at_level(logging.WARNING):
    config_lib.validate(config)
  assert not [r for r in caplog.records if "unstable" in r.getMessage()]
  config.outer.rule.consensus_weight = 1.2
  with pytest.raises(config_lib.ConfigError, match=r"outer.rule.consensus_weight=1.2 .*grows by 11.4% per round") as error:
    config_lib.validate(config)
  assert "outer.allow_unstable=True" in str(error.value) and "\n" not in str(error.value)
  message = build_error(config)  # refused by train.build before anything is compiled
  assert "consensus_weight=1.2" in message and "unstable" in message, message
  config.outer.allow_unstable = True
  with caplog.at_level(logging.WARNING):
    config_lib.validate(config)
    config_lib.validate(config)  # main.py loads it, then train.build again
  warnings = [r.getMessage() for r in caplog.records if "unstable" in r.getMessage()]
  assert len(warnings) == 1 and "11.4% per round" in warnings[0], warnings  # issue 25 item 6: it printed twice


def test_a_method_without_a_stability_analysis_is_logged_as_not_analysed(caplog, monkeypatch):
  monkeypatch.setattr(config_checks, "_LOGGED", set())
  config = smoke()
  config.outer.kind = "epidemic"
  with caplog.at_level(logging.INFO):
    config_lib.validate(config)
    config_lib.validate(config)
  notes = [r.getMessage() for r in caplog.records if "not analysed" in r.getMessage()]
  assert notes == ["config.outer.kind='epidemic': the stability of the replicas' spread is not analysed for this "
                   "method (docs/stability.md analyses NoLoCo's update); nothing is refused."], notes


def test_round_robin_needs_pairs():
  config = smoke()
  config.outer.pairing, config.outer.rule.group_size = "round_robin", 4
  with pytest.raises(config_lib.ConfigError, match="outer.pairing='round_robin'.*group_size 2 only"):
    config_lib.validate(config)


# ---------------------------------------------------------------- the command line (issue 18, item 11)


# (command-line flags after --workdir, the last line the user must see on stderr). Each exits 2, before training.
SMOKE = "--config=configs/default.py:smoke"
# A bound on a hung process only: these runs stop at their config error, in seconds when the machine is
# quiet, but Python and JAX start slowly on a loaded one (tests/mp_env.py).
START_TIMEOUT_S = 300
CLI_ERRORS = [
    ([SMOKE, "--config.outer.momentun=0.9"],
     "noloco_jax: config.outer.momentun is not a field; did you mean config.outer.rule.outer_momentum?"),
    ([SMOKE, "--config.modle.d_model=64"], "noloco_jax: config.modle is not a field; did you mean config.model?"),
    ([SMOKE, "--config.outer.momentum=1.5"],  # the old name, mapped (one warning line), then checked
     "noloco_jax: config.outer.rule.outer_momentum=1.5 is not valid: a number in [0, 1)."),
    ([SMOKE, "--config.outer.kind=fedavg"],
     "noloco_jax: config.outer.kind='fedavg' is not valid: one of noloco | diloco | gossip | epidemic | epidemic_adam | ddp | none."),
    ([SMOKE, "--config.num_steps=abc"], "noloco_jax: config.num_steps='abc' is not valid: an integer."),
    ([SMOKE, "--config.outer.lr=0.5", "--config.outer.rule.outer_lr=0.6"],
     "noloco_jax: config.outer.lr=0.5 and config.outer.rule.outer_lr=0.6 are both set; lr is the old name of "
     "rule.outer_lr: set only rule.outer_lr."),
    (["--config=configs/default.py:smok"],  # raised inside the config file: where is named too
     re.compile(re.escape("noloco_jax: flag --config=configs/default.py:smok: ValueError: configs/default.py: "
                          "unknown argument 'smok'; valid: 'smoke', 'model=NAME'. (configs/default.py, line ")
                + r"\d+\)")),
    (["--config=configs/nonexistent.py"], "noloco_jax: --config=configs/nonexistent.py: cannot load it: "
     "[Errno 2] No such file or directory: 'configs/nonexistent.py'"),
]


@pytest.mark.parametrize("flags,last_line", CLI_ERRORS, ids=[" ".join(f) for f, _ in CLI_ERRORS])
def test_a_bad_command_line_prints_one_line_and_exits_2(tmp_path, flags, last_line):
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  proc = subprocess.run([sys.executable, "-m", "noloco_jax.main", f"--workdir={tmp_path}", *flags], cwd=REPO,
                        capture_output=True, text=True, timeout=START_TIMEOUT_S)
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2, proc.stderr
  assert re.fullmatch(last_line, lines[-1]) if isinstance(last_line, re.Pattern) else lines[-1] == last_line, (
      proc.stderr)
  # Nothing but the error and at most a deprecation warning: no traceback, no usage text.
  assert len(lines) <= 2 and "Traceback" not in proc.stderr, proc.stderr
  assert not any(tmp_path.iterdir())  # refused before anything was written


# What the process had imported when it exited (read by an atexit hook; absl's app.run ends in sys.exit).
_IMPORTED_AT_EXIT = """
import atexit, runpy, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(" ".join(sorted(m for m in sys.modules if m.split(".")[0] in
                                                            ("jax", "jaxlib", "orbax", "grain", "tensorflow_datasets", "optax", "flax")))))
sys.argv[0] = "noloco_jax.main"
runpy.run_module("noloco_jax.main", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("flags,last_line", [
    ([SMOKE, "--config.modle.d_model=64"], "noloco_jax: config.modle is not a field; did you mean config.model?"),
    ([SMOKE, "--config.outer.rule.outer_momentum=0.9", "--config.outer.rule.consensus_weight=1.2"],  # NoLoCo's stability
     re.compile(r"noloco_jax: .*outer.rule.consensus_weight=1.2 .*grows by 11.4% per round.*")),
    ([SMOKE, "--workdir="], "noloco_jax: --workdir is required (except with --dry_run)."),
], ids=["not_a_field", "unstable", "no_workdir"])
def test_a_bad_command_line_is_answered_before_jax_is_imported(tmp_path, flags, last_line):
  """A mistyped field took 2.6 s to answer, the time to import JAX, Orbax, Grain and TFDS first; main.py now
  checks its command line with none of them imported (0.2 s)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  out = tmp_path / "imported"
  proc = subprocess.run([sys.executable, "-c", _IMPORTED_AT_EXIT, str(out), f"--workdir={tmp_path / 'run'}", *flags],
                        cwd=REPO, capture_output=True, text=True, timeout=START_TIMEOUT_S)
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2, proc.stderr
  assert re.fullmatch(last_line, lines[-1]) if isinstance(last_line, re.Pattern) else lines[-1] == last_line, (
      proc.stderr)
  assert out.read_text() == "", f"imported before the command line was checked: {out.read_text()[:300]}"


@pytest.mark.parametrize("source,error", [
    ("def get_config(:\n  pass\n", "SyntaxError: invalid syntax ({path}, line 1)"),
    ("import ml_collections\n\ndef get_config():\n  return 1 / 0\n", "ZeroDivisionError: division by zero ({path}, line 4)"),
    ("import no_such_module_here\n", "ModuleNotFoundError: No module named 'no_such_module_here' ({path}, line 1)"),
], ids=["syntax_error", "raises_in_get_config", "import_error"])
def test_a_config_file_that_cannot_load_is_one_line_and_exits_2(tmp_path, source, error):
  """Issue 25 item 6: a config file with a syntax error gave exit 1 and a 54-line traceback."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  path = tmp_path / "my_config.py"
  path.write_text(source)
  proc = subprocess.run([sys.executable, "-m", "noloco_jax.main", f"--workdir={tmp_path / 'run'}", f"--config={path}"],
                        cwd=REPO, capture_output=True, text=True, timeout=START_TIMEOUT_S)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  assert proc.stderr.splitlines() == [f"noloco_jax: flag --config={path}: " + error.format(path=path)], proc.stderr


def test_a_config_file_whose_get_config_returns_none_is_named(tmp_path):
  """The last line named the value, not the file: 'flag --config=None: Flag --config must have a value other
  than None.' (ml_collections' own warning above it says what happened; the last line now does too)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  path = tmp_path / "my_config.py"
  path.write_text("def get_config():\n  config = {'num_steps': 3}\n")
  proc = subprocess.run([sys.executable, "-m", "noloco_jax.main", f"--workdir={tmp_path / 'run'}", f"--config={path}"],
                        cwd=REPO, capture_output=True, text=True, timeout=START_TIMEOUT_S)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  assert proc.stderr.splitlines()[-1] == (
      f"noloco_jax: flag --config={path}: get_config() returned None; it must return the config (an "
      "ml_collections.ConfigDict): is its return statement missing?"), proc.stderr
  assert not (tmp_path / "run").exists()


def test_a_config_error_found_after_start_up_is_one_line_and_exits_2(tmp_path):
  """The checks that need the file system (data paths, tokenizer files) run in train.build."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  proc = subprocess.run([sys.executable, "-m", "noloco_jax.main", f"--workdir={tmp_path / 'run'}", SMOKE,
                         "--config.data.source=text", "--config.data.train_files=/nonexistent/*.txt"],
                        cwd=REPO, capture_output=True, text=True, timeout=START_TIMEOUT_S)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  assert proc.stderr.splitlines()[-1] == ("noloco_jax: config.data.train_files='/nonexistent/*.txt': pattern "
                                          "'/nonexistent/*.txt' matches no file."), proc.stderr
