"""Run one vLLM engine (one ``LLM()``) and print its greedy tokens and top logprobs as a JSON line.

    python engine_run.py '{"model": DIR, "tp": 1, "oscar": {...} | null, "block_size": 64, "prompts": [[ids]],
                           "max_tokens": 8, "logprobs": 5, "max_model_len": 1024, "prefix_caching": false}'

Used by the tests in this folder (each call is one engine start, ~1 min on 2 CPU cores). The last stdout line
is ``RESULT {...}``; vLLM's own log (with its KV cache capacity) goes to stderr.
"""

import json
import sys
import time


def main() -> None:
    args = json.loads(sys.argv[1])
    t0 = time.time()
    from vllm import LLM, SamplingParams

    kwargs = dict(model=args["model"], dtype=args.get("dtype", "float32"), enforce_eager=True,
                  skip_tokenizer_init=True, tensor_parallel_size=args.get("tp", 1),
                  max_model_len=args.get("max_model_len", 1024), seed=0,
                  enable_prefix_caching=args.get("prefix_caching", False),
                  max_num_seqs=args.get("max_num_seqs", 8))
    if args.get("block_size"):
        kwargs["block_size"] = args["block_size"]
    if args.get("oscar") is not None:
        kwargs["additional_config"] = {"oscar": args["oscar"]}
    if args.get("backend"):
        kwargs["attention_config"] = {"backend": args["backend"]}
    if args.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = args["max_num_batched_tokens"]
        kwargs["enable_chunked_prefill"] = True
    full = args.get("full_logprobs")  # a .pt path: every step's log-probabilities over the whole vocabulary
    if full:
        kwargs["max_logprobs"] = -1
    llm = LLM(**kwargs)
    print(f"ENGINE_START_S {time.time() - t0:.1f}", flush=True)
    params = SamplingParams(max_tokens=args.get("max_tokens", 8), temperature=0.0, detokenize=False,
                            logprobs=-1 if full else args.get("logprobs", 5), ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]], params, use_tqdm=False)
    result, dense = [], []
    for o in outs:
        c = o.outputs[0]
        steps = c.logprobs or []
        if full:
            import torch

            lp = torch.full((len(steps), max(max(s) for s in steps) + 1), float("-inf"))
            for i, s in enumerate(steps):
                ids = torch.tensor(list(s.keys()))
                lp[i, ids] = torch.tensor([x.logprob for x in s.values()])
            dense.append(lp)
            steps = [{t: s[t] for t in [int(tok)]} for s, tok in zip(steps, c.token_ids)]
        lps = [{str(t): lp.logprob for t, lp in step.items()} for step in steps]
        result.append({"tokens": list(c.token_ids), "logprobs": lps})
    if full:
        import torch

        torch.save(dense, full)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
