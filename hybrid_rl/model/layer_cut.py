"""A smaller model cut from a Hugging Face folder: a chosen subset of its decoder blocks, the rest kept.

    python -m hybrid_rl.model.layer_cut SRC DST --layers 0,1,2,3,4,29

The embeddings, final norm, head (or its tie), tokenizer and chat template are kept as they are; the chosen blocks
keep their weights bit for bit and are renumbered 0..k-1 in the order given. The cut model is a cheap student for
distillation from the full one (same tokenizer, same vocabulary, a teacher's own layers as its start): the
first blocks carry the token features and the last one maps back to the head's space, so the cut still writes
text, if poorly. Works on the safetensors files directly (no model load): any architecture whose decoder blocks
are named `<prefix>layers.<i>.` and whose config has `num_hidden_layers`.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

_LAYER = re.compile(r"^(.*\blayers\.)(\d+)(\..*)$")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
# Per-layer lists some configs carry (Qwen2/3 `layer_types`): cut like the blocks.
_PER_LAYER_KEYS = ("layer_types",)


def parse_layers(text: str) -> list[int]:
    """`"0,1,2,29"` or `"0-4,29"` -> [0, 1, 2, 29] (order kept, duplicates refused)."""
    out: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        out += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
    if len(set(out)) != len(out):
        raise ValueError(f"--layers {text!r} names a layer twice")
    return out


def cut_layers(src: str | Path, dst: str | Path, layers: list[int]) -> Path:
    """Write to `dst` the model in `src` with only the decoder blocks `layers` (renumbered in that order)."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    n = config["num_hidden_layers"]
    if not layers or any(not 0 <= i < n for i in layers):
        raise ValueError(f"layers {layers} must be a non-empty subset of 0..{n - 1}")
    new_index = {old: new for new, old in enumerate(layers)}
    tensors = {}
    for f in _weight_files(src):
        for key, t in load_file(f).items():
            m = _LAYER.match(key)
            if m is None:
                tensors[key] = t
            elif int(m.group(2)) in new_index:
                tensors[f"{m.group(1)}{new_index[int(m.group(2))]}{m.group(3)}"] = t
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():  # tokenizer, chat template, generation config: everything but weights and config
        if p.is_file() and p.name != "config.json" and not p.name.startswith(("model", ".")):
            shutil.copy2(p, dst / p.name)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config["num_hidden_layers"] = len(layers)
    for key in _PER_LAYER_KEYS:
        if isinstance(config.get(key), list) and len(config[key]) == n:
            config[key] = [config[key][i] for i in layers]
    config["hybrid_rl_cut"] = {"source": str(src), "layers": layers}
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst


def _weight_files(src: Path) -> list[Path]:
    if (src / _WEIGHT_FILES[0]).exists():
        return [src / _WEIGHT_FILES[0]]
    index = src / _WEIGHT_FILES[1]
    if not index.exists():
        raise FileNotFoundError(f"{src} has no safetensors weights ({' or '.join(_WEIGHT_FILES)})")
    return [src / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--layers", required=True, type=parse_layers, help="blocks to keep, e.g. 0,1,2,3,4,29 or 0-4,29")
    a = p.parse_args()
    print(cut_layers(a.src, a.dst, a.layers))


if __name__ == "__main__":
    main()
