"""What a training run leaves beside its checkpoint: the loss log (JSON lines), the loss curve (PNG) and the
summary (JSON: settings, losses, held-out perplexity, speed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LOG_FILE, CURVE_FILE, SUMMARY_FILE = "train-log.jsonl", "loss.png", "train-summary.json"


def append_log(out_dir: Path, record: dict[str, Any]) -> None:
    with (out_dir / LOG_FILE).open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")


def plot_losses(history: list[dict[str, Any]], path: Path, title: str) -> None:
    """Next-token and MTP loss against the step (whichever the run logged)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    curves = (
        ("lm", "next token"),
        ("mtp", "MTP draft step 1 (token t+2)"),
        ("mtp_chain", "MTP chained steps"),
        ("heldout_lm_loss", "held-out next token"),
    )
    for key, label in curves:
        points = [(h["step"], h[key]) for h in history if key in h]
        if points:
            ax.plot(*zip(*points, strict=True), label=label, marker="o" if key.startswith("heldout") else None)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_summary(out_dir: Path, summary: dict[str, Any]) -> Path:
    path = out_dir / SUMMARY_FILE
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return path
