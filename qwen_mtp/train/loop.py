"""`qwen-mtp train`: the training loop. AdamW (fused on CUDA) with linear warm-up and a cosine decay, gradient
clipping, bf16 weights with fp32 master copies, optional `torch.compile`, a progress line and loss log, and a
resume point every `train.save_every` steps, so a run cut short continues where it stopped when started again
with the same output directory.

Why master weights rather than autocast: our ops are custom ops (a Triton kernel on CUDA, a fake for
torch.compile) that compute in their inputs' dtype; the model in bf16 runs exactly the kernels inference runs,
and AdamW updates fp32 copies so small steps are not rounded away.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qwen_mtp.errors import CheckpointError, RecipeError
from qwen_mtp.loader import check_device, load_model
from qwen_mtp.model import QwenHybridForCausalLM
from qwen_mtp.recipe import Recipe, TrainSection
from qwen_mtp.train import report
from qwen_mtp.train.checkpoint import load_resume, save_checkpoint, save_resume
from qwen_mtp.train.corpus import Corpus
from qwen_mtp.train.data import Windows
from qwen_mtp.train.distill import distill_loss, head_parameters
from qwen_mtp.train.evaluate import heldout_losses
from qwen_mtp.train.loss import joint_loss
from qwen_mtp.train.model import fresh_model, model_config
from qwen_mtp.train.tokenizer import EOS_TOKEN, TOKENIZER_FILES, encode_files, load_tokenizer, train_tokenizer

RESUME_FILE = "resume.pt"
PROBE_STEPS = (2, 12)  # speed is measured between these steps of a run (after the first steps' warm-up/compile)


@dataclass
class TrainResult:
    output_dir: Path
    checkpoint: Path
    steps: int
    summary: dict[str, Any]


class MasterWeights:
    """The trainable parameters and the fp32 copies AdamW updates (the parameters themselves when fp32)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_() for p in params]

    def grads_to_masters(self) -> None:
        for param, master in zip(self.params, self.masters, strict=True):
            if master is not param:
                master.grad = None if param.grad is None else param.grad.float()
                param.grad = None

    @torch.no_grad()
    def masters_to_params(self) -> None:
        for param, master in zip(self.params, self.masters, strict=True):
            if master is not param:
                param.copy_(master)


def learning_rate(train: TrainSection, step: int, total: int) -> float:
    """Linear warm-up to `lr`, then a cosine to `lr * min_lr_ratio` at the last step."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    span = max(total - train.warmup_steps, 1)
    progress = min((step - train.warmup_steps) / span, 1.0)
    floor = train.lr * train.min_lr_ratio
    return floor + (train.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return check_device(name)
    except CheckpointError as err:
        raise RecipeError(f"train.device: {err}") from None


def _tokenizer_dir(train: TrainSection, corpus: Corpus, out: Path, log: Callable[[str], None]) -> Path:
    if train.init is not None:
        directory = Path(train.init).expanduser()
        missing = [name for name in TOKENIZER_FILES if not (directory / name).exists()]
        if missing:
            raise RecipeError(f"train.init: {directory} has no tokenizer ({', '.join(missing)} missing)")
        return directory
    directory = out / "tokenizer"
    if not (directory / "tokenizer.json").exists():
        started = time.perf_counter()
        files = corpus.files("train")
        train_tokenizer((f.text for f in files), train.vocab_size, directory)
        log(f"tokenizer: byte-level BPE of {train.vocab_size} tokens trained on {len(files)} files "
            f"in {time.perf_counter() - started:.1f} s")  # fmt: skip
    return directory


def _token_stream(corpus: Corpus, split: str, tokenizer, tokenizer_dir: Path, out: Path) -> torch.Tensor | None:
    """The split's token stream, cached in `out/data/` (keyed by the corpus settings and the tokenizer)."""
    key = json.dumps([corpus.root, corpus.include, corpus.exclude, split])
    key += hashlib.sha256((tokenizer_dir / "tokenizer.json").read_bytes()).hexdigest()
    cache = out / "data" / f"{split}.pt"
    if cache.exists():
        cached = torch.load(cache, weights_only=True)
        if cached["key"] == key:
            return cached["tokens"]
    try:
        files = corpus.files(split)  # type: ignore[arg-type]
    except RecipeError:
        if split == "heldout":
            return None
        raise
    tokens = encode_files(tokenizer, [f.text for f in files])
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"key": key, "tokens": tokens, "files": len(files)}, cache)
    return tokens


