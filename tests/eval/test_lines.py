"""Next-line exact match from teacher-forced argmaxes, on a character tokenizer."""

import torch

from oscarkv.eval.lines import LineTable, score_lines


class CharTokenizer:
    """One token per character (ids = code points < 128); token 127 is "x\\n" (a line end with text before the
    newline), so line ends are compared up to and including their first newline."""

    def decode(self, ids):
        return "".join("x\n" if i == 127 else chr(i) for i in ids)

    def encode(self, text):
        return torch.tensor([ord(c) for c in text])


TEXT = "a = 1\nif a:\n    b = 2\n\n)\nreturn b\n"


def test_spans_skip_short_and_unscored_lines():
    tok = CharTokenizer()
    table = LineTable(tok, 128)
    ids = tok.encode(TEXT)
    spans = table.spans(ids, lo=0)
    texts = [tok.decode(ids[a: b + 1].tolist()) for a, b in spans]
    # the first line has no newline before it; "" and ")" are too short
    assert texts == ["if a:\n", "    b = 2\n", "return b\n"]
    assert table.spans(ids, lo=11) == spans[1:]  # the line after position 11 is the first predicted from there


def test_a_line_is_correct_only_when_every_token_and_the_line_end_match():
    tok = CharTokenizer()
    table = LineTable(tok, 128)
    ids = tok.encode(TEXT)
    truth = ids[1:].clone()  # perfect predictions: pred[p] = ids[p + 1]
    sc = score_lines(table, ids, 0, truth, truth)
    assert sc.hit.tolist() == [True, True, True] and sc.hit_ref.tolist() == [True, True, True]
    spans = table.spans(ids, 0)
    a, b = spans[1]
    wrong_mid = truth.clone()
    wrong_mid[a + 2] = ord("z")  # a token inside line 2
    assert score_lines(table, ids, 0, wrong_mid, truth).hit.tolist() == [True, False, True]
    other_end = truth.clone()
    other_end[b - 1] = 127  # predicts "x\n" where the truth is "\n": the text before the newline differs
    assert score_lines(table, ids, 0, other_end, truth).hit.tolist() == [True, False, True]
    no_end = truth.clone()
    no_end[spans[2][1] - 1] = ord(" ")  # does not end the last line
    assert score_lines(table, ids, 0, no_end, truth).hit.tolist() == [True, True, False]
    by = score_lines(table, ids, 0, wrong_mid, truth).buckets(size=16, nb=3)
    assert sum(by["n"]) == 3 and sum(by["hit"]) == 2 and sum(by["hit_ref"]) == 3
