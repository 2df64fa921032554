"""Sparse methods, one file each; importing this package registers them all."""

from sglang_sparse.methods import dense, quest, snapkv  # noqa: F401
