"""vLLM's automatic GPU share across the first optimizer step, on a fake-CUDA memory ledger.

A GPU run's memory timeline cannot be measured here, so a ledger follows it: what the trainer holds is
read from the real tensors (a 2.5B-parameter Qwen2 actor and a 1.4B critic built on the meta device: real
shapes, no bytes; real AdamWs whose state appears at their first `step()`), what vLLM holds follows its
sleep/wake calls, and `torch.cuda.mem_get_info` answers from the ledger. The real `HybridEngine` drives two
rollout -> train switches around one actor step and one critic step (PPO), with the real
`VLLMEngine.gpu_utilization` rule; only vLLM's allocations are the ledger's (start: its check that
`utilization x total` is free, then weights + KV cache = that share; sleep level 2 frees both; each wake-up
allocates or fails like CUDA).

The share is measured at the first start, before either optimizer has state: counting neither (the first
rule) or only the actor's (the second), the second KV wake-up does not fit beside the critic's AdamW state,
which stays on the GPU (`offload.critic=none`). Counting both, it does.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from hybrid_rl.colocated.engine_parts import SyncTarget, TrainedPolicy
from hybrid_rl.colocated.hybrid import HybridEngine, SwitchOptions
from hybrid_rl.colocated.vllm_engine import EngineSpec, VLLMEngine
from hybrid_rl.distributed.mesh import ParallelDims
from hybrid_rl.distributed.offload import OffloadManager
from hybrid_rl.model.optimizers import state_to_come
from hybrid_rl.planner.inputs import DeviceSpec, ModelSpec, PlanInputs, RolloutSpec
from hybrid_rl.planner.param_count import ArchDims, model_params
from hybrid_rl.planner.trainer_memory import cuda_resident_overhead_bytes
from hybrid_rl.planner.units import GIB
from hybrid_rl.planner.vllm_memory import plan_sync_reserve, vllm_weight_bytes
from hybrid_rl.weightsync.layout import Layout, ModelDims

TOTAL = 80 * GIB
BUCKET = 256 * 2**20
HF = Qwen2Config(hidden_size=2048, num_hidden_layers=24, intermediate_size=11008, num_attention_heads=16,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=False,
                 architectures=["Qwen2ForCausalLM"])
CRITIC = Qwen2Config(hidden_size=2048, num_hidden_layers=12, intermediate_size=11008, num_attention_heads=16,
                     num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=False,
                     architectures=["Qwen2ForCausalLM"])


class CudaOutOfMemory(RuntimeError):
    pass


class Ledger:
    """Device memory by owner: the CUDA overheads the plan counts, the trainer's tensors, vLLM's allocations."""

    def __init__(self, total: int, overhead: int, models: list[tuple[torch.nn.Module, torch.optim.Optimizer]]):
        self.total, self.overhead, self.models = total, overhead, models
        self.vllm: dict[str, int] = {}
        self.timeline: list[tuple[str, int]] = []

    def trainer(self) -> int:
        total = 0
        for module, optimizer in self.models:
            total += sum(p.nbytes + (p.grad.nbytes if p.grad is not None else 0) for p in module.parameters())
            total += sum(t.nbytes for s in optimizer.state.values() for t in s.values()
                         if torch.is_tensor(t) and t.dim() > 0)  # the 0-dim `step` counters live on the host
        return total

    def used(self) -> int:
        return self.overhead + self.trainer() + sum(self.vllm.values())

    def mem_get_info(self) -> tuple[int, int]:
        return self.total - self.used(), self.total

    def allocate(self, tag: str, n: int) -> None:
        if self.used() + n > self.total:
            raise CudaOutOfMemory(f"CUDA out of memory: {tag} needs {n / GIB:.2f} GiB, "
                                  f"{(self.total - self.used()) / GIB:.2f} GiB free")
        self.vllm[tag] = n
        self.mark(f"+{tag}")

    def release(self, tag: str) -> None:
        self.vllm.pop(tag, None)
        self.mark(f"-{tag}")

    def mark(self, event: str) -> None:
        self.timeline.append((event, self.used()))

    @property
    def peak(self) -> int:
        return max(u for _, u in self.timeline)


class LedgerVLLM(VLLMEngine):
    """vLLM's memory behaviour on the ledger; the share comes from the real `gpu_utilization`."""

    def __init__(self, spec: EngineSpec, ledger: Ledger, weight_bytes: int):
        super().__init__(spec)
        self.ledger, self.weight_bytes, self.sizes = ledger, weight_bytes, {}

    def start(self, pending_bytes: int = 0) -> None:
        util = self.gpu_utilization(pending_bytes)
        free, total = self.ledger.mem_get_info()
        if free < util * total:  # vLLM's start-up check (gpu_worker: requested memory must be free)
            raise ValueError(f"Free memory on device ({free / GIB:.2f} GiB) is less than desired GPU memory "
                             f"utilization ({util}, {util * total / GIB:.2f} GiB)")
        self.sizes = {"weights": self.weight_bytes, "kv_cache": int(util * total) - self.weight_bytes}
        self.llm = object()
        for tag, n in self.sizes.items():
            self.ledger.allocate(tag, n)

    def stop(self) -> None:
        self.llm = None
        for tag in list(self.ledger.vllm):
            self.ledger.release(tag)

    def sleep(self, level: int = 2) -> None:
        self.ledger.release("kv_cache")
        if level == 2:
            self.ledger.release("weights")

    def wake_up(self, tags: list[str]) -> None:
        for tag in tags:
            if tag not in self.ledger.vllm:  # waking what is awake maps nothing (vLLM's CuMemAllocator)
                self.ledger.allocate(tag, self.sizes[tag])

    def weight_sync_path(self, slices) -> str:
        return "inplace"

    def load_weights(self, stream, path: str) -> None:
        for _ in stream:  # the real resharder's buckets, on the meta device
            pass
        self.ledger.mark("synced")


