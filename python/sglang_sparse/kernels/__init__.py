"""Kernels for the sparse hot paths.

``reference`` holds the plain-torch definitions (any device); faster implementations (Triton,
``sgl_kernel_sparse``) are checked against them. Engine-agnostic: no ``sglang`` import.
"""
