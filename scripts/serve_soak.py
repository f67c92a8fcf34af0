"""Soak `specexport serve`: N concurrent clients for M minutes against one server on 127.0.0.1.

Every greedy response (chat, streamed and not, alternately) must carry exactly the tokens the
single-sequence loop gives for its prompt alone (Pipeline.generate, drafter none, with the same
penalties or schema); a divergence is reported with the target's top-2 margin there (floating
point may flip only a near-tie). ``--mix`` cycles each client through request kinds (KINDS):
plain greedy, greedy with penalties and a bias, JSON schema (bench/prompts/structured.jsonl),
sampled with logprobs, and n = 2 sampled; a sampled response must be whole (every choice
finished, a logprob per token) and a schema response must parse and validate. The server's
resident memory is sampled throughout: after warm-up it must stay flat. With ``--drafter suffix``
the store of earlier responses is sampled too (its tokens and index bytes from /metrics): flat once
``--suffix-store-tokens`` is reached.

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


PENALTIES = {"frequency_penalty": 0.8, "presence_penalty": 0.3, "repetition_penalty": 1.1, "logit_bias": {"28": -2.0}}
# kind -> (extra request fields, is its output compared with the solo run)
KINDS = {
    "greedy": ({"temperature": 0}, True),
    "penalties": ({"temperature": 0, **PENALTIES}, True),
    "schema": ({"temperature": 0}, True),  # + response_format from the structured prompt
    "sampled-logprobs": ({"temperature": 0.8, "top_p": 0.95, "min_p": 0.05, "logprobs": True, "top_logprobs": 2},
                         False),
    "n2-sampled": ({"temperature": 1.0, "n": 2}, False),
}


def solo_controls(kind: str, schema: dict | None):
    from specexport.runtime.grammar import GrammarSpec
    from specexport.runtime.rules import Controls, Penalties

    if kind == "penalties":
        return Controls(Penalties(1.1, 0.8, 0.3, {28: -2.0}))
    if kind == "schema":
        return Controls(grammar=GrammarSpec("json_schema", json.dumps(schema)))
    return None


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
    parser.add_argument("--mix", action="store_true", help="cycle through KINDS (default: greedy only)")
    parser.add_argument("--structured", type=Path, default=Path("bench/prompts/structured.jsonl"))
    parser.add_argument("--suffix-store-tokens", type=int, default=None,
                        help="the server's --suffix-store-tokens (a small budget is reached within a short soak)")
    args = parser.parse_args()

    from specexport.runtime import load

    prompts = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    schemas = [json.loads(line) for line in args.structured.read_text().splitlines() if line.strip()]
    kinds = list(KINDS) if args.mix else ["greedy"]
    pipe = load(args.engines, threads=args.threads)
    solo = {}  # (kind, prompt index) -> (ids, tokens)
    for kind in (k for k in kinds if KINDS[k][1]):
        for i, p in enumerate(schemas if kind == "schema" else prompts):
            ids = pipe.prompt_ids(messages=p["messages"])
            solo[(kind, i)] = (ids, pipe.generate(prompt_ids=ids, drafter="none", max_new_tokens=args.max_tokens,
                                                  controls=solo_controls(kind, p.get("json_schema"))).token_ids)
    print(f"solo outputs of {len(solo)} requests ready", flush=True)

    results = {"ok": 0, "failed": [], "diverged": [], "by_kind": dict.fromkeys(kinds, 0)}
    lock = threading.Lock()
    stop_at = time.monotonic() + 60 * args.minutes
    memory: list[tuple[float, float]] = []  # (seconds since start, RSS MB)

    store: list[tuple[float, float, float, float]] = []  # (seconds, store tokens, index bytes, responses)
    extra = [] if args.suffix_store_tokens is None else ["--suffix-store-tokens", str(args.suffix_store_tokens)]
    with spawned_server(args.engines, args.drafter, args.out / "soak-server.log", threads=args.threads,
                        extra_args=extra) as url:
        pid = server_pid(int(url.rsplit(":", 1)[1]))
        started = time.monotonic()

        def client(c: int) -> None:
            n = 0
            with httpx.Client(timeout=300) as http:
                while time.monotonic() < stop_at:
                    kind = kinds[(c + n) % len(kinds)]
                    fields, compared = KINDS[kind]
                    pool = schemas if kind == "schema" else prompts
                    i = (c * 5 + n) % len(pool)
                    stream = (c + n // len(kinds)) % 2 == 0
                    body = {"model": "smollm2-135m", "messages": pool[i]["messages"], "max_tokens": args.max_tokens,
                            "return_token_ids": True, "stream": stream, "seed": c * 1000 + n, **fields}
                    if kind == "schema":
                        body["response_format"] = {"type": "json_schema", "json_schema": {
                            "name": pool[i]["id"], "schema": pool[i]["json_schema"], "strict": True}}
                    n += 1
                    try:
                        choices = _request(http, f"{url}/v1/chat/completions", body)
                        problem = _check(kind, body, choices, pool[i])
                        if problem:
                            raise RuntimeError(problem)
                    except Exception as err:  # noqa: BLE001 - counted, the soak goes on
                        with lock:
                            results["failed"].append(f"client {c} request {n} ({kind}): {err}")
                        continue
                    ids = choices[0]["token_ids"]
                    with lock:
                        results["by_kind"][kind] += 1
                        if not compared or ids == solo[(kind, i)][1]:
                            results["ok"] += 1
                        else:
                            results["diverged"].append({"kind": kind, "prompt": i, "got": ids,
                                                        "want": solo[(kind, i)][1]})

        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            memory.append((time.monotonic() - started, rss_mb(pid)))
            store.append((time.monotonic() - started, *_store_sample(url)))
            time.sleep(5)
        for t in threads:
            t.join()
        memory.append((time.monotonic() - started, rss_mb(pid)))
        metrics = httpx.get(f"{url}/metrics").text

    margins = []
    for d in results["diverged"]:  # where the first difference is, and the target's top-2 margin there
        ids, want = solo[(d["kind"], d["prompt"])]
        k = next(j for j, (a, b) in enumerate(zip(d["got"] + [-1], want + [-1])) if a != b)
        runner = pipe.target
        runner.cache.set_length(0)
        logits = runner.forward(np.asarray(ids + want[:k], dtype=np.int64), want_logits=True).logits[-1]
        top2 = np.sort(logits)[-2:]  # raw logits: for the penalised and schema kinds a bound, not the ruled margin
        margins.append({"kind": d["kind"], "prompt": d["prompt"], "position": k, "top2_margin": float(top2[1] - top2[0])})
    warm = [m for t, m in memory if t >= 60] or [m for _, m in memory]
    report = {"clients": args.clients, "minutes": args.minutes, "drafter": args.drafter, "max_tokens": args.max_tokens,
              "kinds": kinds, "responses_by_kind": results["by_kind"],
              "responses_ok": results["ok"], "failed": results["failed"], "diverged": margins,
              "rss_mb_after_warmup_first": warm[0], "rss_mb_last": warm[-1], "rss_mb_max": max(warm),
              "rss_samples": memory}
    if any(tokens for _, tokens, _, _ in store):
        full = [b for _, tokens, b, _ in store if tokens >= 0.9 * (args.suffix_store_tokens or tokens)]
        report |= {"store_bytes_when_full_first": full[0] if full else None,
                   "store_bytes_max": max(b for _, _, b, _ in store), "store_bytes_last": store[-1][2],
                   "store_samples": store}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(report, indent=1))
    (args.out / "soak-metrics.txt").write_text(metrics)
    print(json.dumps({k: v for k, v in report.items() if k not in ("rss_samples", "store_samples")}, indent=1))


def _store_sample(url: str) -> tuple[float, float, float]:
    """The suffix store's tokens, index bytes and responses on /metrics (zeros without one)."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {"tokens": 0.0, "bytes": 0.0, "responses": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            key = sample.name.removeprefix("specexport_suffix_store_")
            if key in values and key != sample.name:
                values[key] += sample.value
    return values["tokens"], values["bytes"], values["responses"]


