"""`specexport bench`: every drafter against the target alone, on one machine, interleaved.

For each repeat, each prompt runs the baseline (the target alone through the same engines),
then each drafter, then each installed peer, so slow drifts of the machine hit all alike.
Speedups are ratios within this run; absolute times are reported, never compared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from specexport.errors import BadInput
from specexport.runtime.runner import time_interleaved


@dataclass
class BenchOptions:
    prompts: Path
    max_new_tokens: int = 128
    repeats: int = 3
    drafters: list[str] | None = None  # None: every drafter in the manifest
    temperature: float = 0.0
    threads: int = 2
    adaptive: bool = True
    peers: list[str] = field(default_factory=list)
    cost_repeats: int = 9
    draft_len: int | None = None
    backend: str | None = None  # None: onnxruntime when the directory has it
    device_kv: bool = True  # tensorrt: KV cache on the GPU (False: host cache, copied every run)


def load_prompts(path: Path) -> list[dict]:
    if not path.is_file():
        raise BadInput(f"{path}: prompt file not found")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as err:
            raise BadInput(f"{path}:{number}: not JSON ({err})") from None
        if not isinstance(item, dict) or "messages" not in item and "prompt" not in item:
            raise BadInput(f"{path}:{number}: each line needs 'messages' (chat) or 'prompt' (text)")
        prompts.append({"id": str(item.get("id", f"line{number}")), "category": str(item.get("category", "all")),
                        **item})
    if not prompts:
        raise BadInput(f"{path}: no prompts")
    return prompts


def _curve(times: dict[int, float]) -> list[dict]:
    return [{"tokens": size, "ms": round(t * 1e3, 3), "relative": round(t / times[1], 3)}
            for size, t in sorted(times.items())]


def cost_curve(pipe, repeats: int) -> list[dict]:
    """Time of one target pass against the number of tokens it verifies."""
    return _curve(pipe.target.time_engines(pipe.target.sizes, repeats))


def measure_costs(pipe, drafters: list[str], repeats: int, want_logits: bool, draft_len: int) -> dict:
    """What the prediction is made of, measured apart from the decode runs: the target's pass
    at every engine size (the cost curve) and the graphs each drafter's round cost reads
    (``Drafter.cost_graphs``), all taken in turn round after round (runner.time_interleaved),
    so a drift of the machine hits them alike; then each drafter's own ``round_cost`` of
    k = 0..D over those measured parts."""
    timed = {"target": (pipe.target, pipe.target.sizes)}
    for name in drafters:
        for part, (runner, sizes) in pipe.drafter(name).cost_graphs().items():
            timed[f"{name}/{part}"] = (runner, sizes)
    median = time_interleaved(timed, repeats, want_logits)
    target = median["target"]
    parts = {name: {part: {t: s * 1e3 for t, s in median[f"{name}/{part}"].items()}
                    for part in pipe.drafter(name).cost_graphs()} for name in drafters}
    return {
        "curve": _curve(target),
        # the pass a round with k drafts runs (the engine that holds 1+k tokens), k = 0..D
        "verify_ms": [round(target[pipe.target.engine_size(1 + k)] * 1e3, 3) for k in range(draft_len + 1)],
        # per drafter with engines: the ms of its round of k = 0..D drafts, from its own cost model
        "draft_ms": {name: [round(pipe.drafter(name).round_cost(k, parts[name]) * 1e3, 3) for k in range(draft_len + 1)]
                     for name in drafters if parts[name]},
        # the graphs behind it: drafter -> part (step, catchup, block) -> tokens -> ms
        "draft_parts_ms": {name: {part: {str(t): round(ms, 3) for t, ms in by_tokens.items()}
                                  for part, by_tokens in by_part.items()} for name, by_part in parts.items() if by_part},
        "repeats": repeats,
        "logits": want_logits,
    }


def _record(drafter: str, prompt: dict, repeat: int, result) -> dict:
    st = result.stats
    return {
        "drafter": drafter,
        "prompt_id": prompt["id"],
        "category": prompt["category"],
        "repeat": repeat,
        "token_ids": result.token_ids,
        "tokens": st.tokens,
        "rounds": st.rounds,
        "total_s": st.total_s,
        "draft_s": st.draft_s,
        "draft_engine_s": st.draft_engine_s,
        "verify_s": st.verify_s,
        "host_s": st.host_s,
        "accepted_at": list(st.accepted_at),
        "proposed_at": list(st.proposed_at),
    }


def _interleaved_runs(pipe, options: BenchOptions, reporter, prompts: list[dict], drafters: list[str], ids: dict,
                      peers: list, sampling: dict, depth: dict) -> tuple[list[dict], list[dict]]:
    """Every repeat, every prompt: each drafter's run and each peer's: (our records, the peers')."""
    records: list[dict] = []
    peer_records: list[dict] = []
    for repeat in range(options.repeats):
        with reporter.step("bench", f"repeat {repeat + 1}/{options.repeats}") as step:
            for index, prompt in enumerate(prompts):
                prompt_ids = ids[prompt["id"]]
                # ours first on every other prompt, the peers first on the rest: neither side
                # always runs right after the other, so what one run leaves behind (warm caches,
                # a machine drifting) does not land on the same side every time
                ours_first = (index + repeat) % 2 == 0
                if ours_first:
                    records += _our_runs(pipe, drafters, prompt, prompt_ids, repeat, options, sampling, depth)
                peer_records += _peer_runs(peers, prompt, prompt_ids, repeat, options.max_new_tokens)
                if not ours_first:
                    records += _our_runs(pipe, drafters, prompt, prompt_ids, repeat, options, sampling, depth)
            step.detail = f"{len(prompts)} prompts × {len(drafters) + len(peers)} runs"
    return records, peer_records


def _our_runs(pipe, drafters: list[str], prompt: dict, prompt_ids: list[int], repeat: int, options: BenchOptions,
              sampling: dict, depth: dict) -> list[dict]:
    """One generation of the prompt per drafter (the target alone first)."""
    return [_record(name, prompt, repeat, pipe.generate(prompt_ids=prompt_ids, drafter=name, seed=repeat,
                                                        max_new_tokens=options.max_new_tokens, **sampling, **depth))
            for name in drafters]


def _peer_runs(peers: list, prompt: dict, prompt_ids: list[int], repeat: int, max_new_tokens: int) -> list[dict]:
    records = []
    for peer in peers:
        run = peer.run(prompt_ids, max_new_tokens)
        records.append({"peer": peer.name, "threads": peer.threads, "prompt_id": prompt["id"],
                        "category": prompt["category"], "repeat": repeat, "token_ids": run.token_ids,
                        "total_s": run.total_s, "first_token_s": run.first_token_s, "decode_s": run.decode_s,
                        "decode_tokens": run.decode_tokens,
                        "settings": getattr(peer, "settings", {}), "stats": run.stats})
    return records


def run_bench(engine_dir: Path, options: BenchOptions, reporter) -> dict:
    from specexport.runtime import load

    pipe = load(engine_dir, threads=options.threads, backend=options.backend, device_kv=options.device_kv)
    prompts = load_prompts(options.prompts)
    drafters = ["none", *(options.drafters if options.drafters is not None else pipe.manifest.drafters)]
    for name in drafters:
        pipe.drafter(name)  # unknown names fail here, before any timing
    ids = {
        p["id"]: pipe.prompt_ids(messages=p["messages"]) if "messages" in p else pipe.prompt_ids(p["prompt"])
        for p in prompts
    }
    peers, skipped = [], []
    if options.peers:  # each in a process of its own (bench/peer_process.py says why)
        from specexport.bench.peer_process import start_peers

        target = pipe.manifest.target_source
        peers, skipped = start_peers(target, pipe.manifest.recipe_root, options.peers,
                                     options.threads, engine_dir.parent / f".{engine_dir.name}.peers")
    try:
        return _run(pipe, options, reporter, prompts, drafters, ids, peers, skipped)
    finally:
        from specexport.bench.peer_process import close_peers

        close_peers(peers)


def _run(pipe, options: BenchOptions, reporter, prompts: list[dict], drafters: list[str], ids: dict,
         peers: list, skipped: list[dict]) -> dict:
    sampling = dict(temperature=options.temperature)
    depth = dict(adaptive=options.adaptive, draft_len=options.draft_len)

    with reporter.step("bench", "warm-up"):
        first = ids[prompts[0]["id"]]
        for name in drafters:
            pipe.generate(prompt_ids=first, drafter=name, max_new_tokens=8, **sampling, **depth)
        for peer in peers:
            peer.run(first, 8)

    records, peer_records = _interleaved_runs(pipe, options, reporter, prompts, drafters, ids, peers, sampling, depth)

    fixed_records: list[dict] = []
    if options.adaptive and options.temperature == 0.0:
        # Adaptive depth follows this machine's costs, so its E[L] moves from machine to machine;
        # greedy E[L] at the fixed full depth does not: it is what the gate compares (untimed).
        with reporter.step("bench", "acceptance at the fixed full depth") as step:
            for prompt in prompts:
                for name in drafters[1:]:
                    result = pipe.generate(prompt_ids=ids[prompt["id"]], drafter=name, adaptive=False,
                                           max_new_tokens=options.max_new_tokens, **sampling,
                                           draft_len=options.draft_len)
                    fixed_records.append({"drafter": name, "prompt_id": prompt["id"],
                                          "tokens": result.stats.tokens, "rounds": result.stats.rounds})
            step.detail = f"{len(prompts)} prompts × {len(drafters) - 1} drafters"

    with reporter.step("bench", "costs (cost curve, draft steps)"):
        costs = measure_costs(pipe, drafters, options.cost_repeats, want_logits=options.temperature > 0,
                              draft_len=options.draft_len or pipe.manifest.draft_len)

    from specexport.bench.summary import summarize
    from specexport.runtime.memory import memory

    result = summarize(pipe, options, prompts, drafters, records, peer_records, skipped, costs, fixed_records)
    # the bench process (engines, caches; the peers run in processes of their own): peak and current RSS
    result["memory"] = memory()
    result["engine_costs"] = pipe.costs_source  # what adaptive depth read: "build" or "tuned (host, date)"
    return result
