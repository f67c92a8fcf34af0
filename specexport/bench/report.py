"""Write a bench result as JSON, a markdown report and PNG plots."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from specexport import atomic


def _paired_cell(row: dict) -> str:
    spread = row.get("speedup_range")
    if row.get("speedup_paired") is None or not spread:
        return "–"
    return f"{_fmt(row['speedup_paired'])}× ({_fmt(spread[0])}–{_fmt(spread[1])})"


def _fmt(value, spec=".2f", none="–"):
    return none if value is None else format(value, spec)


def _memory_line(result: dict) -> list[str]:
    mem = result.get("memory") or {}
    if mem.get("peak_rss_mb") is None:
        return []
    return [f"Peak resident memory {mem['peak_rss_mb']:.0f} MiB (now {_fmt(mem.get('rss_mb'), '.0f')} MiB); "
            f"engine costs: {result.get('engine_costs', 'build')}.", ""]


def _exactness_lines(result: dict) -> list[str]:
    """Per quantized model (target, draft model, int8 head): what its one-token calls pad, and
    which kernels the build's probe found exact alone (by op) and which not."""
    lines = []
    for model, summary in (result.get("exactness") or {}).items():
        exact = Counter(name.split(" ", 1)[0] for name in summary.get("agrees_alone", []))
        why = ("built before the probe" if not summary["probed"] else "; ".join(
            ([] if summary.get("held", True) else ["a drafter not held to agree row for row"])
            + ([f"exact alone: {', '.join(f'{n} {op}' for op, n in exact.items())}"] if exact else [])
            + ([f"differs alone: {'; '.join(summary['differs_alone'])}"] if summary["differs_alone"] else [])))
        flags = f"; CPU flags {', '.join(summary['cpu_flags'])}" if summary["cpu_flags"] else ""
        lines.append(f"Exactness: {model}'s one-token calls pad {summary['pad']} ({why}{flags}).")
    return [*lines, ""] if lines else []


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"# specexport bench: {result['name']}",
        "",
        f"{s['max_new_tokens']} new tokens, {s['repeats']} repeats (median), {s['threads']} threads, "
        f"temperature {s['temperature']}, draft length ≤ {s['draft_len']}"
        f"{' (adaptive)' if s['adaptive'] else ' (fixed)'}; tokens/s exclude the prefill.",
        "",
        *_memory_line(result),
        *_exactness_lines(result),
        "Predicted: the speedup equation at this run's acceptance (E[L] and draft sizes) with costs "
        "measured apart from the runs (below); engines only, so host time is outside it. "
        "Host: decode time outside all engines.",
        "",
        "## By category (medians over prompts)",
        "",
        "| drafter | category | tok/s | speedup | predicted | E[L] | E[L] at fixed D | host | lossless |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["categories"]:
        lossless = {True: "yes", False: "**NO**", None: "n/a"}[row["matches_baseline"]]
        lines.append(
            f"| {row['drafter']} | {row['category']} | {_fmt(row['tokens_per_s'], '.1f')} | "
            f"{_fmt(row['speedup'])}× | {_fmt(row['predicted_speedup'])}× | {_fmt(row['acceptance_length'])} | "
            f"{_fmt(row.get('acceptance_length_fixed'))} | {_fmt(row.get('host_fraction'), '.1%')} | {lossless} |"
        )
    constrained = [r for r in result["results"] if r.get("constrained")]
    if constrained:
        lines += ["", "## Structured output (prompts with a json_schema)", "",
                  "Schema-valid: the share of runs whose output parsed and validated against the prompt's "
                  "schema. Mask: ms per ruled row (grammar mask and rules) and its share of decode time.", "",
                  "| drafter | prompt | tokens | schema-valid | mask ms/row | mask share |", "|---|---|---|---|---|---|"]
        for r in sorted(constrained, key=lambda r: (r["prompt_id"], r["drafter"])):
            lines.append(f"| {r['drafter']} | {r['prompt_id']} | {r['tokens']} | {_fmt(r['schema_valid'], '.0%')} | "
                         f"{_fmt(r['mask_ms_per_row'], '.3f')} | {_fmt(r['mask_fraction'], '.1%')} |")
    lines += ["", "## Per prompt", "",
              "speedup: median tok/s over the target alone's median; paired: the median of each repeat's "
              "ratio to the target alone in the same repeat, with the lowest and highest.", "",
              "| drafter | prompt | tok/s | speedup | paired (range) | predicted | E[L] | draft/verify/host "
              "(drafter's host) | round ms priced/measured |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(result["results"], key=lambda r: (r["prompt_id"], r["drafter"])):
        split = "/".join(_fmt(r[k], ".0%") for k in ("draft_fraction", "verify_fraction", "host_fraction"))
        split += f" ({_fmt(r.get('draft_host_fraction'), '.0%')})"
        lines.append(f"| {r['drafter']} | {r['prompt_id']} | {_fmt(r['tokens_per_s'], '.1f')} | "
                     f"{_fmt(r['speedup'])}× | {_paired_cell(r)} | {_fmt(r['predicted_speedup'])}× | "
                     f"{_fmt(r['acceptance_length'])} | {split} "
                     f"| {_fmt(r.get('priced_ms_per_round'), '.2f')}/{_fmt(r.get('measured_ms_per_round'), '.2f')} |")
    lines += _curve_lines(result)
    costs = result.get("costs")
    if costs:
        verify = ", ".join(f"k={k}: {ms:.2f}" for k, ms in enumerate(costs["verify_ms"]))
        parts = "; ".join(f"{name}: " + ", ".join(f"{part} T={t} {ms:.2f}" for part, by_t in by_part.items()
                                                    for t, ms in by_t.items())
                          for name, by_part in costs.get("draft_parts_ms", {}).items()) or "none"
        rounds = "; ".join(f"{name}: " + ", ".join(f"{ms:.2f}" for ms in by_k)
                           for name, by_k in costs["draft_ms"].items()) or "none"
        lines += ["", f"## Costs behind the prediction (ms, medians of {costs['repeats']} round-robin timings"
                  f"{', logits copied out' if costs['logits'] else ''})", "",
                  f"- verify pass with k drafts: {verify}", f"- the drafters' graphs: {parts}",
                  f"- a drafter's round of k = 0, 1, ... drafts (its own cost model): {rounds}"]
    if result["peers"] or result["peers_skipped"]:
        lines += ["", "## Peers (same model: fp32 on the CPU, fp16 on a GPU, or int4 where the peer says so)", "", "| peer | threads | prompt | tok/s | vs our baseline | same greedy output | same as its own plain run |",
                  "|---|---|---|---|---|---|---|"]
        for p in result["peers"]:
            same, own = ({True: "yes", False: "no", None: "n/a"}[p.get(k)] for k in ("matches_baseline", "matches_own_plain"))
            lines.append(f"| {p['peer']} | {p['threads']} | {p['prompt_id']} | {_fmt(p['tokens_per_s'], '.1f')} | "
                         f"{_fmt(p['relative_to_baseline'])}× | {same} | {own} |")
        for skipped in result["peers_skipped"]:
            lines.append(f"\n- {skipped['peer']}: skipped ({skipped['skipped']})")
    return "\n".join(lines) + "\n"


def _curve_lines(result: dict) -> list[str]:
    """The verify cost curve, with the CPU's beside it (cost_curve_cpu) where the bench ran on a GPU."""
    tile = result["tile_point"]
    device = result["settings"].get("device", "cpu")
    cpu = result.get("cost_curve_cpu")
    lines = ["", f"## Verify cost curve on {device} (tile rule: 1+D = {tile['tokens']} for G = {tile['group_size']})", ""]
    if cpu is None:
        lines += ["| tokens | ms | relative to 1 |", "|---|---|---|"]
    else:
        lines += [f"CPU curve: {cpu['source']}" + (f" ({cpu['error']})" if cpu.get("error") else "")
                  + (f", {cpu['threads']} threads" if cpu.get("threads") else "") + ".", "",
                  f"| tokens | {device} ms | {device} relative to 1 | CPU ms | CPU relative to 1 |", "|---|---|---|---|---|"]
    by_tokens = {c["tokens"]: c for c in (cpu or {}).get("curve", [])}
    for point in result["cost_curve"]:
        mark = " ← tile rule" if point["tokens"] == tile["tokens"] else ""
        row = f"| {point['tokens']}{mark} | {point['ms']:.2f} | {point['relative']:.2f}× |"
        if cpu is not None:
            other = by_tokens.get(point["tokens"])
            row += f" {_fmt(other and other['ms'])} | {_fmt(other and other['relative'])}{'×' if other else ''} |"
        lines.append(row)
    return lines


def plots(result: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    written = []
    curve = result["cost_curve"]
    cpu = (result.get("cost_curve_cpu") or {}).get("curve")
    device = result["settings"].get("device", "cpu")
    fig, ax = plt.subplots(figsize=(6, 4))
    # beside the CPU's: both relative to their one-token pass (their ms are far apart)
    key = "relative" if cpu else "ms"
    ax.plot([c["tokens"] for c in curve], [c[key] for c in curve], "o-", label=f"verify pass ({device})")
    if cpu:
        ax.plot([c["tokens"] for c in cpu], [c[key] for c in cpu], "s--", label="verify pass (cpu)")
    tile = result["tile_point"]
    ax.axvline(tile["tokens"], color="grey", linestyle="--", label=f"tile rule 1+D = {tile['tokens']}")
    ax.set_xlabel("tokens per verify pass (1+D)")
    ax.set_ylabel("relative to one token" if cpu else "ms per pass")
    ax.set_xscale("log", base=2)
    ax.set_title("verify cost on this device")
    ax.legend()
    fig.tight_layout()
    written.append(out / "cost_curve.png")
    _save(fig, written[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for drafter in result["settings"]["drafters"][1:]:
        rows = [r for r in result["results"] if r["drafter"] == drafter]
        depth = max((len(r["acceptance_by_position"]) for r in rows), default=0)
        rates = []
        for i in range(depth):
            # a long drafter's rows are as long as their deepest round (past D): the others end sooner
            values = [r["acceptance_by_position"][i] for r in rows
                      if i < len(r["acceptance_by_position"]) and r["acceptance_by_position"][i] is not None]
            rates.append(sum(values) / len(values) if values else None)
        xs = [i + 1 for i, v in enumerate(rates) if v is not None]
        ax.plot(xs, [v for v in rates if v is not None], "o-", label=drafter)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted when proposed")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("acceptance by position")
    fig.tight_layout()
    written.append(out / "acceptance.png")
    _save(fig, written[-1])
    plt.close(fig)

    categories = sorted({r["category"] for r in result["categories"]})
    runners = result["settings"]["drafters"] + sorted({p["peer"] for p in result["peers"]})
    fig, ax = plt.subplots(figsize=(max(6, len(categories) * 1.5), 4))
    width = 0.8 / max(len(runners), 1)
    for j, name in enumerate(runners):
        values = []
        for category in categories:
            rows = [r for r in result["categories"] if r["drafter"] == name and r["category"] == category]
            if rows:
                values.append(rows[0]["tokens_per_s"] or 0)
            else:
                peer = [p["tokens_per_s"] for p in result["peers"] if p["peer"] == name and p["category"] == category
                        and p["tokens_per_s"]]
                values.append(sorted(peer)[len(peer) // 2] if peer else 0)
        ax.bar([i + j * width for i in range(len(categories))], values, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(categories))], categories, rotation=20)
    ax.set_ylabel("tokens/s")
    ax.set_title("decode tokens/s by drafter and category")
    ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(out / "tokens_per_s.png")
    _save(fig, written[-1])
    plt.close(fig)
    return written


def _save(fig, path: Path) -> None:
    with atomic.atomic_path(path) as tmp:  # the temporary keeps the .png suffix matplotlib reads
        fig.savefig(tmp, dpi=120)


def write(result: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    atomic.write_text(out / "bench.json", json.dumps(result, indent=1))
    atomic.write_text(out / "bench.md", markdown(result))
    files = [out / "bench.json", out / "bench.md"]
    try:
        files += plots(result, out)
    except ImportError:
        pass  # matplotlib is the `bench` extra; the JSON and markdown are complete without it
    return files
