"""Installs noloco_jax. CPU jax by default; see README.md for the CUDA and TPU installs."""
import setuptools

setuptools.setup(
    name="noloco_jax",
    version="0.1.0",
    description="NoLoCo (no-all-reduce low-communication training) in JAX/Flax, with DiLoCo and DDP baselines.",
    packages=setuptools.find_packages(include=["noloco_jax", "noloco_jax.*"]),
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.7.1,<0.11",
        "flax>=0.10,<0.13",
        "optax>=0.2.4,<0.3",
        "orbax-checkpoint>=0.11,<0.13",
        "ml-collections>=1.0,<2",
        "clu>=0.0.12",
        # clu's metric writers and periodic actions import TensorFlow and TensorBoard. The CPU build
        # keeps TensorFlow off the accelerators that JAX owns (we also hide GPUs from it at start-up).
        "tensorflow-cpu>=2.16,<2.22",
        "tensorboard>=2.16",
        "tensorflow-datasets>=4.9.7,<5",
        "importlib_resources>=6",  # imported by tensorflow-datasets' `tfds build` but not declared by it
        "numpy>=1.26",
        "pyarrow>=14",
        "sentencepiece>=0.2",
        "matplotlib>=3.8",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-xdist>=3.5", "nbclient>=0.10", "nbformat>=5.9", "ipykernel>=6.29"],
        "hf": ["tokenizers>=0.19", "huggingface_hub>=0.23"],
    },
)
