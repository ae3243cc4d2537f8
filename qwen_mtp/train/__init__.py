"""`qwen-mtp train`: a Qwen3.5-architecture model (MTP head included) trained from scratch or fine-tuned on a
local corpus, through the same module code inference runs, written as a Hugging Face checkpoint.

One job a module: `corpus` (files and the fixed train/held-out split), `tokenizer` (byte-level BPE), `data`
(batches by step), `model` (a fresh model's config and initial weights), `loss` (next token + MTP), `distill`
(MTP-head self-distillation), `loop` (the optimiser loop, resume), `checkpoint` (what is written), `report`
(log, curve, summary), `evaluate` (held-out perplexity, acceptance lengths).
"""

from qwen_mtp.train.loop import TrainResult, train

__all__ = ["TrainResult", "train"]