def _request(http: httpx.Client, url: str, body: dict) -> list[dict]:
    """The response's choices (streamed ones reassembled): token_ids, content, logprobs, finish_reason."""
    choices: dict[int, dict] = {}
    if not body["stream"]:
        reply = http.post(url, json=body)
        if reply.status_code != 200:
            raise RuntimeError(f"status {reply.status_code}: {reply.text[:200]}")
        return [{"token_ids": c["token_ids"], "content": c["message"]["content"],
                 "logprobs": (c["logprobs"] or {}).get("content"), "finish_reason": c["finish_reason"]}
                for c in reply.json()["choices"]]
    with http.stream("POST", url, json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"status {reply.status_code}")
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:]).get("choices", []):
                choice = choices.setdefault(c["index"], {"token_ids": [], "content": "", "logprobs": None,
                                                         "finish_reason": None})
                choice["token_ids"] += c.get("token_ids", [])
                choice["content"] += c["delta"].get("content") or ""
                if c.get("logprobs"):
                    choice["logprobs"] = (choice["logprobs"] or []) + c["logprobs"]["content"]
                choice["finish_reason"] = c["finish_reason"] or choice["finish_reason"]
    return [choices[i] for i in sorted(choices)]


def _check(kind: str, body: dict, choices: list[dict], prompt: dict) -> str | None:
    """What is wrong with a response beyond its tokens (None: nothing)."""
    if len(choices) != body.get("n", 1):
        return f"{len(choices)} choices for n={body.get('n', 1)}"
    for c in choices:
        if c["finish_reason"] not in ("stop", "length") or not 0 < len(c["token_ids"]) <= body["max_tokens"]:
            return f"choice unfinished or of {len(c['token_ids'])} tokens"
        if body.get("logprobs") and len(c["logprobs"] or []) != len(c["token_ids"]):
            return "not one logprob per token"
        if kind == "schema" and c["finish_reason"] == "stop":
            import jsonschema

            try:
                jsonschema.validate(json.loads(c["content"]), prompt["json_schema"])
            except (ValueError, jsonschema.ValidationError) as err:
                return f"schema output does not validate: {str(err)[:120]}"
    return None


if __name__ == "__main__":
    main()
