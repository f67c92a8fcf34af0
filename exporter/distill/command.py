"""The distill run: a recipe's target teaches a drafter head, within a time budget.

1. the recipe and its target (the project's loaders), the plan's draft length D;
2. data: the target's own responses to ``--prompts`` (greedy, plus sampled ones) and
   ``--data`` text, a held-out split, the draft vocabulary (or, with ``--resume``, all of it
   from the checkpoint);
3. training (EAGLE-3 with training-time test, DFlash or DSpark blocks at random anchors) until
   ``--minutes`` or ``--max-steps``, the held-out split scored every ``--eval-minutes``, each
   score also a checkpoint;
4. a final score and checkpoint. Ctrl-C keeps the last checkpoint (``checkpoint.py``).
"""

from __future__ import annotations

import contextlib
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specexport.errors import BadInput, SpecexportError
from specexport.exporter.distill import DRAFTER_KINDS, TRAINED_KINDS, checkpoint
from specexport.exporter.distill.data import (
    Sequences,
    check_lines,
    choose_vocab,
    data_sequences,
    file_sha256,
    generate,
    prompt_ids,
    read_jsonl,
    split_holdout,
    vocab_coverage,
)
from specexport.progress import Reporter

MAX_DATA_TOKENS = 2048  # a --data line is cut to this many tokens
EVAL_SEQUENCES = 64  # held-out sequences scored at each checkpoint (all of them at the end)
DEFAULT_MARKOV_RANK = 32
BLOCK_KINDS = ("dflash", "dspark")  # drafters trained as blocks at random anchors


class Interrupted(SpecexportError):
    """Ctrl-C or SIGTERM during a run: the last checkpoint stays."""

    exit_code = 130


@dataclass
class DistillOptions:
    recipe: Path
    drafter: str
    out: Path
    minutes: float = 10.0  # training time of this run (data preparation not counted)
    device: str = "cpu"
    prompts: list[Path] = field(default_factory=list)
    data: list[Path] = field(default_factory=list)
    resume: bool = False
    init: Path | None = None  # eagle3: start from this trained head (its weights, draft vocabulary, taps)
    force: bool = False
    seed: int = 0
    max_steps: int | None = None  # optimizer steps in all (resumed runs included)
    eval_minutes: float = 2.0
    samples: int = 1  # sampled responses per training prompt, besides the greedy one
    temperature: float = 0.7
    max_new: int = 256
    gen_batch: int = 64
    holdout: float = 0.05
    draft_vocab: int = 8192
    topk: int = 64
    ttt_steps: int = 5
    batch_tokens: int = 8192
    lr: float = 1e-3
    warmup: int = 100
    layers: list[int] | None = None
    block_size: int | None = None  # dflash/dspark: the block; default the plan's D + 1 (dspark: D, the anchor drafts)
    draft_layers: int = 1  # dflash/dspark: decoder layers of the head
    anchors: int = 64  # dflash/dspark: blocks per sequence per step
    gamma: float | None = None  # dflash/dspark: loss decay over the drafting slots; default by the drafts
    markov_rank: int | None = None  # dspark: rank of the Markov head; default DEFAULT_MARKOV_RANK
    cache_dir: Path | None = None
    cache_gb: float = 4.0
    quiet: bool = False


# settings a resumed run keeps from the first one (the data and the model's shape depend on them)
KEPT_ON_RESUME = ("seed", "samples", "temperature", "max_new", "holdout", "draft_vocab", "topk", "ttt_steps",
                  "batch_tokens", "lr", "warmup", "block_size", "draft_layers", "anchors", "gamma", "markov_rank")


