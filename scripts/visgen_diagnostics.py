"""Diagnostics for a visgen RL recipe on the shapes task (used for docs/methods/flow_grpo.md).

    python scripts/visgen_diagnostics.py attributes [CONFIG] [overrides...]   # held-out failure rate per attribute
    python scripts/visgen_diagnostics.py gradients  [CONFIG] [overrides...]   # consistency of the policy gradient

``attributes``: ODE samples of the held-out prompts (``visgen.eval`` settings, 4 images per prompt) scored by the
checker, failure rate per (prompt kind, attribute).
``gradients``: the one-optimizer-step gradient of ``--rollouts`` independent rollouts at the *same* weights (the
optimizer step is replaced by a recorder), then the mean pairwise cosine similarity. Near 0 means the batch's
policy gradient is mostly noise: Adam then turns it into drift.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared_rl.config import apply_overrides, load_train_config, load_yaml  # noqa: E402
from shared_rl.trainer import Trainer  # noqa: E402

DEFAULT = str(Path(__file__).resolve().parents[1] / "configs/visgen/shapes_grpo.yaml")


def _trainer(config: str, overrides: list[str]) -> Trainer:
    data = apply_overrides(load_yaml(config), ["logging.progress=false", "eval.at_start=false", "eval.every=0",
                                               "visgen.num_threads=1", *overrides])
    return Trainer(load_train_config(data), None, log=lambda *_: None)


def attributes(config: str, overrides: list[str], per_prompt: int) -> dict:
    from visgen.tasks import shapes

    dom = _trainer(config, overrides).domain
    prompts = [p for p in dom.eval_prompts for _ in range(per_prompt)]
    images = dom.sample_ode(prompts, dom.cfg.eval.seed)
    fails, totals, strict = collections.Counter(), collections.Counter(), 0
    for image, prompt in zip(images, prompts):
        spec = shapes.parse_prompt(prompt)
        result = shapes.check_image(image.numpy(), spec)
        for name, ok in result.items():
            totals[(spec.kind, name)] += 1
            fails[(spec.kind, name)] += not ok
        strict += all(result.values())
    return {"images": len(prompts), "strict": strict / len(prompts),
            "failure_rate": {f"{k}/{a}": fails[(k, a)] / totals[(k, a)] for k, a in sorted(totals)}}


def gradients(config: str, overrides: list[str], rollouts: int) -> dict:
    tr = _trainer(config, ["optim.minibatches_per_epoch=1", "optim.inner_epochs=1", "optim.grad_clip=1e9",
                           *overrides])
    params = [p for g in tr.optimizer.param_groups for p in g["params"]]
    grads: list[torch.Tensor] = []
    tr.optimizer.step = lambda *a, **k: grads.append(torch.cat([p.grad.reshape(-1).clone() for p in params]))
    rewards = [tr.iteration(it)["reward/mean"] for it in range(rollouts)]
    g = torch.stack(grads)
    cos = [float(torch.nn.functional.cosine_similarity(g[i], g[j], dim=0))
           for i, j in itertools.combinations(range(len(g)), 2)]
    return {"rollouts": rollouts, "cos_mean": sum(cos) / len(cos), "cos_min": min(cos), "cos_max": max(cos),
            "grad_norm_mean": float(g.norm(dim=1).mean()), "reward_mean": sum(rewards) / len(rewards)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["attributes", "gradients"])
    ap.add_argument("config", nargs="?", default=DEFAULT)
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides of the config")
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--per-prompt", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.config and "=" in args.config:
        args.overrides.insert(0, args.config)
        args.config = DEFAULT
    out = (attributes(args.config, args.overrides, args.per_prompt) if args.what == "attributes"
           else gradients(args.config, args.overrides, args.rollouts))
    print(json.dumps({"config": args.config, "overrides": args.overrides, **out}, indent=1))


if __name__ == "__main__":
    main()
