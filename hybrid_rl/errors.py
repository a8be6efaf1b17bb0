"""Every error a user may see, in one hierarchy: what the entry points catch, print once and exit with.

`InputError` (exit 2) is bad input found before any weight is loaded: a config value, a data file, a model folder.
`RunError` (exit 1) stops a run that started: the checkpoints written so far are intact. An error with `agreed =
True` is raised on every rank with the same message (the ranks agreed on the verdict first), so the entry point prints
it once, from rank 0. Each module raises the subclass that names its stage; they all live here so that a reader
finds the whole list, and the exit code of each, in one place.
"""

from __future__ import annotations

EXIT_RUNTIME = 1
EXIT_BAD_INPUT = 2


class HybridRLError(Exception):
    """Base of the project's errors."""

    exit_code = EXIT_RUNTIME
    agreed = False  # True: every rank raised it with the same message


class InputError(HybridRLError, ValueError):
    """Bad input, found before any weight is loaded; the message names the key, file or line."""

    exit_code = EXIT_BAD_INPUT


class ConfigError(InputError):
    """A bad configuration value: the message names the key and the allowed values."""


class DatasetError(InputError):
    """A data file or one of its rows is not what the loader expects; the message names the file and line."""


class RunError(HybridRLError, RuntimeError):
    """The run cannot go on; the checkpoints written so far are intact."""


class TrainingError(RunError):
    """The run cannot go on (e.g. repeated non-finite steps); the last good checkpoint is intact."""


class RolloutError(RunError):
    """The rollout backend cannot go on (servers lost, coordination lost past its timeout): raised on every rank
    alike, so the run stops cleanly; the checkpoints written so far are intact."""

    agreed = True


class WeightSyncError(RunError):
    """Weights did not land in vLLM as sent: never generate from stale or corrupt weights.

    Raised on every rank with the same message (the ranks agree on the verdict first)."""

    agreed = True


class CheckpointError(RunError):
    """A checkpoint could not be written or read; the message names the path and the cause. Raised on every rank
    alike (the ranks agree on a save's outcome)."""

    agreed = True
