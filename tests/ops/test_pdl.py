"""Programmatic dependent launch (`triton_utils.launch`): a kernel may start while the one before it still runs, so
every kernel of ours must wait for it before touching memory, and every launch must pass the options that say
whether it may start early. Read from the source (an early start cannot happen on a CPU), and the instructions
read from a kernel compiled for the H200 here."""

import ast
from pathlib import Path

import torch
from op_helpers import sm90_report

from qwen_mtp.ops import triton_utils

OPS = Path(triton_utils.__file__).parent
HELPERS = {"triton_helpers.py", "triton_utils.py"}


def _sources():
    for path in sorted(OPS.rglob("*.py")):
        if path.name not in HELPERS:
            yield path, ast.parse(path.read_text())


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return ast.unparse(target) == "triton.jit"


def _kernels():
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list):
                yield path, node


def test_every_kernel_waits_for_the_previous_one_before_anything_else():
    kernels = list(_kernels())
    assert len(kernels) > 30  # the walk finds the kernels (35 when this test was written)
    for path, kernel in kernels:
        where = f"{path.name}:{kernel.name}"
        params = {arg.arg: arg for arg in kernel.args.args}
        assert "PDL" in params, f"{where} takes no PDL"
        assert ast.unparse(kernel.args.defaults[-1]) == "False" and kernel.args.args[-1].arg == "PDL", where
        body = kernel.body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):  # the docstring
            body = body[1:]
        assert ast.unparse(body[0]) == "triton_utils.wait_for_previous_kernel(PDL)", f"{where} does not wait first"


def test_every_launch_passes_the_launch_options():
    launches = 0
    for path, tree in _sources():
        carriers = {  # names bound to the options (or to a dict holding them) in this module
            target.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and "triton_utils.launch(" in ast.unparse(node.value)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):  # kernel[grid](...)
                name = ast.unparse(node.func.value)
                if name in {"torch.ops.qwen_mtp"}:
                    continue
                launches += 1
                options = [ast.unparse(k.value) for k in node.keywords if k.arg is None]
                passed = any(o.startswith("triton_utils.launch(") or o in carriers for o in options)
                assert passed, f"{path.name}: {name}[...] launches without triton_utils.launch"
    assert launches > 30


def test_launch_options_are_off_on_a_cpu():
    assert triton_utils.launch(torch.device("cpu")) == {"PDL": False}
    assert triton_utils.launch(torch.device("meta")) == {"PDL": False}


def test_a_kernel_compiled_for_hopper_waits_only_with_pdl():
    found = sm90_report("pdl")
    assert found["False"] == []
    assert found["True"] == ["griddepcontrol.wait", "griddepcontrol.launch_dependents"]
