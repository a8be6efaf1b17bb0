"""The built-in demo: a tiny model, a synthetic task, a short supervised warm-up, then RL (`make demo`)."""
