"""tpurec: TorchRec on TPU. Metadata lives in pyproject.toml; this file exists for legacy tooling."""

from setuptools import setup

setup()
