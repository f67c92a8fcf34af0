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
from specexport.runtime.runner import time_rounds
from specexport.runtime.timing_noise import check_noise, labelled, medians


@dataclass
class BenchOptions:
    prompts: Path
    max_new_tokens: int = 128
    repeats: int = 3
    drafters: list[str] | None = None  # None: every drafter in the manifest
    tree_nodes: list[int] | None = None  # tree sizes to run each tree-building drafter at (None: the recipe's)
    temperature: float = 0.0
    threads: int = 2
    adaptive: bool = True
    peers: list[str] = field(default_factory=list)
    cost_repeats: int = 9
    draft_len: int | None = None
    backend: str | None = None  # None: onnxruntime when the directory has it
    device_kv: bool = True  # tensorrt: KV cache on the GPU (False: host cache, copied every run)
    device: str = "cpu"  # onnxruntime's provider for our engines, and where the transformers peers run
    cpu_curve: Path | None = None  # off the CPU: an earlier CPU bench.json whose cost curve is shown beside
    store_tokens: int | None = None  # a suffix drafter's store of earlier responses (0: off; None: the recipe's)


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
        if "json_schema" in item and not isinstance(item["json_schema"], dict):
            raise BadInput(f"{path}:{number}: 'json_schema' must be a JSON schema object")
        prompts.append({"id": str(item.get("id", f"line{number}")), "category": str(item.get("category", "all")),
                        **item})
    if not prompts:
        raise BadInput(f"{path}: no prompts")
    return prompts


def controls_of(prompt: dict):
    """A prompt's output constraint (its ``json_schema``: structured output), or None."""
    if "json_schema" not in prompt:
        return None
    from specexport.runtime.grammar import GrammarSpec
    from specexport.runtime.rules import Controls

    return Controls(grammar=GrammarSpec("json_schema", json.dumps(prompt["json_schema"]),
                                        f"prompt '{prompt['id']}' json_schema"))


def schema_verdict(prompt: dict, text: str) -> bool | None:
    """Whether a constrained output parses and validates against its prompt's schema (None:
    no schema, or jsonschema not installed)."""
    if "json_schema" not in prompt:
        return None
    try:
        import jsonschema
    except ModuleNotFoundError:
        return None
    try:
        jsonschema.validate(json.loads(text), prompt["json_schema"])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _curve(times: dict[int, float]) -> list[dict]:
    return [{"tokens": size, "ms": round(t * 1e3, 3), "relative": round(t / times[1], 3)}
            for size, t in sorted(times.items())]


def cost_curve(pipe, repeats: int) -> list[dict]:
    """Time of one target pass against the number of tokens it verifies."""
    return _curve(pipe.target.time_engines(pipe.target.sizes, repeats))


def measure_costs(pipe, drafters: list[str], repeats: int, want_logits: bool, draft_len: int,
                  accept_noise: bool = True) -> dict:
    """What the prediction is made of, measured apart from the decode runs: the target's pass
    at every engine size (the cost curve) and the graphs each drafter's round cost reads
    (``Drafter.cost_graphs``), all taken in turn round after round (runner.time_interleaved),
    so a drift of the machine hits them alike; then each drafter's own ``round_cost`` of
    k = 0..D over those measured parts."""
    timed = {"target": (pipe.target, pipe.target.sizes)}
    for name in drafters:
        for part, (runner, sizes) in pipe.drafter(name).cost_graphs().items():
            timed[f"{name}/{part}"] = (runner, sizes)
    samples = time_rounds(timed, repeats, want_logits)
    # calibration refuses scattered rounds (NoisyTimings) before it writes; the bench reports them
    noisy = check_noise(labelled(samples, lambda name, size: f"{name} t{size}"), repeats, accept_noise)
    median = medians(samples)
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
        "noisy": {e.what: round(e.spread, 3) for e in noisy},  # rounds spread past timing_noise.NOISE_LIMIT
    }


TREE_LABEL = "+tree"  # a run at a tree size is labelled "<drafter>+tree<N>"


def run_label(name: str, nodes: int) -> str:
    return f"{name}{TREE_LABEL}{nodes}" if nodes else name


