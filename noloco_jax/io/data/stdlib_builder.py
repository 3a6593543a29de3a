"""The embedded corpus: a TFDS dataset of the running Python's standard-library `.py` sources.

Every machine with Python has it, so the default job and the tests never download anything.
One record per file: `{"path": relative path, "text": source text}`.

Why these choices:
- The builder config is named after the Python version and a hash of the file list
  (`py3.11.7-1a2b3c4d`), so two interpreters sharing one data dir never read each other's build.
- The split is a hash of the relative path (3% validation): stable across machines and builds,
  independent of the order in which the file system lists the files.
- Stored as array_record and read with `tfds.data_source`: random access, no TensorFlow graph.
- Built on first use under a file lock, so concurrent processes build it once.
"""

import hashlib
import os
import platform
import sysconfig

from absl import logging
from etils import epath
import tensorflow_datasets as tfds

from noloco_jax.io.data import locking
from noloco_jax.io.data.spec import resolve_data_dir

VALIDATION_PERCENT = 3  # Share of files (by path hash) held out for validation.
_EXCLUDED_DIRS = ("site-packages", "dist-packages")  # Third-party code is not the standard library.


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def list_stdlib_files(root: str | None = None) -> list[str]:
  """Sorted relative paths of the standard library's `.py` files (third-party dirs excluded)."""
  root = root or stdlib_root()
  paths = []
  for dirpath, dirnames, filenames in os.walk(root):
    # Pruning in place keeps os.walk out of the excluded trees altogether.
    dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS and d != "__pycache__")
    for name in filenames:
      if name.endswith(".py"):
        paths.append(os.path.relpath(os.path.join(dirpath, name), root))
  return sorted(paths)


def split_of(relpath: str) -> str:
  """'validation' for about VALIDATION_PERCENT % of paths, else 'train'; a pure function of the path."""
  bucket = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big") % 100
  return "validation" if bucket < VALIDATION_PERCENT else "train"


def _file_list_hash(root: str, paths: list[str]) -> str:
  """Hash of (path, size) of every file: a different or patched stdlib gets a fresh build."""
  h = hashlib.sha256()
  for p in paths:
    h.update(p.encode("utf-8"))
    h.update(str(os.path.getsize(os.path.join(root, p))).encode())
  return h.hexdigest()


def _current_config() -> tfds.core.BuilderConfig:
  root = stdlib_root()
  paths = list_stdlib_files(root)
  list_hash = _file_list_hash(root, paths)
  version = platform.python_version()
  return tfds.core.BuilderConfig(
      name=f"py{version}-{list_hash[:8]}",
      description=(
          f"Python {version} ({platform.python_implementation()}) standard library at {root}: "
          f"{len(paths)} .py files, file-list sha256 {list_hash}."
      ),
  )


class NolocoStdlib(tfds.core.GeneratorBasedBuilder):
  """Python standard-library sources, split train/validation by a hash of the path."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First release: non-empty .py files, 3% validation by path hash."}
  BUILDER_CONFIGS = [_current_config()]
  # TFDS derives this from the module path through `importlib_resources`, a package that tfds 4.9
  # imports on Python >= 3.11 without declaring it; the plain path is all it needs.
  code_path = epath.Path(__file__)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=self.builder_config.description,
        features=tfds.features.FeaturesDict({
            "path": tfds.features.Text(),
            "text": tfds.features.Text(),
        }),
        # The description carries the Python version and file-list hash (see _current_config);
        # metadata adds what only the generation knows: counts of undecodable files.
        metadata=tfds.core.MetadataDict(),
        homepage="https://docs.python.org/3/library/",
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download: the corpus is on this machine.
    root = stdlib_root()
    paths = list_stdlib_files(root)
    self.info.metadata["python_version"] = platform.python_version()
    self.info.metadata["stdlib_root"] = root
    self.info.metadata["file_list_sha256"] = _file_list_hash(root, paths)
    self.info.metadata["num_files"] = len(paths)
    self.info.metadata["num_non_utf8_files"] = 0
    self.info.metadata["num_empty_files_skipped"] = 0
    by_split = {"train": [], "validation": []}
    for p in paths:
      by_split[split_of(p)].append(p)
    return {name: self._generate_examples(root, ps) for name, ps in by_split.items()}

  def _generate_examples(self, root, paths):
    bad, empty = [], 0
    for p in paths:
      with open(os.path.join(root, p), "rb") as f:
        raw = f.read()
      if not raw.strip():
        # Dozens of empty `__init__.py`: no text, so no record (counted in the metadata).
        empty += 1
        continue
      try:
        text = raw.decode("utf-8")
      except UnicodeDecodeError:
        # A handful of test fixtures are Latin-1/KOI8-R on purpose. Keep them, with the bad bytes
        # replaced, and say so: counted here, logged, and stored in the dataset metadata.
        text = raw.decode("utf-8", errors="replace")
        bad.append(p)
      yield p, {"path": p, "text": text}
    self.info.metadata["num_empty_files_skipped"] += empty
    if bad:
      self.info.metadata["num_non_utf8_files"] += len(bad)
      logging.warning("noloco_stdlib: %d file(s) are not UTF-8, bad bytes replaced by U+FFFD: %s",
                      len(bad), ", ".join(bad))


def prepare(data_dir: str = "") -> NolocoStdlib:
  """Returns the builder for this Python's stdlib corpus, building it first if needed.

  Safe to call from several processes at once: the first one builds under a lock, the others wait
  and then find it built.
  """
  data_dir = resolve_data_dir(data_dir)
  config_name = NolocoStdlib.BUILDER_CONFIGS[0].name
  builder = NolocoStdlib(data_dir=data_dir, config=config_name, file_format="array_record")
  if builder.is_prepared():
    return builder
  with locking.file_lock(os.path.join(data_dir, f".noloco_stdlib-{config_name}.lock")):
    # A fresh builder: the one above read the directory before we held the lock.
    builder = NolocoStdlib(data_dir=data_dir, config=config_name, file_format="array_record")
    if not builder.is_prepared():
      logging.info("Building the standard-library corpus %s into %s", config_name, data_dir)
      builder.download_and_prepare(
          download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  return NolocoStdlib(data_dir=data_dir, config=config_name, file_format="array_record")
