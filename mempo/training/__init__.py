"""Training on one machine: SFT cold start and the local GRPO + memory-advantage trainer.

    mempo train sft  --policy outputs/policy --out outputs/sft      (mempo.training.sft)
    mempo train grpo --policy outputs/sft/model --out outputs/train  (mempo.training.grpo)

Shared pieces: `stage` (the scaffold both stages run in: seed, resume, final save and log),
`runtime` (device, seeding, loading/saving HF folders), `checkpoint` (atomic resumable
checkpoints), `rollouts` (deterministic lockstep batching), `plots`. `sft_data` makes the
SFT samples (the scripted teacher's episodes on the knowledge world, or a jsonl).
Submodules import torch lazily; import them directly.
"""
