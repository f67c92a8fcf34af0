"""One client: `specexport serve` against Pipeline.generate (what `specexport generate` runs), same
drafter, same prompts, interleaved in one run. Each side is timed from the call to the last
token (prefill included), greedy; the server through HTTP on 127.0.0.1, non-streamed. The server
runs in this process (uvicorn in a thread), so both sides share onnxruntime's one thread pool:
two processes would each keep a pool spinning while the other runs.

    .venv/bin/python scripts/serve_vs_generate.py engines/smollm2-135m --drafter ngram \
        --out bench/reports/2026-11-30-serve
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import uvicorn

from specexport.serve.app import create_app
from specexport.serve.config import ServeConfig


@contextmanager
def in_process_server(config: ServeConfig):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(config), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    while not server.started or httpx.get(f"{url}/health").status_code != 200:
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("engines", type=Path)
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=Path, default=Path("bench/prompts/dev.jsonl"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from specexport.runtime import load

    prompts = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    rows = []
    config = ServeConfig(str(args.engines), "smollm2-135m", drafter=args.drafter, threads=args.threads)
    with in_process_server(config) as url:
        pipe = load(args.engines, threads=args.threads)
        with httpx.Client(timeout=600) as http:
            for repeat in range(args.repeats + 1):  # repeat 0 warms both up
                for p in prompts:
                    ids = pipe.prompt_ids(messages=p["messages"])
                    start = time.perf_counter()
                    local = pipe.generate(prompt_ids=ids, drafter=args.drafter, max_new_tokens=args.max_tokens)
                    generate_s = time.perf_counter() - start
                    body = {"model": "smollm2-135m", "messages": p["messages"], "max_tokens": args.max_tokens,
                            "temperature": 0, "return_token_ids": True}
                    start = time.perf_counter()
                    reply = http.post(f"{url}/v1/chat/completions", json=body).json()
                    serve_s = time.perf_counter() - start
                    served = reply["choices"][0]["token_ids"]
                    if repeat:
                        rows.append({"prompt": p["id"], "tokens": len(served), "same_tokens": served == local.token_ids,
                                     "generate_tok_s": len(local.token_ids) / generate_s,
                                     "serve_tok_s": len(served) / serve_s})
    ratios = [r["serve_tok_s"] / r["generate_tok_s"] for r in rows]
    summary = {"drafter": args.drafter, "max_tokens": args.max_tokens, "repeats": args.repeats,
               "threads": args.threads, "all_same_tokens": all(r["same_tokens"] for r in rows),
               "generate_tok_s_median": float(np.median([r["generate_tok_s"] for r in rows])),
               "serve_tok_s_median": float(np.median([r["serve_tok_s"] for r in rows])),
               "ratio_median": float(np.median(ratios)), "ratio_min": float(min(ratios)),
               # total tokens over total time, each side: the long answers weigh more
               "ratio_of_totals": sum(r["tokens"] / r["generate_tok_s"] for r in rows)
               / sum(r["tokens"] / r["serve_tok_s"] for r in rows)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"serve_vs_generate_{args.drafter}.json").write_text(json.dumps({**summary, "rows": rows}, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
