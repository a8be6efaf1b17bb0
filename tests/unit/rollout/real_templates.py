"""The models' own chat templates and real tokenizers of their families, fetched from PyPI (the tests have no model
hub) and built once into a cache folder.

The sdist of `llama-cpp-python` (pinned, sha256 checked) vendors llama.cpp, whose `models/templates/*.jinja` are the
models' own chat templates (copied from their Hub repositories) and whose `models/ggml-vocab-*.gguf` are the real
tokenizer vocabularies of several families (vocabulary only, no weights). This module downloads it, keeps only the
files the tests use, and saves each family's tokenizer as a Hugging Face folder (`save_pretrained`) with its chat
template, so a test session loads them in about a second. Mistral's tokenizers come from `mistral_common`'s data
files (installed with vLLM): tekken_240718 is Mistral Nemo's.

What is real and what is not, per tokenizer (`TOKENIZERS`):
- qwen2.5, qwen3: Qwen2's byte-level BPE (ggml-vocab-qwen2.gguf, the vocabulary Qwen2.5 and Qwen3 share). That file
  predates Qwen2.5's added tokens (its ids 151646+ are padding), so the added tokens the tool loop writes
  (`<tool_call>`..., Qwen3's `<tool_response>` and `<think>`) are put back at their ids in the models'
  tokenizer_config.json (`QWEN25_ADDED`, `QWEN3_ADDED`); the other added tokens (vision, FIM) are left as padding.
- llama3: Llama 3's BPE (ggml-vocab-llama-bpe.gguf, Llama 3.0's special-token names), with Llama 3.1's renames
  (`<|eom_id|>`, `<|python_tag|>`) at their ids.
- mistral-nemo: Mistral Nemo's tekken (mistral_common's tekken_240718.json), converted by transformers.
- mistral-v11: Pixtral's tekken (tekken_240911.json); Mistral Small 3.2's tokenizer (v11) adds `[ARGS]` and
  `[CALL_ID]`, which are appended here as special tokens (not at their real ids).

A download or build failure raises (the tests fail, never skip). The cache is $HR_MODEL_CACHE (default
~/.cache/hybrid_rl); a folder without its marker file is a build that did not finish and is rebuilt.
$HR_LLAMA_CPP_SDIST may name a local copy of the sdist (its sha256 is checked all the same).
"""

from __future__ import annotations

import copy
import fcntl
import functools
import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import urllib.request
from pathlib import Path

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
URL = ("https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/"
       + SDIST)
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
_MODELS = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/models/"
# name -> the model's own template file in the sdist (Llama 3.3-70B's is byte-identical to 3.1-8B's)
TEMPLATES = {
    "qwen2.5": "Qwen-Qwen2.5-7B-Instruct.jinja",
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
    "qwen3-coder": "Qwen3-Coder.jinja",
    "llama3.1": "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "llama3.2": "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "mistral-nemo": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "mistral-small-3.2": "Mistral-Small-3.2-24B-Instruct-2506.jinja",
    "devstral": "unsloth-mistral-Devstral-Small-2507.jinja",
}
VOCABS = ("ggml-vocab-qwen2.gguf", "ggml-vocab-llama-bpe.gguf")
# The added tokens the tool loop relies on, at their ids in Qwen2.5's / Qwen3's tokenizer_config.json; not special
# (they decode as text), as there.
QWEN25_ADDED = {151657: "<tool_call>", 151658: "</tool_call>"}
QWEN3_ADDED = {**QWEN25_ADDED, 151665: "<tool_response>", 151666: "</tool_response>", 151667: "<think>",
               151668: "</think>"}
LLAMA31_RENAMED = {128004: "<|finetune_right_pad_id|>", 128008: "<|eom_id|>", 128010: "<|python_tag|>"}
# tokenizer name -> how to build it: (source, added or renamed tokens by id, special?, bos, eos)
TOKENIZERS = {
    "qwen2.5": ("ggml-vocab-qwen2.gguf", QWEN25_ADDED, False, None, "<|im_end|>"),
    "qwen3": ("ggml-vocab-qwen2.gguf", QWEN3_ADDED, False, None, "<|im_end|>"),
    "llama3": ("ggml-vocab-llama-bpe.gguf", LLAMA31_RENAMED, True, "<|begin_of_text|>", "<|eot_id|>"),
    "mistral-nemo": ("tekken_240718.json", {}, True, "<s>", "</s>"),
    "mistral-v11": ("tekken_240911.json", {}, True, "<s>", "</s>"),
}
_V11_EXTRA = ["[ARGS]", "[CALL_ID]"]
_DONE = ".built"
_BUILD = 2  # raised when the way the tokenizers are built changes


