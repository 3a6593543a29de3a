"""The config schema: one typed section per part of the config, each owning its defaults, comments
and validation; the checks across sections in one place (checks.py).

| config.   | section                          | module        |
|-----------|----------------------------------|---------------|
| (top)     | seed, steps, layout, logging     | run.py        |
| model     | which model, size, precision     | model.py      |
| data      | corpus, tokenizer, batch shape   | data.py       |
| inner     | the inner optimizer              | inner.py      |
| outer     | the outer method, H, its rule,   | outer.py      |
|           | codec, overlap, async schedule   |               |
| checkpoint| what is kept, warm start         | checkpoint.py |
| pipeline  | micro-batches between stages     | pipeline.py   |
| wandb     | the optional W&B writer          | wandb.py      |

Config files (configs/*.py) stay ml_collections files: configs/default.py builds its ConfigDict from
these defaults (`default_config_dict`), so `--config.outer.kind=diloco` works as before. `validate`
reads a ConfigDict into the frozen records (missing fields take their defaults, old field names are
mapped with a warning, an unknown field is an error suggesting the nearest one), checks every section
and then the sections against each other, and returns the ConfigDict the trainer reads.

This package imports nothing else from noloco_jax: the allowed values (dtypes, routings, ...) are
declared here and the implementation modules take them from here; registries add theirs at run time (the
outer methods, noloco_jax/outer/methods/, registered when the package is imported; the models).
"""

import ml_collections

from noloco_jax.config.checks import check_across_sections, check_stability
from noloco_jax.config.data import DataSpec
from noloco_jax.config.fields import ConfigError, Section
from noloco_jax.config.run import Config


def load(config) -> Config:
  """The typed, validated config from a ConfigDict (or dict): every section, the checks across them, and the
  outer method's stability analysis (refused unless outer.allow_unstable); raises ConfigError (one line). A
  typed config is returned as it is: whoever made it has checked it."""
  if isinstance(config, Config):
    return config
  record = Config.parse(config)
  check_across_sections(record)
  check_stability(record)
  return record


def validate(config) -> ml_collections.ConfigDict:
  """`load(config)` as a ConfigDict: every field present, under its current name. What train.build reads."""
  return load(config).to_config_dict()


def default_config_dict() -> ml_collections.ConfigDict:
  """Every field at its default, the per-kind outer fields unset (resolved from the kind's paper values
  by `validate`: config/outer.py), plus unset placeholders for the old names of renamed fields (so that
  `--config.outer.lr=...` still parses): the base of configs/default.py."""
  return Config().to_config_dict(for_config_file=True)


__all__ = ["Config", "ConfigError", "DataSpec", "Section", "default_config_dict", "load", "validate"]
