"""An empty corpus says so (issue 18 item 12): 'no tokens in FILE', and no empty cache file is kept.

Array mode (the text default) used to fail with "cannot mmap an empty file" and keep a 0-byte cache;
stream mode already said the data is empty, and is checked here too."""

import os

import pytest

from noloco_jax.io import data
from test_data_sources import data_config, write_texts


@pytest.mark.parametrize("mode, message", [("array", "no tokens in .*empty.txt"), ("stream", "data is empty")])
def test_an_empty_text_file_fails_with_no_tokens_and_leaves_no_cache(tmp_path, mode, message):
  glob_ = write_texts(tmp_path / "t", {"empty.txt": ""})
  cache = tmp_path / "cache"
  c = data_config(source="text", train_files=glob_, eval_files=glob_, data_dir=str(cache), seq_len=3,
                  batch_size=1, prefetch=0, mode=mode)
  for _ in range(2):  # the second attempt must not trip over anything the first one left
    with pytest.raises(ValueError, match=message):
      with data.make_train_iterator(c, seed=0, replica_ids=[0], num_replicas=1, vocab_size=257) as it:
        next(it)
  left = [os.path.join(d, f) for d, _, files in os.walk(cache) for f in files if not f.endswith(".lock")]
  assert [f for f in left if os.path.getsize(f) == 0] == []
