"""The kernel order `triton_utils.STATE_READS_BEFORE_THE_WAIT` relies on: under programmatic dependent launch the
GDN delta rule and the conv update (its multi-token kernel) read their pool slot before waiting for the kernel just
before them, which is safe only if that kernel never writes the pool. Recorded here from the ops a decode and a
verify step dispatch (bf16 and FP8 checkpoints, the one-GEMM layout CUDA runs), views left out (they launch
nothing)."""

import pytest
from helpers import cpu_engine, random_prompt
from torch.utils._python_dispatch import TorchDispatchMode

from qwen_mtp import SamplingParams
from qwen_mtp.ops import triton_utils

VIEWS = {"view", "_unsafe_view", "reshape", "split", "split_with_sizes", "slice", "select", "transpose", "t",
         "unsqueeze", "squeeze", "expand", "as_strided", "alias", "detach", "permute", "unbind"}  # fmt: skip


class OpOrder(TorchDispatchMode):
    """The ops dispatched (namespace, name), views left out."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, name = func.namespace, func.__name__.split(".")[0]
        if name not in VIEWS:
            self.ops.append((namespace, name))
        return func(*args, **(kwargs or {}))


MODELS = [("tiny", "float32", "none"), ("tiny-fp8", "bfloat16", "fp8-block")]


@pytest.mark.parametrize(("preset", "dtype", "quant"), MODELS)
@pytest.mark.parametrize("k", [0, 2])
def test_the_kernel_before_each_state_reader_does_not_write_its_pool(checkpoint, preset, dtype, quant, k):
    engine = cpu_engine(checkpoint(preset, "text", dtype=dtype), k or None, quant)
    engine.model.use_one_gemm()
    engine.submit(random_prompt(9, seed=3), SamplingParams(6, ignore_eos=True))
    engine.step()  # the prefill
    with OpOrder() as order:
        while engine.has_unfinished():
            engine.step()
    ops = order.ops
    readers = [i for i, (ns, name) in enumerate(ops) if ns == "qwen_mtp" and name in ("gdn_recurrent", "conv_update")]
    assert sum(ops[i][1] == "gdn_recurrent" for i in readers) >= 3  # decode (or verify) steps of every GDN layer
    for i in readers:
        before = ops[i - 1]
        if ops[i][1] == "gdn_recurrent":
            assert before == ("qwen_mtp", "conv_update"), ops[i - 3 : i + 1]
        else:  # the input projection
            assert before[0] == "qwen_mtp" and before[1].startswith("linear"), ops[i - 3 : i + 1]
    assert {"gdn_recurrent_rows", "conv_update_window"} == set(triton_utils.STATE_READS_BEFORE_THE_WAIT)
