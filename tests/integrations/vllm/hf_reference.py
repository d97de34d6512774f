"""Next-token distributions of the project's transformers integration on the tokens vLLM generated, and their KL
to vLLM's: the reference the vLLM backend is held to (same model, same calibration, same method).

``oscarkv.hf.simulate(model, calib, method, prompt_len=P)`` gives, in one teacher-forced pass, the logits that
prefilling the prompt in one chunk and then decoding token by token through the OSCAR cache would give.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def vllm_model_dir(src: Path, dst: Path) -> Path:
    """A folder vLLM loads: ``src``'s weights (symlinked) with ``architectures`` added to its config."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg.setdefault("architectures", ["LlamaForCausalLM" if cfg["model_type"] == "llama" else
                                     "Qwen2ForCausalLM" if cfg["model_type"] == "qwen2" else "Qwen3ForCausalLM"])
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in src.glob("*.safetensors"):
        if not (dst / f.name).exists():
            (dst / f.name).symlink_to(f)
    return dst


def teacher_forced_logprobs(model_dir: Path, calib_dir: str | None, method: str, prompts: list[list[int]],
                            generated: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, ``[len(generated), vocab]`` float32 log-probabilities of each generated token's position under
    ``method`` (``"bf16"``: no cache quantization). The model is loaded once."""
    from transformers import AutoModelForCausalLM

    from oscarkv.artifact import Calibration

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for prompt, gen in zip(prompts, generated):
        ids = torch.tensor([prompt + gen[:-1]])
        with torch.no_grad():
            if method == "bf16":
                logits = model(ids, use_cache=False).logits
            else:
                from oscarkv import hf

                with hf.simulate(model, Calibration.load(calib_dir, model), method, prompt_len=len(prompt)):
                    logits = model(ids, use_cache=False).logits
        out.append(logits[0, len(prompt) - 1:].float().log_softmax(-1))
    return out


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) per row from log-probabilities (rows of Q may be -inf only where P is 0)."""
    p = p_log.exp()
    return (p * (p_log - q_log)).nan_to_num(0.0).sum(-1)
