"""Data for noloco_jax: corpora, tokenizers, packing, per-replica sharding, resumable iterators.

The trainer's interface:

    tok = data.make_tokenizer(config.data)
    data.validate(config.data, model_max_seq_len, vocab_size)      # before compiling anything
    spec, tok = data.validate_with_tokenizer(config.data)           # paths and tokenizer, before the model
    data.check_against_model(spec, tok, model_max_seq_len, vocab_size)
    it = data.make_train_iterator(config.data, seed=..., replica_ids=..., num_replicas=...,
                                  vocab_size=...)                   # next(it): [R_local, B, L+1] int32
    state = it.get_state(); it.set_state(state); it.close()
    eval_BxExL1 = data.make_eval_batches(config.data, seed=..., vocab_size=...)

Modules, one job each: spec (checks of config.data against files and tokenizer; the record,
DataSpec, is in noloco_jax/config/data.py), tokenizer, documents (the Source interface
and shared helpers), tfds_sources / file_sources (the sources), sources (the one picked by
config.data.source), stdlib_builder (the embedded TFDS corpus), packing (tokens and caches),
streams (one replica's sequences as a Grain dataset), iterator (Grain pipelines per replica,
stacked and prefetched), train_spm (CLI).
"""

from noloco_jax.io.data.iterator import make_eval_batches
from noloco_jax.io.data.iterator import make_train_iterator
from noloco_jax.io.data.iterator import TrainIterator
from noloco_jax.io.data.spec import DataSpec
from noloco_jax.io.data.spec import check_against_model
from noloco_jax.io.data.spec import validate
from noloco_jax.io.data.spec import validate_with_tokenizer
from noloco_jax.io.data.tokenizer import make_tokenizer

__all__ = ["DataSpec", "TrainIterator", "check_against_model", "make_eval_batches", "make_train_iterator",
           "make_tokenizer", "validate", "validate_with_tokenizer"]
