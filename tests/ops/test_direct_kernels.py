"""`ops.backend.DirectKernels`: eager inference calls of an op run its device implementation without the dispatcher;
everything else (autograd, compile, other devices) keeps the dispatcher. The device is CPU here (a toy op with a CPU
kernel); on CUDA every qwen_mtp op is the same class with its CUDA kernel."""

from __future__ import annotations

import inspect

import torch
from torch.profiler import ProfilerActivity, profile

import qwen_mtp.engine.engine  # noqa: F401  (registers every qwen_mtp op)
from qwen_mtp.ops.backend import OPS, DirectKernels, device_kernel


@torch.library.custom_op("qwen_mtp_test::double", mutates_args=())
def double(x: torch.Tensor, times: int = 2) -> torch.Tensor:
    return x * times


@device_kernel(double, "cpu")
def _(x, times=2):
    return x * times


@double.register_fake
def _(x, times=2):
    return x.new_empty(x.shape)


def dispatched(fn) -> bool:
    """Whether calling fn entered the dispatcher for the toy op (the profiler records an op call there)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return any(event.name == "qwen_mtp_test::double" for event in prof.events())


def test_an_inference_call_runs_the_kernel_directly_with_the_same_result():
    x = torch.arange(4.0)
    with torch.inference_mode():
        assert not dispatched(lambda: double(x))
        assert torch.equal(double(x), x * 2) and torch.equal(double(x, 3), x * 3)
    assert dispatched(lambda: double(x))  # outside inference mode: the dispatcher (autograd may need it)
    assert dispatched(lambda: torch.ops.qwen_mtp_test.double(x))


def test_autograd_and_compile_keep_the_dispatcher():
    x = torch.arange(4.0, requires_grad=True)
    double.register_autograd(lambda ctx, grad: (grad * 2, None))
    (grad,) = torch.autograd.grad(double(x).sum(), x)
    assert torch.equal(grad, torch.full((4,), 2.0))
    graphs = []

    def backend(graph, inputs):  # what dynamo traced: the op itself, not its kernel's body
        graphs.append(graph)
        return graph.forward

    compiled = torch.compile(lambda t: double(t) + 1, backend=backend, fullgraph=True)
    with torch.inference_mode():
        assert torch.equal(compiled(x.detach()), x.detach() * 2 + 1)
    assert "qwen_mtp_test.double" in graphs[0].code


def test_every_op_with_a_cuda_kernel_calls_it_with_the_schema_arguments():
    """A direct call skips the schema's defaults and names: each CUDA kernel must take the very arguments (names,
    order, defaults) of its op's schema."""
    ops = {name: getattr(torch.ops.qwen_mtp, name) for name in OPS}
    for name in sorted(OPS):
        op = next(obj for obj in _custom_ops() if obj._name == name)
        assert isinstance(op, DirectKernels), name
        schema = ops[name].default._schema
        parameters = inspect.signature(op._direct["cuda"]).parameters
        assert [a.name for a in schema.arguments] == list(parameters), name
        for argument in schema.arguments:
            if argument.has_default_value():
                assert parameters[argument.name].default == argument.default_value, (name, argument.name)


def _custom_ops() -> list[DirectKernels]:
    """The op objects the qwen_mtp.ops modules define."""
    import importlib
    import pkgutil

    import qwen_mtp.ops

    found = []
    for info in pkgutil.walk_packages(qwen_mtp.ops.__path__, "qwen_mtp.ops."):
        module = importlib.import_module(info.name)
        found += [obj for obj in vars(module).values() if isinstance(obj, DirectKernels)]
    return found