def check_options(opts: DistillOptions) -> None:
    if opts.drafter not in DRAFTER_KINDS:
        raise BadInput(f"--drafter: unknown kind '{opts.drafter}' (one of {', '.join(DRAFTER_KINDS)})")
    if opts.drafter not in TRAINED_KINDS:
        raise BadInput(f"--drafter {opts.drafter}: training is not yet supported (supported: {', '.join(TRAINED_KINDS)})")
    if opts.device not in ("cpu", "cuda"):
        raise BadInput(f"--device: '{opts.device}' is not cpu or cuda")
    if opts.drafter == "eagle3" and opts.layers is not None and len(opts.layers) != 3:
        raise BadInput(f"--layers: EAGLE-3 reads three target layers, got {len(opts.layers)}")
    if opts.layers is not None and len(set(opts.layers)) != len(opts.layers) and opts.drafter in BLOCK_KINDS:
        raise BadInput(f"--layers: {opts.layers} repeats a layer (block heads read distinct target layers)")
    if opts.drafter not in BLOCK_KINDS and (opts.block_size is not None or opts.draft_layers != 1
                                            or opts.gamma is not None):
        raise BadInput("--block-size, --draft-layers and --gamma are DFlash settings (--drafter dflash or dspark)")
    if opts.drafter != "dspark" and opts.markov_rank is not None:
        raise BadInput("--markov-rank is a DSpark setting (--drafter dspark)")
    if opts.markov_rank is not None and opts.markov_rank < 1:
        raise BadInput(f"--markov-rank: {opts.markov_rank} is not a positive rank")
    if opts.drafter == "dspark" and opts.block_size is not None and opts.block_size < 2:
        raise BadInput(f"--block-size: {opts.block_size} is below 2 (the dspark layout's least block)")
    if opts.init is not None:
        if opts.drafter != "eagle3":
            raise BadInput(f"--init: fine-tuning from a trained head is supported for --drafter eagle3, "
                           f"not {opts.drafter}")
        if opts.resume:
            raise BadInput("--init and --resume contradict each other (--resume continues its own checkpoint)")
        if opts.init.resolve() == opts.out.resolve():
            raise BadInput(f"--init {opts.init}: is the output folder too; write the fine-tuned head elsewhere (-o)")
    out = opts.out
    if out.exists() and not out.is_dir():
        raise BadInput(f"-o {out}: is a file; choose a folder")
    if opts.resume:
        if opts.force:
            raise BadInput("--resume and --force contradict each other (continue, or start over)")
        if not checkpoint.has_state(out):
            raise BadInput(f"--resume: {out} holds no distill checkpoint (state/state.json); run without --resume")
    elif out.is_dir() and any(out.iterdir()):
        ours = checkpoint.has_state(out) or (out / checkpoint.PROVENANCE).is_file()
        if not ours:
            raise BadInput(f"-o {out}: folder exists and is not a distill output; choose another -o or remove it")
        if not opts.force:
            raise BadInput(f"-o {out}: holds an earlier distill run; continue it with --resume or start over with --force")
    if not opts.resume and not opts.prompts and not opts.data:
        raise BadInput("distill needs training text: --prompts FILE.jsonl (the target answers them) "
                       "and/or --data FILE.jsonl")


def _device(name: str):
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise BadInput("--device cuda: no CUDA device is available to torch here; use --device cpu")
    return torch.device(name)


def _note_bench_prompts(paths: list[Path], rep: Reporter) -> None:
    for p in paths:
        if p.resolve().parent.name == "prompts" and p.resolve().parent.parent.name == "bench":
            rep.warn(f"{p} is the bench's prompt set: a head trained on it inflates the bench's E[L]")


def read_inputs(opts: DistillOptions) -> dict[str, list[tuple[Path, list[tuple[int, dict]]]]]:
    """Every --prompts and --data file read and checked (before the target is loaded)."""
    inputs: dict[str, list[tuple[Path, list[tuple[int, dict]]]]] = {"--prompts": [], "--data": []}
    for option, paths in (("--prompts", opts.prompts), ("--data", opts.data)):
        for path in paths:
            items = read_jsonl(path, option)
            check_lines(items, path, option)
            inputs[option].append((path, items))
    return inputs


