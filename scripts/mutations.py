"""Break the decode loop on purpose, run the tests that should catch each break, restore.

Each case replaces one line of the runtime with a plausible slip, runs the named tests (stopping
at the first failure) and prints CAUGHT when they fail, MISSED when they pass. The file is
restored after each case whatever happens. Run from the repository root, after `make install`:

    .venv/bin/python scripts/mutations.py            # every case
    .venv/bin/python scripts/mutations.py 0 3        # cases by index

Exit status 1 when any case is missed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The tests that read each drafter kind's greedy output, and its sampled output (a chain's q:
# point-mass drafts, prompt lookup's, have no q for a residual to be taken from).
_BY_KIND_GREEDY = [
    ("fakes: oracle, fixed, n-gram", ["tests/runtime/test_decode.py"]),
    ("draft model, int4 copy", ["tests/runtime/test_drafter_acceptance.py"]),
    ("EAGLE-3, MTP", ["tests/heads/test_chain_acceptance.py"]),
    ("DFlash", ["tests/heads/test_dflash.py"]),
    ("DSpark", ["tests/heads/test_dspark.py"]),
]
_BY_KIND_SAMPLED = [
    ("draft model", ["tests/runtime/test_decode.py", "-k", "sampled"]),
    ("int4 copy, draft model", ["tests/runtime/test_pipeline.py", "-k", "sampl"]),
    ("EAGLE-3", ["tests/heads/test_eagle3.py", "-k", "sampling"]),
    ("MTP", ["tests/heads/test_mtp.py", "-k", "sampling"]),
    ("DFlash", ["tests/heads/test_dflash.py", "-k", "sampling"]),
    ("DSpark", ["tests/heads/test_dspark.py", "-k", "sampling"]),
]

# (what the slip is, file, the line as it is, the slip, the tests that must catch it)
CASES = [
    ("append graphs write each row one position late", "runtime/cache_store.py",
     "array[row, :, length : length + count] = new[row, :, :count]",
     "array[row, :, length + 1 : length + 1 + count] = new[row, :, :count]",
     ["tests/exporter/test_batched_standard.py::test_each_request_under_batching_gives_its_batch_1_output"]),
    ("verify fed at the committed length (no rewind)", "runtime/loop.py",
     "roots = [(seq.length - 1, int(seq.context[seq.length - 1])) for seq in running]",
     "roots = [(seq.length, int(seq.context[seq.length - 1])) for seq in running]",
     ["tests/runtime/test_decode.py"]),
    ("chain catch-up pairs features with the wrong token", "runtime/chain_drafter.py",
     "tokens = context[start + 1 : start + 1 + len(features)]  # row p: token x_{p+1}",
     "tokens = context[start : start + len(features)]  # row p: token x_{p+1}",
     ["tests/heads/test_chain_acceptance.py"]),
    ("a row's drafter gets another row's committed outputs", "runtime/loop.py",
     "{name: out[name][kept] for name in drafter.needs}",
     "{name: verified.rows[0][name][kept] for name in drafter.needs}",
     ["tests/runtime/test_batch_heads.py::test_every_head_decodes_and_drafts_in_the_batch_as_alone", "-k", "eagle3"]),
    ("batched block graphs count a row's tokens, not its context rows", "runtime/model.py",
     "per_context_row=entry.role == Role.BLOCK,",
     "per_context_row=False,",
     ["tests/runtime/test_batch_heads.py::test_every_head_decodes_and_drafts_in_the_batch_as_alone", "-k",
      "dflash or dspark"]),
    ("a chain head's skipped round priced at nothing", "runtime/chain_drafter.py",
     "+ max(k - 1, 0) * step / 1e3",
     "+ max(k - 1, 0) * step / 1e3 if k > 0 else 0.0",
     ["tests/bench/test_bench.py::test_a_round_s_draft_cost_per_drafter_shape"]),
    # the three slips of the tests issue, each against the tests of every drafter kind
    *[("verify rows read one position late" + f" ({kind})", "runtime/target_rows.py",
       "self.next_tokens = out[NEXT_TOKENS]  # [1+N] the graph's argmax",
       "self.next_tokens = np.roll(out[NEXT_TOKENS], -1)  # [1+N] the graph's argmax", tests)
      for kind, tests in _BY_KIND_GREEDY],
    *[("the residual taken from q" + f" ({kind})", "runtime/acceptance.py",
       "residual = np.maximum(p.probs - q.at(p.ids, len(p.probs)), 0.0)  # [m]",
       "residual = q.at(p.ids, len(p.probs))  # [m]", tests)
      for kind, tests in _BY_KIND_SAMPLED],
    ("greedy proposals shifted by one (n-gram)", "runtime/drafters.py",
     "start = int(full[-1] if full.size else hits[0]) + n",
     "start = int(full[-1] if full.size else hits[0]) + n + 1",
     ["tests/runtime/test_drafters.py"]),
    ("greedy proposals shifted by one (draft model, int4 copy)", "runtime/drafters.py",
     "drafts[r] = Draft(tokens[r, : ks[r]].copy(), None if rows[r].sampling.greedy else probs[r], self.name)",
     "drafts[r] = Draft(np.roll(tokens[r, : ks[r]], 1), None if rows[r].sampling.greedy else probs[r], self.name)",
     ["tests/runtime/test_drafter_acceptance.py"]),
    ("greedy proposals shifted by one (EAGLE-3, MTP)", "runtime/chain_drafter.py",
     "return int(out[NEXT_TOKENS][r, at])",
     "return int(out[NEXT_TOKENS][r, max(at - 1, 0)])",
     ["tests/heads/test_chain_acceptance.py"]),
    ("greedy proposals shifted by one (DFlash)", "runtime/block_drafter.py",
     "return Draft(out[NEXT_TOKENS][0, :k].astype(np.int64), None, self.name)",
     "return Draft(np.roll(out[NEXT_TOKENS][0], 1)[:k].astype(np.int64), None, self.name)",
     ["tests/heads/test_dflash.py"]),
    ("greedy proposals shifted by one (DSpark)", "runtime/block_drafter.py",
     "token = heads.target_id(int(np.argmax(logits)))",
     "token = heads.target_id(int(np.argmax(base[max(j - 1, 0)])))",
     ["tests/heads/test_dspark.py"]),
]


def run_case(label: str, rel: str, old: str, new: str, tests: list[str]) -> bool:
    path = ROOT / rel
    text = path.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{rel}: the line for '{label}' is not there once; update scripts/mutations.py")
    path.write_text(text.replace(old, new, 1))
    try:
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                                cwd=ROOT, capture_output=True, text=True, timeout=1800)
    finally:
        path.write_text(text)
    summary = [line for line in result.stdout.splitlines() if " passed" in line or " failed" in line]
    caught = result.returncode != 0
    print(f"{'CAUGHT' if caught else 'MISSED'}: {label} ({summary[-1] if summary else result.returncode})", flush=True)
    return caught


def main(argv: list[str]) -> int:
    chosen = [CASES[int(i)] for i in argv] if argv else CASES
    missed = [case[0] for case in chosen if not run_case(*case)]
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
