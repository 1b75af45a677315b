from setuptools import find_packages, setup

setup(
    name="megatron-deepspeed-plugins",
    version="0.1.0",
    license="Apache-2.0",
    description="Shared-memory node loader, hierarchical ZeRO-3 and Flash-Overlap TP linears for megatron-core + DeepSpeed",
    packages=find_packages(
        include=[
            "mdsp_base",
            "mdsp_base.*",
            "deepspeed_ext",
            "deepspeed_ext.*",
            "megatron_ext",
            "megatron_ext.*",
        ]
    ),
    # The model and DeepSpeed presets (scripts/presets links here): the recommendation CLI reads them in a wheel too.
    package_data={"mdsp_base": ["presets/*.args", "presets/*.json", "presets/upstream/*"]},
    python_requires=">=3.11",  # enum.StrEnum
    # torch is pinned by the set-up script before this installs; a range here must admit that build.
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.19,<0.20",
        "megatron-core>=0.16,<0.17",
        "pydantic>=2.7",
        "numpy",
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "ruff>=0.6",
            "mypy==1.13.0",
            "matplotlib",
            "tensorboard",
        ],
        # What upstream Megatron-LM / Megatron-DeepSpeed pretrain_gpt.py import (and their dataset
        # helper's build) beyond the suite: the upstream training tests and python -m megatron_ext.launch.
        "upstream": ["transformers", "pyyaml", "triton", "pybind11", "nltk", "six"],
    },
)
