"""Third-party import-time chatter that is not for grove's users (issue 42).

Whenever ``torchao`` is installed, ``transformers`` (``modeling_utils`` -> ``quantizers/auto.py`` ->
``quantizer_torchao.py``: ``if is_torchao_available(): from torchao.prototype.safetensors ...``) and ``diffusers``
(its torchao quantizer shim) import it on their own import, whether or not a run quantizes anything; grove itself
imports torchao only inside the functions that use it (``visgen/lowprec.py``). torchao's import then registers two
enums with torch's pytree (``register_constant``), which torch >= 2.10 answers with a deprecation warning per enum
through the ``torch.utils._pytree`` logger ("<enum 'KernelPreference'> is an Enum subclass and is now natively
supported by torch.compile ..."). The import cannot be avoided from grove without faking transformers'
availability check; these filters drop exactly those notices (any other pytree warning still shows), and
diffusers' "Unable to import `torchao` Tensor objects" (its torchao shim probing for tensor classes the installed
torchao moved; grove loads no torchao-serialised checkpoint), and transformers' rename notice for the cache keyword
LeRobot's π-Gemma still uses.
"""
from __future__ import annotations

import logging

_NOTICES = {  # logger -> the message fragment dropped
    "torch.utils._pytree": "is an Enum subclass and is now natively supported by torch.compile",
    "diffusers.quantizers.torchao.torchao_quantizer": "Unable to import `torchao` Tensor objects",
    # LeRobot 0.6's pi_gemma (π0 / π0.5) passes the cache by its transformers-5.8 name; 5.24 renames it and says so
    # once per process (robotics/policies/lerobot/compat.py keeps the matching FutureWarning quiet)
    "transformers.utils.generic": "`past_key_values`/`cache_params` are deprecated",
}


class _DropNotice(logging.Filter):
    def __init__(self, fragment: str) -> None:
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return self.fragment not in record.getMessage()
        except Exception:  # a malformed record is not ours to judge
            return True


def install() -> None:
    """Add the filters to their loggers once (idempotent; before or after the libraries are imported)."""
    for name, fragment in _NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNotice) for f in logger.filters):
            logger.addFilter(_DropNotice(fragment))
