"""`specexport distill`: train a drafter head for a recipe's target, from the target itself.

The modules, one job each:

- ``data.py``: prompts and text in (JSONL), the target's own responses (batched generation
  with its chat template), the held-out split, the draft vocabulary (d2t/t2d);
- ``teacher.py``: the target's tapped hidden states and next-token distributions per sequence,
  computed on the fly or cached on disk under a size cap (never all in memory);
- ``eagle3_model.py``: the EAGLE-3 head being trained (SafeAILab layout and math) and its
  training-time-test unroll;
- ``eagle3_train.py``: batches, the loss, the held-out evaluation, the learning-rate schedule;
- ``dflash_model.py``: the DFlash head being trained (speculators layout, the math of the
  build's reference forward), many blocks in one batched forward;
- ``dflash_train.py``: random anchors, the position-decayed block loss, block acceptance;
- ``dspark_model.py``, ``dspark_train.py``: DSpark, the DFlash block drafting from the anchor
  slot plus a vanilla Markov head (teacher-forced) and a confidence head (BCE, calibrated so its
  running product predicts acceptance), in the speculators ``dspark`` layout;
- ``checkpoint.py``: the output folder (a checkpoint the ``eagle3``, ``dflash`` or ``dspark`` loader reads, provenance,
  and the training state ``--resume`` continues), written whole or not at all;
- ``command.py``: the run: options, progress, checkpoints, Ctrl-C.
"""

DRAFTER_KINDS = ("eagle3", "dflash", "dspark")  # the kinds `--drafter` names
TRAINED_KINDS = ("eagle3", "dflash", "dspark")
