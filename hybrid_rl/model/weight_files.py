"""The tensors of a Hugging Face checkpoint folder (safetensors), read a block of rows at a time.

One `model.safetensors`, or shards named by `model.safetensors.index.json` (`weight_map`: tensor
name -> file), as `save_pretrained` writes them. `rows(name, a, b)` reads rows [a, b) of dim 0
only, through `safetensors.safe_open(...).get_slice`: a row block of a row-major tensor is one
contiguous byte range, so a rank that reads its FSDP rows touches no other bytes of the file.

Each read opens the file and closes it again. safe_open memory-maps the file, and every page a
read touches counts in the process's RSS (as file-backed memory) until the file is closed: kept
open, a rank's RSS would grow by every byte it read, on top of the shards it filled.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class WeightFiles:
    """Names, shapes and dtypes of a checkpoint's tensors (read from the file headers), and their rows."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.dir = Path(path)
        if (self.dir / INDEX).is_file():
            files = sorted(set(json.loads((self.dir / INDEX).read_text())["weight_map"].values()))
        elif (self.dir / SINGLE).is_file():
            files = [SINGLE]
        else:
            raise ValueError(f"{str(self.dir)!r} has neither {SINGLE} nor {INDEX}: the trainer reads safetensors "
                             "checkpoints only (convert a *.bin checkpoint with `save_pretrained`)")
        self.file_of: dict[str, str] = {}
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
        for file in files:
            with safe_open(str(self.dir / file), framework="pt") as f:
                for name in f.keys():
                    s = f.get_slice(name)
                    self.file_of[name] = file
                    self._meta[name] = (tuple(s.get_shape()), s.get_dtype())

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        code = self._meta[name][1]
        if code not in _DTYPES:
            raise ValueError(f"{name}: safetensors dtype {code} is not supported here")
        return _DTYPES[code]

    def row_bytes(self, name: str) -> int:
        """Bytes of one row (one index of dim 0) of tensor `name` as stored."""
        return math.prod(self.shape(name)[1:]) * self.dtype(name).itemsize

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) of dim 0 of tensor `name`, in its stored dtype, on the CPU."""
        from safetensors import safe_open

        with safe_open(str(self.dir / self.file_of[name]), framework="pt") as f:
            return f.get_slice(name)[a:b]
