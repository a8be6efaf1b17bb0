"""What post-sync verification reads back: with tied word embeddings, the head too, as vLLM's logits read it."""

import dataclasses

import torch

from hybrid_rl.sidecar.shm_ring import Manifest, layout_bucket
from hybrid_rl.weightsync.layout import Layout, ModelDims
from hybrid_rl.weightsync.verify import target_label, verify_targets

DIMS = ModelDims("Qwen2ForCausalLM", vocab_size=100, hidden_size=64, intermediate_size=96, num_heads=2,
                 num_kv_heads=1, head_dim=32, tie_word_embeddings=True)
SHAPES = {"model.embed_tokens.weight": (100, 64), "model.layers.0.mlp.down_proj.weight": (64, 96),
          "model.norm.weight": (64,)}


def _slices(tp_rank: int):
    layout = Layout(DIMS, tp=2)
    return [layout.slice(n, s, tp_rank) for n, s in SHAPES.items() if not layout.skip(n)]


def test_a_tied_head_is_checked_through_the_head_module_against_the_embedding_sent():
    slices = _slices(1)
    targets = verify_targets(slices, tied=True)
    assert [i for i, _ in targets] == [0, 1, 2, 0]  # every slice, then the head from the embedding's checksum
    head = targets[-1][1]
    assert (head.vllm_name, head.module) == ("lm_head.weight", "lm_head")
    assert (head.start, head.stop, head.shape) == (slices[0].start, slices[0].stop, slices[0].shape)  # same rows
    assert target_label(slices, *targets[-1]).startswith("lm_head.weight (tied to model.embed_tokens.weight")
    assert target_label(slices, *targets[0]) == "model.embed_tokens.weight"
    assert verify_targets(slices, tied=False) == targets[:3]


def test_the_sidecar_server_reads_the_same_targets_from_its_manifest():
    slices = _slices(0)
    entries, _ = layout_bucket(slices, torch.float32)
    m = Manifest(3, 32, [entries[:1], entries[1:]], tied=True)
    back = Manifest.from_json(m.to_json())
    assert back.tied and back.targets() == verify_targets(slices, tied=True)
    untied = dataclasses.replace(m, tied=False)
    assert Manifest.from_json(untied.to_json()).targets() == verify_targets(slices, tied=False)