def split_label(label: str) -> tuple[str, int | None]:
    """A run's label -> (drafter name, tree nodes; None: the recipe's default)."""
    name, _, nodes = label.partition(TREE_LABEL)
    return name, int(nodes) if nodes else None


def run_labels(pipe, drafters: list[str], tree_nodes: list[int] | None) -> list[str]:
    """Every drafter, and each one that builds trees once per tree size asked for (0: its chain)."""
    if tree_nodes is None:
        return drafters
    labels = []
    for name in drafters:
        trees = pipe.drafter(name).builds_trees
        for nodes in tree_nodes if trees else [0]:
            pipe.tree_nodes(nodes)  # a size the directory has no tree graph for fails here
            labels.append(run_label(name, nodes) if nodes else name)
    return list(dict.fromkeys(labels))


def _record(drafter: str, prompt: dict, repeat: int, result) -> dict:
    st = result.stats
    return {
        "tree_nodes": st.tree_nodes,
        "verified_tokens": st.verified_tokens,
        "constrained": "json_schema" in prompt,
        "schema_valid": schema_verdict(prompt, result.text),
        "rules_s": st.rules_s,
        "ruled_rows": st.ruled_rows,
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
        "priced_rounds": st.priced_rounds,
        "priced_s": st.priced_s,
        "priced_measured_s": st.priced_measured_s,
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
                if "json_schema" not in prompt:  # the peers cannot constrain their output: not compared there
                    peer_records += _peer_runs(peers, prompt, prompt_ids, repeat, options.max_new_tokens)
                if not ours_first:
                    records += _our_runs(pipe, drafters, prompt, prompt_ids, repeat, options, sampling, depth)
            step.detail = f"{len(prompts)} prompts × {len(drafters) + len(peers)} runs"
    return records, peer_records


def _our_runs(pipe, drafters: list[str], prompt: dict, prompt_ids: list[int], repeat: int, options: BenchOptions,
              sampling: dict, depth: dict) -> list[dict]:
    """One generation of the prompt per run label (the target alone first)."""
    records = []
    for label in drafters:
        name, nodes = split_label(label)
        nodes = tree_setting(pipe, name, nodes, options)
        result = pipe.generate(prompt_ids=prompt_ids, drafter=name, tree_nodes=nodes, seed=repeat,
                               max_new_tokens=options.max_new_tokens, controls=controls_of(prompt), **sampling, **depth)
        records.append({**_record(label, prompt, repeat, result), "tree_setting": nodes})
    return records


def tree_setting(pipe, name: str, nodes: int | None, options: BenchOptions) -> int:
    """The tree nodes a run uses: its label's, 0 for the chain runs of --tree-nodes, else the
    recipe's default for the drafter (draft.tree.drafters)."""
    if nodes is not None:
        return nodes
    if options.tree_nodes is not None or not pipe.drafter(name).builds_trees:
        return 0
    return pipe.tree_nodes(None, name)


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
    from specexport.bench.device import load_options
    from specexport.runtime import load

    pipe = load(engine_dir, threads=options.threads, backend=options.backend, device_kv=options.device_kv,
                store_tokens=options.store_tokens, **load_options(options.device))
    prompts = load_prompts(options.prompts)
    drafters = ["none", *(options.drafters if options.drafters is not None else pipe.manifest.drafters)]
    for name in drafters:
        pipe.drafter(name)  # unknown names fail here, before any timing
    drafters = run_labels(pipe, drafters, options.tree_nodes)
    for prompt in prompts:  # and a schema the grammar engine refuses
        if (controls := controls_of(prompt)) is not None:
            pipe.grammars.check(controls.grammar)
    ids = {
        p["id"]: pipe.prompt_ids(messages=p["messages"]) if "messages" in p else pipe.prompt_ids(p["prompt"])
        for p in prompts
    }
    peers, skipped = [], []
    if options.peers:  # each in a process of its own (bench/peer_process.py says why)
        from specexport.bench.device import peer_device
        from specexport.bench.peer_process import start_peers
        from specexport.bench.peers import draft_model_source

        target = pipe.manifest.target_source
        peers, skipped = start_peers(target, pipe.manifest.recipe_root, options.peers,
                                     options.threads, engine_dir.parent / f".{engine_dir.name}.peers",
                                     peer_device(options.device), draft_model_source(pipe.manifest.recipe))
    try:
        result = _run(pipe, options, reporter, prompts, drafters, ids, peers, skipped)
    finally:
        from specexport.bench.peer_process import close_peers

        close_peers(peers)
    if options.device != "cpu":  # the CPU's curve beside this device's
        from specexport.bench.device import curve_from_file, curve_measured

        with reporter.step("bench", "the CPU's cost curve"):
            result["cost_curve_cpu"] = (curve_from_file(options.cpu_curve) if options.cpu_curve is not None else
                                        curve_measured(engine_dir, options.threads, options.cost_repeats))
    return result


def _run(pipe, options: BenchOptions, reporter, prompts: list[dict], drafters: list[str], ids: dict,
         peers: list, skipped: list[dict]) -> dict:
    sampling = dict(temperature=options.temperature)
    depth = dict(adaptive=options.adaptive, draft_len=options.draft_len)

    with reporter.step("bench", "warm-up"):
        first = ids[prompts[0]["id"]]
        for label in drafters:
            name, nodes = split_label(label)
            pipe.generate(prompt_ids=first, drafter=name, max_new_tokens=8, controls=controls_of(prompts[0]),
                          tree_nodes=tree_setting(pipe, name, nodes, options), **sampling, **depth)
        for peer in peers:
            peer.run(first, 8)
    for store in pipe.stores.values():  # a suffix drafter learns from what it saw: not from the warm-up
        store.clear()

    records, peer_records = _interleaved_runs(pipe, options, reporter, prompts, drafters, ids, peers, sampling, depth)
    # what the timed runs left in the suffix stores (their size, memory and hit rate); the
    # untimed pass below starts from empty stores, so it does not draft from its own answers
    stores = {name: store.stats() for name, store in pipe.stores.items()}
    for store in pipe.stores.values():
        store.clear()

    fixed_records: list[dict] = []
    if options.adaptive and options.temperature == 0.0:
        # Adaptive depth follows this machine's costs, so its E[L] moves from machine to machine;
        # greedy E[L] at the fixed full depth does not: it is what the gate compares (untimed).
        with reporter.step("bench", "acceptance at the fixed full depth") as step:
            for prompt in prompts:
                for label in drafters[1:]:
                    name, nodes = split_label(label)
                    result = pipe.generate(prompt_ids=ids[prompt["id"]], drafter=name, adaptive=False,
                                           max_new_tokens=options.max_new_tokens, **sampling,
                                           draft_len=options.draft_len, controls=controls_of(prompt),
                                           tree_nodes=tree_setting(pipe, name, nodes, options))
                    fixed_records.append({"drafter": label, "prompt_id": prompt["id"],
                                          "tokens": result.stats.tokens, "rounds": result.stats.rounds})
            step.detail = f"{len(prompts)} prompts × {len(drafters) - 1} drafters"

    with reporter.step("bench", "costs (cost curve, draft steps)"):
        costs = measure_costs(pipe, list(dict.fromkeys(split_label(d)[0] for d in drafters)), options.cost_repeats,
                              want_logits=options.temperature > 0,
                              draft_len=options.draft_len or pipe.manifest.draft_len)

    from specexport.bench.summary import summarize
    from specexport.runtime.kernel_probe import model_exactness_summary
    from specexport.runtime.memory import memory

    result = summarize(pipe, options, prompts, drafters, records, peer_records, skipped, costs, fixed_records)
    # the bench process (engines, caches; the peers run in processes of their own): peak and current RSS
    result["memory"] = memory()
    result["engine_costs"] = pipe.costs_source  # what adaptive depth read: "build" or "tuned (host, date)"
    exactness = {name: model_exactness_summary(entry.info) for name, entry in pipe.manifest.models.items()}
    if any(exactness.values()):  # per quantized model or head: what its one-token calls pad, and why (kernel_probe)
        result["exactness"] = {name: summary for name, summary in exactness.items() if summary}
    if stores:
        result["suffix_stores"] = stores
    return result
