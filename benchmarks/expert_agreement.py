"""How well a checkpoint knows the expert's move: its action distribution on held-out states.

    python benchmarks/expert_agreement.py RUN_DIR [RUN_DIR ...] [--levels 200]
        [--checkpoints bc final] [--out runs/benchmarks/expert_agreement.json]

The env's expert (noise-free, ``ExpertActor``) plays the first ``levels`` held-out levels
through the rollout engine with the run's rollout settings (envs in this process), so each of
its turns is a prompt exactly as the policy sees it.
At each such state the checkpoint's next-token distribution is read over the first tokens
of the env's action names. Reported per checkpoint: the mean probability of the expert's
move, how often it is the most likely of the actions ("argmax agreement"), and the
entropy of the distribution renormalised over the actions (ln 4 = 1.386 nats is uniform
over Sokoban's four moves; a cloned policy near it has learnt little of the rooms). Sampling
at T = 1 plays the first; a sharpened policy plays the second, so the gap between them is
what sharpening alone (all GRPO does on levels it already solves sometimes) can gain.
Where several moves are optimal the expert names one, so the first two figures are lower bounds.
Writes JSON (default ``runs/benchmarks/expert_agreement.json``) and a Markdown table next to it.
"""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

import numpy as np
import torch

from _checkpoints import engine, load, parser, save, score
from turnforge.rollout.actors import ExpertActor
from turnforge.rollout.engine import EpisodeRequest


def agreement(run: Path, checkpoint: str, levels: int) -> dict[str, float]:
    cfg, policy = load(run, checkpoint)
    with closing(engine(cfg, policy, min(levels, 50))) as eng:
        names = eng.env.action_names
        if not names:
            raise SystemExit(f"{cfg.env.id}: needs an env with a fixed action set (action_names)")
        requests = [EpisodeRequest(eng.env.task("heldout", i), i, f"level-{i}", f"expert-{i}") for i in range(levels)]
        trajs, _ = eng.play(requests, ExpertActor())
    actions = torch.tensor([policy.tokenizer.encode(a)[0] for a in names])
    probs, hits, entropies = [], [], []
    with torch.no_grad():
        for sample in (x for t in trajs if t.infra_failure is None for x in t.samples):
            ids, start = list(sample.token_ids), list(sample.loss_mask).index(1)
            p = torch.softmax(policy.model(torch.tensor([ids[:start]])).logits[0, -1], -1)
            probs.append(p[ids[start]].item())
            hits.append(bool(actions[p[actions].argmax()] == ids[start]))
            q = p[actions] / p[actions].sum()
            entropies.append(-(q * q.clamp_min(1e-12).log()).sum().item())
    return {"states": len(probs), "p_expert": float(np.mean(probs)), "argmax_agreement": float(np.mean(hits)),
            "action_entropy": float(np.mean(entropies))}


def main() -> None:
    ap = parser(__doc__, "expert_agreement")
    ap.add_argument("--levels", type=int, default=200)
    args = ap.parse_args()
    rows = score(args, lambda run, ck: agreement(run, ck, args.levels))
    lines = ["| run | checkpoint | held-out expert states | mean p(expert move) | argmax agreement | action entropy (nats) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['checkpoint']} | {r['states']} | {r['p_expert']:.3f} | {r['argmax_agreement']:.3f} "
              f"| {r['action_entropy']:.3f} |" for r in rows]
    save(args.out, rows, lines)


if __name__ == "__main__":
    main()
