"""Small stand-ins for the evaluation tests: a word tokenizer, a fake-quantizing backend on tiny HF models, and a
copy ("induction") model whose cache is its token history."""

from __future__ import annotations

import contextlib
import random
import re
from types import SimpleNamespace

import torch
from torch import nn

from oscarkv.eval.backend import decoder
from oscarkv.quant import fake_quantize

_WORD = re.compile(r"\w+|[^\w\s]")


class WordTokenizer:
    """Words and punctuation marks are tokens; the vocabulary grows as text is encoded."""

    bos_token_id = None
    add_bos_token = False

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []

    def _id(self, w: str) -> int:
        if w not in self.vocab:
            self.vocab[w] = len(self.words)
            self.words.append(w)
        return self.vocab[w]

    def __call__(self, text, add_special_tokens=False):
        if isinstance(text, list):
            return {"input_ids": [self(t)["input_ids"] for t in text]}
        return {"input_ids": [self._id(w) for w in _WORD.findall(text)]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.words[i] if i < len(self.words) else f"<{i}>" for i in ids)


def random_text(n_words: int = 3000, vocab: int = 80, seed: int = 0) -> str:
    """``n_words`` words drawn from ``vocab`` made-up ones ("w0" ...), seeded."""
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(vocab)}" for _ in range(n_words))


def tiny_llama(vocab: int = 96, layers: int = 2, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


class FakeQuantBackend:
    """``bf16``: the model as is. ``q2``/``q4``: every key and value row of every head fake-quantized (no windows).
    Quantization is per token and position-independent, so the teacher-forced and decode paths agree."""

    BITS = {"bf16": None, "q2": 2, "q4": 4}

    def __init__(self):
        self.cache_calls = 0

    @contextlib.contextmanager
    def simulate(self, model, method, prompt_len=0):
        bits = self.BITS[method]
        handles = []
        if bits is not None:
            d = model.config.head_dim

            def hook(_m, _a, out):
                return fake_quantize(out.reshape(*out.shape[:-1], -1, d), bits=bits).reshape(out.shape)

            for layer in decoder(model).layers:
                handles += [layer.self_attn.k_proj.register_forward_hook(hook),
                            layer.self_attn.v_proj.register_forward_hook(hook)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def cache(self, model, method):
        from transformers import DynamicCache

        self.cache_calls += 1
        with self.simulate(model, method):
            yield lambda: DynamicCache(config=model.config)

    def describe(self, model, method):
        bits = self.BITS[method]
        return {"method": method, "bits": 16.0 if bits is None else bits + 32 / model.config.head_dim}


class CopyCache:
    """The copy model's "cache": the token history, optionally forgetting all but the last ``keep`` tokens."""

    def __init__(self, keep: int | None = None):
        self.tokens: list[int] = []
        self.keep = keep


class CopyModel(nn.Module):
    """Predicts the token that followed the most recent earlier occurrence of the longest matching suffix
    (up to ``max_n`` tokens) of the history: an n-gram induction "copy" model. Logits are one-hot."""

    def __init__(self, vocab: int = 4096, max_n: int = 8):
        super().__init__()
        self.vocab, self.max_n = vocab, max_n
        self.dummy = nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace()

    def predict(self, hist: list[int]) -> int:
        for n in range(min(self.max_n, len(hist) - 1), 0, -1):
            suffix = hist[-n:]
            for s in range(len(hist) - n - 1, -1, -1):
                if hist[s : s + n] == suffix:
                    return hist[s + n]
        return 0

    def forward(self, input_ids, past_key_values=None, use_cache=True, logits_to_keep=0, **_):
        cache = past_key_values if past_key_values is not None else CopyCache()
        cache.tokens += input_ids[0].tolist()
        visible = cache.tokens if cache.keep is None else cache.tokens[-cache.keep :]
        logits = torch.zeros(1, 1, self.vocab)
        logits[0, 0, self.predict(visible)] = 1.0
        return SimpleNamespace(logits=logits, past_key_values=cache)


class CopyBackend:
    """``bf16``: full history; ``forgetful``: the cache keeps only the last 24 tokens (a method that loses the
    needle)."""

    KEEP = {"bf16": None, "forgetful": 24}

    @contextlib.contextmanager
    def cache(self, model, method):
        keep = self.KEEP[method]
        yield lambda: CopyCache(keep)

    def simulate(self, model, method, prompt_len=0):
        raise NotImplementedError

    def describe(self, model, method):
        return {"method": method}


# ------------------------------------------------------------------------------------ a tiny model on disk
NIAH_WORDS = (
    "Some special magic numbers words number word are hidden within the following text . Make sure to memorize "
    "them I will quiz you about afterwards The for is : Question What ? Answer grass sky sun green blue yellow "
    "Here we go There and back again"
).split()


def word_level_tokenizer(words):
    """A transformers fast tokenizer over ``words`` (whitespace and punctuation split, ``<unk>`` for the rest):
    what ``oscarkv eval --model DIR`` loads with ``AutoTokenizer``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")


def tiny_model_folder(folder, text: str, layers: int = 2, seed: int = 0):
    """Save a tiny random Llama with head_dim 64 (the Triton kernels' smallest) and a word-level tokenizer over
    ``text`` and the NIAH template words to ``folder``; returns ``(model, tokenizer)``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = word_level_tokenizer(list(dict.fromkeys(_WORD.findall(text) + NIAH_WORDS)))
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      tie_word_embeddings=True, initializer_range=0.08)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model, tok


def tiny_calibration(model, text_ids, *, sink: int = 16, window: int = 32, page_size: int = 16,
                     bit_budget: float | str | None = 2.75):
    """A real (small) OSCAR calibration of ``model`` on token ids ``text_ids`` ``[N]``: rotations, means, fitted
    clip and, with ``bit_budget``, per-layer formats for ``oscar-auto`` (page_size 16: the kernels' smallest)."""
    from oscarkv.calib import calibrate
    from oscarkv.config import QuantSpec

    n = 128
    chunks = [text_ids[i * n : (i + 1) * n] for i in range(min(4, text_ids.numel() // n))]
    spec = QuantSpec(sink=sink, window=window, page_size=page_size, clip_grid=(1.0, 0.9), bit_budget=bit_budget)
    return calibrate(model, None, chunks, spec=spec, tokens=n * len(chunks), seq_len=n, holdout=0.25,
                     progress=False)
