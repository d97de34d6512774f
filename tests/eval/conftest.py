import random

import pytest

from eval_standins import FakeQuantBackend, WordTokenizer, tiny_llama
from oscarkv.eval.context import EvalContext
from oscarkv.eval.store import ResultStore
from oscarkv.eval.texts import EvalText


def random_text(n_words: int = 3000, vocab: int = 80, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(vocab)}" for _ in range(n_words))


@pytest.fixture
def tiny_context(tmp_path):
    def make(score_from: int = 8, ref_dir=True, model=None, backend=None, text=None):
        return EvalContext(
            model=model or tiny_llama(), tokenizer=WordTokenizer(), model_name="tiny",
            backend=backend or FakeQuantBackend(),
            store=ResultStore(tmp_path / "out"), text=EvalText("rand", text or random_text(), {"kind": "test"}),
            score_from=score_from, ref_dir=(tmp_path / "ref") if ref_dir else None, progress=False,
        )

    return make
