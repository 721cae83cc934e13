"""LLM path: tokenizer, log-prob layout invariants, TRL-signature rewards, tree bookkeeping, tasks, configs."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from shared_rl.domain import RunContext
from shared_rl.llm.domain import LLMConfig, LLMDomain
from shared_rl.llm.engine import Generation, TorchRolloutEngine
from shared_rl.llm.model import LLMLoraSettings, build_tiny_llama
from shared_rl.llm.policy import collate, token_log_probs
from shared_rl.llm.rewards import LLMRewardSpec, build_reward, call_reward, format_check, numeric_match, overlong
from shared_rl.llm.tasks import DatasetSettings, arith_problems, format_prompt, is_eval_pair, load_task
from shared_rl.llm.tokenizer import build_char_tokenizer
from shared_rl.llm.tree import LLMTreeSettings, grow_trees

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A randomly initialised tiny Llama + char tokenizer saved like the asset (no downloads)."""
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("tiny")
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32, seed=0)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def make_domain(model_dir: Path, **overrides) -> LLMDomain:
    cfg = LLMConfig(model=str(model_dir), dataset=DatasetSettings(source="arith", num_train=64, num_eval=16),
                    max_new_tokens=6, logprob_batch_size=16, **overrides)
    cfg.check("llm")
    return LLMDomain(cfg, RunContext(run_dir=None, device=torch.device("cpu"), seed=0, log=lambda s: None))


# ---- tokenizer ---------------------------------------------------------------------------------------------------
def test_char_tokenizer_pitfalls():
    tok = build_char_tokenizer()
    ids = tok("12+3=").input_ids
    assert ids[0] == tok.bos_token_id and len(ids) == 6          # BOS from the post-processor, one id per char
    assert tok.decode(tok("1 + 2\n").input_ids, skip_special_tokens=True) == "1 + 2\n"  # Fuse: no inserted spaces
    assert tok.pad_token_id not in (tok.eos_token_id, tok.bos_token_id)
    batch = tok(["1=", "123="], padding=True)
    assert batch.input_ids[0][:2] == [tok.pad_token_id] * 2      # left padding


# ---- log-probs ---------------------------------------------------------------------------------------------------
def test_ratio_is_exactly_one_before_update(tiny_dir):
    dom = make_domain(tiny_dir)
    gen = torch.Generator().manual_seed(0)
    ro = dom.rollout([0, 1, 2, 3], 4, gen, 0)
    assert ro.logp_old.shape == (16, 6) and ro.mask.shape == (16, 6)
    assert ro.mask.any(1).all() and (ro.logp_old[~ro.mask] == 0).all() and (ro.logp_old[ro.mask] < 0).all()
    for idx in (torch.tensor([3, 0, 9]), torch.arange(16), torch.tensor([15])):
        out = dom.log_probs(ro, idx, need_kl=False)
        assert out.logp.requires_grad
        m = ro.mask[idx]
        ratio = torch.exp(out.logp.detach() - ro.logp_old[idx])[m]
        assert torch.equal(out.logp.detach()[m], ro.logp_old[idx][m]), "recomputed log-probs must be bitwise equal"
        assert (ratio == 1).all()


