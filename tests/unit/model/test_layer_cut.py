"""`layer_cut`: a model cut to some of its decoder blocks keeps those blocks bit for bit and loads in transformers."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybrid_rl.model.layer_cut import cut_layers, parse_layers
from hybrid_rl.model.tiny import TinySpec, build_tiny_model


@pytest.mark.parametrize("arch,tie", [("llama", True), ("qwen2", False)])
def test_cut_keeps_the_chosen_blocks_bitwise_and_loads(tmp_path, arch, tie):
    src = build_tiny_model(tmp_path / "full", TinySpec(arch=arch, layers=4, tie_embeddings=tie))
    keep = [0, 1, 3]
    dst = cut_layers(src, tmp_path / "cut", keep)
    full = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    cut = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    assert cut.config.num_hidden_layers == 3 and len(cut.model.layers) == 3
    for new, old in enumerate(keep):
        a, b = cut.model.layers[new].state_dict(), full.model.layers[old].state_dict()
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), (new, old)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(cut.get_parameter(name), full.get_parameter(name)), name
    assert (cut.lm_head.weight is cut.model.embed_tokens.weight) == tie
    # The cut computes what the full model computes with only those blocks in that order.
    full.model.layers = torch.nn.ModuleList([full.model.layers[i] for i in keep])
    for i, layer in enumerate(full.model.layers):
        layer.self_attn.layer_idx = i
    full.config.num_hidden_layers = len(keep)
    if getattr(full.config, "layer_types", None):
        full.config.layer_types = [full.config.layer_types[i] for i in keep]
    ids = torch.arange(3, 19).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(cut(ids).logits, full(ids).logits)
    tok = AutoTokenizer.from_pretrained(dst)
    assert tok.chat_template == AutoTokenizer.from_pretrained(src).chat_template is not None
    assert json.loads((dst / "config.json").read_text())["hybrid_rl_cut"]["layers"] == keep


def test_cut_refuses_layers_out_of_range(tmp_path):
    src = build_tiny_model(tmp_path / "full", TinySpec(arch="llama", layers=2))
    with pytest.raises(ValueError, match="subset"):
        cut_layers(src, tmp_path / "cut", [0, 2])


def test_parse_layers():
    assert parse_layers("0-4,29") == [0, 1, 2, 3, 4, 29]
    assert parse_layers("3,1") == [3, 1]
    with pytest.raises(ValueError, match="twice"):
        parse_layers("0-2,1")
