"""training/summary.py: the end-of-run screen and summary.json say what metrics.jsonl says, name the
workdir and how the run started, every outer hyperparameter in force (and only those) and how the kind
exchanges (pairing, epidemic graph, codec, overlap)."""

import json

import pytest

from configs import default
from noloco_jax import config as config_lib
from noloco_jax.outer import wire
from noloco_jax.training import summary as summary_lib
from noloco_jax.training.loop_state import LoopState


def _loop(step=12, process_loss=5.0912):
  loop = LoopState(step=step, round=4, history={
      "eval": [{"step": 0, "eval/loss": 5.52, "eval/ppl": 249.8, "replicas/weight_std": 0.0},
               {"step": step, "eval/loss": 4.89, "eval/ppl": 133.3, "replicas/weight_std": 1.5e-3}],
      # What this process logged last: in a multi-process job, the loss of its own replicas only.
      "train": {"step": step, "train/loss": process_loss, "perf/steps_per_s": 8.0}})
  loop.add_round({}, None, wire.allreduce(1000, 8))
  return loop


def _config(**outer):
  config = default.get_config("smoke")
  config.outer.update(outer)
  return config_lib.validate(config)


def _write_metrics(workdir, rows):
  with open(workdir / "metrics.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)


def test_the_training_loss_is_metrics_jsonl_s_not_this_processs(tmp_path):
  _write_metrics(tmp_path, [{"step": 9, "train/loss": 5.3}, {"step": 12, "train/loss": 5.0623, "perf/steps_per_s": 7.5},
                            {"step": 12, "eval/loss": 4.89}])
  out = summary_lib.summarize(_config(), _loop(), 26784, 10.0, str(tmp_path))
  assert out["train/loss"] == 5.0623 and out["train/loss_over"] == "all replicas (metrics.jsonl)"
  assert "train/loss  5.0623 (step 12, all replicas (metrics.jsonl))" in out["text"]
  assert "7.50 steps/s" in out["text"]


def test_without_the_final_row_it_says_whose_loss_it_reports(tmp_path):
  _write_metrics(tmp_path, [{"step": 9, "train/loss": 5.3}])  # process 0 has not merged step 12 yet
  out = summary_lib.summarize(_config(), _loop(), 26784, 10.0, str(tmp_path))
  assert out["train/loss"] == 5.0912 and out["train/loss_over"] == "this process's replicas"


def test_it_names_the_workdir_and_how_the_run_started(tmp_path):
  _write_metrics(tmp_path, [])
  out = summary_lib.summarize(_config(), _loop(), 1, 1.0, str(tmp_path), start_step=6)
  assert f"workdir     {tmp_path} (resumed from its checkpoint at step 6)" in out["text"]
  assert out["resumed_from_step"] == 6 and out["workdir"] == str(tmp_path)
  config = _config()
  config.checkpoint.warm_start = "/runs/other"
  out = summary_lib.summarize(config, _loop(), 1, 1.0, str(tmp_path))
  assert "(warm start from /runs/other)" in out["text"] and out["warm_start"] == "/runs/other"
  assert "(started from scratch)" in summary_lib.summarize(_config(), _loop(), 1, 1.0, str(tmp_path))["text"]


@pytest.mark.parametrize("outer,shown,absent", [
    ({}, "outer noloco: α=0.5 (paper), β=0.7 (paper), γ=0.7 (paper), n=2 (paper), H=3, pairing fresh, messages float32",
     ("overlap",)),
    ({"kind": "diloco"}, "outer diloco: α=0.3 (paper), β=0.7 (paper), heavy-ball (paper), H=3, all-reduce priced as ring",
     ("γ=", "n=")),
    ({"kind": "diloco", "outer_momentum": 0.5, "nesterov": True}, "outer diloco: α=0.5, β=0.7 (paper), Nesterov, H=3", ()),
    ({"kind": "gossip"}, "outer gossip: α=0 (fixed by gossip), β=1 (fixed by gossip), γ=1 (fixed by gossip), "
     "n=2 (default for gossip; not in the paper), H=3", ("(paper)",)),
    ({"kind": "epidemic"}, "outer epidemic: s=1 (default for epidemic; not in the paper), H=3", ("(paper)",)),
    ({"kind": "epidemic", "fanout": 2}, "outer epidemic: s=2, H=3, graph EL-Oracle (topology=oracle), pairing fresh, "
     "messages float32", ("α=", "n=")),
    ({"kind": "ddp"}, "outer ddp: all-reduce priced as ring", ("H=", "α=", "β=")),
    ({"kind": "none"}, "outer none: no outer step", ("H=",)),
])
def test_it_names_every_outer_hyperparameter_in_force_and_no_other(tmp_path, outer, shown, absent):
  _write_metrics(tmp_path, [])
  config = _config(**outer)
  out = summary_lib.summarize(config, _loop(), 1, 1.0, str(tmp_path))
  assert shown in out["text"], out["text"]
  header, outer_line = out["text"].splitlines()[1:3]
  for text in absent:
    assert text not in header + outer_line, (text, header, outer_line)
  expected = {"noloco": {"outer_momentum", "outer_lr", "consensus_weight", "group_size", "inner_steps"},
              "diloco": {"outer_momentum", "outer_lr", "nesterov", "inner_steps"},
              "gossip": {"outer_momentum", "outer_lr", "consensus_weight", "group_size", "inner_steps"},
              "epidemic": {"fanout", "inner_steps"}, "ddp": set(), "none": set()}[config.outer.kind]
  assert set(out["outer"]) == expected and out["outer/kind"] == config.outer.kind
  assert json.loads(json.dumps(out["outer"])) == out["outer"]  # summary.json holds it as it is


def test_comm_figures_are_on_the_wire_and_the_operands(tmp_path):
  _write_metrics(tmp_path, [])
  out = summary_lib.summarize(_config(kind="diloco"), _loop(), 1, 1.0, str(tmp_path))
  assert out["comm/bytes_sent_per_replica"] == out["comm/bytes_received_per_replica"] == 1750.0
  assert out["comm/collective_operand_bytes_per_replica"] == 1000
  assert "comm/bytes_sent_per_replica      1,750" in out["text"]


@pytest.mark.parametrize("outer,shown,exchange", [
    ({"kind": "epidemic", "topology": "local"}, "graph EL-Local (topology=local), pairing fresh, messages float32",
     {"message_dtype": "float32", "topology": "local", "pairing": "fresh"}),
    ({"pairing": "fixed", "message_dtype": "bfloat16", "overlap_steps": 2, "overlap_mix": 0.25},
     "pairing fixed, messages bfloat16, overlap τ=2, λ=0.25",
     {"message_dtype": "bfloat16", "compression": "none", "pairing": "fixed", "overlap_steps": 2, "overlap_mix": 0.25}),
    ({"compression": "topk", "topk_density": 0.03}, "messages float32, topk (topk_density=0.03, topk_bits=2, "
     "slow_codec=int8, compression_chunk=4096, feedback_decay=1)",
     {"message_dtype": "float32", "compression": "topk", "compression_chunk": 4096, "feedback_decay": 1.0,
      "topk_density": 0.03, "topk_bits": 2, "slow_codec": "int8", "pairing": "fresh", "overlap_steps": 0}),
    ({"kind": "epidemic_adam", "pairing": "round_robin"}, "pairing round_robin, messages float32",
     {"message_dtype": "float32", "pairing": "round_robin"}),
    ({"schedule": "async", "max_wait_s": 2.0, "overlap_steps": 1},
     "schedule async (partners at run time: max_wait_s=2, match_window_s=0.05, staleness_decay=0.693, match_odd=triple), "
     "messages float32, overlap τ=1, λ=0.5",
     {"message_dtype": "float32", "compression": "none", "schedule": "async", "max_wait_s": 2.0, "match_window_s": 0.05,
      "staleness_decay": 0.693, "match_odd": "triple", "overlap_steps": 1, "overlap_mix": 0.5}),
    ({"kind": "diloco", "allreduce_algorithm": "tree"}, "all-reduce priced as tree", {"allreduce_algorithm": "tree"}),
    ({"kind": "none"}, "outer none: no outer step", {}),
])
def test_it_names_how_the_kind_exchanges(tmp_path, outer, shown, exchange):
  """What travels and between whom changes the result as much as α or H: the EL-Oracle and EL-Local graphs,
  the pairing mode, the overlap window and the codec are named on the screen and in summary.json."""
  _write_metrics(tmp_path, [])
  out = summary_lib.summarize(_config(**outer), _loop(), 1, 1.0, str(tmp_path))
  assert shown in out["text"].splitlines()[2], out["text"]
  assert out["outer/exchange"] == exchange
  assert json.loads(json.dumps(out["outer/exchange"])) == exchange


def test_the_consensus_models_loss_is_beside_eval_loss(tmp_path):
  _write_metrics(tmp_path, [])
  loop = _loop()
  loop.history["eval"][-1].update({"eval/consensus_loss": 4.80, "eval/consensus_ppl": 121.5})
  out = summary_lib.summarize(_config(), loop, 1, 1.0, str(tmp_path))
  assert "eval/consensus_loss  4.8000 (the replicas' average, eval_consensus=slow; -0.0900 against eval/loss)" in out["text"]
  assert out["eval/consensus_loss"] == 4.80 and out["eval/consensus_ppl"] == 121.5
  without = summary_lib.summarize(_config(), _loop(), 1, 1.0, str(tmp_path))  # no consensus row (eval_consensus="")
  assert "eval/consensus_loss" not in without and "eval/consensus" not in without["text"]