def plan_inputs() -> PlanInputs:
    spec = ModelSpec(tuple(model_params(HF, "lm")), ArchDims.from_hf_config(HF))
    return PlanInputs(actor=spec, world=1, device=DeviceSpec("cuda", TOTAL, "ledger"), compute_bytes=2,
                      pass_tokens=4096, update_tokens=4096, micro_batch_tokens=4096, max_sequence_tokens=1024,
                      rollout=RolloutSpec(enabled=True, tp=1, release="sleep", bucket_bytes=BUCKET))


def update(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One update's backward (grads appear), then its optimizer step."""
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_two_steps(monkeypatch, tmp_path, *, count: str) -> tuple[Ledger, PlanInputs]:
    """`count`: the optimizer state the engine knows is to come: "none", "actor" or "both" (actor and critic)."""
    x = plan_inputs()
    with torch.device("meta"):
        policy = AutoModelForCausalLM.from_config(HF)
        critic = AutoModelForCausalLM.from_config(CRITIC)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-5)
    ledger = Ledger(TOTAL, cuda_resident_overhead_bytes(x), [(policy, optimizer), (critic, critic_optimizer)])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: ledger.mem_get_info())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    if count == "none":  # the first rule: whatever is free at the first start
        monkeypatch.setattr(HybridEngine, "_state_to_come", lambda self: 0)
    spec = EngineSpec(model_path="unused", tp=1, dtype="bfloat16", max_model_len=2048, seed=0, enforce_eager=False,
                      sync_reserve_bytes=plan_sync_reserve(x), sleep_mode=True)
    vllm = LedgerVLLM(spec, ledger, vllm_weight_bytes(x.actor, 1, 2))
    options = SwitchOptions(bucket_bytes=BUCKET, verify=False, probe_cols=64, release="sleep", offload_params="none",
                            offload_grads="none", offload_optim="none")
    engine = HybridEngine(TrainedPolicy(policy, optimizer),
                          SyncTarget(vllm, Layout(ModelDims.from_hf_config(HF), 1), device=torch.device("meta"),
                                     dtype=torch.bfloat16),
                          dims=ParallelDims(world=1, rank=0, local_rank=0, tp=1),
                          offload=OffloadManager(tmp_path, rank=0), options=options)
    if count == "both":  # as build does once the critic is built (`offload.critic=none`: its state stays)
        engine.keep_room_for(critic_optimizer, "none")
    assert state_to_come(optimizer) == 8 * sum(p.numel() for p in policy.parameters())
    assert state_to_come(critic_optimizer) == 8 * sum(p.numel() for p in critic.parameters())
    for step in range(2):
        with engine.rollout_mode():
            ledger.mark(f"rollout {step}")
        update(policy, optimizer)
        ledger.mark(f"optimizer step {step}")
        update(critic, critic_optimizer)
        ledger.mark(f"critic step {step}")
    assert state_to_come(optimizer) == 0 and state_to_come(critic_optimizer) == 0
    return ledger, x


def test_the_share_leaves_room_for_both_optimizers_state_at_every_later_rollout(monkeypatch, tmp_path):
    ledger, _ = run_two_steps(monkeypatch, tmp_path, count="both")
    rollouts = [u for e, u in ledger.timeline if e.startswith("rollout")]
    assert rollouts[1] > rollouts[0]  # both AdamW states appeared after the first steps and stayed
    events = [e for e, _ in ledger.timeline]
    after_step = ledger.timeline[events.index("critic step 0"):events.index("rollout 1")]
    second_wake = [used for e, used in after_step if e == "+kv_cache"]
    assert len(second_wake) == 1 and second_wake[0] <= TOTAL  # the KV cache woke again, beside both states
    assert ledger.peak <= TOTAL


@pytest.mark.parametrize("count", ["none", "actor"])
def test_a_rule_missing_an_optimizer_cannot_wake_the_kv_cache_after_the_first_steps(monkeypatch, tmp_path, count):
    with pytest.raises(CudaOutOfMemory, match="kv_cache"):
        run_two_steps(monkeypatch, tmp_path, count=count)
