"""Programmatic dependent launch (`triton_utils.launch`): a kernel may start while the one before it still runs, so
every kernel of ours must wait for it before touching memory that a kernel writes (only its weights, `w_ptr`, which
nothing writes while a step runs, may be read before), and every launch must pass the options that say whether it
may start early. Read from the source (an early start cannot happen on a CPU), and the instructions read from a
kernel compiled for the H200 here."""

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


# Pointers a kernel may read before its wait: the weights (model parameters), which no kernel writes.
CONSTANT_POINTERS = {"w_ptr"}
WRITES = {"store", "atomic_add", "atomic_xchg", "atomic_cas", "atomic_max", "atomic_min", "atomic_and", "atomic_or"}


def _before_the_wait_ok(statement: ast.stmt, kernel: str = "") -> bool:
    """A statement a kernel may run before its wait: it writes nothing and names no pointer but the weights' and
    the state the kernel's entry in `STATE_READS_BEFORE_THE_WAIT` names."""
    allowed = CONSTANT_POINTERS | triton_utils.STATE_READS_BEFORE_THE_WAIT.get(kernel, set())
    for node in ast.walk(statement):
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in WRITES:
            return False
        if isinstance(node, ast.Name) and node.id.endswith("_ptr") and node.id not in allowed:
            return False
    return True


def test_every_kernel_waits_for_the_previous_one_before_touching_what_a_kernel_writes():
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
        if ast.unparse(body[0]).startswith("triton_utils.prefetch_weight_rows("):  # the GEMMs: weights to L2 first
            body = body[1:]
        waits = [i for i, stmt in enumerate(body) if ast.unparse(stmt) == "triton_utils.wait_for_previous_kernel(PDL)"]
        assert waits, f"{where} never waits"
        early = [ast.unparse(stmt) for stmt in body[: waits[0]] if not _before_the_wait_ok(stmt, kernel.name)]
        assert not early, f"{where} touches memory a kernel writes before its wait: {early}"


def test_the_rule_catches_reads_and_writes_before_the_wait():
    bad = ["x = tl.load(x_ptr + cols)", "tl.store(w_ptr, x)", "rows = pool_ptr + 3", "tl.atomic_add(c, 1)"]
    good = ["w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)", "cols = tl.program_id(0) * 4 + tl.arange(0, 4)"]
    assert not any(_before_the_wait_ok(ast.parse(line).body[0]) for line in bad)
    assert all(_before_the_wait_ok(ast.parse(line).body[0]) for line in good)
    state = ast.parse("s = tl.load(pool_ptr + rows)").body[0]
    assert _before_the_wait_ok(state, "gdn_recurrent_rows") and not _before_the_wait_ok(state, "rms_norm_rows")
    assert not _before_the_wait_ok(ast.parse("tl.store(pool_ptr, s)").body[0], "gdn_recurrent_rows")
    assert not _before_the_wait_ok(ast.parse("q = tl.load(q_ptr)").body[0], "gdn_recurrent_rows")


def test_the_only_work_before_the_wait_is_an_l2_prefetch_of_weights():
    """`prefetch_weight_rows`, which GEMMs run before waiting, loads and stores nothing: one bulk L2 prefetch."""
    tree = ast.parse((OPS / "triton_helpers.py").read_text())
    helper = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "prefetch_weight_rows")
    calls = {ast.unparse(n.func) for n in ast.walk(helper) if isinstance(n, ast.Call)}
    assert not {c for c in calls if c.split(".")[-1] in {"load", "store", "atomic_add", "atomic_xchg"}}, calls
    asm = [n for n in ast.walk(helper) if isinstance(n, ast.Call) and "inline_asm" in ast.unparse(n.func)]
    assert len(asm) == 1 and ast.literal_eval(asm[0].args[0]).startswith("cp.async.bulk.prefetch.L2.global ")


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
    assert triton_utils.launch(torch.device("cpu")) == {"PDL": False, "enable_fp_fusion": True}
    assert triton_utils.launch(torch.device("meta")) == {"PDL": False, "enable_fp_fusion": True}


def test_launch_options_pin_fma_contraction_whatever_tritons_default():
    """`enable_fp_fusion=True` in every launch's options (unless a kernel asks for `fp_fusion=False`) keeps
    multiply-adds fused where Triton's default does not (TRITON_DEFAULT_FP_FUSION=0, its announced default from
    3.10): the kernels round as they were measured."""
    assert triton_utils.launch(torch.device("cpu"))["enable_fp_fusion"] is True
    assert triton_utils.launch(torch.device("cpu"), fp_fusion=False)["enable_fp_fusion"] is False
    found = sm90_report("fpfusion")
    assert found["pinned"] >= 1 and found["default"] == 0, found


def test_a_kernel_compiled_for_hopper_waits_only_with_pdl():
    found = sm90_report("pdl")
    assert found["False"] == []
    assert found["True"] == ["griddepcontrol.wait", "griddepcontrol.launch_dependents"]


def _prefetching(kind, n, k, plan_fields):
    return sm90_report("prefetch", [n, k, kind, *plan_fields])


def test_gemms_compiled_for_hopper_prefetch_weights_before_the_wait():
    """`GemmPlan.l2_prefetch` compiled as a graph capture launches it: bulk L2 prefetches, all before the one
    grid dependency wait, for bf16 and W8A16 "stream" / "grid" plans and the W8A8 kernel, loading their tiles by
    pointers or by TMA (the prefetch takes the weight's address beside its descriptor); none without it."""
    stream = [64, 64, 80, 4, 6, "stream", {"block_m": 64, "swap_ab": True, "l2_prefetch": 4}]
    grid = [128, 64, 80, 4, 4, "grid", {"block_m": 16, "l2_prefetch": 2}]
    w8a8 = [64, 128, 40, 4, 4, "stream", {"block_m": 16, "row_tiles": 2, "swap_ab": True, "l2_prefetch": 4}]
    tma = [[*stream[:-1], stream[-1] | {"tma_loads": True}], [*w8a8[:-1], w8a8[-1] | {"tma_loads": True}]]
    for kind, plan in (("bf16", stream), ("w8a16", grid), ("w8a8", w8a8), ("bf16", tma[0]), ("w8a8", tma[1])):
        found = _prefetching(kind, 34816, 5120, plan)
        assert found["prefetches"] >= 1 and found["before_wait"] and found["waits"] == 1, (kind, found)
        assert found["columns"]["L2_PREFETCH_K"] == plan[-1]["l2_prefetch"] * plan[1], (kind, found)
    off = _prefetching("bf16", 34816, 5120, [*stream[:-1], stream[-1] | {"l2_prefetch": 0}])
    assert off["prefetches"] == 0 and off["columns"]["L2_PREFETCH_K"] == 0


def test_recurrent_state_kernels_compiled_for_hopper_read_their_state_before_the_wait():
    """`STATE_READS_BEFORE_THE_WAIT` as compiled for the H200: the GDN delta rule issues its state tile's loads (more
    than its row, start slot and two gate parameters) before the grid dependency wait, the multi-token conv update
    its window (more than its weights, row and start slot), the one-token conv update its 4 weights only; each
    loads its new tokens after the wait."""
    found = sm90_report("stateloads")
    assert all(kernel["waits"] == 1 and kernel["after"] >= 5 for kernel in found.values()), found
    assert found["gdn_recurrent_rows"]["before"] > 4 and found["conv_update_window"]["before"] > 6, found
    assert found["conv_update_columns"]["before"] <= 4, found
