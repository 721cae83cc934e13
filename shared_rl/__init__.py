"""grove's shared core: rollout trees, advantages, losses, selection, the trainer, configs, checkpoints, CLI.

This package never imports ``visgen`` or ``robotics``; domains are resolved by name (``shared_rl.registry``).
"""
__version__ = "0.1.0"

from . import _quiet

_quiet.install()  # torchao's import-time pytree notices (imported by transformers/diffusers, not by grove)
