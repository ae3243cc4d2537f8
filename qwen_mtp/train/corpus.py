"""The training corpus: text files under a root (by default this interpreter's standard library sources) and
their fixed split into train and held-out files.

The split is a function of each file's path relative to the root and nothing else: a file is held out when the
SHA-256 of its POSIX relative path, read as a big-endian integer, is divisible by `HELDOUT_EVERY` (1 file in 20).
So a file lands on the same side on every machine and every Python version that ships it; only the set of
files differs between versions (3.11 and 3.12 ship slightly different standard libraries).
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Literal

from qwen_mtp.errors import RecipeError

HELDOUT_EVERY = 20
SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}  # installed packages are not the stdlib

Split = Literal["train", "heldout"]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative_path: str) -> bool:
    """The fixed rule: held out iff sha256(relative POSIX path) is divisible by HELDOUT_EVERY."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest, "big") % HELDOUT_EVERY == 0


@dataclass(frozen=True)
class CorpusFile:
    path: str  # POSIX path relative to the corpus root: what the split hashes
    text: str


@dataclass(frozen=True)
class Corpus:
    """`root` ("stdlib" or a directory) and the patterns that pick its files: `include` globs (pathlib's, `**`
    for any depth) minus `exclude` patterns (fnmatch on the relative path, where `*` also crosses folders)."""

    root: str = "stdlib"
    include: tuple[str, ...] = ("**/*.py",)
    exclude: tuple[str, ...] = ()

    @property
    def directory(self) -> Path:
        return stdlib_root() if self.root == "stdlib" else Path(self.root).expanduser()

    def paths(self) -> list[str]:
        """Relative POSIX paths of the corpus files, sorted (files that are not UTF-8 text are skipped later)."""
        root = self.directory
        if not root.is_dir():
            raise RecipeError(f"train.corpus: {root} is not a directory (give 'stdlib' or a folder of text files)")
        found: set[str] = set()
        for pattern in self.include:
            for path in root.glob(pattern):
                relative = path.relative_to(root)
                if path.is_file() and not SKIPPED_DIRS.intersection(relative.parts):
                    found.add(relative.as_posix())
        excluded = {p for p in found if any(fnmatch(p, pattern) for pattern in self.exclude)}
        return sorted(found - excluded)

    def files(self, split: Split) -> list[CorpusFile]:
        """The split's files with their text; a RecipeError when the split has none."""
        root = self.directory
        wanted = split == "heldout"
        files = []
        for relative in self.paths():
            if is_heldout(relative) != wanted:
                continue
            try:
                text = (root / relative).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # the stdlib ships a few deliberately mis-encoded test files
            if text.strip():
                files.append(CorpusFile(relative, text))
        if not files:
            raise RecipeError(
                f"train.corpus: no {split} files under {root} match train.include {list(self.include)} "
                f"(minus train.exclude {list(self.exclude)})"
            )
        return files
