"""configs/paper.py: the paper's grid validates, has the paper's hyperparameters and model sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import paper
from noloco_jax import config as config_lib
from noloco_jax.models import llama as model_lib

GRID = paper.grid()


def test_grid_is_every_row_method_and_dataset_once():
  assert len(GRID) == len(paper.ROWS) * 3 * 2 == 48
  names = paper.grid_names()
  assert len(names) == 48
  assert "small-16gpu-dp8-pp2-noloco-c4" in names and "large-64gpu-dp16-pp4-ddp-reddit" in names


@pytest.mark.parametrize("arg", GRID)
def test_every_grid_config_validates_with_the_papers_settings(arg):
  cfg = paper.get_config(arg)
  config_lib.validate(cfg)
  o = paper._parse(arg)  # pylint: disable=protected-access
  size = paper.SIZES[o["model"]]
  assert cfg.num_replicas == o["dp"]
  # Every GPU of the row is used: DP replicas × (stages × fsdp) devices each.
  assert cfg.num_replicas * cfg.num_stages * cfg.fsdp == o["gpus"]
  assert cfg.num_replicas * cfg.data.batch_size * cfg.data.seq_len == size["batch_tokens"]
  assert cfg.data.seq_len == 1024 and cfg.num_steps == 25_000
  assert (cfg.inner.optimizer, cfg.inner.lr, cfg.inner.warmup_steps, cfg.inner.min_lr_ratio,
          cfg.inner.weight_decay, cfg.inner.grad_clip) == ("adam", size["lr"], 1000, 0.1, 0.0, 1.0)
  assert (cfg.model.dtype, cfg.model.preset) == ("bfloat16", o["model"])
  outer = cfg.outer
  if o["method"] == "noloco":
    assert (outer.kind, outer.rule.outer_momentum, outer.rule.outer_lr, outer.rule.consensus_weight, outer.rule.group_size,
            outer.inner_steps) == (
        "noloco", 0.5, 0.7, 0.7, 2, 50)
  elif o["method"] == "diloco":
    assert (outer.kind, outer.rule.outer_momentum, outer.rule.outer_lr, outer.inner_steps, outer.rule.nesterov) == (
        "diloco", 0.3, 0.7, 100, False)
  else:
    assert outer.kind == "ddp"


def test_pp_as_fsdp_puts_a_replicas_devices_on_fsdp():
  cfg = paper.get_config("model=large,gpus=64,dp=16,pp=4,method=noloco,data=c4,pp_as=fsdp")
  config_lib.validate(cfg)
  assert (cfg.num_replicas, cfg.num_stages, cfg.fsdp) == (16, 1, 4)
  # 128 sequences per replica, 32 per device, accumulated 8 at a time.
  assert cfg.data.batch_size // (cfg.fsdp * cfg.inner.microbatches) == paper.SIZES["large"]["device_seqs"]


def test_bad_arguments_name_what_is_valid():
  with pytest.raises(ValueError, match="method"):
    paper.get_config("method=fsdp")
  with pytest.raises(ValueError, match="multiple of dp"):
    paper.get_config("gpus=12,dp=8")


@pytest.mark.parametrize("preset,data", [(m, d) for m in ("small", "medium", "large") for d in paper.DATASETS])
def test_parameter_count_matches_an_abstract_init(preset, data):
  cfg = paper.get_config(f"model={preset},data={data}")
  model_cfg = model_lib.resolve_config(cfg.model, vocab_size=cfg.model.vocab_size, seq_len=cfg.data.seq_len)
  # jax.eval_shape: shapes only, nothing allocated (the large model is 9.6B parameters).
  shapes = jax.eval_shape(model_lib.Llama(model_cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  counted = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
  assert counted == model_lib.num_params(model_cfg)
  # docs/method.md §10: ≈310M / 2.14B / 9.64B with the reference's 128,002-token vocabulary.
  expected = {"small": 310e6, "medium": 2.14e9, "large": 9.64e9}[preset]
  assert abs(counted - expected) / expected < 0.01
