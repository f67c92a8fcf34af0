"""What folding the tree inputs into the main ort-gqa graph would cost a chain call.

The ort-gqa tree graph (GroupQueryAttention with position ids, a bias and the whole cache as its
total length) is run as a chain (a chain's offsets, a causal mask) against the main graph at the
same token counts, interleaved, at a half-full cache (docs/trees.md, "Memory").

    .venv/bin/python scripts/tree_fold_cost.py engines/smollm2-135m-tree [rounds]
"""

from __future__ import annotations

import sys
import time

import numpy as np
import onnx

from specexport.contract import NEXT_TOKENS, VALID_TOKENS, present_of
from specexport.exporter.onnx_export import tensor_specs
from specexport.runtime import load
from specexport.runtime.ort_engine import OrtEngine
from specexport.runtime.runner import PAD_ID
from specexport.runtime.tree import DraftTree
from specexport.runtime.tree_verify import batched_tree_feeds


def main(directory: str, rounds: int = 15) -> None:
    pipe = load(directory, threads=2)
    target = pipe.batched_target(1)
    verifier = pipe.tree_verifier(target)
    runner = target.runners[0]
    path = f"{directory}/target.tree.onnx"
    proto = onnx.load(path, load_external_data=False)
    engines: dict[int, OrtEngine] = {}

    def tree_as_chain(tokens: int) -> float:
        if tokens not in engines:  # the tree graph's one session, at this row count
            engines[tokens] = OrtEngine(f"tree-as-chain-{tokens}", path, tensor_specs(proto, "inputs", tokens, 1),
                                        tensor_specs(proto, "outputs", tokens, 1), pipe.options, pipe.sessions)
        engine = engines[tokens]
        chain = DraftTree.chain(np.full(tokens - 1, PAD_ID, dtype=np.int64))
        length = (verifier.max_seq_len - tokens) // 2
        feeds = batched_tree_feeds({0: (length, PAD_ID, chain)}, 1, tokens - 1, VALID_TOKENS in engine.inputs)
        cache = {name: array[:1] for name, array in verifier.tensors.items()}  # [1, n_kv, S_max, hd]
        start = time.perf_counter()
        engine.run({**cache, **feeds}, [NEXT_TOKENS], {present_of(name): array for name, array in cache.items()})
        return time.perf_counter() - start

    sizes = runner.decoding_sizes
    for tokens in sizes:  # warm both
        tree_as_chain(tokens)
        runner.time_run(tokens)
    for tokens in sizes:
        main, tree = [], []
        for _ in range(rounds):
            main.append(runner.time_run(tokens))
            tree.append(tree_as_chain(tokens))
        m, t = np.median(main) * 1e3, np.median(tree) * 1e3
        print(f"T={tokens:3d}  main graph {m:7.2f} ms  tree graph as a chain {t:7.2f} ms  ({t / m:.3f}x)")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
