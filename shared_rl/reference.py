"""The start of reading: one GRPO training run of the toy domain on one screen (CleanRL style).

Everything ``shared_rl.trainer.Trainer`` does for a flat-group run in one process, written out with no layers:
keys → rollout → group advantages → inner epochs of minibatches → clipped surrogate → AdamW step. It consumes the
random numbers in the same order as the trainer, so on the same config the two give the same metrics and the same
weights (``tests/core/test_reference.py``); the trainer adds what this file leaves out — registries of estimators
and losses, several processes, filters and refills, trees and critics, KL, checkpoints, evaluation cadence.

    python -m shared_rl.reference          # configs/toy.yaml, prints one line per iteration
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from shared_rl.collect import iteration_seed
from shared_rl.config import TrainConfig, load_train_config, load_yaml
from shared_rl.domain import RunContext
from shared_rl.toy import ToyDomain


def train(cfg: TrainConfig, log=print) -> tuple[ToyDomain, list[dict[str, float]]]:
    """Train the toy domain with flat GRPO as ``cfg`` says; returns the domain and one metrics record per iteration."""
    G, S = cfg.rollout.groups_per_iteration, cfg.rollout.group_size
    adv_cfg, loss_cfg, opt_cfg = cfg.advantage, cfg.loss, cfg.optim
    assert cfg.advantage.estimator.name == "grpo" and cfg.policy_loss_choice().name == "clipped"
    assert cfg.selection.filter == "none" and loss_cfg.aggregation == "token-mean" and loss_cfg.kl_coef == 0
    torch.manual_seed(cfg.seed)
    domain = ToyDomain(cfg.domain_config, RunContext(run_dir=None, device=torch.device("cpu"), seed=cfg.seed))
    params = domain.parameters()
    optimizer = torch.optim.AdamW(params, lr=opt_cfg.lr, betas=tuple(opt_cfg.betas), eps=opt_cfg.eps,
                                  weight_decay=opt_cfg.weight_decay)
    eps_lo = loss_cfg.clip_low
    eps_hi = loss_cfg.clip_low if loss_cfg.clip_high is None else loss_cfg.clip_high
    history = []

    for it in range(cfg.iterations):
        gen = torch.Generator().manual_seed(iteration_seed(cfg.seed, it))

        # 1. keys: G contexts drawn uniformly without replacement (cycling through permutations if G > pool)
        pool, keys = domain.train_keys(), []
        while len(keys) < G:
            keys += [pool[i] for i in torch.randperm(len(pool), generator=gen).tolist()[: G - len(keys)]]

        # 2. rollout: S samples per key from the current policy, with their log-probs and rewards (no grad)
        call = torch.Generator().manual_seed(iteration_seed(cfg.seed, it) + 1_000_003)  # round 0, call 0
        with torch.no_grad():
            ro = domain.rollout(keys, S, call, it)
        r = ro.rewards["correct"].double()

        # 3. advantages: GRPO, A = (r − mean_g) / (std_g + eps) within each group of S, 0 for a tied group; clip
        r_g = r.view(G, S)
        mean, std = r_g.mean(1, keepdim=True), r_g.std(1, keepdim=True)
        adv = torch.where(std > 0, (r_g - mean) / (std + adv_cfg.eps), torch.zeros_like(r_g)).float().flatten()
        if adv_cfg.clip is not None:
            adv = adv.clamp(-adv_cfg.clip, adv_cfg.clip)

        # 4. inner epochs of minibatches; one AdamW step per minibatch
        losses, grad_norms, clipped, trained = [], [], 0.0, 0.0
        for _epoch in range(opt_cfg.inner_epochs):
            order = torch.randperm(G * S, generator=gen)
            for mb in torch.tensor_split(order, opt_cfg.minibatches_per_epoch):
                logp = domain.log_probs(ro, mb, need_kl=False).logp            # [n, T] with grad
                mask = ro.mask[mb].float()
                ratio = torch.exp((logp - ro.logp_old[mb]) * mask)
                a = adv[mb][:, None]
                # the clipped surrogate (PPO; DAPO's clip-higher), token-mean over the minibatch's steps
                per_step = torch.maximum(-a * ratio, -a * ratio.clamp(1 - eps_lo, 1 + eps_hi)) * mask
                loss = per_step.sum() / mask.sum()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                clip = opt_cfg.grad_clip if opt_cfg.grad_clip is not None else float("inf")
                grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
                optimizer.step()
                losses.append(float(loss.detach()))
                cut = (-a * ratio.clamp(1 - eps_lo, 1 + eps_hi)) > (-a * ratio)  # where the clip took the gradient
                clipped += float((cut.float() * mask).sum())
                trained += float(mask.sum())

        rec = {"reward/mean": float(ro.rewards["correct"].mean()), "loss/policy": sum(losses) / len(losses),
               "grad_norm": sum(grad_norms) / len(grad_norms), "clip_frac": clipped / max(trained, 1.0)}
        history.append(rec)
        log(f"[{it + 1}/{cfg.iterations}] " + " ".join(f"{k}={v:.4g}" for k, v in rec.items()))
    return domain, history


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "configs" / "toy.yaml"
    train(load_train_config(load_yaml(path)))
