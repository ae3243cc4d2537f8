"""sigmoid, silu and softplus for the CPU references, with `invariant` for the decode path: every element rounds
the same way wherever it sits in its tensor, so a request's numbers do not depend on its batch or on T.

torch's CPU kernels run an elementwise function as a vector loop over the flattened tensor, 2 x the SIMD width
of elements a step (Sleef and a vector formula), and hand the last few elements to a scalar loop (libm and the
scalar formula). For sigmoid, silu and softplus the two loops round differently (AVX-512, fp32: 4%, 4% and 10%
of a million random inputs, by an ulp). Which elements land in the tail depends on the tensor's size, so the GDN
gates of a request (`Hv` values a token) rounded one way alone and another in a batch of 8 or in a verify
step: ~1e-6 differences in MTP-on vs MTP-off logprobs. Above 32768 elements torch also splits the loop over
threads at size-dependent points. exp, log, log1p, rsqrt (fp32), sqrt, tanh, cos and sin measured identical in
both loops.

`invariant=True` runs the function over a strided copy of x: the vector loop needs unit strides, so every
element takes the scalar loop, whatever the size, the thread split or the machine's SIMD width. That is also
what a 1-token decode of one request computes for its small tensors (fewer elements than one vector step).
Decode-sized tensors cost microseconds more; prefill keeps torch's plain call (`invariant=False`), which is
what Hugging Face computes, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _scalar_loop(function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """function(x) with every element through torch's scalar loop: x's values at a stride of 2 elements."""
    spread = x.new_empty(*x.shape, 2)
    spread[..., 0] = x
    return function(spread[..., 0])  # a new contiguous tensor


def sigmoid(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    return _scalar_loop(torch.sigmoid, x) if invariant else torch.sigmoid(x)


def silu(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    return _scalar_loop(F.silu, x) if invariant else F.silu(x)


def softplus(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    return _scalar_loop(F.softplus, x) if invariant else F.softplus(x)