def cache_dir() -> Path:
    return Path(os.environ.get("HR_MODEL_CACHE", Path.home() / ".cache" / "hybrid_rl")) / f"llama-cpp-{VERSION}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fetch_sdist(into: Path) -> Path:
    local = os.environ.get("HR_LLAMA_CPP_SDIST")
    path = Path(local) if local else into / SDIST
    if not local:
        try:
            with urllib.request.urlopen(URL, timeout=120) as r, path.open("wb") as f:
                shutil.copyfileobj(r, f, 1 << 20)
        except OSError as e:
            raise RuntimeError(f"could not download {URL} (the real chat templates' source, from PyPI): {e}") from e
    got = _sha256(path)
    if got != SHA256:
        raise RuntimeError(f"{path}: sha256 {got}, expected {SHA256} (llama-cpp-python {VERSION}'s sdist)")
    return path


def _extract(sdist: Path, out: Path) -> None:
    wanted = {_MODELS + "templates/" + f: out / f for f in TEMPLATES.values()}
    wanted |= {_MODELS + f: out / f for f in VOCABS}
    with tarfile.open(sdist, "r|gz") as tar:  # one pass over the stream: the vendored tree is large
        for member in tar:
            if member.name in wanted and member.isfile():
                wanted.pop(member.name).write_bytes(tar.extractfile(member).read())
    if wanted:
        raise RuntimeError(f"{sdist} lacks {sorted(wanted)}")


def _edit_vocab(tok, tokens: dict[int, str], special: bool):
    """`tok` with the entries at `tokens`' ids renamed (the GGUF's padding or old names) and made added tokens."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tok.backend_tokenizer.to_str())
    by_id = {i: t for t, i in spec["model"]["vocab"].items()}
    for i, new in tokens.items():
        spec["model"]["vocab"].pop(by_id[i])
        spec["model"]["vocab"][new] = i
    # (transformers' GGUF reader appends an <|endoftext|> past Llama 3's vocabulary, which the model has not)
    added = [a for a in spec["added_tokens"] if a["id"] not in tokens and a["id"] < len(spec["model"]["vocab"])]
    added += [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
               "special": special} for i, t in tokens.items()]
    spec["added_tokens"] = sorted(added, key=lambda a: a["id"])
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))


@functools.cache
def _from_gguf(files: Path, source: str):
    """The tokenizer of a GGUF file (read once: reading 150k tokens through `gguf` takes most of the build)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(files, gguf_file=source)


def _build_tokenizer(name: str, files: Path, out: Path) -> None:
    source, tokens, special, bos, eos = TOKENIZERS[name]
    if source.endswith(".gguf"):
        tok = _edit_vocab(_from_gguf(files, source), tokens, special)
    else:
        import mistral_common
        from transformers.integrations.mistral import convert_tekken_tokenizer

        tok = convert_tekken_tokenizer(str(Path(mistral_common.__file__).parent / "data" / source))
        if name == "mistral-v11":
            tok.add_special_tokens({"additional_special_tokens": _V11_EXTRA})
    tok.bos_token, tok.eos_token = bos, eos
    tok.save_pretrained(out)


def _marker() -> dict:
    """What a finished build holds: a cache built from other settings is rebuilt."""
    return {"sdist": SDIST, "sha256": SHA256, "templates": TEMPLATES, "tokenizers": sorted(TOKENIZERS),
            "build": _BUILD}


def _is_built(out: Path) -> bool:
    return (out / _DONE).exists() and json.loads((out / _DONE).read_text()) == _marker()


def build(force: bool = False) -> Path:
    """The cache folder: the templates (`<file>.jinja`) and one tokenizer folder per `TOKENIZERS` entry. Built under
    a file lock: the test workers of one `make test` (pytest-xdist) may all ask for it at once."""
    out = cache_dir()
    if _is_built(out) and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with (out.parent / f"{out.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or the process dies)
        if _is_built(out) and not force:  # another worker built it while this one waited
            return out
        if out.exists():
            shutil.rmtree(out)
        out.mkdir()
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            _extract(_fetch_sdist(Path(tmp)), out)
        for name in TOKENIZERS:
            _build_tokenizer(name, out, out / "tokenizers" / name)
        _from_gguf.cache_clear()
        for vocab in VOCABS:  # built into the tokenizers: the GGUF files are not needed again
            (out / vocab).unlink()
        (out / _DONE).write_text(json.dumps(_marker()) + "\n")
    return out


@functools.lru_cache(maxsize=1)
def built() -> Path:
    return build()


def template(name: str) -> str:
    """The model's own chat template (`TEMPLATES`)."""
    return (built() / TEMPLATES[name]).read_text()


@functools.cache
def _tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(built() / "tokenizers" / name)


def tokenizer(name: str, chat_template: str):
    """The real tokenizer `name` (`TOKENIZERS`) with `chat_template`: a new object (a test may set its template), but
    sharing the loaded vocabulary (a deep copy takes seconds), so no test may add tokens to it."""
    tok = copy.copy(_tokenizer(name))
    tok.chat_template = chat_template
    return tok
