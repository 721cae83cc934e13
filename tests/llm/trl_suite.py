"""Run TRL's own GRPOTrainer tests against ``shared_rl.llm.api.GRPOTrainer`` (or TRL's, for the baseline), offline.

    nice -n 19 .venv/bin/python tests/llm/trl_suite.py --impl grove   # or --impl trl; --mirror GIT_DIR; -k EXPR

What it does, all in a fresh temporary folder (nothing of TRL is copied into the project): takes
``tests/test_grpo_trainer.py`` and ``tests/testing_utils.py`` out of a git mirror of huggingface/trl (``git show``),
changes the one import line ``from trl import GRPOConfig, GRPOTrainer`` to take ``GRPOTrainer`` from grove (with
``--impl grove``), and builds the Hub repositories those tests name as tiny offline stand-ins from configs, in a
folder of the same relative path (``trl-internal-testing/tiny-Qwen2ForCausalLM-2.5``...), so that the tests' own
``from_pretrained`` / ``load_dataset`` calls, run from that folder, find them: Qwen2 / Qwen3 / Llama / Mistral / Gemma2 causal
LMs and Qwen2 / Qwen3 / Llama sequence classifiers (hidden 16, 2 layers) sharing one byte-level BPE tokenizer with
a Qwen-style chat template, and the ``zen`` prompt dataset (8 train / 2 test rows, standard and conversational).
Tests of other models (VLMs, MoE, remote code), vLLM, liger, tools and environments are deselected (``-k``).
It prints pytest's summary and writes ``results.json`` (test id -> outcome) into ``--out`` (default: the temp
folder). Not collected by pytest (no ``test_`` prefix): it runs for minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MIRROR = "/work/.mirror/huggingface+trl/repo"
IMPORT_LINE = "from trl import GRPOConfig, GRPOTrainer"
GROVE_IMPORT = "from trl import GRPOConfig\nfrom shared_rl.llm.api import GRPOTrainer"
# what no stand-in can serve: other model families, VLMs, vLLM / liger / tools / environments, TRL internals
DESELECT = ("not VLM and not Slow and not vllm and not liger and not tools and not environment and not Environment "
            "and not Cohere2 and not Glm4 and not GptOss and not Qwen3Moe and not NemotronH and not moe "
            "and not remote_code and not TestGetHighEntropyMask and not TestGRPORolloutDispatch "
            "and not TestTransformersContinuousBatchingContract and not multimodal")

# 8 rows (TRL's zen has 17): a test's default 3 epochs are then 24 generations, which keeps the file's ~100 tests
# within the hour on 2 busy cores
ZEN = ["The sun", "What is 2 + 2?", "Write a haiku about", "Beautiful is better than", "Explicit is better",
       "Simple is better than", "Readability counts.", "Namespaces are one"]
ZEN_TEST = ["Although never is often", "Unless explicitly silenced."]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# TrainingArguments refuses bf16 (TRL's default) without a GPU unless use_cpu is set: on a CPU-only machine the
# suite's GRPOConfigs get use_cpu=True (TRL then trains with bf16 autocast on the CPU), for both trainers alike
CONFTEST = """
import torch
import trl

if not torch.cuda.is_available():
    _init = trl.GRPOConfig.__init__

    def _on_cpu(self, *args, **kwargs):
        kwargs.setdefault("use_cpu", True)
        _init(self, *args, **kwargs)

    trl.GRPOConfig.__init__ = _on_cpu