def build_data(opts: DistillOptions, inputs: dict, target, device, rep: Reporter,
               rng: random.Random) -> tuple[Sequences, dict]:
    """The training sequences (see data.py) and their record for the provenance."""
    tok = target.tokenizer
    record: dict = {"prompts": [], "data": []}
    prompts: list[np.ndarray] = []
    for path, items in inputs["--prompts"]:
        prompts += prompt_ids(tok, items, path)
        record["prompts"].append({"path": str(path), "sha256": file_sha256(path), "lines": len(items)})
    extra: list[tuple[np.ndarray, int]] = []
    for path, items in inputs["--data"]:
        extra += data_sequences(tok, items, path, MAX_DATA_TOKENS)
        record["data"].append({"path": str(path), "sha256": file_sha256(path), "lines": len(items)})
    if len(prompts) + len(extra) < 2:
        raise BadInput("distill needs at least two prompts or data lines (one is held out)")
    seqs = Sequences()
    held = split_holdout(len(prompts) + len(extra), opts.holdout, rng)
    eos = _eos_ids(target)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    if prompts:
        gen = dict(max_new=opts.max_new, batch=opts.gen_batch, eos_ids=eos, pad_id=pad, device=device)
        passes = [(list(range(len(prompts))), 0.0)] + [
            ([i for i in range(len(prompts)) if i not in held], opts.temperature)] * opts.samples
        for n, (members, temperature) in enumerate(passes):
            what = f"{len(members)} responses, " + ("greedy" if temperature == 0 else f"T={temperature}")
            with rep.step("generate", what) as s:
                answers = generate(target.model, [prompts[i] for i in members], temperature=temperature,
                                   seed=opts.seed + n, **gen)
                kept = 0
                for i, answer in zip(members, answers):
                    if answer is not None and len(answer):
                        seqs.add(np.concatenate((prompts[i], answer)), len(prompts[i]), i in held, temperature == 0)
                        kept += 1
                s.detail = f"{kept} kept"
    for k, (ids, start) in enumerate(extra):
        seqs.add(ids, start, len(prompts) + k in held, False)
    if not seqs.members(holdout=True):
        raise BadInput("--holdout: no held-out sequence; give more prompts or a larger --holdout")
    if not seqs.members(holdout=False):
        raise BadInput("--holdout: nothing left to train on; give more prompts or a smaller --holdout")
    record["stats"] = seqs.stats()
    return seqs, record


def _eos_ids(target) -> list[int]:
    eos = target.model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    ids = [int(e) for e in eos if e is not None]
    if target.tokenizer.eos_token_id is not None and target.tokenizer.eos_token_id not in ids:
        ids.append(int(target.tokenizer.eos_token_id))
    return ids or [0]


def distill(opts: DistillOptions, rep: Reporter | None = None,
            on_event: Callable[[str, int], None] | None = None) -> dict:
    """Run distillation; returns the provenance record (also DIR/distill.json). ``on_event(kind,
    step)`` is called after each optimizer step ("step") and checkpoint ("checkpoint")."""
    rep = rep or Reporter(quiet=opts.quiet)
    check_options(opts)
    from specexport.exporter.recipe import load_recipe

    recipe, base = load_recipe(opts.recipe)
    inputs = read_inputs(opts) if not opts.resume else {"--prompts": [], "--data": []}
    init = checkpoint.read_head(opts.init) if opts.init is not None else None
    device = _device(opts.device)
    cache = Path(tempfile.mkdtemp(prefix="specexport-distill-", dir=opts.cache_dir))
    try:
        return _run(opts, inputs, init, recipe, base, device, cache, rep, on_event or (lambda kind, step: None))
    finally:
        shutil.rmtree(cache, ignore_errors=True)


@dataclass
class _Head:
    """What the run needs of the head being trained, whichever kind it is."""

    module: Any  # torch module; checkpoint_names() -> {tensor name: parameter}
    config: dict  # config.json
    layout: str  # the layout its loader reads
    params: list  # what the optimizer trains
    step: Callable[[list[int], float], float]  # (batch members, lr) -> loss
    score: Callable[[list[int]], dict]  # held-out members -> figures
    facts: dict = field(default_factory=dict)  # kind-specific settings kept for --resume and the provenance


def _eagle3_head(s: dict, cfg, taps, draft_ids, d: int, longest: int, target, teacher, seqs, draft_t, draft_of,
                 device) -> _Head:
    import torch

    from specexport.exporter.distill.eagle3_model import Eagle3Draft, head_config, rope_tables
    from specexport.exporter.distill.eagle3_train import assemble, evaluate, train_step

    config = head_config(cfg, taps, len(draft_ids))
    embed = target.model.get_input_embeddings().weight.detach().float().to(device)  # [V, H]
    head = Eagle3Draft(config, len(taps), embed, rope_tables(config, longest + max(s["ttt_steps"], d) + 2)).to(device)
    with torch.no_grad():  # lm_head starts from the target's output rows of the draft vocabulary
        head.lm_head.weight.copy_(target.model.get_output_embeddings().weight.detach().float()[draft_t])

    def step(members, lr):  # step.opt: the optimizer, set once the head exists
        batch = assemble(teacher, seqs, members, s["ttt_steps"], device)
        return train_step(head, step.opt, batch, s["ttt_steps"], draft_of, lr, device)

    def score(members):
        return evaluate(head, teacher, seqs, members, s["ttt_steps"], d, draft_t, draft_of, s["batch_tokens"], device)

    return _Head(head, config, "safeailab", list(head.parameters()), step, score)


