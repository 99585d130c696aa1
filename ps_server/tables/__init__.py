"""Sparse embedding tables on one server: the table, its hash index, compiled kernels, per-row optimizers,
sync mode and files. No wire.
"""
