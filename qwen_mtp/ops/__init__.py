"""Compute ops, one file each: a plain-PyTorch `reference` that runs anywhere (and is the documentation of the
math); Triton kernels will sit beside their reference and must equal it."""