def _block_facts(kind: str, s: dict, cfg, d: int, target, seqs) -> dict:
    """What fixes a new block head's shape and loss (kept for --resume and the provenance)."""
    from specexport.exporter.distill.dflash_train import default_gamma, mask_token

    # DSpark's anchor slot drafts too: a block of B drafts B tokens (the dspark layout's least block is 2)
    block = s["block_size"] or (max(2, d) if kind == "dspark" else d + 1)
    drafts = block if kind == "dspark" else block - 1
    special = list(getattr(target.tokenizer, "all_special_ids", []) or [])
    facts = {"block_size": block, "draft_layers": s["draft_layers"], "gamma": s["gamma"] or default_gamma(drafts + 1),
             "mask_token_id": mask_token(seqs, cfg.vocab_size, special)}
    if kind == "dspark":
        facts["markov_rank"] = s["markov_rank"] or DEFAULT_MARKOV_RANK
    return facts


def _block_head(kind: str, s: dict, cfg, taps, draft_ids, d: int, longest: int, target, teacher, seqs, draft_t,
                draft_of, device, facts: dict | None) -> _Head:
    """A DFlash or DSpark head (DSpark: the DFlash block and its training, plus its two heads)."""
    import torch

    from specexport.exporter.distill import dflash_model, dflash_train, dspark_model, dspark_train
    from specexport.exporter.distill.eagle3_train import assemble

    facts = facts or _block_facts(kind, s, cfg, d, target, seqs)
    block, gamma = facts["block_size"], facts["gamma"]
    shape = (cfg, taps, len(draft_ids), block, facts["draft_layers"], facts["mask_token_id"])
    if kind == "dspark":
        config, model, train = dspark_model.head_config(*shape, facts["markov_rank"]), dspark_model.DSparkDraft, dspark_train
    else:
        config, model, train = dflash_model.head_config(*shape), dflash_model.DFlashDraft, dflash_train
    embed = target.model.get_input_embeddings().weight.detach().float().to(device)  # [V, H]
    lm_head = target.model.get_output_embeddings().weight.detach().float().to(device)[draft_t]  # [V_d, H]
    head = model(config, embed, lm_head, dflash_model.rope_tables(config, longest + block + 2)).to(device)
    gen = torch.Generator().manual_seed(s["seed"])

    def step(members, lr):
        batch = assemble(teacher, seqs, members, block, device)
        return train.train_step(head, step.opt, batch, s["anchors"], draft_of, gamma, lr, device, gen)

    def score(members):
        return train.evaluate(head, teacher, seqs, members, d, s["anchors"], draft_t, draft_of, gamma,
                              s["batch_tokens"], device)

    return _Head(head, config, "speculators", head.trainable(), step, score, facts)


def _run(opts, inputs, init: checkpoint.InitHead | None, recipe, base, device, cache: Path, rep: Reporter,
         on_event) -> dict:
    """The run after its inputs are checked: target, data, head, then the training loop."""
    import torch

    from specexport.exporter.plan import plan_recipe_draft

    t_start = time.time()
    state = checkpoint.read(opts.out) if opts.resume else None
    s = _settings(opts, state, init, rep)
    torch.manual_seed(s["seed"] + (state.info["step"] if state else 0))
    target, origin = _load_target(opts, recipe, base, device, state, rep)
    cfg = target.model.config
    heads = cfg.num_attention_heads
    d = plan_recipe_draft(recipe, base, heads, getattr(cfg, "num_key_value_heads", None) or heads).draft_len
    taps = _choose_taps(opts, state, init, cfg)
    seqs, draft_ids, data_record = _training_data(opts, inputs, state, init, target, device, rep, s)
    rep.note(f"data: {seqs.stats()}; draft vocabulary {len(draft_ids)} "
             f"(covers {data_record['vocabulary']['response_coverage']:.1%} of response tokens); D = {d}")
    trained, opt = _build_head(opts, s, cfg, taps, draft_ids, d, target, seqs, device, cache, state, init)
    if trained.facts:
        rep.note(f"{opts.drafter}: {trained.facts}, taps {list(taps)}")
    info = _start_record(opts, state, s, taps, origin, data_record, trained)
    training = _Training(opts, s, info, trained, opt, seqs, draft_ids, cfg.vocab_size, d, rep, on_event, t_start)
    return training.run()


