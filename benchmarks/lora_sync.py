"""LoRA weight sync, adapter vs merged (`model.lora.sync`): bytes and seconds per update, and generation speed.

    python benchmarks/lora_sync.py [--sizes 0.5B] [--rank 16] [--nproc 2] [--steps 3] [--order merged adapter]

For each Qwen2.5 shape (random weights, `qwen_shapes.py`), one GRPO LoRA run per sync mode through
`hybrid_rl.train` (the batch of `scale.py`), alternating nothing else. Per mode, over steps >= 2 (step 1 also
sends the base weights): the median of `sync/bytes_per_rank`, `timing/sync_s` and
`throughput/generated_tokens_per_s`; then adapter / merged ratios. Runs take minutes; not in `make bench --quick`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import qwen_shapes  # noqa: E402
from scale import base_overrides, train  # noqa: E402

KEYS = {"bytes": "sync/bytes_per_rank", "sync_s": "timing/sync_s", "gen_tok_s": "throughput/generated_tokens_per_s"}


def run(size: str, mode: str, a) -> dict:
    out = common.CACHE / "lora_sync" / f"{size}_{mode}"
    model = common.sized_model(size) if size in common.SIZES else qwen_shapes.folder(size)
    overrides = base_overrides(model, out, a.steps) + [
        f"model.lora.rank={a.rank}", f"model.lora.sync={mode}", "trainer.memory_check=warn"]
    r = train(f"lora_sync_{size}_{mode}", overrides, a.nproc, out)
    later = [s for s in r["steps"] if s["step"] >= 2]
    got = {k: common.median([s[v] for s in later if v in s]) for k, v in KEYS.items()}
    first = next((s for s in r["steps"] if s["step"] == 1), {})
    return {"size": size, "mode": mode, "ok": r["ok"], "log": r["log"], **got,
            "first_sync_bytes": first.get(KEYS["bytes"]), "first_sync_s": first.get(KEYS["sync_s"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["0.5B"])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--order", nargs=2, default=["adapter", "merged"], choices=["adapter", "merged"],
                   help="which mode runs first (run both orders on a loaded machine: the load drifts)")
    p.add_argument("--smoke", action="store_true", help=common.SMOKE_HELP + " (the 4M model, 2 steps)")
    a = p.parse_args()
    if a.smoke:
        a.sizes, a.steps = ["4M"], 2
    rows = [run(size, mode, a) for size in a.sizes for mode in a.order]
    print(common.table(rows, [("size", "shape", "s"), ("mode", "sync", "s"), ("bytes", "bytes/update/rank", ".3g"),
                              ("sync_s", "sync s/update", ".3f"), ("gen_tok_s", "gen tok/s", ".1f"),
                              ("first_sync_bytes", "first sync bytes", ".3g")]))
    ratios = []
    for size in a.sizes:
        ad, me = (next(r for r in rows if r["size"] == size and r["mode"] == m) for m in ("adapter", "merged"))
        ratios.append({"size": size, "bytes_ratio": ad["bytes"] / me["bytes"], "sync_s_ratio": ad["sync_s"] / me["sync_s"],
                       "gen_tok_s_ratio": ad["gen_tok_s"] / me["gen_tok_s"]})
        print(f"  {size}: adapter/merged bytes {ratios[-1]['bytes_ratio']:.4f}, sync seconds "
              f"{ratios[-1]['sync_s_ratio']:.3f}, generation tokens/s {ratios[-1]['gen_tok_s_ratio']:.3f}")
    common.write_result("lora_sync", {"runs": rows, "ratios": ratios, "rank": a.rank, "nproc": a.nproc},
                        quick=False)


if __name__ == "__main__":
    main()
