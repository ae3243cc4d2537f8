"""Draft vocabularies (`mtp.draft_vocab`): the token-count file that `qwen-mtp draft-vocab` writes, and the N
ids a draft vocabulary keeps (the N most frequent).

The count file is UTF-8 text: comment lines start with `#` (the first says `qwen-mtp draft-vocab counts`, the
others what was counted: the model, the source, the total), then one line per token, `<id><TAB><count>`,
most frequent first (ties: lower id first). Ids the file does not list count 0. Keeping the N most frequent
ids means the file's first N lines, then, if it lists fewer, the unlisted ids in ascending order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qwen_mtp.engine.params import SamplingParams
from qwen_mtp.errors import RecipeError

if TYPE_CHECKING:
    from qwen_mtp.engine.engine import Engine

HEADER = "# qwen-mtp draft-vocab counts"
FIRST = "first"  # `mtp.draft_vocab_file: first`: ids 0..N-1 (synthetic models, whose tokens mean nothing)


def write_counts(path: str | Path, counts: Counter[int], about: dict[str, object]) -> None:
    """The count file at `path`: the header, `about` as `# key: value` lines, then the counts, most first."""
    lines = [HEADER, *(f"# {key}: {value}" for key, value in about.items())]
    lines += [f"{token}\t{count}" for token, count in sorted(counts.items(), key=lambda item: (-item[1], item[0]))]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


def read_counts(path: str | Path) -> list[tuple[int, int]]:
    """(id, count) pairs in file order (most frequent first)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise RecipeError(f"mtp.draft_vocab_file {str(path)!r}: cannot read it ({err.strerror or err})") from None
    if not text.startswith(HEADER):
        raise RecipeError(
            f"mtp.draft_vocab_file {str(path)!r} is not a count file (its first line must be {HEADER!r}; "
            "`qwen-mtp draft-vocab` writes one)"
        )
    pairs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 2 or not all(f.strip().isdigit() for f in fields):
            raise RecipeError(f"mtp.draft_vocab_file {str(path)!r} line {number}: expected '<id><TAB><count>'")
        pairs.append((int(fields[0]), int(fields[1])))
    return pairs


def draft_ids(source: str | None, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` ids a draft vocabulary keeps [size] (ascending), from a count file or `FIRST`."""
    if source is None:
        raise RecipeError(
            "mtp.draft_vocab needs mtp.draft_vocab_file: a token-count file (`qwen-mtp draft-vocab` writes one), "
            "or 'first' for the first N ids (synthetic models)"
        )
    if not 1 <= size <= vocab_size:
        raise RecipeError(f"mtp.draft_vocab must be 1..{vocab_size} (the model's vocabulary), got {size}")
    if source == FIRST:
        return torch.arange(size)
    kept: list[int] = []
    seen: set[int] = set()
    for token, _ in read_counts(source):
        if token >= vocab_size:
            raise RecipeError(
                f"mtp.draft_vocab_file {source!r} lists token {token}, outside the model's vocabulary "
                f"({vocab_size}): was it counted with another tokenizer?"
            )
        if token not in seen and len(kept) < size:
            kept.append(token)
            seen.add(token)
    kept += [token for token in range(vocab_size) if token not in seen][: size - len(kept)]
    return torch.tensor(sorted(kept))


def count_tokens(sequences: Iterable[list[int]]) -> Counter[int]:
    counts: Counter[int] = Counter()
    for ids in sequences:
        counts.update(ids)
    return counts


def count_corpus(encode: Callable[[str], list[int]], texts: Iterable[str]) -> Counter[int]:
    """Token counts of `texts` through `encode` (the model's tokenizer)."""
    return count_tokens(encode(text) for text in texts)


def count_generations(engine: Engine, prompts: list[str], max_new_tokens: int) -> Counter[int]:
    """Token counts of the model's own greedy continuations of `prompts` (MTP off, EOS ends a continuation):
    the tokens the target actually emits, which are the ones a draft must hit."""
    ids = [engine.encode(prompt) for prompt in prompts]
    results = engine.generate(ids, SamplingParams(max_new_tokens=max_new_tokens))
    return count_tokens(result.token_ids for result in results)