def _settings(opts: DistillOptions, state: checkpoint.TrainState | None, init: checkpoint.InitHead | None,
              rep: Reporter) -> dict:
    """The run's settings: the options, with a resumed run's data-defining ones from its first
    run and an --init head's draft vocabulary size."""
    settings = asdict(opts)
    if state is not None:  # the first run's data-defining settings
        if state.info.get("drafter", "eagle3") != opts.drafter:
            raise BadInput(f"--resume: {opts.out} holds a {state.info.get('drafter', 'eagle3')} head, not "
                           f"--drafter {opts.drafter}")
        settings.update({k: state.info["settings"][k] for k in KEPT_ON_RESUME if k in state.info["settings"]})
        if opts.prompts or opts.data:
            rep.warn("--resume continues with the first run's data: --prompts/--data are ignored")
    if init is not None:  # the head fixes the draft vocabulary
        settings["draft_vocab"] = len(init.draft_ids)
    return settings


def _load_target(opts: DistillOptions, recipe, base, device, state: checkpoint.TrainState | None,
                 rep: Reporter) -> tuple[Any, dict]:
    """The recipe's target on ``device`` and its origin record (a resumed run's must match)."""
    from specexport.exporter.sources import fingerprint, load_source

    with rep.step("load", "target") as st:
        target = load_source(recipe.target, base, "target")
        target.model.to(device)
        cfg = target.model.config
        st.detail = f"{cfg.model_type}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}"
    origin = {"recipe": str(opts.recipe), "source": recipe.target.model_dump(mode="json"),
              "fingerprint": fingerprint(recipe.target, base, "target")}
    if state is not None and state.info["target"]["fingerprint"] != origin["fingerprint"]:
        raise BadInput(f"--resume: {opts.out} was trained for another target than {opts.recipe}'s; start over with --force")
    return target, origin


def _choose_taps(opts: DistillOptions, state: checkpoint.TrainState | None, init: checkpoint.InitHead | None,
                 cfg) -> tuple[int, ...]:
    """The target layers the head reads: a resumed run's, an --init head's, --layers, or the kind's default."""
    from specexport.exporter.distill import dflash_model
    from specexport.exporter.heads.eagle3 import default_taps

    n_layers = cfg.num_hidden_layers
    if state is not None:
        return tuple(state.info["taps"])
    if init is not None:
        taps = tuple(init.taps or default_taps(n_layers))
        if opts.layers is not None and tuple(opts.layers) != taps:
            raise BadInput(f"--layers {opts.layers}: the --init head reads layers {list(taps)}; leave --layers out")
        if int(init.draft_ids[-1]) >= cfg.vocab_size:
            raise BadInput(f"--init {opts.init}: its draft vocabulary names token {int(init.draft_ids[-1])}, "
                           f"past the target's {cfg.vocab_size}; it was trained for another target")
        return taps
    defaults = default_taps if opts.drafter == "eagle3" else dflash_model.default_taps  # dspark: DFlash's
    taps = tuple(opts.layers) if opts.layers is not None else tuple(defaults(n_layers))
    if not all(0 <= i < n_layers for i in taps):
        raise BadInput(f"--layers: {list(taps)} must be target layers in 0..{n_layers - 1}")
    return taps


def _training_data(opts: DistillOptions, inputs: dict, state: checkpoint.TrainState | None,
                   init: checkpoint.InitHead | None, target, device, rep: Reporter,
                   s: dict) -> tuple[Sequences, np.ndarray, dict]:
    """(sequences, draft vocabulary, data record): built from the inputs, or a resumed run's."""
    if state is not None:
        return state.sequences, state.draft_ids, state.info["data"]
    vocab = target.model.config.vocab_size
    _note_bench_prompts(opts.prompts, rep)
    seqs, data_record = build_data(opts, inputs, target, device, rep, random.Random(s["seed"]))
    if init is not None:  # the head's own vocabulary, and how much of the new data it covers
        draft_ids, coverage = init.draft_ids, vocab_coverage(seqs, vocab, init.draft_ids)
        data_record["init"] = {"path": str(opts.init), "sha256": file_sha256(opts.init / "model.safetensors")}
    else:
        draft_ids, coverage = choose_vocab(seqs, vocab, s["draft_vocab"])
    data_record["vocabulary"] = coverage
    return seqs, draft_ids, data_record


