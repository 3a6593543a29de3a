"""Damaging a copy of a finished run's checkpoint the ways a disk or a hand does, for the tests of the tools
that read checkpoints after a run (export_hf, sample): each damage is one a resume detects."""

import json
import os
import shutil


def damage(workdir: str, step: int, how: str) -> None:
  """`state`: 8 bytes flipped in the middle of the step's largest array file (read without complaint by
  orbax: only the checksums stored at save time catch it); `meta`: an edited value in its meta record."""
  if how == "state":
    data = os.path.join(workdir, "checkpoints", str(step), "state", "ocdbt.process_0", "d")
    biggest = max((os.path.join(data, n) for n in os.listdir(data)), key=os.path.getsize)
    with open(biggest, "r+b") as f:
      f.seek(os.path.getsize(biggest) // 2)
      original = f.read(8)
      f.seek(os.path.getsize(biggest) // 2)
      f.write(bytes(255 - b for b in original))
  else:
    path = os.path.join(workdir, "checkpoints", str(step), "meta", "metadata")
    with open(path) as f:
      meta = json.load(f)
    meta["comm_bytes"] += 1
    with open(path, "w") as f:
      json.dump(meta, f)


def copy_run(finished_run, tmp_path) -> str:
  return str(shutil.copytree(finished_run, tmp_path / "run"))
