"""Kernels, one module per op: argument validation, dispatch (CuPy / Numba / torch reference).

Each op's torch reference lives in its module and is what runs without a GPU and what tests
compare the GPU kernels against. Must not import engine, cache or request types.
"""
