"""``oscarkv serve``: OpenAI-compatible completions/chat server with Prometheus metrics, on localhost."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="registry name (e.g. smollm2-135m), a transformers folder or a .gguf file")
    p.add_argument("--calibration", default=None, help="calibration folder (OSCAR cache)")
    p.add_argument("--kv", choices=("oscar", "bf16"), default="oscar")
    p.add_argument("--kv-budget-gb", type=float, default=1.0, help="KV pool size in GiB")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default=None, help="cpu or cuda (default: where the model loads)")


def run(args: argparse.Namespace) -> int:
    import time

    from oscarkv.engine import LLM
    from oscarkv.engine.server import serve

    llm = LLM(args.model, args.calibration, kv=args.kv, kv_budget_gb=args.kv_budget_gb,
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, device=args.device)
    srv = serve(llm, args.host, args.port, model_name=str(args.model))
    print(f"serving {args.model} ({args.kv} cache, {llm.pool.nbytes() / 2**30:.2f} GiB pool) on "
          f"http://{args.host}:{args.port}  (POST /v1/completions, /v1/chat/completions; GET /metrics)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        srv.shutdown()
    return 0
