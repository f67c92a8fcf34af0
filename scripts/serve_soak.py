"""Soak `specexport serve`: N concurrent clients for M minutes against one server on 127.0.0.1.

Every response (greedy, chat, streamed and not, alternately) must carry exactly the tokens the
single-sequence loop gives for its prompt alone (Pipeline.generate, drafter none); a divergence
is reported with the target's top-2 margin there (floating point may flip only a near-tie). The
server's resident memory is sampled throughout: after warm-up it must stay flat.

    .venv/bin/python scripts/serve_soak.py engines/smollm2-135m --clients 8 --minutes 5 \
        --out bench/reports/2026-11-30-serve
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from specexport.serve.bench_serve import spawned_server


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def server_pid(port: int) -> int:
    """The pid listening on 127.0.0.1:port (the spawned server), from /proc/net/tcp."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == f"0100007F:{port:04X}" and fields[3] == "0A":  # LISTEN
            inode = fields[9]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(Path(fd).readlink().name == f"socket:[{inode}]" for fd in (proc / "fd").iterdir()):
                return int(proc.name)
        except OSError:
            continue
    raise RuntimeError(f"no process listens on port {port}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("engines", type=Path)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=Path, default=Path("bench/prompts/dev.jsonl"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from specexport.runtime import load

    prompts = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    pipe = load(args.engines, threads=args.threads)
    solo = []
    for p in prompts:
        ids = pipe.prompt_ids(messages=p["messages"])
        solo.append((ids, pipe.generate(prompt_ids=ids, drafter="none", max_new_tokens=args.max_tokens).token_ids))
    print(f"solo outputs of {len(prompts)} prompts ready", flush=True)

    results = {"ok": 0, "failed": [], "diverged": []}
    lock = threading.Lock()
    stop_at = time.monotonic() + 60 * args.minutes
    memory: list[tuple[float, float]] = []  # (seconds since start, RSS MB)

    with spawned_server(args.engines, args.drafter, args.out / "soak-server.log", threads=args.threads) as url:
        pid = server_pid(int(url.rsplit(":", 1)[1]))
        started = time.monotonic()

        def client(c: int) -> None:
            n = 0
            with httpx.Client(timeout=300) as http:
                while time.monotonic() < stop_at:
                    i = (c * 5 + n) % len(prompts)
                    stream = (c + n) % 2 == 0
                    body = {"model": "smollm2-135m", "messages": prompts[i]["messages"], "temperature": 0,
                            "max_tokens": args.max_tokens, "return_token_ids": True, "stream": stream}
                    n += 1
                    try:
                        if stream:
                            ids: list[int] = []
                            with http.stream("POST", f"{url}/v1/chat/completions", json=body) as reply:
                                if reply.status_code != 200:
                                    raise RuntimeError(f"status {reply.status_code}")
                                for line in reply.iter_lines():
                                    if line.startswith("data: {"):
                                        ids += json.loads(line[6:])["choices"][0].get("token_ids", [])
                        else:
                            reply = http.post(f"{url}/v1/chat/completions", json=body)
                            if reply.status_code != 200:
                                raise RuntimeError(f"status {reply.status_code}: {reply.text[:200]}")
                            ids = reply.json()["choices"][0]["token_ids"]
                    except Exception as err:  # noqa: BLE001 - counted, the soak goes on
                        with lock:
                            results["failed"].append(f"client {c} request {n}: {err}")
                        continue
                    with lock:
                        if ids == solo[i][1]:
                            results["ok"] += 1
                        else:
                            results["diverged"].append({"prompt": prompts[i]["id"], "got": ids, "want": solo[i][1]})

        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            memory.append((time.monotonic() - started, rss_mb(pid)))
            time.sleep(5)
        for t in threads:
            t.join()
        memory.append((time.monotonic() - started, rss_mb(pid)))
        metrics = httpx.get(f"{url}/metrics").text

    margins = []
    for d in results["diverged"]:  # where the first difference is, and the target's top-2 margin there
        ids, want = next((s for s, p in zip(solo, prompts) if p["id"] == d["prompt"]))
        k = next(j for j, (a, b) in enumerate(zip(d["got"] + [-1], want + [-1])) if a != b)
        runner = pipe.target
        runner.cache.set_length(0)
        logits = runner.forward(np.asarray(ids + want[:k], dtype=np.int64), want_logits=True).logits[-1]
        top2 = np.sort(logits)[-2:]
        margins.append({"prompt": d["prompt"], "position": k, "top2_margin": float(top2[1] - top2[0])})
    warm = [m for t, m in memory if t >= 60] or [m for _, m in memory]
    report = {"clients": args.clients, "minutes": args.minutes, "drafter": args.drafter, "max_tokens": args.max_tokens,
              "responses_ok": results["ok"], "failed": results["failed"], "diverged": margins,
              "rss_mb_after_warmup_first": warm[0], "rss_mb_last": warm[-1], "rss_mb_max": max(warm),
              "rss_samples": memory}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(report, indent=1))
    (args.out / "soak-metrics.txt").write_text(metrics)
    print(json.dumps({k: v for k, v in report.items() if k != "rss_samples"}, indent=1))


if __name__ == "__main__":
    main()