def _model(train: TrainSection, tokenizer, device: torch.device, dtype: torch.dtype):
    if train.init is None:
        config = model_config(train, tokenizer.convert_tokens_to_ids(EOS_TOKEN))
        return fresh_model(config, train.seed, device, dtype), config
    directory = Path(train.init).expanduser()
    config = json.loads((directory / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    return load_model(directory, dtype=dtype, device=device).train(), config


def _trainable(model: QwenHybridForCausalLM, mode: str) -> list[torch.nn.Parameter]:
    if mode == "mtp-head":
        chosen = {id(p) for p in head_parameters(model)}
    elif mode == "target":
        head = {id(p) for p in model.mtp.parameters()} if model.mtp is not None else set()
        chosen = {id(p) for p in model.parameters()} - head
    else:
        if model.mtp is None:
            raise RecipeError("train.mode joint: the model has no MTP head; use train.mode target")
        chosen = {id(p) for p in model.parameters()}
    for param in model.parameters():
        param.requires_grad_(id(param) in chosen)
    return [p for p in model.parameters() if id(p) in chosen]


def _optimizer(train: TrainSection, weights: MasterWeights, device: torch.device) -> torch.optim.AdamW:
    decay = [m for m in weights.masters if m.ndim >= 2]  # matrices, embeddings, conv kernels; not norms or gates
    rest = [m for m in weights.masters if m.ndim < 2]
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=train.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def _loss_function(train: TrainSection) -> Callable:
    def fn(model, windows):
        if train.mode == "mtp-head":
            return distill_loss(model, windows, train.mtp_chain)
        return joint_loss(model, windows, train.mtp_weight, train.mtp_chain, with_mtp=train.mode == "joint")

    if not train.compile:
        return fn
    from qwen_mtp.engine.graphs import register_inductor_fallbacks

    register_inductor_fallbacks()
    return torch.compile(fn)


def train(recipe: Recipe, log: Callable[[str], None] = print, progress: bool = False) -> TrainResult:
    """Run (or resume) the recipe's training; returns where the checkpoint and the summary are."""
    t = recipe.train
    started = time.perf_counter()
    out = Path(t.output_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    device = _device(t.device)
    dtype = torch.bfloat16 if t.precision == "bf16" else torch.float32
    corpus = Corpus(t.corpus, tuple(t.include), tuple(t.exclude))

    tokenizer_dir = _tokenizer_dir(t, corpus, out, log)
    tokenizer = load_tokenizer(tokenizer_dir)
    train_tokens = _token_stream(corpus, "train", tokenizer, tokenizer_dir, out)
    heldout_tokens = _token_stream(corpus, "heldout", tokenizer, tokenizer_dir, out)
    windows = Windows(train_tokens, t.seq_len, 1 + t.mtp_chain, t.batch_size, t.seed)
    model, config = _model(t, tokenizer, device, dtype)
    if len(tokenizer) > config["vocab_size"]:
        raise RecipeError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {config['vocab_size']}"
        )
    weights = MasterWeights(_trainable(model, t.mode))
    optimizer = _optimizer(t, weights, device)
    parameters = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in weights.params)
    log(f"model: {parameters / 1e6:.2f} M parameters ({trained / 1e6:.2f} M trained, mode {t.mode}), "
        f"{t.precision} on {device}; corpus: {len(train_tokens) / 1e6:.2f} M train tokens "
        f"({windows.count} windows of {t.seq_len}), "
        f"{0 if heldout_tokens is None else len(heldout_tokens) / 1e6:.2f} M held-out")  # fmt: skip

    step, total, sized, history = 0, t.steps, t.time_budget_s is None, []
    state = load_resume(out / RESUME_FILE)
    if state is not None:
        with torch.no_grad():
            for master, saved in zip(weights.masters, state["masters"], strict=True):
                master.copy_(saved)
        weights.masters_to_params()
        optimizer.load_state_dict(state["optimizer"])
        step, total, sized, history = state["step"], state["total_steps"], state["sized"], state["history"]
        torch.set_rng_state(state["rng"])
        log(f"resumed from {out / RESUME_FILE} at step {step} of {total}")

    def save_point() -> None:
        save_resume(out / RESUME_FILE, {
            "step": step, "total_steps": total, "sized": sized, "history": history,
            "masters": [m.detach().cpu() for m in weights.masters], "optimizer": optimizer.state_dict(),
            "rng": torch.get_rng_state(), "recipe": dataclasses.asdict(t),
        })  # fmt: skip

    loss_fn = _loss_function(t)
    tokens_per_step = t.batch_size * t.seq_len
    first, probe_time, bar = step, None, None
    if progress and step < total:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=step, desc="training", unit="step")
    model.train()
    window_sums: dict[str, torch.Tensor] = {}  # summed on the device: the host reads them once per log line
    while step < total:
        batch = windows.batch(step).to(device, non_blocking=True)
        loss, parts = loss_fn(model, batch)
        loss.backward()
        weights.grads_to_masters()
        grad_norm = torch.nn.utils.clip_grad_norm_(weights.masters, t.grad_clip)
        lr = learning_rate(t, step, total)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        weights.masters_to_params()
        step += 1
        for key, value in {**parts, "grad_norm": grad_norm}.items():
            window_sums[key] = window_sums.get(key, 0.0) + value.detach().float()
        done = step - first
        if done == PROBE_STEPS[0]:
            probe_time = time.perf_counter()
        elif done == PROBE_STEPS[1] and probe_time is not None:
            rate = (PROBE_STEPS[1] - PROBE_STEPS[0]) / (time.perf_counter() - probe_time)
            if not sized:
                elapsed = time.perf_counter() - started
                total = max(step + 1, min(total, step + int((t.time_budget_s - elapsed) * rate)))
                sized = True
            log(f"throughput: {rate * tokens_per_step:,.0f} tokens/s ({rate:.2f} steps/s of {tokens_per_step} "
                f"tokens); {total} steps in all, about {(total - step) / rate / 60:.1f} min to go")  # fmt: skip
        if step % t.log_every == 0 or step == total:
            count = t.log_every if step % t.log_every == 0 else step % t.log_every
            record = {"step": step, "lr": lr, **{k: float(v) / count for k, v in window_sums.items()}}
            record["elapsed_s"] = round(time.perf_counter() - started, 1)
            history.append(record)
            report.append_log(out, record)
            window_sums = {}
            line = " ".join(
                f"{k} {record[k]:.4f}" for k in ("lm", "mtp", "mtp_chain", "draft_acc", "grad_norm") if k in record
            )
            if bar is not None:
                bar.set_postfix_str(line)
            else:
                log(f"step {step}/{total} {line} lr {lr:.2e} ({record['elapsed_s']:.0f} s)")
        if t.eval_every and step % t.eval_every == 0 and heldout_tokens is not None and step < total:
            model.eval()
            scores = heldout_losses(model, heldout_tokens, t.seq_len, t.batch_size, t.eval_tokens, t.mtp_chain)
            model.train()
            history.append({"step": step, **{f"heldout_{k}": v for k, v in scores.items() if k != "tokens"}})
            report.append_log(out, history[-1])
            log(f"step {step}: held-out perplexity {scores['perplexity']:.3f}")
        if bar is not None:
            bar.update(1)
        if step % t.save_every == 0 or step == total:
            save_point()
    if bar is not None:
        bar.close()

    model.eval()
    heldout = None
    if heldout_tokens is not None:
        heldout = heldout_losses(model, heldout_tokens, t.seq_len, t.batch_size, t.eval_tokens, t.mtp_chain)
        log(f"held-out: {heldout['tokens']} tokens, perplexity {heldout['perplexity']:.3f}"
            + (f", MTP loss {heldout['mtp_loss']:.3f}, draft acceptance {heldout['draft_acc']:.3f}"
               if "mtp_loss" in heldout else ""))  # fmt: skip
    checkpoint = save_checkpoint(model, config, tokenizer_dir, out / "model", t.save_dtype)
    report.plot_losses(history, out / report.CURVE_FILE, f"qwen-mtp train ({t.mode}, {total} steps)")
    summary = {
        "mode": t.mode, "steps": total, "tokens_seen": total * tokens_per_step,
        "epochs": round(windows.epochs(total), 3), "parameters": parameters, "trained_parameters": trained,
        "train_tokens": len(train_tokens), "heldout": heldout, "final": history[-1] if history else None,
        "wall_s": round(time.perf_counter() - started, 1), "device": str(device),
        "torch": torch.__version__, "recipe": dataclasses.asdict(t), "history": history,
    }  # fmt: skip
    report.write_summary(out, summary)
    log(f"wrote {checkpoint} (HF layout, {t.save_dtype}), {out / report.CURVE_FILE}, {out / report.SUMMARY_FILE}")
    return TrainResult(out, checkpoint, total, summary)
