"""Fake cuda-python (see tests/fake_gpu/README.md)."""
