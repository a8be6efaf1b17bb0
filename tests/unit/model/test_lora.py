"""LoRA: the disabled adapter is exactly the base model; merging reproduces the adapted model. (A reference pass
first under FSDP2, in a spawned gloo process: tests/integration/model/test_lora_fsdp.py.)"""


import copy

import torch
from transformers import AutoModelForCausalLM

from hybrid_rl.model.lora import LoraWeights, adapter_disabled, apply_lora, merge_full_state_dict


def _trained_lora(path):
    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), rank=4, alpha=8.0,
                       dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(5, 400, (2, 12))
    for _ in range(3):  # move the adapter away from its zero init
        model(input_ids=ids).logits.logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, ids


def test_disabled_adapter_gives_the_base_models_logprobs_exactly(tiny_models):
    base = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float32)
    model, ids = _trained_lora(tiny_models["qwen2"])
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with adapter_disabled(model):
            disabled = model(input_ids=ids).logits
        want = base(input_ids=ids).logits
    assert not torch.allclose(adapted, want)  # the adapter does change the model ...
    assert torch.equal(disabled.log_softmax(-1), want.log_softmax(-1))  # ... and disabling it is exact


def test_merged_weights_reproduce_the_adapted_model(tiny_models):
    model, ids = _trained_lora(tiny_models["qwen2"])
    merged = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float32)
    merged.load_state_dict(merge_full_state_dict(model, model.state_dict()))
    synced = {n: t if isinstance(t, torch.Tensor) else t() for n, t, _ in LoraWeights(model).weights()}  # sent
    for name, t in merged.state_dict().items():
        if name in synced:
            torch.testing.assert_close(synced[name], t, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    assert LoraWeights(model).changed_names() == {f"model.layers.{i}.{m}.weight" for i in range(2)
                                                  for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")}


def test_the_reference_context_leaves_the_adapter_trainable(tiny_models):
    model, _ = _trained_lora(tiny_models["qwen2"])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    with model.disable_adapter():  # peft's own context freezes the adapter while it is on ...
        assert not any(p.requires_grad for p in model.parameters())
    with adapter_disabled(model):  # ... ours does not (FSDP2 reads the flags at the first forward)
        assert [n for n, p in model.named_parameters() if p.requires_grad] == trainable
    assert [n for n, p in model.named_parameters() if p.requires_grad] == trainable


def test_merged_experts_equal_peft_merge_and_unload(tiny_models):
    """LoRA on a mixture's fused experts (peft's `target_parameters`): the merged weights the sync sends (one per
    expert and projection) and the export's are peft's own `merge_and_unload`, which reproduces the adapted model."""
    torch.manual_seed(0)
    path = tiny_models["qwen3_moe"]
    model = apply_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), rank=4, alpha=8.0,
                       dropout=0.0, target_modules=["q_proj", "experts"])
    wrapped = [n for n, p in model.named_parameters() if p.requires_grad and ".experts." in n]
    assert len(wrapped) == 2 * 2 * 2  # layers x (gate_up_proj, down_proj) x (A, B)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(5, 400, (2, 12))
    for _ in range(3):
        model(input_ids=ids).logits.logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        peft_merged = copy.deepcopy(model).merge_and_unload().state_dict()
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    ours = merge_full_state_dict(model, model.state_dict())
    assert sorted(ours) == sorted(peft_merged)
    for name, t in peft_merged.items():
        torch.testing.assert_close(ours[name], t, rtol=1e-6, atol=1e-6)
    experts = [k for k in ours if ".mlp.experts." in k]
    assert len(experts) == 4 and all(not torch.equal(ours[k], base[k]) for k in experts)  # the experts did train
    synced = {n: t if isinstance(t, torch.Tensor) else t() for n, t, _ in LoraWeights(model).weights()}
    for layer in range(2):
        for e in range(8):
            gate_up, down = (ours[f"model.layers.{layer}.mlp.experts.{p}"] for p in ("gate_up_proj", "down_proj"))
            pre = f"model.layers.{layer}.mlp.experts.{e}."
            parts = torch.cat([synced[pre + "gate_proj.weight"], synced[pre + "up_proj.weight"]])
            torch.testing.assert_close(parts, gate_up[e], rtol=0, atol=0)
            torch.testing.assert_close(synced[pre + "down_proj.weight"], down[e], rtol=0, atol=0)
    merged = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    merged.load_state_dict(ours)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted, rtol=1e-5, atol=1e-5)
    names = LoraWeights(model).changed_names()
    assert {f"model.layers.1.mlp.experts.7.{p}_proj.weight" for p in ("gate", "up", "down")} <= names
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names
