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