def test_left_padding_invariance_and_engine_agreement(tiny_dir):
    dom = make_domain(tiny_dir)
    tok, model = dom.tokenizer, dom.model
    prompts = [torch.tensor(tok(p).input_ids) for p in ("1+2=", "345+67=")]
    comps = [torch.tensor(tok("3", add_special_tokens=False).input_ids + [tok.eos_token_id]),
             torch.tensor(tok("412", add_special_tokens=False).input_ids)]
    with torch.no_grad():
        tight, _ = token_log_probs(model, collate(prompts, comps, None, tok.pad_token_id), 1.0)
        wide, _ = token_log_probs(model, collate(prompts, comps, torch.tensor([[14, 7], [14, 7]]), tok.pad_token_id), 1.0)
        alone, _ = token_log_probs(model, collate(prompts[:1], comps[:1], None, tok.pad_token_id), 1.0)
    assert tight.shape == (2, 3) and wide.shape == (2, 7)
    assert torch.allclose(tight, wide[:, :3], atol=1e-5) and (wide[:, 3:] == 0).all()
    assert torch.allclose(tight[0, :2], alone[0, :2], atol=1e-5)
    assert tight[0, 2] == 0  # the pad after the first completion is masked out
    # the KV-cache sampler's own log-probs agree with the full-sequence recompute (not bitwise: other kernels)
    eng = TorchRolloutEngine(model, tok.pad_token_id, tok.eos_token_id)
    g = eng.generate([p.tolist() for p in prompts], 3, 5, 1.0, torch.Generator().manual_seed(1))
    rows_p = [prompts[i] for i in g.prompt_index]
    rows_c = [torch.tensor(c, dtype=torch.long) for c in g.completion_ids]
    with torch.no_grad():
        re, _ = token_log_probs(model, collate(rows_p, rows_c, None, tok.pad_token_id), 1.0)
    for i, lps in enumerate(g.sample_logprobs):
        assert torch.allclose(re[i, :len(lps)], torch.tensor(lps), atol=1e-5)


def test_temperature_scaling_of_log_probs(tiny_dir):
    dom = make_domain(tiny_dir)
    tok = dom.tokenizer
    batch = collate([torch.tensor(tok("9+9=").input_ids)], [torch.tensor(tok("18", add_special_tokens=False).input_ids)],
                    None, tok.pad_token_id)
    with torch.no_grad():
        out = dom.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        logits = out.logits[0, -3:-1] / 0.5
        expected = torch.log_softmax(logits, -1).gather(1, batch.completion_ids[0][:, None]).squeeze(1)
        got, _ = token_log_probs(dom.model, batch, 0.5)
    assert torch.allclose(got[0], expected, atol=1e-6)


