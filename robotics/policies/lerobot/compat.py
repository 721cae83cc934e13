"""Importing LeRobot's policy modules under grove's pinned stack (Python 3.12, torch 2.14, transformers 5.24, lerobot
0.6.1 --no-deps).

What stands between ``import lerobot.policies.{smolvla,pi0,pi05}`` and a working policy here:

1. LeRobot's pure-Python needs (draccus, einops, pyserial, deepdiff < 9, num2words) that ``pip install --no-deps
   lerobot`` leaves out: the project's robotics extra and ``constraints.txt`` install them.
2. (LeRobot 0.4.4 only, gone with 0.6) GR00T's config failed at class creation under transformers 5 and grove skipped
   its package init; LeRobot 0.6.1's ``lerobot.policies`` imports as it is.
3. **π-Gemma's causal mask** (π0 / π0.5). LeRobot 0.6's ``lerobot/policies/pi_gemma.py`` (``PiGemmaModel.forward``,
   the Gemma decoder of π0's VLM and action expert) calls ``create_causal_mask(config=..., inputs_embeds=...,
   attention_mask=..., cache_position=..., past_key_values=..., position_ids=...)``, the signature of transformers
   5.4-5.8, which LeRobot's ``pi`` extra pins (< 5.6). transformers ~5.9 dropped ``cache_position`` from
   ``masking_utils.create_causal_mask`` and renamed ``past_key_values`` to ``cache``, so on the transformers grove
   pins (5.24, which diffusers 0.42's LTX-2 and Gemma-4 pipelines need) π0's *training* forward runs (it passes a
   4-d mask and no cache) and its *inference* (the prefix KV-cache pass) fails: ``TypeError: create_causal_mask()
   got an unexpected keyword argument 'cache_position'``. :func:`patch_pi_gemma` rebinds the name
   ``create_causal_mask`` inside ``lerobot.policies.pi_gemma`` only (no file edited, nothing else in transformers
   touched) to a wrapper that drops ``cache_position`` and passes the cache as ``cache`` when the installed
   function takes those — the fix starVLA applied in its copy of this Gemma. With a transformers that still takes
   ``cache_position`` the name is left alone. The mask is the same either way (``cache_position`` was the
   positions of the new tokens, which 5.9+ derives from the cache's length).

4. **SmolVLA's cache crop.** LeRobot 0.6's SmolVLA ``denoise_step`` restores the prefix cache after each step with
   ``past_key_values.crop(prefix_len)``: the *absolute length* meaning ``Cache.crop`` had before transformers ~5.20.
   Transformers 5.24's ``crop`` takes the number of tokens to remove, as a negative number, and raises
   ``ValueError: Calling `crop` with a positive value`` otherwise, so SmolVLA's ``predict_action_chunk`` stops at its
   first denoising step. :func:`patch_smolvla_cache` rebinds the name ``DynamicCache`` inside
   ``lerobot.policies.smolvla.smolvlm_with_expert`` (where SmolVLA makes its cache) to :class:`LegacyCropCache`, a
   ``DynamicCache`` whose ``crop(n)`` with n > 0 keeps the first n tokens, as before; grove's own prefix caches
   are the same class.

Every grove module that touches ``lerobot.policies`` calls :func:`import_policies` first. A user script that imports
LeRobot's policies itself calls it too (``from robotics.policies.lerobot import import_policies``).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import types
import warnings

from shared_rl.errors import ConfigError

# the families grove drives: the LeRobot policy ``name`` (config.json's "type") -> modeling module and class
FAMILIES = {
    "smolvla": ("lerobot.policies.smolvla.modeling_smolvla", "SmolVLAPolicy"),
    "pi0": ("lerobot.policies.pi0.modeling_pi0", "PI0Policy"),
    "pi05": ("lerobot.policies.pi05.modeling_pi05", "PI05Policy"),
}


def _check_lerobot() -> None:
    if importlib.util.find_spec("lerobot") is None:
        raise ConfigError("robotics.policy.type: lerobot needs LeRobot: pip install --no-deps -c constraints.txt "
                          "lerobot (make does this; LeRobot 0.6 needs Python >= 3.12)")


def import_policies() -> types.ModuleType:
    """``lerobot.policies``, with π-Gemma's causal mask call and SmolVLA's cache crop made to fit the installed
    transformers (:func:`patch_pi_gemma`, :func:`patch_smolvla_cache`)."""
    _check_lerobot()
    try:
        policies = importlib.import_module("lerobot.policies")
    except ModuleNotFoundError as e:
        raise ConfigError(f"robotics.policy.type: lerobot: LeRobot's policy modules need {e.name!r}; install the "
                          f"robotics extra: pip install -c constraints.txt -e '.[robotics]'") from None
    except SyntaxError as e:  # PEP 695 syntax in LeRobot >= 0.5 on an older interpreter
        raise ConfigError(f"robotics.policy.type: lerobot: LeRobot's modules need Python >= 3.12 ({e.filename}: "
                          f"{e.msg}); make builds .venv with Python 3.12") from None
    patch_pi_gemma()
    patch_smolvla_cache()
    return policies


def _legacy_crop_cache() -> type:
    from transformers.cache_utils import DynamicCache

    class LegacyCropCache(DynamicCache):
        """``DynamicCache`` whose ``crop(n)`` with n > 0 keeps the first n tokens of every layer (the meaning LeRobot
        0.6's SmolVLA relies on); n <= 0 is transformers' own (remove -n tokens)."""

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove > 0:
                for layer in self.layers:
                    excess = layer.get_seq_length() - tokens_to_remove if layer.is_initialized else 0
                    if excess > 0:
                        layer.crop(-excess)
                return
            super().crop(tokens_to_remove)

    return LegacyCropCache


_LEGACY_CACHE: list[type] = []


def legacy_crop_cache() -> type:
    """The :class:`LegacyCropCache` class (made once, on first use: it subclasses transformers' ``DynamicCache``)."""
    if not _LEGACY_CACHE:
        _LEGACY_CACHE.append(_legacy_crop_cache())
    return _LEGACY_CACHE[0]


def _crop_keeps_length(cache_class) -> bool:
    """Whether ``cache_class().crop(n)`` with n > 0 keeps n tokens (transformers before ~5.20) rather than raising."""
    import torch

    cache = cache_class(((torch.zeros(1, 1, 3, 1), torch.zeros(1, 1, 3, 1)),))
    try:
        cache.crop(2)
    except ValueError:
        return False
    return cache.get_seq_length() == 2


def _rebind(module_name: str, name: str, is_ours, needs_it, replacement) -> bool:
    """Rebind ``name`` inside LeRobot's ``module_name`` to ``replacement(current)`` when ``needs_it(current)`` (the
    installed transformers breaks LeRobot's call); idempotent (``is_ours``). Returns whether grove's version is (now)
    in place; a LeRobot without that module or name, or a transformers it still fits, is left as it is."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError:
        return False
    current = getattr(module, name, None)
    if current is None:
        return False
    if is_ours(current):
        return True
    if not needs_it(current):
        return False
    setattr(module, name, replacement(current))
    return True


def patch_smolvla_cache() -> bool:
    """SmolVLA makes its prefix cache as a :class:`LegacyCropCache` (module docstring, item 4) when the installed
    ``DynamicCache.crop`` refuses positive lengths. Returns whether the rebinding is (now) in place."""
    return _rebind("lerobot.policies.smolvla.smolvlm_with_expert", "DynamicCache",
                   lambda current: current is legacy_crop_cache(), lambda current: not _crop_keeps_length(current),
                   lambda current: legacy_crop_cache())


def _drops_cache_position(create_causal_mask) -> bool:
    """Whether this ``create_causal_mask`` is transformers >= ~5.9's (no ``cache_position``, the cache as ``cache``)."""
    params = inspect.signature(create_causal_mask).parameters
    return "cache_position" not in params and "cache" in params


def _mask_without_cache_position(create_causal_mask):
    """``create_causal_mask`` taking π-Gemma's 5.4-5.8 keywords: ``cache_position`` dropped, ``past_key_values``
    passed as ``cache`` (see the module docstring, item 3)."""
    @functools.wraps(create_causal_mask)
    def mask(*args, cache_position=None, past_key_values=None, **kwargs):
        kwargs.setdefault("cache", past_key_values)
        return create_causal_mask(*args, **kwargs)
    mask.grove_compat = True
    return mask


def patch_pi_gemma() -> bool:
    """Make ``lerobot.policies.pi_gemma`` call the installed transformers' ``create_causal_mask`` with the keywords
    it takes (module docstring, item 3). Returns whether the wrapper is (now) in place; idempotent; a LeRobot
    without ``pi_gemma`` (0.4.x) or a transformers that still takes ``cache_position`` is left as it is."""
    if not _rebind("lerobot.policies.pi_gemma", "create_causal_mask",
                   lambda current: getattr(current, "grove_compat", False), _drops_cache_position,
                   _mask_without_cache_position):
        return False
    # pi_gemma's decoder layer hands its attention the cache as past_key_values, which 5.24 renames (until 5.40)
    warnings.filterwarnings("ignore", message=r"`past_key_values` is deprecated .* `GemmaAttention.forward`",
                            category=FutureWarning)
    return True


def policy_class(family: str) -> type:
    """The ``PreTrainedPolicy`` subclass of a LeRobot policy family (``smolvla``, ``pi0``, ``pi05``)."""
    if family not in FAMILIES:
        raise ConfigError(f"robotics.policy: LeRobot policy type {family!r} is not supported; grove drives "
                          f"{', '.join(FAMILIES)}")
    import_policies()
    module, name = FAMILIES[family]
    return getattr(importlib.import_module(module), name)
