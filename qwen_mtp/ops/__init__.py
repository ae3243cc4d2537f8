"""Compute ops, one file (or folder, `gdn/`) each: a plain-PyTorch reference that runs anywhere and is the
documentation of the math, the Triton kernel beside it that must equal it, and the torch custom op that runs the
reference on CPU and the kernel on CUDA (`backend.py` forces the references there too). `@triton.jit` helpers
that several kernels share are written once, in `triton_helpers.py`."""