def test_lora_reference_is_adapter_disabled(tiny_dir):
    dom = make_domain(tiny_dir, lora=LLMLoraSettings(enabled=True, rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    names = [n for n, p in dom.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    ro = dom.rollout([0, 1], 2, torch.Generator().manual_seed(0), 0)
    idx = torch.arange(len(ro))
    out = dom.log_probs(ro, idx, need_kl=True)
    assert torch.equal(out.ref_logp[ro.mask], ro.logp_old[ro.mask])  # LoRA B starts at 0: policy == base
    with torch.no_grad():
        for n, p in dom.model.named_parameters():
            if "lora_B" in n:
                p.add_(0.5)
    out2 = dom.log_probs(ro, idx, need_kl=True)
    assert torch.equal(out2.ref_logp, out.ref_logp)                  # the reference did not move
    assert not torch.allclose(out2.logp[ro.mask], out.logp[ro.mask])  # the policy did


# ---- rewards -----------------------------------------------------------------------------------------------------
def test_builtin_rewards_hand_values():
    nm = numeric_match()
    assert nm(prompts=["q"] * 4, completions=["579", "The answer is 1,234.", "x", "12"],
              answer=["579", "#### 1234", "5", "no number"]) == [1.0, 1.0, 0.0, None]
    fmt = format_check()
    assert fmt(prompts=[""] * 3, completions=["123", "12a", "77"], truncated=[False, False, True]) == [1.0, 0.0, 0.0]
    ol = overlong(max_length=10, buffer=4)
    # L - C = 6: length 6 -> 0; 8 -> (6 - 8) / 4 = -0.5; 10 -> -1; 11 -> -1 (beyond L)
    assert ol(prompts=[""] * 4, completions=[""] * 4, completion_ids=[[0] * 6, [0] * 8, [0] * 10, [0] * 11]) == \
        [0.0, -0.5, -1.0, -1.0]


TRL_STYLE_MODULE = '''
def trl_style_reward(completions, answer, **kwargs):
    """A reward written for TRL: conversational-or-text completions, a dataset column, and **kwargs."""
    out = []
    for c, a in zip(completions, answer):
        text = c if isinstance(c, str) else c[0]["content"]
        out.append(None if text == "" else float(text.startswith(str(a)[0])))
    return out
'''


def test_trl_signature_reward_none_becomes_nan(tiny_dir, tmp_path, monkeypatch):
    (tmp_path / "my_trl_rewards.py").write_text(TRL_STYLE_MODULE)   # a user's module, imported by name
    monkeypatch.syspath_prepend(str(tmp_path))
    label, fn = build_reward(LLMRewardSpec(name="my_trl_rewards:trl_style_reward"))
    assert label == "trl_style_reward"
    vals = call_reward(fn, label, ["1+1=", "2+2=", "3+3="], ["2", "", "5"], [[1], [], [1]],
                       {"answer": ["2", "4", "6"]}, {"trainer_state": None})
    assert vals[0] == 1.0 and math.isnan(vals[1]) and vals[2] == 0.0
    with pytest.raises(ValueError, match="returned 1 values for 2"):
        call_reward(lambda **k: [1.0], "bad", ["a", "b"], ["x", "y"], [[], []], {}, {})
    # inside the domain: dataset columns arrive as kwargs and None is NaN in the rollout
    dom = make_domain(tiny_dir, rewards=[LLMRewardSpec("numeric_match"),
                                         LLMRewardSpec("my_trl_rewards:trl_style_reward", 0.0)])
    ro = dom.rollout([0, 1], 8, torch.Generator().manual_seed(0), 0)
    r = ro.rewards["trl_style_reward"]
    empty = torch.tensor([not bool(dom._decode(c.tolist())) for c in ro.payload["completion_ids"]])
    assert torch.equal(torch.isnan(r), empty)
    assert set(ro.rewards) == {"numeric_match", "trl_style_reward"}


FLAKY_MODULE = '''
CALLS = []


def flaky_reward(completions, **kwargs):
    """Fails like a reward server on its first call, answers afterwards."""
    CALLS.append(len(completions))
    if len(CALLS) == 1:
        raise ConnectionError("reward server reset the connection")
    return [1.0] * len(completions)


def dead_reward(completions, **kwargs):
    raise TimeoutError("reward server gone")
'''


def test_reward_backends_are_retried_then_masked(tiny_dir, tmp_path, monkeypatch):
    from shared_rl.rewards import RewardFailure, RewardGuardConfig

    (tmp_path / "flaky_llm_rewards.py").write_text(FLAKY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    guard = RewardGuardConfig(retries=1, backoff_s=0.0)
    dom = make_domain(tiny_dir, reward_guard=guard,
                      rewards=[LLMRewardSpec("flaky_llm_rewards:flaky_reward"), LLMRewardSpec("flaky_llm_rewards:dead_reward")])
    ro = dom.rollout([0, 1], 4, torch.Generator().manual_seed(0), 0)
    import flaky_llm_rewards

    assert flaky_llm_rewards.CALLS == [8, 8]                          # failed once, retried once, answered
    assert torch.equal(ro.rewards["flaky_reward"], torch.ones(8))
    assert torch.isnan(ro.rewards["dead_reward"]).all()                # masked: the trainer skips and counts it
    fatal = make_domain(tiny_dir, reward_guard=RewardGuardConfig(retries=0, on_failure="fatal"),
                        rewards=[LLMRewardSpec("flaky_llm_rewards:dead_reward")])
    with pytest.raises(RewardFailure, match="dead_reward.*failed after 1 attempts"):
        fatal.rollout([0], 2, torch.Generator().manual_seed(0), 0)


# ---- trees -------------------------------------------------------------------------------------------------------
class ScriptedEngine:
    """Emits token 10 + depth-of-call for every row; row 0 of the first call ends with EOS (id 2) after 1 token."""

    def __init__(self):
        self.calls = 0

    def generate(self, prompts, n, max_new_tokens, temperature, generator, stop_entropy=None,
                 min_new_tokens_before_stop=1):
        out = Generation(prompt_index=[i for i in range(len(prompts)) for _ in range(n)], completion_ids=[],
                         finished=[], stopped=[])
        for row in range(len(prompts) * n):
            if self.calls == 0 and row == 0:
                out.completion_ids.append([2])
                out.finished.append(True)
            else:
                out.completion_ids.append([10 + self.calls] * max_new_tokens)
                out.finished.append(False)
            out.stopped.append(False)
        self.calls += 1
        out.nfe = len(out.completion_ids)
        return out

    def sync_weights(self):
        pass


def test_tree_bookkeeping_counts_prefixes_parents():
    prompts = [[1, 5], [1, 6]]
    tree = grow_trees(ScriptedEngine(), prompts, LLMTreeSettings(enabled=True, branching=[2, 3], segment_tokens=2),
                      max_new_tokens=5, temperature=1.0, generator=torch.Generator())
    # per prompt: 1 root + 2 children + 3 grandchildren per unfinished child; the EOS child (node 2) is a leaf
    # prompt 0: root 0, children 2 (EOS) and 3; prompt 1: root 1, children 4, 5; grandchildren of 3, 4, 5
    assert len(tree) == 2 + 4 + 9
    assert tree.parent[:6] == [-1, -1, 0, 0, 1, 1]
    assert tree.parent[6:] == [3] * 3 + [4] * 3 + [5] * 3
    assert tree.group == [0, 1, 0, 0, 1, 1] + [0] * 3 + [1] * 6
    assert tree.depth == [0, 0, 1, 1, 1, 1] + [2] * 9
    leaves = tree.is_leaf
    assert [i for i, l in enumerate(leaves) if l] == [2] + list(range(6, 15))
    for i in range(6, 15):                                   # children share the parent's prefix exactly
        p = tree.parent[i]
        assert tree.path[i][:len(tree.path[p])] == tree.path[p] and tree.start[i] == len(tree.path[p]) == 2
        assert len(tree.path[i]) == 5                         # last depth runs to the length cap
    assert tree.path[2] == [2] and tree.finished[2]
    assert tree.generated_tokens == 1 + 3 * 2 + 9 * 3


def test_tree_rollout_in_domain(tiny_dir):
    tree = LLMTreeSettings(enabled=True, branching=[2, 2, 2], segment_tokens=2)
    dom = make_domain(tiny_dir, tree=tree)
    ro = dom.rollout([0, 1, 2], 0, torch.Generator().manual_seed(0), 0)
    parent = ro.parent
    n = len(ro)
    assert parent is not None and (parent[:3] == -1).all()
    roots = (parent < 0).nonzero().flatten()
    assert len(roots) == 3 and not ro.mask[roots].any()          # roots own no tokens
    children = torch.zeros(n, dtype=torch.long)
    children.index_add_(0, parent[parent >= 0], torch.ones(int((parent >= 0).sum()), dtype=torch.long))
    leaf = (children == 0) & (parent >= 0)
    r = ro.rewards["numeric_match"]
    assert torch.equal(torch.isfinite(r), leaf)                  # rewards only on leaves
    assert ((children == 0) | (children == 2)).all()             # every expanded node has exactly 2 children
    for i in range(n):                                            # the mask is the node's own segment
        if parent[i] >= 0:
            own = ro.mask[i].nonzero().flatten()
            plen = len(ro.payload["completion_ids"][int(parent[i])])
            assert own.numel() >= 1 and int(own[0]) == plen
            assert torch.equal(ro.payload["completion_ids"][i][:plen], ro.payload["completion_ids"][int(parent[i])])
    out = dom.log_probs(ro, torch.arange(n), need_kl=False)
    assert torch.equal(out.logp.detach()[ro.mask], ro.logp_old[ro.mask])
    assert ro.info["completion/tokens"] == float(ro.mask.sum())  # each generated token is owned by one edge


# ---- tasks and datasets ------------------------------------------------------------------------------------------
def test_arith_splits_are_deterministic_and_disjoint():
    a = arith_problems("train", 300, 3, seed=0)
    assert a == arith_problems("train", 300, 3, seed=0)
    e = arith_problems("eval", 300, 3, seed=0)
    assert not {x["prompt"] for x in a} & {x["prompt"] for x in e}
    for ex in e[:20]:
        x, y = map(int, ex["prompt"][:-1].split("+"))
        assert is_eval_pair(x, y) and int(ex["answer"]) == x + y


def test_jsonl_csv_and_datasets_sources(tmp_path):
    rows = [{"question": f"{i}+1=", "answer": str(i + 1), "level": i % 3} for i in range(200)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    s = DatasetSettings(source="jsonl", path=str(tmp_path / "d.jsonl"), prompt_column="question",
                        prompt_template="Q: {prompt}", eval_fraction=0.1, num_train=0, num_eval=0)
    t1, t2 = load_task(s), load_task(s)
    assert t1.train == t2.train and len(t1.train) + len(t1.eval) == 200 and 5 < len(t1.eval) < 40
    assert not {r["prompt"] for r in t1.train} & {r["prompt"] for r in t1.eval}
    assert t1.train[0]["prompt"].startswith("Q: ") and "level" in t1.train[0]
    import csv
    with (tmp_path / "d.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["question", "answer", "level"])
        w.writeheader()
        w.writerows(rows)
    tc = load_task(DatasetSettings(source="csv", path=str(tmp_path / "d.csv"), prompt_column="question",
                                   num_train=0, num_eval=0))
    assert len(tc.train) + len(tc.eval) == 200
    import datasets
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:150]),
                          "test": datasets.Dataset.from_list(rows[150:])}).save_to_disk(str(tmp_path / "hf"))
    th = load_task(DatasetSettings(source="hf", path=str(tmp_path / "hf"), split="train", eval_split="test",
                                   prompt_column="question", num_train=0, num_eval=0))
    assert len(th.train) == 150 and len(th.eval) == 50 and th.eval[0]["answer"] == "151"


def test_chat_template_applied_when_present():
    tok = build_char_tokenizer()
    assert format_prompt(tok, "1+1=") == tok("1+1=").input_ids
    tok.chat_template = "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}" \
                        "{% if add_generation_prompt %}<a>{% endif %}"
    ids = format_prompt(tok, "1+1=", system_prompt="S")
    assert tok.decode(ids) == "<s>S<u>1+1=<a>"
    assert format_prompt(tok, [{"role": "user", "content": "hi"}]) == tok("<u>hi<a>", add_special_tokens=False).input_ids
    assert format_prompt(tok, "1+1=", use_chat_template="never") == tok("1+1=").input_ids


# ---- configs -----------------------------------------------------------------------------------------------------
def test_all_llm_configs_parse():
    import yaml
    from shared_rl.config import from_dict, load_train_config
    from shared_rl.llm.pretrain import SFTConfig

    paths = sorted((REPO / "configs" / "llm").glob("*.yaml"))
    assert {p.stem for p in paths} >= {"arith_sft", "arith_grpo", "arith_dapo", "arith_gspo", "arith_tree",
                                       "qwen05b_gsm8k"}
    for p in paths:
        data = yaml.safe_load(p.read_text())
        if data.get("kind") == "supervised":
            from_dict(SFTConfig, {k: v for k, v in data.items() if k not in ("kind", "domain")}, "sft")
            continue
        cfg = load_train_config(data)
        assert cfg.domain == "llm"
        assert not cfg.advantage.weights  # the domain never writes into the trainer's sections
        assert set(cfg.domain_config.default_reward_weights()) == {build_reward(r)[0] for r in cfg.domain_config.rewards}
    qwen = load_train_config(yaml.safe_load((REPO / "configs/llm/qwen05b_gsm8k.yaml").read_text()))
    assert qwen.domain_config.lora.enabled and "/" in qwen.domain_config.model


def test_config_errors_are_actionable():
    from shared_rl.config import ConfigError, load_train_config

    with pytest.raises(ConfigError, match="tree advantage estimator"):
        load_train_config({"domain": "llm", "advantage": {"estimator": "grpo"}, "llm": {"tree": {"enabled": True}}})
    with pytest.raises(ConfigError, match="temperature"):
        load_train_config({"domain": "llm", "llm": {"temperature": 0}})
    with pytest.raises(ConfigError, match="unknown config key 'llm.max_new_token'"):
        load_train_config({"domain": "llm", "llm": {"max_new_token": 4}})


@pytest.mark.parametrize("tree", [False, True])
def test_engine_behaviour_logprobs_match_recompute(tiny_dir, tree):
    settings = LLMTreeSettings(enabled=tree, branching=[2, 2], segment_tokens=2)
    dom = make_domain(tiny_dir, tree=settings, behaviour_logprobs="engine")
    ro = dom.rollout([0, 1, 2], 4, torch.Generator().manual_seed(3), 0)
    out = dom.log_probs(ro, torch.arange(len(ro)), need_kl=False)
    assert (ro.logp_old[~ro.mask] == 0).all()
    assert torch.allclose(out.logp.detach()[ro.mask], ro.logp_old[ro.mask], atol=1e-5)


def test_entropy_branching_stops_before_uncertain_tokens(tiny_dir):
    dom = make_domain(tiny_dir)
    prompts = [dom._prompt_ids("train", k) for k in range(3)]
    g = dom.engine.generate(prompts, 2, 6, 1.0, torch.Generator().manual_seed(0), stop_entropy=0.0,
                            min_new_tokens_before_stop=2)
    # every next-token distribution has entropy > 0: each row stops right after its 2 guaranteed tokens
    assert all(s or f for s, f in zip(g.stopped, g.finished))
    assert all(len(c) == 2 for c, s in zip(g.completion_ids, g.stopped) if s)
    # a threshold above log(vocab) never fires: entropy trees equal fixed-segment trees for the same noise
    big = math.log(len(dom.tokenizer)) + 1
    fixed = grow_trees(dom.engine, prompts, LLMTreeSettings(True, [2, 2], 2, "fixed"), 6, 1.0,
                       torch.Generator().manual_seed(1))
    entropy = grow_trees(dom.engine, prompts, LLMTreeSettings(True, [2, 2], 2, "entropy", big), 6, 1.0,
                         torch.Generator().manual_seed(1))
    assert entropy.path == fixed.path and entropy.parent == fixed.parent
    low = grow_trees(dom.engine, prompts, LLMTreeSettings(True, [2, 2], 3, "entropy", 0.0, 1), 6, 1.0,
                     torch.Generator().manual_seed(1))
    assert all(len(low.path[i]) - low.start[i] == 1 for i in range(len(low)) if low.depth[i] == 1 and not low.finished[i])


def test_long_prompts_truncate_keeps_the_last_tokens_and_says_so(tmp_path):
    """``llm.dataset.long_prompts: truncate``: a prompt longer than ``max_prompt_tokens`` keeps its last tokens (the
    question end, TRL's side), short ones are untouched, and the run says how many were cut."""
    import json as _json

    from shared_rl.config import load_train_config
    from shared_rl.trainer import Trainer

    rows = [{"prompt": "1+1=", "answer": "2"}] * 20 + [{"prompt": "12345678+1=", "answer": "12345679"}] * 4
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(_json.dumps(r) + "\n" for r in rows))
    logs = []
    cfg = load_train_config({"domain": "llm", "iterations": 1, "logging": {"progress": False},
                             "llm": {"dataset": {"source": "jsonl", "path": str(path), "max_prompt_tokens": 6,
                                                 "long_prompts": "truncate", "eval_fraction": 0.2}}})
    tr = Trainer(cfg, None, log=logs.append)
    d = tr.domain
    from shared_rl.llm.tasks import format_prompt

    for split, rows_ in (("train", d.task.train), ("eval", d.task.eval)):
        for i, row in enumerate(rows_):
            full = format_prompt(d.tokenizer, row["prompt"])
            got = d._prompt_ids(split, i)
            assert got == (full[-6:] if len(full) > 6 else full)
    assert any("prompts longer than 6 tokens (llm.dataset.max_prompt_tokens) are cut to their last 6" in m
               for m in logs), logs
