"""The document source named by `config.data.source`: stdlib | tfds | c4_json | parquet | text.

The interface and helpers every source shares are in documents.py; the sources
are in tfds_sources.py (the embedded corpus, TFDS datasets) and file_sources.py (C4 JSON, Parquet,
text files). Heavy readers are imported only by the source that needs them: Grain's TFRecord
reader inside TfdsSource, pyarrow inside ParquetSource; this module only pulls in tensorflow_datasets
(via the embedded corpus's builder, about 0.3 s), which does not import TensorFlow.
"""

from noloco_jax.config.data import SOURCES
from noloco_jax.io.data import file_sources
from noloco_jax.io.data import tfds_sources
from noloco_jax.io.data.documents import Source


def make_source(config_data, split: str) -> Source:
  """The source named by `config_data.source`, for split "train" or "eval"."""
  kind = config_data.source
  if kind == "stdlib":
    return tfds_sources.StdlibSource(config_data.data_dir, "train" if split == "train" else "validation")
  if kind == "tfds":
    return tfds_sources.TfdsSource(config_data, _split_name(config_data, split))
  if kind == "c4_json":
    return file_sources.C4JsonSource(config_data.path, _split_name(config_data, split),
                                     config_data.text_field)
  if kind == "parquet":
    field = "train_files" if split == "train" else "eval_files"
    return file_sources.ParquetSource(config_data[field], field, config_data.parquet_ids_field,
                                      config_data.parquet_mask_field)
  if kind == "text":
    field = "train_files" if split == "train" else "eval_files"
    return file_sources.TextSource(config_data[field], field)
  raise ValueError(f"config.data.source={kind!r} is unknown; valid: {', '.join(SOURCES)}.")


def _split_name(config_data, split: str) -> str:
  return config_data.train_split if split == "train" else config_data.eval_split
