"""The entry points' logging drops what is neither ours nor actionable, and nothing else."""

import logging

from hybrid_rl.utils.logs import quiet_foreign_noise


def test_foreign_noise_is_dropped_and_the_rest_passes(caplog):
    quiet_foreign_noise()
    quiet_foreign_noise()  # idempotent: one filter per logger
    assert len(logging.getLogger("torchao").filters) == 1
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load %s: %s", "/x/_C_mxfp8.so", "no CUDA")
        logging.getLogger("torch.utils._pytree").warning("%s is an Enum subclass and is now natively supported", "E")
        logging.getLogger("torchao").warning("A real problem")
    assert [r.getMessage() for r in caplog.records] == ["A real problem"]
