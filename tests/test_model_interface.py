"""Adding a model is one file plus its test: a second architecture, written here, trains end to end.

`TinyMLP` is deliberately unlike Llama (plain jax.numpy, no Flax, no attention: each token's vector
goes through a stack of residual tanh layers), so that passing here shows the trainer, the pipeline
and the summary reach a model only through models/base.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from noloco_jax import models
from noloco_jax import training
from noloco_jax.models import base
from noloco_jax.training import build as build_lib


@models.register
class TinyMLP(base.Model):
  arch = "test_tiny_mlp"
  stage_roles = {"embed": "first", "layers": "layers", "out": "last"}

  def __init__(self, vocab_size: int, d_model: int, num_layers: int, max_seq_len: int):
    self._vocab, self.d, self.num_layers, self._max_len = vocab_size, d_model, num_layers, max_seq_len

  @classmethod
  def resolve(cls, model_cfg, *, vocab_size, seq_len):
    return cls(model_cfg.vocab_size or vocab_size, model_cfg.d_model or 16, model_cfg.num_layers or 2,
               model_cfg.max_seq_len or seq_len)

  @classmethod
  def from_preset(cls, preset, *, vocab_size, seq_len):
    return cls(vocab_size, {"tiny": 16}[preset], 2, seq_len)

  def with_batch_axis(self, axis):
    return self  # nothing to pin: no activation outgrows a weight here

  @property
  def vocab_size(self):
    return self._vocab

  @property
  def max_seq_len(self):
    return self._max_len

  def init(self, rng, tokens_BxL):
    k1, k2, k3 = jax.random.split(rng, 3)
    V, D, n = self._vocab, self.d, self.num_layers
    return {"embed": {"table": 0.02 * jax.random.normal(k1, (V, D))},
            "layers": {"w": 0.02 * jax.random.normal(k2, (n, D, D)), "b": jnp.zeros((n, D))},
            "out": {"w": 0.02 * jax.random.normal(k3, (D, V))}}

  def embed(self, params, tokens_BxL):
    return params["embed"]["table"][tokens_BxL]

  def blocks(self, params, x_BxLxD):
    def layer(x, wb):
      w_DxD, b_D = wb
      return x + jnp.tanh(x @ w_DxD + b_D), None
    x_BxLxD, _ = jax.lax.scan(layer, x_BxLxD, (params["layers"]["w"], params["layers"]["b"]))
    return x_BxLxD

  def head(self, params, x_BxLxD):
    return (x_BxLxD @ params["out"]["w"]).astype(jnp.float32)

  def apply(self, params, tokens_BxL):
    return self.head(params, self.blocks(params, self.embed(params, tokens_BxL)))

  def num_params(self):
    V, D, n = self._vocab, self.d, self.num_layers
    return V * D + n * (D * D + D) + D * V

  def flops_per_token(self, seq_len):
    return 6.0 * (self.num_layers * self.d * self.d + self.d * self._vocab)  # no attention term


def _config(**fields):
  config = default.get_config("smoke")
  config.model.arch = TinyMLP.arch
  for key, value in fields.items():
    config[key] = value
  return config


def test_the_registry_names_the_new_model_and_rejects_unknown_ones():
  assert models.get("test_tiny_mlp") is TinyMLP and "llama" in models.archs()
  with pytest.raises(ValueError, match="config.model.arch='nope' is not a registered model; valid: .*llama"):
    models.get("nope")


def test_num_params_counts_what_init_builds():
  model = TinyMLP.from_preset("tiny", vocab_size=11, seq_len=8)
  params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  assert sum(x.size for x in jax.tree.leaves(params)) == model.num_params()


def test_a_second_model_trains_end_to_end_with_noloco(tmp_path):
  result = training.train_and_evaluate(_config(), str(tmp_path))
  evals = result["history"]["eval"]
  assert result["model/num_params"] == TinyMLP(257, 32, 1, 32).num_params()  # the smoke sizes: d 32, 1 layer
  assert np.isfinite(evals[-1]["eval/loss"]) and evals[-1]["eval/loss"] < evals[0]["eval/loss"]
  assert result["comm/collective_operand_bytes_per_replica"] > 0  # NoLoCo rounds ran


def test_the_pipeline_cuts_the_new_model_by_its_stage_roles():
  """Two stages, fixed routing: the pipelined loss equals the model's own loss on the same weights."""
  config = _config(num_replicas=4, num_stages=2)
  config.model.num_layers = 2
  setup = build_lib.build(config, vocab_size=257)
  state = setup.init_state()
  batch = np.random.default_rng(0).integers(0, 257, size=(8, config.data.seq_len + 1)).astype(np.int32)
  pipelined = np.asarray(setup.eval_step(state.params, batch))
  params = jax.tree.map(lambda x: np.asarray(x)[0], state.params)
  logits = setup.model.apply(params, batch[:, :-1])
  logp = jax.nn.log_softmax(logits, axis=-1)
  direct = -np.mean(np.take_along_axis(np.asarray(logp), batch[:, 1:, None], axis=-1))
  np.testing.assert_allclose(pipelined, np.full(4, direct), rtol=1e-5)
