"""`benchmarks/gpu_suite.sh`, the script every device call runs, checked here where device time costs nothing: it
parses, the stages its header lists are the stages it has, and every file it names exists (a renamed script or
test would otherwise be found by a device call that prints "No such file")."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu_suite.sh"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_suite_parses():
    subprocess.run(["bash", "-n", str(SUITE)], check=True)


def test_the_header_lists_exactly_the_stages_the_script_has():
    text = SUITE.read_text()
    header = text[text.index("# STAGE=") : text.index(" runs one part")]
    listed = set(re.sub(r"[#\s]", "", header.removeprefix("# STAGE=")).split("|"))
    branches = set(re.findall(r'"\$STAGE" == ([a-z0-9]+)', text)) - {"all"}
    assert listed == branches


def test_every_file_the_suite_names_exists():
    names = re.findall(r"(?:benchmarks|tests|recipes)/[\w/.-]+\.(?:py|sh|yaml)", SUITE.read_text())
    assert names
    assert [name for name in sorted(set(names)) if not (ROOT / name).exists()] == []


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_ab_stage_runs_each_tree_with_its_own_prefetch_and_keeps_every_run(tmp_path):
    """`STAGE=prefetch`'s A/B runs, with `python3` and `nvidia-smi` stubbed to record what each bench run gets: a
    "baseline" or "tree:DIR" run uses its tree's default L2 prefetch (the variable unset; a run with 0 compared two
    trees and the prefetch at once), a number sets it, an "env:" setting sets its variables for its run only, and a
    repeated setting writes to a folder of its own; each run's JSON stays and its plot goes (KEEP_PLOTS unset: a
    device call brings back 8 files)."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    record = tmp_path / "runs.txt"
    (stubs / "nvidia-smi").write_text("#!/bin/sh\necho stub\n")
    (stubs / "python3").write_text(
        "#!/bin/bash\n"
        '[[ "$1" == -c ]] && exit 0\n'
        "for arg; do [[ $arg == bench.out_dir=* ]] && out=${arg#bench.out_dir=}; done\n"
        f'[[ -n ${{out:-}} ]] && echo "${{QWEN_MTP_L2_PREFETCH-unset}} ${{PYTHONPATH%%:*}} ${{out##*/}}'
        f' ${{QWEN_MTP_PDL-unset}}" >> {record}\n'
        '[[ -n ${out:-} ]] && mkdir -p "$out" && touch "$out/bench.json" "$out/bench.png"\n'
        f'[[ $1 == benchmarks/ab_table.py ]] && echo "$@" >> {record}.table\n'
    )
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "STAGE": "prefetch", "MODELS": "fp8", "EXACT": "0",
           "SETTINGS": "baseline 4 tree:.variant env:QWEN_MTP_PDL=0 baseline 4",
           "OUT": str(tmp_path / "out"),
           "HOME": str(tmp_path)}  # fmt: skip
    subprocess.run(["bash", str(SUITE)], cwd=ROOT, env=env, check=True, capture_output=True, timeout=120)
    runs = [line.split() for line in record.read_text().splitlines()]
    assert runs == [
        ["unset", f"{ROOT}/.baseline", "bench-fp8-baseline", "unset"],
        ["4", str(ROOT), "bench-fp8-4", "unset"],
        ["unset", f"{ROOT}/.variant", "bench-fp8-treevariant", "unset"],
        ["unset", str(ROOT), "bench-fp8-envQWEN_MTP_PDL0", "0"],
        ["unset", f"{ROOT}/.baseline", "bench-fp8-baseline-run2", "unset"],
        ["4", str(ROOT), "bench-fp8-4-run2", "unset"],
    ]
    kept = sorted(path.relative_to(tmp_path / "out").as_posix() for path in (tmp_path / "out").glob("*/*"))
    assert kept == sorted(f"{run[2]}/bench.json" for run in runs)
    table = ["benchmarks/ab_table.py", str(tmp_path / "out"), "--settings", *env["SETTINGS"].split()]
    assert (tmp_path / "runs.txt.table").read_text().split() == table
