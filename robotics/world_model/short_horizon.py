"""Short imagined branches bootstrapped by a critic of real returns (``robotics.rollout.name: short_horizon``).

The alternative to the verified two-stage rollout (``verified.py``) that keeps imagination in the update, MBPO-style
(Janner et al. 2019, "When to Trust Your Model": short model rollouts branched from real states, the value of where
they end taken from a critic): imagination is trusted only a few chunks deep, and the return of a branch is never
an imagined success — it is the critic's value of the state the branch ends in, and the critic only ever learns
from real returns. Per iteration:

1. **Real rollouts**: ``short_horizon.real_episodes`` fresh episodes of the current policy (its sampling mode) from
   training reset states in the simulator (counted as real steps). Their chunk boundaries become branch starts
   (keyframes: real states), they join the world model's real data (refit every ``world_model.coevolve_every``
   iterations), and their Monte-Carlo returns train the critic.
2. **Critic** (``policies.value_head.ValueHead`` on the policy's fused features, detached, plus the chunk's time —
   the PPO critic's architecture): ``critic_steps`` Adam steps regressing every real boundary of the policy's own
   episodes (the world model's data and the fresh ones) on its return ``gamma^(chunks to success)`` (1 at the
   success frame, 0 when the episode failed).
3. **Branches**: ``rollout.group_size`` imagined branches of ``short_horizon.horizon`` env steps from each key (a
   keyframe), each with its own noise stream; a branch runs its whole horizon (an imagined success does not end it:
   the success model does not judge), and its return is ``gamma^j · V(s_j)`` at its last trusted boundary ``j``
   (the end, or the boundary before the world model's disagreement truncated it). GRPO normalises the returns
   within each group, so a branch's advantage is how much better than its siblings the critic finds its end state.
4. **Audit** (measurement only, counted apart): ``audit_groups`` groups per iteration are re-executed in the
   simulator from the keyframe's restored state with the same noise streams; ``short/rank_spearman`` is the rank
   agreement of the imagined returns with the real ones (real success within the branch → ``gamma^j``, else
   ``gamma^H · V(real s_H)``).

The trainer sees the imagined branches (reward name ``return``); the rollout strategy owns the critic (its own Adam,
saved with the domain's state under ``short_horizon.``). Metrics: ``short/critic_loss``,
``short/critic_explained_variance`` (on all real boundaries), ``short/value_mean``, ``short/fresh_success``,
``short/rank_spearman``, ``short/rank_spearman_group``, ``short/truncated_frac``, ``wm/imagined_steps``,
``env/steps`` (fresh real steps this iteration), ``wm/real_env_steps``.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch.nn import functional as F

from shared_rl.two_stage import spearman

from ..envs.metaworld_env import decode_key, instruction_for, make_key
from ..episodes import run_episodes
from ..policies.value_head import ValueHead
from ..rollouts import flat_rollout
from .data import RecordingEnv
from .env import WorldModelEnv
from .rollout import WorldModelRollout, info_reduce
from .train import collect_policy_episodes
from .verified import RestoredEnv


class ShortHorizonRollout(WorldModelRollout):
    """See the module docstring. World model, keyframes and co-evolution are ``WorldModelRollout``'s."""

    state_prefix = "short_horizon."

    def __init__(self, cfg, ctx, policy, venv, sampling) -> None:
        super().__init__(cfg, ctx, policy, venv, sampling)
        s, w = cfg.rollout.short_horizon, cfg.rollout.world_model
        # branches run their whole horizon ("end"): where they stop is the critic's to judge, not the success model's
        self.imagine = WorldModelEnv(self.wm, self.keyframes, s.horizon, success=self.success,
                                     success_mode="end", uncertainty_threshold=w.uncertainty_threshold,
                                     pessimistic=w.pessimistic)
        self.chunk = policy.cfg.chunk
        self.total_chunks = math.ceil(cfg.env.horizon / self.chunk)
        self.value = ValueHead(policy.cfg.hidden, s.critic_hidden).to(self.device)
        self._value_opt = torch.optim.Adam(self.value.parameters(), lr=s.critic_lr)
        self._text = {t: policy.text.token_ids([instruction_for(t)])[0] for t in cfg.env.tasks}
        self._buf = {"frames": [], "proprio": [], "task": [], "chunk": [], "target": []}
        self._add_returns([e for e in self.real_data if e.source == "policy"])
        self._initial_returns = {k: len(v) for k, v in self._buf.items()}  # rebuilt by construction; not stored
        self.imagined_steps = 0

    # -- the critic's data: real boundaries and their Monte-Carlo returns
    def _add_returns(self, episodes) -> None:
        g = self.cfg.rollout.short_horizon.gamma
        for ep in episodes:
            if ep.task not in self._text or ep.num_chunks == 0:
                continue
            off = ep.start_steps // self.chunk
            j = int(np.argmax(ep.success)) if ep.succeeded else None
            c = np.arange(ep.num_chunks + 1)
            target = (g ** np.maximum(j - c, 0)).astype(np.float32) if j is not None else np.zeros(len(c), np.float32)
            self._buf["frames"].append(ep.frames)
            self._buf["proprio"].append(ep.proprio.astype(np.float32))
            self._buf["task"] += [ep.task] * len(c)
            self._buf["chunk"].append(off + c)
            self._buf["target"].append(target)

    @torch.no_grad()
    def _features(self, frames: np.ndarray, proprio: np.ndarray, tasks: list[str], batch: int = 512) -> torch.Tensor:
        out = []
        for i in range(0, len(frames), batch):
            out.append(self.policy.encode(torch.from_numpy(frames[i:i + batch]).to(self.device),
                                          torch.from_numpy(proprio[i:i + batch]).to(self.device),
                                          [self._text[t] for t in tasks[i:i + batch]]))
        return torch.cat(out) if out else torch.zeros(0, self.policy.cfg.hidden, device=self.device)

    def _frac(self, chunks) -> torch.Tensor:
        return torch.as_tensor(np.asarray(chunks, np.float32) / self.total_chunks, device=self.device)

    def fit_critic(self, generator: torch.Generator) -> dict[str, float]:
        """``critic_steps`` Adam steps on all real boundaries (features of the current policy, without grad)."""
        s = self.cfg.rollout.short_horizon
        frames, proprio = np.concatenate(self._buf["frames"]), np.concatenate(self._buf["proprio"])
        y = torch.from_numpy(np.concatenate(self._buf["target"])).to(self.device)
        frac = self._frac(np.concatenate(self._buf["chunk"]))
        self.policy.eval()
        h = self._features(frames, proprio, self._buf["task"])
        g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
        loss = torch.zeros(())
        self.value.train()
        with torch.enable_grad():  # the trainer's rollout runs without grad
            for _ in range(s.critic_steps):
                idx = torch.randint(0, len(y), (min(s.critic_batch, len(y)),), generator=g).to(self.device)
                loss = F.mse_loss(self.value(h[idx], frac[idx]), y[idx])
                self._value_opt.zero_grad()
                loss.backward()
                self._value_opt.step()
        self.value.eval()
        with torch.no_grad():
            v = self.value(h, frac)
        ev = 1.0 - float((y - v).var()) / max(float(y.var()), 1e-12)
        return {"short/critic_loss": float(loss.detach()), "short/critic_explained_variance": ev,
                "short/critic_boundaries": float(len(y))}

    @torch.no_grad()
    def values(self, frames: np.ndarray, proprio: np.ndarray, tasks: list[str], chunks) -> torch.Tensor:
        self.policy.eval()
        return self.value(self._features(frames, proprio, tasks), self._frac(chunks)).float().cpu()

    # -- rollouts
    def _fresh(self, generator: torch.Generator) -> dict[str, float]:
        """Fresh real rollouts: critic targets, branch starts, world-model data (counted as real steps)."""
        s, w = self.cfg.rollout.short_horizon, self.cfg.rollout.world_model
        if not s.real_episodes:
            return {}
        tasks = self.cfg.trained_tasks
        idx = torch.randint(0, w.keyframe_states, (s.real_episodes,), generator=generator).tolist()
        keys = [make_key(self.cfg.env.tasks.index(tasks[i % len(tasks)]), "train", j) for i, j in enumerate(idx)]
        eps = collect_policy_episodes(self.policy, self.venv, keys, [self.cfg.env.tasks[decode_key(k)[0]] for k in keys],
                                      self.cfg.head_mode, self.cfg.noise_level, self.cfg.env.horizon, generator)
        steps = sum(e.env_steps for e in eps)
        self.real_steps_coevolve += steps
        new = self._keyframes(eps, first_id=max(int(k) % 500_000 for k in self.keyframes) + 1)
        self.keyframes.update(new)
        self.imagine.keyframes = self.keyframes
        for e in eps:  # their keyframes are taken; the refits need no simulator states
            e.states = None
        self._add_returns(eps)
        self.real_data += eps
        self._pending += eps
        return {"env/steps": float(steps), "short/fresh_success": float(np.mean([e.succeeded for e in eps])),
                "short/new_keyframes": float(len(new))}

    def _returns(self, slots) -> tuple[torch.Tensor, float]:
        """``gamma^j · V(s_j)`` at each branch's last trusted boundary ``j``; the truncated fraction."""
        g = self.cfg.rollout.short_horizon.gamma
        frames, proprio, tasks, chunks, depth = [], [], [], [], []
        for st in slots:
            kf = self.keyframes[st.key]
            j = len(st.trace["frames"]) - (1 if st.truncated else 0)
            frames.append(kf.frame if j == 0 else st.trace["frames"][j - 1])
            proprio.append(kf.proprio if j == 0 else st.trace["proprio"][j - 1])
            tasks.append(kf.task), chunks.append(kf.chunk + j), depth.append(j)
        v = self.values(np.stack(frames), np.stack(proprio).astype(np.float32), tasks, chunks)
        trunc = float(np.mean([st.truncated for st in slots])) if slots else 0.0
        return v * torch.tensor([g ** d for d in depth], dtype=torch.float32), trunc

    def rollout(self, keys, group_size, generator, iteration):
        s, w = self.cfg.rollout.short_horizon, self.cfg.rollout.world_model
        info: dict[str, float] = {"env/steps": 0.0}
        if w.coevolve_every and iteration > 0 and iteration % w.coevolve_every == 0 and self._coevolved_at != iteration:
            self._coevolved_at = iteration
            info.update(self.coevolve(generator))
        info.update(self._fresh(generator))
        if s.critic_steps:
            info.update(self.fit_critic(generator))
        keys = list(keys)
        G, n = len(keys), group_size
        seeds = torch.randint(0, 2**62, (G, n), generator=generator)
        env_keys = [kk for kk in keys for _ in range(n)]
        tasks = [self.task_of(kk) for kk in env_keys]
        self.policy.eval()
        batch = run_episodes(self.policy, self.imagine, env_keys, tasks, self.sampling, s.horizon, generator,
                             device=self.device, noise_seeds=seeds.flatten().tolist())
        returns, trunc = self._returns(self.imagine.slots)
        steps = int(batch.length.sum())
        self.imagined_steps += steps
        ro = flat_rollout(batch, keys, n, self.cfg.env.tasks, self.cfg.env.success_mode, False)
        ro.rewards = {"return": returns}
        info.update({"short/value_mean": float(returns.mean()), "short/truncated_frac": trunc,
                     "wm/imagined_steps": float(steps), "wm/real_env_steps": float(self.real_env_steps)})
        if s.audit_groups:
            info.update(self._audit(keys, seeds, returns.view(G, n), generator))
        info["env/episodes"] = float(s.real_episodes)  # env/ counts real interaction; the branches are wm/
        ro.info.update(info)
        ro.info_reduce.update(info_reduce(ro.info))
        return ro, None  # the branches are imagined: no part learns from them as episodes

    def _audit(self, keys, seeds, returns: torch.Tensor, generator) -> dict[str, float]:
        """Re-execute ``audit_groups`` groups in the simulator with the same noise streams; rank agreement."""
        s = self.cfg.rollout.short_horizon
        pick = torch.randperm(len(keys), generator=generator)[: s.audit_groups].tolist()
        n = returns.shape[1]
        env_keys = [keys[g] for g in pick for _ in range(n)]
        rec = RecordingEnv(RestoredEnv(self.venv, self.keyframes))
        real = run_episodes(self.policy, rec, env_keys, [self.task_of(k) for k in env_keys], self.sampling, s.horizon,
                            torch.Generator().manual_seed(0), device=self.device,
                            noise_seeds=seeds[pick].flatten().tolist())
        self.audit_steps += int(real.length.sum())
        eps = rec.episodes("audit")
        ends = [self.keyframes[k].chunk + e.num_chunks for k, e in zip(env_keys, eps)]
        v = self.values(np.stack([e.frames[-1] for e in eps]), np.stack([e.proprio[-1] for e in eps]).astype(np.float32),
                        [self.task_of(k) for k in env_keys], ends)
        g = s.gamma
        real_ret = torch.tensor([g ** int(np.argmax(e.success)) if e.succeeded else g ** e.num_chunks * float(v[i])
                                 for i, e in enumerate(eps)], dtype=torch.float32).view(len(pick), n)
        imag = returns[pick]
        per_group = [x for x in (spearman(imag[i], real_ret[i]) for i in range(len(pick))) if np.isfinite(x)]
        return {"short/rank_spearman": spearman(imag, real_ret),
                "short/rank_spearman_group": float(np.mean(per_group)) if per_group else float("nan"),
                "short/audit_real_success": float(np.mean([e.succeeded for e in eps])),
                "short/audit_return_gap": float((imag - real_ret).mean()),
                "audit/env_steps_total": float(self.audit_steps)}

    def learned_state(self) -> dict:
        """The world model's learned state plus the critic's: the real boundaries and returns it fits on (those
        added since it was built) and its optimizer (its weights are tensors of their own, ``short_horizon.``)."""
        return super().learned_state() | {
            "returns": {k: v[self._initial_returns[k]:] for k, v in self._buf.items()},
            "value_opt": self._value_opt.state_dict()}

    def load_learned_state(self, s: dict) -> None:
        super().load_learned_state(s)
        self._buf = {k: v[:self._initial_returns[k]] + list(s["returns"][k]) for k, v in self._buf.items()}
        self._value_opt.load_state_dict(s["value_opt"])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return super().state_dict() | {f"{self.state_prefix}{k}": v.detach().clone()
                                       for k, v in self.value.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        n = len(self.state_prefix)
        own = {k[n:]: v for k, v in state.items() if k.startswith(self.state_prefix)}
        if own:
            self.value.load_state_dict(own)
        super().load_state_dict(state)

    def extra_state(self) -> dict:
        return super().extra_state() | {"imagined_steps": self.imagined_steps}

    def load_extra_state(self, state: dict) -> None:
        super().load_extra_state(state)
        self.imagined_steps = int(state.get("imagined_steps", 0))
