"""Logging of the entry points: INFO on rank 0, warnings elsewhere; the libraries' chatter at WARNING, and what is
neither ours nor actionable dropped."""

from __future__ import annotations

import logging
import os

# (logger, start of the message): printed at import by libraries we use, about things no user can act on.
NOT_ACTIONABLE = (
    # torchao's wheel carries CUDA kernels (mxfp8, cutlass) that a CPU or pre-Hopper install cannot load; nothing of
    # ours uses them (8-bit AdamW runs on its Python/compiled path).
    ("torchao", "Failed to load "),
    # torchao registers its enums with torch's pytree, which torch 2.13 deprecates for Enum subclasses.
    ("torch.utils._pytree", "%s is an Enum subclass"),
)


class _Drop(logging.Filter):
    def __init__(self, text: str, anywhere: bool):
        super().__init__()
        self.text, self.anywhere = text, anywhere

    def filter(self, record: logging.LogRecord) -> bool:
        if self.anywhere:
            return self.text not in record.getMessage()
        return not str(record.msg).startswith(self.text)


def drop_messages(pairs, *, anywhere: bool = False) -> None:
    """Drop the messages of each (logger, text) pair: those whose format string starts with `text`, or with
    `anywhere`, whose formatted message contains it. Idempotent: a logger gets each filter once."""
    for name, text in pairs:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.text == text for f in logger.filters):
            logger.addFilter(_Drop(text, anywhere))


def quiet_foreign_noise() -> None:
    """Drop the `NOT_ACTIONABLE` messages."""
    drop_messages(NOT_ACTIONABLE)


def setup_logging() -> None:
    main = int(os.environ.get("RANK", 0)) == 0
    logging.basicConfig(level=logging.INFO if main else logging.WARNING, format="%(asctime)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("vllm", "transformers", "torch", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    quiet_foreign_noise()
