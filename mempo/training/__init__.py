"""Training on one machine: SFT cold start and the local GRPO + memory-advantage trainer.

    mempo train sft  --policy outputs/policy --out outputs/sft      (mempo.training.sft)
    mempo train grpo --policy outputs/sft/model --out outputs/train  (mempo.training.grpo)

Shared pieces: `runtime` (device, seeding, loading/saving HF folders), `checkpoint`
(atomic resumable checkpoints), `rollouts` (deterministic lockstep batching), `plots`.
Submodules import torch lazily; import them directly.
"""
