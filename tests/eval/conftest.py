import pytest

from eval_standins import FakeQuantBackend, WordTokenizer, random_text, tiny_llama
from oscarkv.eval.context import EvalContext
from oscarkv.eval.store import ResultStore
from oscarkv.eval.texts import EvalText


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
