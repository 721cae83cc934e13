"""Does the world model rank robot episodes as the simulator does? A measurement for the verified rollout.

``python bench/robotics_verified_probe.py --out runs/i39/probe``: with the BC policy and the world model of
``configs/robotics/world_model_verified.yaml``, ``--keys`` random keyframes each get ``--candidates`` imagined
episodes (noise streams, as the verified rollout), and then *every* candidate — not only the selected ones — is
re-executed in MuJoCo from the keyframe's restored state with its stream. Reported (``probe.json``):

- ``spearman_within``: mean over keyframes of the rank agreement of imagined score and real success among one
  keyframe's candidates (what the candidate selector relies on);
- ``spearman_across``: over all candidates of all keyframes (mostly keyframe difficulty);
- ``mixed_selected`` vs ``mixed_random``: the share of keyframes whose k selected candidates (the shared
  ``max_variance`` selector on imagined scores) have mixed real outcomes, against the first k candidates (a random
  k: the streams are i.i.d.) — whether selection makes GRPO groups informative;
- ``real_mixed_all``: keyframes whose N real outcomes are mixed at all (the ceiling for any selector);
- ``spearman_group_variance``: across keyframes, imagined score variance vs real success variance (whether
  imagination could choose *keyframes* where outcomes vary).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run(out_dir: Path, keys: int = 16, candidates: int = 16, k: int = 4, seed: int = 0, horizon: int | None = None,
        overrides: list[str] | None = None, log=print) -> dict:
    import torch

    from shared_rl.config import apply_overrides, load_train_config, load_yaml
    from shared_rl.trainer import Trainer
    from shared_rl.two_stage import select_candidates, spearman

    from robotics.episodes import run_episodes
    from robotics.world_model.probe import imagined_scores
    from robotics.world_model.verified import RestoredEnv

    torch.set_num_threads(1)
    cfg = load_yaml(ROOT / "configs" / "robotics" / "world_model_verified.yaml")
    cfg = apply_overrides(cfg, ["robotics.eval_states_per_task=1"] + list(overrides or []))
    tr = Trainer(load_train_config(cfg), None, log=log)
    dom, st = tr.domain, tr.domain.rollouts
    w = dom.cfg.rollout.world_model
    h = horizon or w.horizon
    rng = np.random.default_rng(seed)
    picked = [int(x) for x in rng.choice(list(st.keyframes), keys, replace=False)]
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.randint(0, 2**62, (keys, candidates), generator=gen)
    cand = [kk for kk in picked for _ in range(candidates)]
    tasks = [st.task_of(kk) for kk in cand]
    dom.policy.eval()
    run_episodes(dom.policy, st.imagine, cand, tasks, dom.sampling, h, gen, noise_seeds=seeds.flatten().tolist())
    score, imag = imagined_scores(st.imagine.slots, dom.cfg.rollout.verify.score)
    real = run_episodes(dom.policy, RestoredEnv(dom.venv, st.keyframes), cand, tasks, dom.sampling, h, gen,
                        noise_seeds=seeds.flatten().tolist())
    succ = real.success_once.astype(np.float64)
    S, R = torch.from_numpy(score).view(keys, candidates), torch.from_numpy(succ).view(keys, candidates)
    within = [spearman(S[g], R[g]) for g in range(keys)]
    keep = select_candidates(S, k, "max_variance")
    mixed = lambda r: float(((r.max(1).values > r.min(1).values).double()).mean())  # noqa: E731
    out = {
        "keys": keys, "candidates": candidates, "k": k, "horizon": h, "real_env_steps": int(real.length.sum()),
        "imagined_success": float(imag.mean()), "real_success": float(succ.mean()),
        "spearman_within": float(np.nanmean(within)) if np.isfinite(within).any() else float("nan"),
        "spearman_within_defined": int(np.isfinite(within).sum()),
        "spearman_across": spearman(S, R),
        "mixed_selected": mixed(R.gather(1, keep)), "mixed_random": mixed(R[:, :k]), "real_mixed_all": mixed(R),
        "spearman_group_variance": spearman(S.var(1), R.var(1)),
        "per_key": [{"key": picked[g], "chunk": st.keyframes[picked[g]].chunk, "imagined": S[g].tolist(),
                     "real": R[g].tolist()} for g in range(keys)],
    }
    dom.close()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "probe.json").write_text(json.dumps(out, indent=1, default=float))
    return out


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/i39/probe")
    p.add_argument("--keys", type=int, default=16)
    p.add_argument("--candidates", type=int, default=16)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--horizon", type=int)
    a, rest = p.parse_known_args()
    res = run(Path(a.out), a.keys, a.candidates, a.k, a.seed, a.horizon, rest)
    print(json.dumps({k: v for k, v in res.items() if k != "per_key"}, indent=1, default=float))
