"""``oscarkv serve``: OpenAI-compatible completions/chat server with Prometheus metrics (docs/serving.md)."""

from __future__ import annotations

import argparse
import signal


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="registry name (e.g. smollm2-135m), a transformers folder or a .gguf file")
    p.add_argument("--calibration", default=None, help="calibration folder (OSCAR cache)")
    p.add_argument("--kv", choices=("oscar", "bf16"), default="oscar")
    p.add_argument("--kv-budget-gb", type=float, default=1.0, help="KV pool size in GiB")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--device", default=None, help="cpu or cuda (default: where the model loads)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: MODEL)")
    p.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body accepted (413 beyond)")
    p.add_argument("--max-connections", type=int, default=512, help="open connections beyond this get 503")
    p.add_argument("--body-timeout", type=float, default=30.0, help="seconds for a request body to arrive (408)")
    p.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds in-flight requests get to finish")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))


def run(args: argparse.Namespace) -> int:
    from oscarkv.engine import LLM
    from oscarkv.serve import ServeConfig, Server

    for name in ("max_body_mb", "body_timeout", "graceful_timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.max_connections < 1:
        raise ValueError(f"--max-connections must be >= 1, got {args.max_connections}")
    llm = LLM(args.model, args.calibration, kv=args.kv, kv_budget_gb=args.kv_budget_gb,
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, device=args.device)
    config = ServeConfig(model_name=args.served_model_name or str(args.model),
                         max_body_bytes=int(args.max_body_mb * 2**20), body_timeout_s=args.body_timeout)
    server = Server(llm, args.host, args.port, config, max_connections=args.max_connections,
                    graceful_timeout_s=args.graceful_timeout, log_level=args.log_level)
    pool_gib = llm.gauges()["kv_pool_bytes"] / 2**30
    print(f"serving {config.model_name} ({args.kv} cache, {pool_gib:.2f} GiB pool) on {server.url}"
          "  (POST /v1/completions, /v1/chat/completions; GET /v1/models, /health, /metrics)", flush=True)
    # uvicorn turns SIGINT/SIGTERM into a graceful shutdown, then raises the signal again; these handlers take
    # that second delivery, so a clean stop exits 0 (the engine loop has already stopped by then).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    print("oscarkv serve: stopped", flush=True)
    return 0
