"""grove's shared core: rollout trees, advantages, losses, selection, the trainer, configs, checkpoints, CLI.

This package never imports ``visgen`` or ``robotics``; domains are resolved by name (``shared_rl.registry``).
"""
__version__ = "0.1.0"
