from setuptools import find_packages, setup

setup(
    name="nmst-fast",
    version="0.1.0",
    description="Fused, memory-lean losses for non-monotonic self-terminating language models",
    packages=find_packages(include=["nmst_fast", "nmst_fast.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.5", "numpy", "tqdm"],
    extras_require={
        "triton": ["triton>=3.0"],
        "hf": ["transformers>=4.45"],
        "train": ["matplotlib>=3.5", "transformers>=4.45", "tokenizers"],
        "hub": ["datasets"],  # --dataset: WikiText from the Hugging Face hub (network)
        "test": ["pytest", "pytest-xdist", "scipy", "triton>=3.0", "transformers>=4.45", "matplotlib>=3.5", "peft",
                 "accelerate", "tokenizers"],
        "bench": ["pytest-benchmark", "tqdm"],
    },
)
