"""Logging of the entry points: INFO on rank 0, warnings elsewhere; the libraries' chatter at WARNING."""

from __future__ import annotations

import logging
import os


def setup_logging() -> None:
    main = int(os.environ.get("RANK", 0)) == 0
    logging.basicConfig(level=logging.INFO if main else logging.WARNING, format="%(asctime)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("vllm", "transformers", "torch", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
