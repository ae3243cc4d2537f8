"""What the H200 runs for the bf16 stream GEMM at one row, read from its SASS compiled here (no GPU needed): a
program reserves the shared memory of its widest K loop (the 27B gate_up plan: 4 x 48 KB, so one program per SM
at every M), and `GemmPlan.wide_stages` lets the one-row-tile loop pipeline deeper in that same memory, with the
same MMA instructions (so the same sums) and more weight bytes in flight."""

from op_helpers import sm90_report


def _k_loops(n: int, k: int, fields: list, options: dict) -> dict:
    return sm90_report("loops", [n, k, *fields, options])


def test_deep_one_tile_loop_keeps_the_mmas_and_shared_memory_and_doubles_bytes_in_flight():
    # the 27B gate_up plan before its deep8 tail8 one: 64x128 weight blocks, swapped, 4 tiles of 32 rows, 4 stages
    tuned = [64, 128, 40, 4, 4, "stream", 32, 4, True]
    deep = [64, 128, 40, 4, 8, "stream", 32, 4, True]
    now, candidate = _k_loops(34816, 5120, tuned, {}), _k_loops(34816, 5120, deep, {"wide_stages": 4})
    assert now["shared"] == 4 * (64 + 4 * 32) * 128 * 2  # the 4-tile loop's 4 stages: one program per SM
    assert candidate["shared"] <= now["shared"]
    assert [loop["mma"] for loop in candidate["loops"]] == [loop["mma"] for loop in now["loops"]]
    one_tile = [i for i, loop in enumerate(now["loops"]) if loop["mma"] == {"HGMMA.64x32x16.F32.BF16": 8}]
    assert len(one_tile) == 1  # the M <= 32 loop: 8 wgmma 64x32x16 per 128-deep K step
    i = one_tile[0]
    assert now["loops"][i]["copies"] == candidate["loops"][i]["copies"] == 12  # 8 weight + 4 row 16-byte copies
    # two copy groups per K step: 4 -> 2 K steps in flight behind the one computing; 12 -> 6
    assert candidate["loops"][i]["in_flight"] >= 2 * now["loops"][i]["in_flight"]


def test_split_tail_leaves_the_k_loops_and_shared_memory_as_they_were():
    """`tail_tiles` only remaps the last programs to (tile, K split) and adds the split reduction after the loops:
    the K loops every program runs (MMAs, copies, depth) and the shared memory (programs per SM) are unchanged."""
    tuned = [64, 128, 40, 4, 4, "stream", 32, 4, True]
    now, tail = _k_loops(34816, 5120, tuned, {}), _k_loops(34816, 5120, tuned, {"tail_tiles": 16, "tail_splits": 8})
    assert tail == now


# [n, k, fp8 weights, plan fields, plan options]: one of each kind of launch the launcher makes
LAUNCHES = {
    "one split, no tail (gate_up, before)": [34816, 5120, False, [64, 128, 40, 4, 4, "stream", 32, 4, True], {}],
    "three K splits (TUNED o_proj)": [5120, 6144, False, [128, 128, 16, 8, 3, "stream", 32, 4, True], {}],
    "split tail": [34816, 5120, False, [64, 128, 40, 4, 4, "stream", 32, 4, True], dict(tail_tiles=16, tail_splits=8)],
    "wide_stages": [34816, 5120, False, [64, 128, 40, 4, 8, "stream", 32, 4, True], {"wide_stages": 4}],
    "W8A16, one split (TUNED_FP8 gate_up)": [34816, 5120, True, [128, 128, 40, 8, 3, "stream", 64, 2, True], {}],
    "grid, one split (TUNED 0.8B lm_head)": [248320, 1024, False, [128, 64, 16, 4, 4], {"block_m": 64}],
}


def test_every_kind_of_launch_compiles_for_sm90():
    """The CPU tests run the kernels in Triton's interpreter, which never compiles them: a path that only a real
    target rejects (an atomic on the bf16 output that one-split launches pass as their counters) passes every
    test here and fails every such plan on the GPU. Each kind of launch compiles here for the H200."""
    assert sm90_report("compile", LAUNCHES) == {}
