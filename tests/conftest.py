"""Shared fixtures: tiny checkpoints in the real HF layout, built once per session, and the HF reference."""

from __future__ import annotations

import os

import torch

# torchao (FP8 quantization; transformers imports it too) skips its compiled kernels, which we do not use and which
# only warn when built for another torch.
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
if not torch.cuda.is_available():
    # Triton kernels run under the CPU interpreter here; this must be set before any kernel is created.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Under pytest-xdist (`-n N`) the workers share the machine's cores rather than each taking all of them.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))

# tests/gpu needs a CUDA device: it is run on the GPU box (benchmarks/gpu_suite.sh), not collected elsewhere.
collect_ignore = [] if torch.cuda.is_available() else ["gpu"]

from qwen_mtp.testing import build_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(preset="tiny", layout="text", **kwargs) -> path; identical requests share one directory."""
    built = {}

    def make(preset: str = "tiny", layout: str = "text", **kwargs):
        key = (preset, layout, tuple(sorted(kwargs.items())))
        if key not in built:
            name = "-".join([preset, layout] + [f"{k}{v}" for k, v in sorted(kwargs.items())])
            built[key] = build_checkpoint(tmp_path_factory.mktemp(name), preset=preset, layout=layout, **kwargs)
        return built[key]

    return make


@pytest.fixture(scope="session")
def chat_checkpoint(checkpoint, tmp_path_factory):
    """The tiny checkpoint with the test chat template (tests/serve_helpers.py: `CHAT_TEMPLATE`)."""
    from serve_helpers import with_chat_template

    return with_chat_template(checkpoint(), tmp_path_factory.getbasetemp() / "tiny-chat")


@pytest.fixture(autouse=True, scope="session")
def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


@pytest.fixture(autouse=True)
def _isolated_fixture_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("QWEN_MTP_CACHE", str(tmp_path_factory.getbasetemp() / "qwen-mtp-cache"))
