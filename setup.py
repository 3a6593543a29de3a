"""Installs noloco_jax. CPU jax by default; see docs/install.md for the CUDA and TPU installs.

The core install has no TensorFlow: TensorBoard event files are written by the `tensorboard`
package's own writer, the embedded corpus is built and read as a TFDS array_record dataset without
TensorFlow, and input pipelines run on Grain. Plotting (experiments/*.py) is the `plots` extra; the
ablation notebooks also need a kernel and a runner: the `test` extra.
"""
import setuptools

setuptools.setup(
    name="noloco_jax",
    version="0.1.0",
    description="NoLoCo (no-all-reduce low-communication training) in JAX/Flax, with DiLoCo and DDP baselines.",
    # configs/ and experiments/ (config files, the benchmarks and their library, the notebooks' helpers)
    # are packages of the checkout too, so that scripts, notebooks and tests import them by name.
    packages=setuptools.find_packages(include=["noloco_jax", "noloco_jax.*", "configs", "experiments",
                                               "experiments.*"]),
    python_requires=">=3.11",  # Tested: 3.11 with jax 0.10 and 3.13 with jax 0.12 (CI); docs/install.md.
    install_requires=[
        "jax>=0.10,<0.13",
        "flax>=0.12,<0.13",
        "optax>=0.2.5,<0.3",
        "orbax-checkpoint>=0.12,<0.13",
        "ml-collections>=1.0,<2",
        "absl-py>=2",
        # clu.parameter_overview only (io/metrics.py); 0.0.12's own imports are flax, jax, numpy, absl, etils
        # and wrapt. Its metric writers, which import TensorFlow, are not used (io/writers.py).
        "clu==0.0.12",
        "tensorboard>=2.16",  # Its event-file writer only; it needs no TensorFlow (io/metrics.py).
        "tensorflow-datasets>=4.9.7,<5",  # Without TensorFlow: array_record builds and data sources.
        "array-record>=0.8.1",
        "grain>=0.2.12,<0.3",
        "numpy>=1.26",
        "pyarrow>=14",
        "sentencepiece>=0.2",
    ],
    extras_require={
        "plots": ["matplotlib>=3.8"],
        # safetensors (the reference reader of the export), tokenizers (the byte tokenizer's file) and wandb
        # (its writer's test, offline) are small; transformers and torch, which the export's strongest test
        # loads, are not installed here (docs/after_a_run.md: pip install transformers 'torch==2.13.0').
        "test": ["pytest>=8", "pytest-xdist>=3.5", "nbclient>=0.10", "nbformat>=5.9", "ipykernel>=6.29",
                 "matplotlib>=3.8", "safetensors>=0.4", "tokenizers>=0.19", "wandb>=0.17", "etcd3gw>=2.7"],
        "hf": ["tokenizers>=0.19", "huggingface_hub>=0.23"],
        "export": ["tokenizers>=0.19"],  # python -m noloco_jax.export_hf: the tokenizer.json of the byte tokenizer
        "wandb": ["wandb>=0.17"],  # --config.wandb.project=...: the Weights & Biases writer (io/writers.py)
        # --control=etcd://...: the asynchronous schedule's replicated control plane (asynchronous/etcd_kv.py).
        # etcd3gw speaks etcd's v3 JSON gateway over HTTP (requests): no grpcio or protobuf of its own to meet
        # JAX's; maintained by OpenStack; docs/async.md §5 says why it was chosen.
        "etcd": ["etcd3gw>=2.7"],
    },
)
