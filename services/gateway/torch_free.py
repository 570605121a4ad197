"""The gateway process runs without torch, as its image does, even where torch is installed beside it.

Why: the gateway only tokenizes and renders chats, and its install set (`specserve[gateway]`, Dockerfile.target's
gateway image) has no torch. But `make run`, `specserve serve` and any one-virtualenv install put torch in the same
environment, and transformers imports torch whenever it finds it: loading SmolLM2's tokenizer then took 5.7 s
instead of 2.2 s (2 CPU cores), and the gateway held 391 MB resident where it holds 153 without. Marking torch
absent in this process (None in sys.modules: Python's way to make an import fail with ImportError) makes
transformers take the torch-free path the image takes, so every deployment runs the gateway the same way.
With --trust-remote-code torch stays importable: a tokenizer's own Python code may import it.

Without torch, transformers greets every gateway start with "PyTorch was not found. Models won't be available ...".
It is true of the gateway and by design, but a user serving a model reads it as a broken install, so the gateway
drops that one line (`quiet_torch_absence`); every other transformers warning still shows.
"""

from __future__ import annotations

import logging
import sys

TORCH_ABSENT_NOTICE = "PyTorch was not found."


def hide_torch() -> None:
    """Make `import torch` fail in this process from now on, unless something imported it already (then it stays:
    a process that uses torch, such as a test importing the gateway's app, is left as it is)."""
    sys.modules.setdefault("torch", None)


class _DropTorchAbsentNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TORCH_ABSENT_NOTICE)


def quiet_torch_absence() -> None:
    """Drop transformers' import-time notice that torch is absent (module docstring). Called before transformers
    is imported; the notice is logged by the library's own logger ("transformers"), where the filter sits."""
    logger = logging.getLogger("transformers")
    if not any(isinstance(f, _DropTorchAbsentNotice) for f in logger.filters):
        logger.addFilter(_DropTorchAbsentNotice())
