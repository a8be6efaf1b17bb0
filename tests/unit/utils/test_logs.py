"""The entry points' logging drops what is neither ours nor actionable, and nothing else."""

import logging

from hybrid_rl.utils.logs import quiet_foreign_noise


def test_foreign_noise_is_dropped_and_the_rest_passes():
    quiet_foreign_noise()
    quiet_foreign_noise()  # idempotent: one filter per logger
    assert len(logging.getLogger("torchao").filters) == 1
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:  # directly: torch's own loggers do not propagate to the root
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
    try:
        loggers[0].warning("Failed to load %s: %s", "/x/_C_mxfp8.so", "no CUDA")
        loggers[1].warning("%s is an Enum subclass and is now natively supported", "E")
        loggers[0].warning("A real problem")
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
    assert seen == ["A real problem"]
