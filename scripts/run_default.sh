#!/usr/bin/env bash
# The default job: 8 replicas of a tiny Llama trained with NoLoCo on the embedded standard-library
# corpus, on CPU. Extra arguments go to noloco_jax.main, e.g. --config.outer.kind=diloco.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python -m noloco_jax.main --config=configs/default.py --workdir="${WORKDIR:-runs/default}" "$@"
