"""experiments/bench_mfu.py in its seconds-on-CPU mode: the JSON fields, and the model's FLOP count it
uses (Model.flops_per_token) against independent counts: matmul by matmul, and XLA's own cost analysis
of the compiled forward pass."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest

from noloco_jax.models import llama as model_lib
from experiments.lib import mfu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
  spec = importlib.util.spec_from_file_location("bench_mfu", os.path.join(ROOT, "experiments", "bench_mfu.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.exhaustive(reason="bench_mfu end to end (its FLOP count: the other tests of the file)")
def test_bench_prints_the_fields_on_a_tiny_model(capsys):
  result = _bench().main(["--config=configs/default.py:smoke", "--steps=1", "--repeats=1", "--replicas_per_device=2",
                          "--config.model.loss_chunk=8", "--json"])
  assert capsys.readouterr().out.strip().splitlines()[-1].startswith('{"benchmark": "bench_mfu"')
  assert result["platform"] == "cpu" and result["mfu"] is None and result["plain"]["mfu"] is None
  assert result["replicas"] == 2 and result["loss_chunk"] == 8
  assert result["tokens_per_step"] == 2 * result["batch_per_replica"] * result["seq_len"]
  for side in (result, result["plain"]):
    assert side["step_s"] > 0 and side["tokens_per_s"] == pytest.approx(side["tokens_per_step"] / side["step_s"])
    assert side["predicted_peak_bytes"] > 0
    assert side["peak_bytes_in_use"] is None  # XLA:CPU keeps no memory statistics
  # Two replicas hold twice the state: the mapped program's predicted peak must exceed the plain one's.
  assert result["predicted_peak_bytes"] > result["plain"]["predicted_peak_bytes"]
  cfg = model_lib.LlamaConfig(vocab_size=257, d_model=32, num_layers=1, num_heads=2, mlp_dim=64, max_seq_len=32)
  assert result["flops_per_token"] == model_lib.LlamaModel(cfg).flops_per_token(32)


def _small(**kw):
  return model_lib.LlamaConfig(**{**dict(vocab_size=257, d_model=64, num_layers=1, num_heads=4, mlp_dim=256,
                                         max_seq_len=32, attention="einsum"), **kw})


def test_flops_per_token_matches_a_count_by_matmul():
  cfg, L = _small(num_layers=3), 32
  D, F, V = cfg.d_model, cfg.mlp_dim, cfg.vocab_size
  forward_per_layer = 2 * (4 * D * D + 3 * D * F) + 2 * 2 * L * D  # projections, MLP; q·kᵀ and p·v
  forward = cfg.num_layers * forward_per_layer + 2 * D * V  # + the head
  assert model_lib.LlamaModel(cfg).flops_per_token(L) == 3 * forward


def test_flops_per_token_is_close_to_xla_cost_analysis():
  """3 × XLA's count of the compiled forward pass (one layer: no loop to undercount) within 5%."""
  cfg, B, L = _small(), 2, 32
  model = model_lib.Llama(cfg)
  tokens = jnp.zeros((B, L), jnp.int32)
  params = model.init(jax.random.key(0), tokens)["params"]
  cost = jax.jit(lambda p, t: model.apply({"params": p}, t)).lower(params, tokens).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  xla_per_token = 3 * cost["flops"] / (B * L)
  assert model_lib.LlamaModel(cfg).flops_per_token(L) == pytest.approx(xla_per_token, rel=0.05)


def test_peak_table():
  assert mfu.peak_flops("NVIDIA H100 80GB HBM3", "gpu") == 989e12
  assert mfu.peak_flops("NVIDIA H200", "gpu") == 989e12
  assert mfu.peak_flops("NVIDIA A100-SXM4-80GB", "gpu") == 312e12
  assert mfu.peak_flops("TPU v5 lite", "tpu") == 197e12
  assert mfu.peak_flops("TPU v5", "tpu") == 459e12
  assert mfu.peak_flops("TPU v4", "tpu") == 275e12
  assert mfu.peak_flops("cpu", "cpu") is None
  assert mfu.mfu(1000.0, 10 ** 9, 1e12, 2) == pytest.approx(0.5)
