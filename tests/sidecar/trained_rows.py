"""A probe for end-to-end runs (`run_recipes.py`'s "probe"): each rank writes the rows it trains at each step, as the
trainer built them (its `TrainBatch`), so a test can check which samples were trained with which score, advantage and
token versions. It records; it changes nothing the trainer does."""

import json
from pathlib import Path

import torch


def record(trainer) -> None:
    """Wrap `trainer._train_batch`: rank r writes `<output_dir>/trained/step<s>_rank<r>.json`, one row per sample."""
    build = trainer._train_batch
    out = Path(trainer.out) / "trained"
    out.mkdir(parents=True, exist_ok=True)

    def recorded(mine, passes, scoring, metrics, *, version):
        batch = build(mine, passes, scoring, metrics, version=version)
        index, scored = mine.index, scoring.result()
        episodes = index.episodes if index.episodes is not None else torch.arange(index.size)
        rows = []
        for i, s in enumerate(batch.samples):
            uid, mask = int(mine.rows[i]), batch.mask[i]
            rows.append({"uid": uid, "episode": int(episodes[uid]), "part": s.part, "group": s.group,
                         "score": float(batch.scores[i]), "parts": {k: float(v[uid]) for k, v in scored.parts.items()},
                         "advantage": float(batch.advantages[i][mask][0]) if mask.any() else None,
                         "response_ids": s.response_ids.tolist(), "loss_mask": s.loss_mask.tolist(),
                         "versions": s.token_versions.tolist()})
        (out / f"step{version + 1}_rank{trainer.dims.rank}.json").write_text(json.dumps(rows))
        return batch

    trainer._train_batch = recorded


def load(output_dir: Path, step: int) -> list[dict]:
    """Every rank's rows of `step`, by uid."""
    rows = [r for f in sorted((Path(output_dir) / "trained").glob(f"step{step}_rank*.json"))
            for r in json.loads(f.read_text())]
    return sorted(rows, key=lambda r: r["uid"])