def _build_head(opts: DistillOptions, s: dict, cfg, taps, draft_ids: np.ndarray, d: int, target, seqs: Sequences,
                device, cache: Path, state: checkpoint.TrainState | None, init: checkpoint.InitHead | None):
    """The head being trained on ``device`` (with a resumed run's or an --init head's weights),
    its teacher, and its optimizer (a resumed run's moments)."""
    import torch

    from specexport.exporter.distill.teacher import Teacher

    longest = max(len(x) for x in seqs.ids)
    draft_t = torch.from_numpy(draft_ids).to(device)
    draft_of = torch.full((cfg.vocab_size,), -1, dtype=torch.long, device=device)
    draft_of[draft_t] = torch.arange(len(draft_ids), device=device)
    teacher = Teacher(target.model, taps, draft_ids, s["topk"], device, cache, int(opts.cache_gb * 2**30),
                      s["batch_tokens"])
    parts = (s, cfg, taps, draft_ids, d, longest, target, teacher, seqs, draft_t, draft_of, device)
    if opts.drafter == "eagle3":
        trained = _eagle3_head(*parts)
    else:
        trained = _block_head(opts.drafter, *parts, state.info.get("head") if state is not None else None)
    if state is not None:
        load_weights(trained.module, state.weights, f"--resume: {opts.out}/state/head.safetensors",
                     "start over with --force")
    elif init is not None:
        load_weights(trained.module, init.weights, f"--init: {opts.init}/model.safetensors",
                     "it must be an EAGLE-3 head of this target's hidden size")
    opt = torch.optim.AdamW(trained.params, lr=s["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    if state is not None:
        opt.load_state_dict(state.optimizer)
    trained.step.opt = opt
    return trained, opt


def _start_record(opts: DistillOptions, state: checkpoint.TrainState | None, s: dict, taps, origin: dict,
                  data_record: dict, trained: _Head) -> dict:
    """The run's record (a resumed run's, continued), with this run appended to its runs."""
    info: dict = state.info if state is not None else {
        "step": 0, "epoch": 0, "train_seconds": 0.0, "wall_seconds": 0.0, "curve": [], "runs": []}
    info.update(settings={k: (str(v) if isinstance(v, Path) else v) for k, v in s.items()
                          if k not in ("prompts", "data", "cache_dir", "out", "recipe")},
                taps=list(taps), target=origin, data=data_record, drafter=opts.drafter)
    if trained.facts:
        info["head"] = trained.facts
    info["runs"].append({"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": opts.device,
                         "minutes": opts.minutes, "from_step": info["step"]})
    return info


class _Training:
    """The training loop of one run: steps until ``--minutes`` or ``--max-steps``, the held-out
    score and a checkpoint every ``--eval-minutes``, then the final score and checkpoint."""

    def __init__(self, opts: DistillOptions, s: dict, info: dict, trained: _Head, opt, seqs: Sequences,
                 draft_ids: np.ndarray, vocab: int, d: int, rep: Reporter, on_event, t_start: float):
        self.opts, self.s, self.info, self.trained, self.opt = opts, s, info, trained, opt
        self.seqs, self.draft_ids, self.vocab, self.d, self.rep, self.on_event = seqs, draft_ids, vocab, d, rep, on_event
        self.t_start = t_start
        self.run_record = info["runs"][-1]
        self.wall_before, self.train_before = info["wall_seconds"], info["train_seconds"]
        self.written: int | None = None  # the step of the last checkpoint written

    def save(self, final: dict | None) -> dict:
        """Write the checkpoint (the head, its provenance, the training state); returns the provenance."""
        from specexport import __version__

        info, trained = self.info, self.trained
        info["wall_seconds"] = round(self.wall_before + time.time() - self.t_start, 1)
        self.run_record["to_step"] = info["step"]
        provenance = {"specexport": __version__, "drafter": self.opts.drafter, "layout": trained.layout,
                      "draft_len": self.d, "target": info["target"], "taps": info["taps"], "data": info["data"],
                      "steps": info["step"], "epochs": info["epoch"], "train_seconds": round(info["train_seconds"], 1),
                      "wall_seconds": info["wall_seconds"], "runs": info["runs"], "settings": info["settings"],
                      "curve": info["curve"], "final": final}
        if trained.facts:
            provenance["head"] = trained.facts
        weights = {k: v.detach().float().cpu() for k, v in trained.module.checkpoint_names().items()}
        train_state = checkpoint.TrainState(weights, self.opt.state_dict(), self.seqs, self.draft_ids, info)
        checkpoint.write(self.opts.out, trained.config, weights, self.draft_ids, self.vocab, provenance, train_state)
        self.written = info["step"]
        self.on_event("checkpoint", info["step"])
        return provenance

    def record(self, result: dict) -> None:
        """Add a held-out score to the curve and say it."""
        info = self.info
        if info["curve"] and info["curve"][-1]["step"] == info["step"]:
            info["curve"].pop()  # the final score replaces a periodic one of the same step
        info["curve"].append({"step": info["step"], "train_minutes": round(info["train_seconds"] / 60, 3), **result})
        accept = result["acceptance"]
        self.rep.note(f"held-out at step {info['step']}: loss {result['loss']:.4f}"
                      + (f", acceptance per position {accept}, E[L] {result['expected_length']} at D={self.d}"
                         if accept else "")
                      + _confidence_note(result))

    def run(self) -> dict:
        """Score the untrained head (a new run), train, score and write the final checkpoint;
        Ctrl-C keeps the last checkpoint."""
        info, eval_all = self.info, self.seqs.members(holdout=True)
        with StopRequests() as stops:
            try:
                if not info["curve"]:
                    with self.rep.step("score", "untrained head (held-out)"):
                        self.record(self.trained.score(eval_all[:EVAL_SEQUENCES]))
                t_train = time.time()
                self.train(stops, t_train, eval_all[:EVAL_SEQUENCES])
                info["train_seconds"] = self.train_before + time.time() - t_train
                with self.rep.step("score", f"final, {len(eval_all)} held-out sequences"):
                    final = self.trained.score(eval_all)
                self.record(final)
                with self.rep.step("write", str(self.opts.out)), stops.held():
                    return self.save(final)  # a stop asked for meanwhile: the run is complete anyway
            except KeyboardInterrupt:
                where = (f"{self.opts.out} holds the checkpoint of step {self.written}; continue with --resume"
                         if self.written is not None else "no checkpoint was written")
                raise Interrupted(f"interrupted at step {info['step']}; {where}") from None

    def train(self, stops: StopRequests, t_train: float, eval_some: list[int]) -> None:
        """Optimizer steps over shuffled epochs until the time budget or --max-steps; the
        learning rate warms up, then follows a cosine over the run's progress."""
        from specexport.exporter.distill.eagle3_train import learning_rate, make_batches

        info, s, opts = self.info, self.s, self.opts
        budget = opts.minutes * 60.0
        total_budget = self.train_before + budget
        max_steps = opts.max_steps
        train_members = self.seqs.members(holdout=False)
        lengths = [len(x) for x in self.seqs.ids]
        next_eval = t_train + opts.eval_minutes * 60
        with _progress(self.rep) as bar:
            task = bar.add_task("train", total=1000, loss=float("nan"), step=info["step"])
            done = max_steps is not None and info["step"] >= max_steps
            while not done:
                info["epoch"] += 1
                epoch_rng = random.Random(s["seed"] * 1_000_003 + info["epoch"])
                for members in make_batches(train_members, lengths, s["batch_tokens"], epoch_rng):
                    spent = time.time() - t_train
                    frac = max((self.train_before + spent) / total_budget,
                               info["step"] / max_steps if max_steps else 0.0)
                    if spent >= budget or (max_steps is not None and info["step"] >= max_steps):
                        done = True
                        break
                    lr = learning_rate(s["lr"], info["step"], s["warmup"], frac)
                    with stops.held():  # torch can turn an interrupt raised inside it into another error
                        loss = self.trained.step(members, lr)
                    info["step"] += 1
                    info["train_seconds"] = self.train_before + time.time() - t_train
                    bar.update(task, completed=int(1000 * min(frac, 1.0)), loss=loss, step=info["step"])
                    self.on_event("step", info["step"])
                    stops.check()
                    if time.time() >= next_eval:
                        with stops.held():  # the score (torch), the checkpoint and the note of its step, whole
                            self.record(self.trained.score(eval_some))
                            self.save(None)
                        next_eval = time.time() + opts.eval_minutes * 60
                        stops.check()
                if not train_members:
                    break
            bar.update(task, completed=1000)


class StopRequests:
    """Ctrl-C (or the CLI's SIGTERM) raises KeyboardInterrupt wherever the main thread is. When
    that happens inside a finalizer (torch runs Python ``__del__``s and weakref callbacks during
    training), Python prints "Exception ignored" and carries on, and the run would go on to its
    time budget. So the handlers Python already runs are wrapped to also note the request, and
    the loop checks the note after each step and checkpoint. Ignored signals stay ignored (a
    background job), and off the main thread nothing is installed. Inside ``held()`` a signal is
    only noted (``check`` after the block raises): a checkpoint is written whole and its step
    recorded, where a KeyboardInterrupt between the two had the interrupt's message name the
    step before the one the folder held (and could leave the old folder's temporary behind).
    Training steps and scoring are held too: an interrupt raised inside torch came out as
    "ValueError: could not determine the shape of object type 'torch.storage.UntypedStorage'"
    (exit 1, not 130) in a clean-clone run of the Ctrl-C test."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self) -> None:
        self.requested = False
        self._holding = False
        self._previous: dict = {}

    def __enter__(self) -> StopRequests:
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self
        for name in self.SIGNALS:
            number = getattr(signal, name)
            handler = signal.getsignal(number)
            if callable(handler):  # a Python handler (not SIG_DFL/SIG_IGN): it raises, we note it too
                self._previous[number] = handler
                signal.signal(number, self._noting(handler))
        return self

    def _noting(self, handler):
        def note_then_raise(signum, frame):
            self.requested = True
            if not self._holding:
                handler(signum, frame)

        return note_then_raise

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Signals inside the block are noted, not raised."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False

    def check(self) -> None:
        if self.requested:
            raise KeyboardInterrupt

    def __exit__(self, *exc) -> None:
        import signal

        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}


def load_weights(head, weights: dict, where: str, fix: str) -> None:
    """Copy checkpoint tensors into ``head`` by its checkpoint names; a mismatch is one BadInput line."""
    import torch

    names = head.checkpoint_names()
    if set(names) != set(weights):
        missing, extra = sorted(set(names) - set(weights)), sorted(set(weights) - set(names))
        raise BadInput(f"{where} does not match the head (missing {missing[:3]}, unexpected {extra[:3]}); {fix}")
    for name, param in names.items():
        if tuple(param.shape) != tuple(weights[name].shape):
            raise BadInput(f"{where}: {name} is {list(weights[name].shape)}, the head needs {list(param.shape)}; {fix}")
    with torch.no_grad():
        for name, param in names.items():
            param.copy_(weights[name])


def _progress(rep: Reporter):
    from contextlib import nullcontext

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    if rep.quiet:
        class Silent:
            def add_task(self, *args, **kwargs) -> int:
                return 0

            def update(self, *args, **kwargs) -> None:
                pass

        return nullcontext(Silent())
    return Progress(TextColumn("[bold]train[/]"), BarColumn(), TextColumn("step {task.fields[step]}"),
                    TextColumn("loss {task.fields[loss]:.4f}"), TimeElapsedColumn(), TextColumn("ETA"),
                    TimeRemainingColumn(), console=rep.console, transient=False)


def _confidence_note(result: dict) -> str:
    conf = result.get("confidence")
    if not conf or conf["right"] is None or conf["wrong"] is None:
        return ""
    return f"; mean confidence {conf['right']} on right drafts, {conf['wrong']} on wrong ones"


def summary(provenance: dict) -> str:
    """One paragraph for the terminal: the first and last held-out scores."""
    curve = provenance["curve"]
    first, last = curve[0], provenance["final"] or curve[-1]
    line = (f"{provenance['steps']} steps in {provenance['train_seconds'] / 60:.1f} min; held-out loss "
            f"{first['loss']:.4f} -> {last['loss']:.4f}")
    if first.get("expected_length") is not None and last.get("expected_length") is not None:
        line += (f"; E[L] at D={provenance['draft_len']} {first['expected_length']} -> {last['expected_length']}"
                 f"; acceptance per position {last['acceptance']}")
    return line + _confidence_note(last)
