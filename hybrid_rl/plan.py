"""Memory planner: the expected memory per rank of every phase, before anything heavy starts.

    python -m hybrid_rl.plan --config-name=<recipe> key=value ... [--world N] [--device-gib G]
        [--device auto|cuda|cpu] [--local-ranks N] [--attention auto|sdpa|flash]

Takes the same recipe and overrides as `hybrid_rl.train`, reads the models' `config.json` and the
training prompts' lengths (tokenized as training would; no weights, no GPU) and prints a table: phases (startup, sync, rollout, old_logp,
reference, critic, reward_model, update, critic_update) by items (params, AdamW states, grads,
compute copies, activations, vLLM weights and KV cache), offloaded items marked, then whether the
peak fits the device and, if not, the settings that together make it fit, cheapest in speed first.
`hybrid_rl.train` computes the same plan before it loads any weight and stops when it does not fit
(`trainer.memory_check`).

--world: ranks in the run (default $WORLD_SIZE or 1). --device-gib: plan for a device of this
size (e.g. `--device cuda --device-gib 80` for an H100 from any machine); without it, CUDA device
0's memory, or on CPU the host memory available now (MemAvailable: other processes' memory excluded) /
--local-ranks (default: the world size). --attention: defaults to
what the run would use with this install (flash-attn where it imports, else SDPA per sequence).

Exit codes: 0 fits, 1 does not fit, 2 bad configuration or input.
"""

from __future__ import annotations

import os
import sys

from hybrid_rl.config import ConfigError, split_command_line
from hybrid_rl.plan_inputs import detect_device, plan_for, prompt_lengths
from hybrid_rl.planner.table import render

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT = 0, 1, 2
FLAGS = ("--world", "--device-gib", "--device", "--local-ranks", "--attention")


def split_flags(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """The planner's own `--flag value` / `--flag=value` arguments, and the rest (the recipe and its overrides)."""
    flags, rest, i = {}, [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name in FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{name} needs a value")
                i += 1
                value = argv[i]
            flags[name] = value
        else:
            rest.append(argv[i])
        i += 1
    return flags, rest


def _number(flags: dict[str, str], name: str, kind: type, default):
    try:
        value = kind(flags[name]) if name in flags else default
    except ValueError:
        raise ConfigError(f"{name}={flags[name]}: expected a {kind.__name__}") from None
    if value is not None and value <= 0:
        raise ConfigError(f"{name}={value}: must be > 0")
    return value


def main(argv: list[str] | None = None) -> int:
    from hybrid_rl.utils.env import set_runtime_defaults

    set_runtime_defaults()
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return EXIT_FITS
    from hybrid_rl.config import load_config

    try:
        flags, rest = split_flags(argv)
        name, overrides = split_command_line(rest)
        world = _number(flags, "--world", int, int(os.environ.get("WORLD_SIZE", 1)))
        local = _number(flags, "--local-ranks", int, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        kind, attention = flags.get("--device", "auto"), flags.get("--attention", "auto")
        if kind not in ("auto", "cuda", "cpu") or attention not in ("auto", "sdpa", "flash"):
            raise ConfigError("--device must be auto, cuda or cpu; --attention auto, sdpa or flash")
        device = detect_device(kind, gib=_number(flags, "--device-gib", float, None), local_ranks=local)
        cfg = load_config(name, overrides, platform=device.kind)
        plan = plan_for(cfg, world, device=device, attention=attention, prompt_lengths=prompt_lengths(cfg))
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    print(render(plan), flush=True)
    return EXIT_FITS if plan.fits else EXIT_DOES_NOT_FIT


if __name__ == "__main__":
    sys.exit(main())
