"""Five optimizer steps of a real model on a fixed batch, as one rank of torch's launcher (or
alone: a world of one), for the scale-out tests:
``python -m torch.distributed.run --standalone --nproc-per-node N updates_job.py MODEL_DIR LORA_R OUT.pt [BUDGET]``.

The steps are the trainers' own: ``attach_trainer`` (FSDP2 on several ranks), AdamW over
``trainable_parameters``, ``collate`` -> ``token_logprobs`` -> ``sft_loss`` on this rank's share
of the batch in passes of at most BUDGET padded tokens (``micro_batches``; 0 or none: one pass,
``minibatch_share``'s), ``GuardedStep``, then ``sync_sampler``. Rank 0 saves the trainable
tensors of the plain model and the five losses; every rank writes its passes per step to OUT.pt.rankR.json."""

import json
import sys
from pathlib import Path

import numpy as np
import torch

from turnforge.algos import sft_loss
from turnforge.config import LoraConfig
from turnforge.dist import (
    attach_trainer,
    init_world,
    micro_batches,
    share_weighted,
    shutdown,
    sync_sampler,
)
from turnforge.optim import GuardedStep
from turnforge.policy.generate import token_logprobs
from turnforge.policy.lora import add_lora, trainable_parameters
from turnforge.policy.model import load_policy, quiet_hf
from turnforge.train.common import collate
from turnforge.types import Sample

model_dir, lora_r, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
budget = int(sys.argv[4]) if len(sys.argv) > 4 else 0
quiet_hf()
torch.set_num_threads(1)
w = init_world("auto", 300)
torch.manual_seed(0)
policy = load_policy(model_dir)
if lora_r:
    add_lora(policy, LoraConfig(r=lora_r, alpha=2.0 * lora_r), 0, "rl")
attach_trainer(policy)
model = policy.train_model
LR = 1e-3 if lora_r else 1e-4
optimizer = torch.optim.AdamW(trainable_parameters(model), lr=LR, weight_decay=0.0)
step = GuardedStep(model, optimizer, 1.0, 3)
gen = np.random.default_rng(0)
vocab = policy.model.config.vocab_size
samples = []
for i in range(5):  # 5 rows of 24-40 tokens, the last 6-10 the action: an uneven split over 2 ranks
    n, a = int(gen.integers(24, 41)), int(gen.integers(6, 11))
    mask = np.zeros(n, np.int8)
    mask[-a:] = 1
    samples.append(Sample(token_ids=gen.integers(0, vocab, n).astype(np.int64), loss_mask=mask,
                          logprobs=np.where(mask == 1, -1.0, np.nan).astype(np.float32), versions=np.where(mask == 1, 0, -1).astype(np.int32),
                          trajectory_id=f"t{i}", turn_index=0))
losses, passes = [], []
model.train()
for _ in range(5):
    rank_loss, parts = 0.0, micro_batches(samples, lambda x: x.num_action_tokens, len, budget)
    for part in parts:
        batch = collate(part.rows, policy.pad_id)
        lp, _ = token_logprobs(model, batch.ids, batch.attention, positions=batch.mask)
        loss = sft_loss(lp, batch.mask)
        step.backward(loss if part.factor == 1.0 else loss * part.factor)
        rank_loss += loss.item() * part.factor
    assert step.step() is not None
    losses.append(share_weighted([[rank_loss]], [1.0])[0][0])
    passes.append([len(p.rows) if p.factor > 0 else 0 for p in parts])
sync_sampler(policy)
Path(f"{out}.rank{w.rank}.json").write_text(json.dumps(passes))  # this rank's passes per step
if w.main:
    torch.save({"lr": LR, "steps": 5, "losses": losses, "weights": {k: v.detach().clone() for k, v in policy.model.named_parameters()
                                              if v.requires_grad}}, out)
shutdown()
