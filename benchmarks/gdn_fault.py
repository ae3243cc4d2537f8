"""Which GDN prefill kernel faults at Qwen3.5-27B shapes, and under which launch settings (GPU box).

An illegal memory access surfaces at the next CUDA call after the faulting kernel and leaves the process's CUDA
context unusable, so each launch setting runs in a fresh process that makes the benchmark's inputs
(`gdn_prefill.inputs`: q/k/v slices of one conv output), runs the torch reference, then one
`chunked.gdn_chunked_triton` call with a device synchronisation after each of its five kernels. Per setting it
prints the first step that failed (`reference`, `decay_kkt`, `invert`, `wy`, `states`, `output`) or `ok` with the
largest difference from the reference. The kernels' index arithmetic at these shapes stays inside every tensor
(tests/ops/test_gdn_bounds.py, under the interpreter), so a fault here points at the compiled code.
Usage (repo root): PYTHONPATH=$PWD python3 benchmarks/gdn_fault.py [lengths ...]   (default 2048 8192)
GDN_SHAPE=hk,hv,d (e.g. 2,4,16: the tiny fixture's) runs other head counts and head size instead of 27B's;
GDN_BATCH=b runs b equal-length sequences (default 1).
"""

import json
import os
import subprocess
import sys

SETTINGS = (  # chunked module constants per run; {} is the default
    {},
    {"STATE_STAGES": 1},
    {"STATE_WARPS": 8},
    {"STATE_BLOCK_V": 64},
    {"INVERT_WARPS": 4},
    {"PREPARE_WARPS": 8},
    {"OUTPUT_WARPS": 4},
)


def child(length: int, setting: dict) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gdn_prefill

    from qwen_mtp.ops.gdn import chunked, chunked_gated_delta_rule

    for name, value in setting.items():
        setattr(chunked, name, value)
    if os.environ.get("GDN_SHAPE"):
        hk, hv, d = (int(x) for x in os.environ["GDN_SHAPE"].split(","))
        gdn_prefill.HK, gdn_prefill.HV, gdn_prefill.DK, gdn_prefill.DV = hk, hv, d, d
    batch = int(os.environ.get("GDN_BATCH", "1"))
    step = {"name": "reference"}
    kernels = chunked._kernels()

    class Synced:  # launches the kernel, then waits for it, so a fault is charged to it
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                step["name"] = self.fn.__name__
                self.fn[grid](*args, **kwargs)
                torch.cuda.synchronize()

            return launch

    chunked._kernels = lambda: tuple(Synced(k) for k in kernels)
    try:
        with torch.inference_mode():
            args = gdn_prefill.inputs(length)
            if batch > 1:  # b copies of the sequence as one [b, T, ...] batch
                args = tuple(torch.cat([a] * batch) for a in args)
            ref_out, ref_final = chunked_gated_delta_rule(*args[:5], initial_state=args[5])
            torch.cuda.synchronize()
            out, final = chunked.gdn_chunked_triton(*args)
            torch.cuda.synchronize()
            diff = max(gdn_prefill.max_diff(out, ref_out), gdn_prefill.max_diff(final, ref_final))
        print(json.dumps({"failed": None, "max_diff": diff}))
    except Exception as err:
        print(json.dumps({"failed": step["name"], "error": f"{type(err).__name__}: {err}"[:200]}))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), json.loads(sys.argv[3]))
        return
    import triton

    lengths = [int(a) for a in sys.argv[1:]] or [2048, 8192]
    print(f"triton {triton.__version__}")
    for length in lengths:
        for setting in SETTINGS:
            run = [sys.executable, os.path.abspath(__file__), "--child", str(length), json.dumps(setting)]
            done = subprocess.run(run, capture_output=True, text=True, timeout=600)
            lines = done.stdout.strip().splitlines()
            result = lines[-1] if lines else f"no result (rc {done.returncode}): {done.stderr[-300:]}"
            print(f"{length} tokens {setting or 'default'}: {result}", flush=True)


if __name__ == "__main__":
    main()