"""


def build_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(ZEN + ZEN_TEST + ["user assistant system"] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def build_standins(root: Path) -> None:
    import torch
    import transformers as tf

    org = root / "trl-internal-testing"
    tok = build_tokenizer(root / "_tokenizer")
    common = dict(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                  tie_word_embeddings=False)
    families = {"Qwen2": tf.Qwen2Config, "Qwen3": tf.Qwen3Config, "Llama": tf.LlamaConfig, "Mistral": tf.MistralConfig,
                "Gemma2": tf.Gemma2Config}
    names = {("Qwen2", "CausalLM"): "tiny-Qwen2ForCausalLM-2.5", ("Qwen2", "SequenceClassification"):
             "tiny-Qwen2ForSequenceClassification-2.5", ("Qwen3", "CausalLM"): "tiny-Qwen3ForCausalLM",
             ("Qwen3", "SequenceClassification"): "tiny-Qwen3ForSequenceClassification",
             ("Llama", "CausalLM"): "tiny-LlamaForCausalLM-3.2",
             ("Llama", "SequenceClassification"): "tiny-LlamaForSequenceClassification-3.2",
             ("Mistral", "CausalLM"): "tiny-MistralForCausalLM-0.2",
             ("Gemma2", "CausalLM"): "tiny-Gemma2ForCausalLM"}  # tied embeddings, as TRL's (its lm_head test)
    for seed, ((family, head), name) in enumerate(names.items()):
        extra = {"head_dim": 4} if family in ("Qwen3", "Gemma2") else {}
        if family == "Gemma2":
            extra["tie_word_embeddings"] = True
        cfg = families[family](**{**common, **extra}, **({"num_labels": 1} if head != "CausalLM" else {}))
        torch.manual_seed(seed)
        model = getattr(tf, f"{family}For{head}")(cfg)
        if head == "CausalLM":
            model.generation_config = tf.GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        model.save_pretrained(org / name)
        tok.save_pretrained(org / name)
    zen = org / "zen"
    for config, wrap in (("standard_prompt_only", lambda p: p),
                         ("conversational_prompt_only", lambda p: [{"role": "user", "content": p}])):
        for split, rows in (("train", ZEN), ("test", ZEN_TEST)):
            path = zen / config / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps({"prompt": wrap(p)}) + "\n" for p in rows))
    cards = "".join(f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train.jsonl\n"
                    f"  - split: test\n    path: {c}/test.jsonl\n"
                    for c in ("standard_prompt_only", "conversational_prompt_only"))
    (zen / "README.md").write_text(f"---\nconfigs:\n{cards}---\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", choices=("grove", "trl"), default="grove")
    ap.add_argument("--mirror", default=DEFAULT_MIRROR, help="git dir of a huggingface/trl mirror")
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("-k", default="", help="extra pytest -k expression, and-ed with the deselection")
    ap.add_argument("--out", default="", help="folder for results.json (default: the temp folder)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per test at most (pytest-timeout)")
    ap.add_argument("--collect-only", action="store_true", help="list the selected test ids, in run order")
    ap.add_argument("--ids", default="", help="file of test ids (one per line) to run, in that order, instead of "
                                              "the -k selection (a long run resumed, or a priority order)")
    a = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix=f"trl-suite-{a.impl}-"))
    tests = root / "tests"
    tests.mkdir()
    for name in ("test_grpo_trainer.py", "testing_utils.py"):
        text = subprocess.run(["git", "--git-dir", a.mirror, "show", f"{a.rev}:tests/{name}"], check=True,
                              capture_output=True, text=True).stdout
        if name == "test_grpo_trainer.py" and a.impl == "grove":
            if IMPORT_LINE not in text:
                raise SystemExit(f"the import line {IMPORT_LINE!r} is not in {a.rev}'s test file")
            text = text.replace(IMPORT_LINE, GROVE_IMPORT, 1)
        if name == "testing_utils.py":
            text = _tolerant_imports(text)
        (tests / name).write_text(text)
    (tests / "__init__.py").write_text("")
    (tests / "conftest.py").write_text(CONFTEST)
    build_standins(root)
    out = Path(a.out).resolve() if a.out else root  # pytest runs in root: a relative --out would land there
    out.mkdir(parents=True, exist_ok=True)
    report = out / f"junit-{a.impl}.xml"
    expr = DESELECT + (f" and ({a.k})" if a.k else "")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(root / "_hf_datasets"), "WANDB_MODE": "disabled"}
    targets = ["tests/test_grpo_trainer.py", "-k", expr]
    if a.ids:
        targets = [f"tests/test_grpo_trainer.py::{line.strip()}" for line in Path(a.ids).read_text().splitlines()
                   if line.strip()]
    if a.collect_only:
        listing = subprocess.run([sys.executable, "-m", "pytest", *targets, "--collect-only", "-q", "-p",
                                  "no:cacheprovider", "-o", "addopts="], cwd=root, env=env, capture_output=True,
                                 text=True).stdout
        print("\n".join(x.split("::", 1)[1] for x in listing.splitlines() if "::" in x))
        return 0
    # -v: each test's outcome on its own line as it ends, so a run cut short still says what it measured
    cmd = [sys.executable, "-m", "pytest", *targets, "-v", "-p", "no:cacheprovider", f"--junitxml={report}",
           "-o", "addopts=", "--tb=line", "-rN", f"--timeout={a.timeout}"]
    print(f"trl_suite: {a.impl} in {root}", flush=True)
    rc = subprocess.run(cmd, cwd=root, env=env).returncode
    results = _read_junit(report)
    (out / f"results-{a.impl}.json").write_text(json.dumps(results, indent=1))
    counts = {}
    for v in results.values():
        counts[v["outcome"]] = counts.get(v["outcome"], 0) + 1
    print(f"trl_suite: {a.impl}: {counts} -> {out / f'results-{a.impl}.json'}")
    return rc


def _tolerant_imports(text: str) -> str:
    """The mirror's testing_utils may name ``trl.import_utils.is_*_available`` checks the installed TRL no longer
    has (the mirror and the wheel are different snapshots): a missing one reads as False (its tests skip)."""
    import re

    match = re.search(r"from trl\.import_utils import \(([^)]*)\)", text)
    if not match:
        return text
    names = [n.strip() for n in match.group(1).split(",") if n.strip()]
    lines = ["import trl.import_utils as _iu"] + [f"{n} = getattr(_iu, {n!r}, lambda *a, **k: False)" for n in names]
    return text[:match.start()] + "\n".join(lines) + text[match.end():]


def _read_junit(path: Path) -> dict[str, dict[str, str]]:
    import xml.etree.ElementTree as ET

    if not path.exists():
        return {}
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name")
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or "").splitlines()[0][:300] if el.get("message") else ""
        out[name] = {"outcome": outcome, "message": message}
    return out


if __name__ == "__main__":
    sys.exit(main())
