"""Tiny π0 / π0.5-architecture policies built from LeRobot 0.6's own classes, with no hub download.

LeRobot's π0 / π0.5 accept only ``paligemma_variant`` / ``action_expert_variant`` in {``gemma_300m``, ``gemma_2b``}
(``PI0Config.__post_init__``), build their Gemma sizes from a fixed table (``modeling_pi0.get_gemma_config``) and their
PaliGemma from ``CONFIG_MAPPING["paligemma"]()`` with SigLIP's full size (27 layers of width 1152) and a projection
width of 2048 written in the code. A CPU test cannot build that (~3B parameters). :func:`tiny_pi_sizes` substitutes,
while it is active, a small table for both variant names and a small SigLIP (set on the config just before LeRobot
constructs its PaliGemma) — nothing else: the classes, the forward passes, the processors, the joint
attention and the checkpoint layout are LeRobot's. The vocabulary (257,152 tokens) and the 8 attention heads that
``compute_layer_complete`` reshapes to are kept, so most of a tiny policy's parameters are its two embedding tables.

A tiny policy directory carries ``grove_tiny_pi.json`` (its sizes): :func:`load.load_lerobot_policy` and the tests
load it inside :func:`tiny_pi_sizes`; a real checkpoint (``lerobot/pi05_base``) has no such file and loads as is.
The tokenizer is a word-level one written next to the policy (PaliGemma's SentencePiece model lives on the Hub);
the preprocessor's ``tokenizer_name`` points at it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .compat import import_policies
from .tiny import env_words

TINY_FILE = "grove_tiny_pi.json"
TOKENIZER_DIR = "tokenizer"
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
PROMPT_WORDS = ["Task", "State", "Action", ":", ",", ";", ".", "\n"]


@dataclass
class TinyPi:
    """Sizes of a tiny π0 / π0.5 (LeRobot's own fields where it has them)."""

    family: str = "pi05"  # pi0 | pi05
    image_size: int = 64  # the image feature's side (the env renders it)
    vision_size: int = 32  # SigLIP input side (PI0Config.image_resolution)
    patch_size: int = 8
    vision_width: int = 32
    vision_layers: int = 1
    vlm_width: int = 64
    vlm_depth: int = 2
    vlm_mlp: int = 128
    expert_width: int = 32
    expert_depth: int = 2
    expert_mlp: int = 64
    head_dim: int = 8  # 8 heads (LeRobot's joint attention reshapes to 8 · head_dim), 1 KV head, as Gemma 300m / 2b
    chunk_size: int = 8
    n_action_steps: int = 4
    max_state_dim: int = 8
    max_action_dim: int = 8
    num_inference_steps: int = 4
    tokenizer_max_length: int = 32
    words: list[str] = field(default_factory=list)  # extra prompt words ([] = Meta-World's instructions)

    def gemma(self, variant: str):
        """The Gemma sizes LeRobot's ``get_gemma_config`` returns, tiny: ``gemma_2b`` = the VLM, ``gemma_300m`` = the
        action expert (π0's defaults)."""
        from lerobot.policies.pi0.modeling_pi0 import GemmaConfig

        if variant == "gemma_2b":
            return GemmaConfig(self.vlm_width, self.vlm_depth, self.vlm_mlp, 8, 1, self.head_dim)
        if variant == "gemma_300m":
            return GemmaConfig(self.expert_width, self.expert_depth, self.expert_mlp, 8, 1, self.head_dim)
        raise ValueError(f"Unknown variant: {variant}")


def _small_vision(make_paligemma, t: TinyPi):
    """LeRobot's ``PaliGemmaForConditionalGenerationWithPiGemma`` constructor with the vision config made small first
    (the modeling code builds a full-size SigLIP config and writes ``intermediate_size = 4304`` and ``projection_dim
    = 2048`` into it just before this call)."""
    def make(config):
        v = config.vision_config
        v.hidden_size, v.intermediate_size, v.num_hidden_layers = t.vision_width, 2 * t.vision_width, t.vision_layers
        v.num_attention_heads, v.patch_size, v.projection_dim = 2, t.patch_size, t.vlm_width
        v.num_image_tokens = (v.image_size // t.patch_size) ** 2
        config.text_config.num_image_tokens = v.num_image_tokens
        return make_paligemma(config=config)
    return make


@contextlib.contextmanager
def tiny_pi_sizes(t: TinyPi):
    """While active, LeRobot's π0 / π0.5 build at the sizes of ``t`` (module docstring)."""
    import_policies()
    modules = [importlib.import_module(f"lerobot.policies.{f}.modeling_{f}") for f in ("pi0", "pi05")]
    name = "PaliGemmaForConditionalGenerationWithPiGemma"
    saved = [(m, m.get_gemma_config, getattr(m, name)) for m in modules]
    try:
        for m in modules:
            m.get_gemma_config = t.gemma
            setattr(m, name, _small_vision(getattr(m, name), t))
        yield t
    finally:
        for m, gemma, make in saved:
            m.get_gemma_config = gemma
            setattr(m, name, make)


def read_tiny(path: str | Path) -> TinyPi | None:
    """The sizes a tiny policy directory was built with (None for a real checkpoint)."""
    f = Path(path) / TINY_FILE
    if not f.is_file():
        return None
    try:
        return TinyPi(**json.loads(f.read_text()))
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        from shared_rl.errors import ConfigError

        raise ConfigError(f"robotics.policy.path: {f} is not a tiny π size file grove wrote ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120]})") from None


def sizes_context(path: str | Path):
    """:func:`tiny_pi_sizes` for a tiny policy directory, a no-op context for any other."""
    t = read_tiny(path)
    return tiny_pi_sizes(t) if t is not None else contextlib.nullcontext()


def write_tiny_tokenizer(out: Path, t: TinyPi) -> Path:
    """A word-level tokenizer for π's prompts ("Task: <instruction>, State: <256-bin ints>;\\nAction: " for π0.5,
    the instruction and a newline for π0): PaliGemma's SentencePiece model is on the Hub, this one is local."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from ...envs.metaworld_env import TASK_INSTRUCTIONS

    words = set(t.words) | {w for text in TASK_INSTRUCTIONS.values() for w in text.replace("_", " ").split()}
    words |= {w.lower() for w in words}
    vocab_words = SPECIAL + PROMPT_WORDS + [str(i) for i in range(256)] + sorted(words - set(PROMPT_WORDS))
    vocab = {w: i for i, w in enumerate(dict.fromkeys(vocab_words))}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", behavior="isolated"),
                                                     pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>",
                                  eos_token="<eos>")
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    return out


@contextlib.contextmanager
def _local_tokenizer(path: Path):
    """LeRobot's π processor factories name ``google/paligemma-3b-pt-224``; while building a tiny policy's processors
    that name loads the local word-level tokenizer instead (nothing is fetched)."""
    from lerobot.processor import tokenizer_processor

    real = tokenizer_processor.AutoTokenizer

    class LocalAutoTokenizer:
        @staticmethod
        def from_pretrained(name, *args, **kwargs):
            return real.from_pretrained(str(path) if name == "google/paligemma-3b-pt-224" else name, *args, **kwargs)

    tokenizer_processor.AutoTokenizer = LocalAutoTokenizer
    try:
        yield
    finally:
        tokenizer_processor.AutoTokenizer = real


def build_tiny_pi(out_dir: str | Path, env_cfg, t: TinyPi | None = None, stats: dict | None = None, seed: int = 0):
    """Write a fresh tiny π0 / π0.5 policy directory (``out_dir``: LeRobot's ``save_pretrained`` of the policy and both
    processors, ``grove_tiny_pi.json``, the tokenizer in ``out_dir/tokenizer``) whose features are the env's: one
    image feature ``observation.images.<camera>`` per env camera at ``t.image_size``, the proprio state, a 4-d
    action. ``stats``: normalisation statistics (``tiny.demo_stats``: mean/std for π0, quantiles for π0.5); None =
    the identity. Returns the policy (LeRobot's ``PI0Policy`` / ``PI05Policy``)."""
    t = t or TinyPi()
    if t.family not in ("pi0", "pi05"):
        raise ValueError(f"TinyPi.family must be pi0 or pi05, got {t.family!r}")
    import_policies()
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.processor import TokenizerProcessorStep

    if t.family == "pi0":
        from lerobot.policies.pi0.configuration_pi0 import PI0Config as Config
        from lerobot.policies.pi0.modeling_pi0 import PI0Policy as Policy
        from lerobot.policies.pi0.processor_pi0 import make_pi0_pre_post_processors as make_processors
    else:
        from lerobot.policies.pi05.configuration_pi05 import PI05Config as Config
        from lerobot.policies.pi05.modeling_pi05 import PI05Policy as Policy
        from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors as make_processors

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if env_words(env_cfg):
        t = dataclasses.replace(t, words=sorted(set(t.words) | set(env_words(env_cfg))))
    tokenizer = write_tiny_tokenizer(out / TOKENIZER_DIR, t)
    inputs = {f"observation.images.{cam}": PolicyFeature(FeatureType.VISUAL, (3, t.image_size, t.image_size))
              for cam in env_cfg.cameras}
    inputs["observation.state"] = PolicyFeature(FeatureType.STATE, (env_cfg.proprio_dim,))
    config = Config(chunk_size=t.chunk_size, n_action_steps=t.n_action_steps, max_state_dim=t.max_state_dim,
                    max_action_dim=t.max_action_dim, num_inference_steps=t.num_inference_steps,
                    image_resolution=(t.vision_size, t.vision_size), tokenizer_max_length=t.tokenizer_max_length,
                    dtype="float32", device="cpu", input_features=inputs,
                    output_features={"action": PolicyFeature(FeatureType.ACTION, (env_cfg.action_dim,))})
    if stats is None:
        dims = {"observation.state": env_cfg.proprio_dim, "action": env_cfg.action_dim}
        stats = {k: {"mean": torch.zeros(d), "std": torch.ones(d), "min": -torch.ones(d), "max": torch.ones(d),
                     "q01": -torch.ones(d), "q99": torch.ones(d)} for k, d in dims.items()}
    torch.manual_seed(seed)
    with tiny_pi_sizes(t):
        policy = Policy(config)
    with _local_tokenizer(tokenizer):
        pre, post = make_processors(config, dataset_stats=stats)
    for i, step in enumerate(pre.steps):  # saved with the local tokenizer's path as its name
        if isinstance(step, TokenizerProcessorStep):
            pre.steps[i] = dataclasses.replace(step, tokenizer_name=str(tokenizer.resolve()), tokenizer=None)
    policy.save_pretrained(out)
    pre.save_pretrained(out)
    post.save_pretrained(out)
    from .local_files import bundle_local_files

    bundle_local_files(out, config, pre)  # tokenizer/ is inside: the directory loads wherever it is moved
    (out / TINY_FILE).write_text(json.dumps(dataclasses.asdict(t), indent=1))
    return policy
