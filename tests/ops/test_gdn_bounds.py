"""Every load and store of the GDN prefill kernels stays inside its tensor at Qwen3.5-27B's real shapes (16 key /
48 value heads, head dim 128, bf16, q/k/v slices of one conv output as benchmarks/gdn_prefill.py passes them) and
real lengths, where offsets are largest (int32 products overflow first there). The interpreter runs the kernels
with each masked access's addresses checked against the storages of the kernel's tensor arguments; only the first
and last two programs along each grid axis run (every offset is affine in the program ids, so they bound it)."""

import inspect

import numpy as np
import pytest
import torch

interpreter = pytest.importorskip("triton.runtime.interpreter")

from qwen_mtp.ops.gdn import chunked, gate_values  # noqa: E402

HK, HV, D = 16, 48, 128


def _inputs(length, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(1, length, 2 * HK * D + HV * D, generator=gen).to(torch.bfloat16)
    q, k, v = torch.split(mixed, [HK * D, HK * D, HV * D], dim=-1)
    q, k, v = q.view(1, length, HK, D), k.view(1, length, HK, D), v.view(1, length, HV, D)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    g, beta = gate_values(rand(1, length, HV), rand(1, length, HV).to(torch.bfloat16), rand(HV).abs(), rand(HV))
    return q, k, v, g, beta, rand(1, HV, D, D) * 0.1


@pytest.fixture
def accesses(monkeypatch):
    """Runs kernels on the edge programs of their grids and collects the accesses that leave their tensor."""
    if not chunked.triton_utils.INTERPRET:
        pytest.skip("needs the Triton interpreter")
    builder, executor = interpreter.InterpreterBuilder, interpreter.GridExecutor
    state = {"kernel": None, "storages": [], "outside": []}
    run_grid, load, store = executor.__call__, builder.create_masked_load, builder.create_masked_store

    def call(self, *args, **kwargs):
        names = list(inspect.signature(self.fn).parameters)
        tensors = [(n, a) for n, a in [*zip(names, args, strict=False), *kwargs.items()] if isinstance(a, torch.Tensor)]
        state["kernel"] = self.fn.__name__
        state["storages"] = [(n, t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for n, t in tensors]
        full = tuple(self.grid) + (1,) * (3 - len(self.grid))
        edges = [sorted({0, 1, n - 2, n - 1} & set(range(n))) for n in full]
        set_index, set_dims, grid = interpreter_builder.set_grid_idx, interpreter_builder.set_grid_dim, self.grid
        monkeypatch.setattr(interpreter_builder, "set_grid_idx", lambda x, y, z: set_index(*(
            e[i] for e, i in zip(edges, (x, y, z), strict=True))))  # fmt: skip
        monkeypatch.setattr(interpreter_builder, "set_grid_dim", lambda *dims: set_dims(*full))
        self.grid = tuple(len(e) for e in edges)
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            self.grid = grid
            monkeypatch.setattr(interpreter_builder, "set_grid_idx", set_index)
            monkeypatch.setattr(interpreter_builder, "set_grid_dim", set_dims)

    def check(kind, ptrs, mask):
        addresses = ptrs.data[mask.data.astype(bool)]
        if addresses.size == 0:
            return
        size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        lo, hi = int(addresses.min()), int(addresses.max()) + size
        inside = [n for n, start, nbytes in state["storages"] if start <= lo and hi <= start + nbytes]
        if not inside:
            state["outside"].append((state["kernel"], kind, lo, hi, state["storages"]))

    def checked_load(self, ptrs, mask, *rest):
        check("load", ptrs, mask)
        return load(self, ptrs, mask, *rest)

    def checked_store(self, ptrs, value, mask, *rest):
        check("store", ptrs, mask)
        return store(self, ptrs, value, mask, *rest)

    interpreter_builder = interpreter.interpreter_builder
    monkeypatch.setattr(executor, "__call__", call)
    monkeypatch.setattr(builder, "create_masked_load", checked_load)
    monkeypatch.setattr(builder, "create_masked_store", checked_store)
    return state["outside"]


def test_prefill_kernels_stay_inside_their_tensors_at_27b_shapes(accesses):
    chunked.gdn_chunked_triton(*_inputs(8192))
    assert accesses == []


def test_varlen_kernels_stay_inside_their_tensors_at_27b_shapes(accesses):
    """Two packed sequences of ragged lengths: chunk slots past the last chunk, padded rows past the end."""
    first, second = _inputs(4101, seed=1), _inputs(2085)
    packed = [torch.cat([a, b], dim=1) for a, b in zip(first[:5], second[:5], strict=True)]
    cu = torch.tensor([0, 4101, 4101 + 2085], dtype=torch.int32)
    chunked.gdn_chunked_varlen_triton(*packed, cu, torch.cat([first[5], second[5]]))
    assert accesses == []
