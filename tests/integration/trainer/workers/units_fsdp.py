"""Worker (torchrun): the update's gradient on FSDP ranks equals one plain micro-batch over the whole batch.

For DPO (dataset pairs), online DPO (best-vs-worst pairs), GRPO with the KL loss term and the PPO critic,
at two token budgets: the samples go through the real exchange (`make_share`), the real update
(`update_actor` / `update_critic`, one SGD step with lr 1 and no clipping, so the step is minus the
gradient), and the result is compared on rank 0 with a single-process gradient of the whole batch.
Argument: the tiny model's folder. Writes {case: max relative error} and the pairs trained.
"""

import copy
import sys

from hybrid_rl.utils.env import set_runtime_defaults

set_runtime_defaults()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import distribute_tensor  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification  # noqa: E402

from hybrid_rl.algos.losses import aggregate, value_loss_terms  # noqa: E402
from hybrid_rl.algos.objectives import Denominators, MicroInputs, ObjectiveSettings, get_objective  # noqa: E402
from hybrid_rl.distributed.fsdp import shard_model  # noqa: E402
from hybrid_rl.distributed.mesh import fsdp_mesh, init_distributed  # noqa: E402
from hybrid_rl.experience.share import adjacent_pairs, make_share, ranked_pairs, singles  # noqa: E402
from hybrid_rl.model.forward import _micro_batch, policy_logprobs, token_values  # noqa: E402
from hybrid_rl.model.handle import Model  # noqa: E402
from hybrid_rl.types import BatchIndex, Rollout, Sample, TrainBatch  # noqa: E402
from hybrid_rl.updates import UpdateSettings, response_mask, update_actor, update_critic  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0] + "/../../../engine/workers")
from common import full_state_dict, write_result  # noqa: E402

N, WIDTH = 10, 7
SETTINGS = ObjectiveSettings("token-mean", 0.2, 0.2, None, 0.1, "k3", 0.0, 0.1, "sigmoid", 0.0)


def all_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for uid in range(N):
        p, r = int(torch.randint(3, 9, (1,), generator=g)), int(torch.randint(1, WIDTH + 1, (1,), generator=g))
        out.append(Sample(uid, torch.randint(5, 400, (p,), generator=g), torch.randint(5, 400, (r,), generator=g),
                          torch.zeros(r), False, uid // 2, uid, {}))
    return out


def per_uid(seed: int) -> torch.Tensor:
    return torch.randn(N, WIDTH, generator=torch.Generator().manual_seed(seed))


def batch_for(samples: list[Sample], rows: torch.Tensor, paired: bool, old, ref) -> TrainBatch:
    mask = response_mask(samples, max(s.response_len for s in samples) if samples else 1)
    w = mask.shape[1]
    pick = lambda t: None if t is None else t[rows, :w] * mask  # noqa: E731
    return TrainBatch(samples, mask, torch.zeros(len(samples)), pick(old), pick(per_uid(1)), pick(ref),
                      pick(per_uid(2)), pick(per_uid(3)), paired)


def reference_grads(model, full: TrainBatch, case: str) -> list[torch.Tensor]:
    """Single process, one micro-batch of the whole batch, no collectives."""
    model.zero_grad()
    mb = _micro_batch(full.samples, list(range(len(full.samples))))
    m = full.mask
    pairs = full.units and torch.tensor(full.units) if full.paired else None
    d = Denominators(float(m.sum()), float((m.sum(-1) > 0).sum()), float(len(full.samples) // 2), 8.0)
    if case == "critic":
        v = token_values(model, mb)
        per_token, _ = value_loss_terms(v, full.values, full.returns, m, 0.5)
        aggregate(per_token, m, "token-mean", **d.aggregate_kwargs()).backward()
    else:
        objective = get_objective("dpo" if full.paired else "ppo_clip")
        out = policy_logprobs(model, mb, temperature=1.0, with_entropy=objective.entropy)
        logp, ent = out if objective.entropy else (out, None)
        objective.loss(MicroInputs(logp, ent, m, full.old_logp, full.advantages, full.ref_logp, pairs), SETTINGS,
                       d)[0].backward()
    return [p.grad.clone() for p in model.parameters()]


def main() -> None:
    dims = init_distributed(1)
    path = sys.argv[1]
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    critic = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    plain = {"lm": copy.deepcopy(lm), "critic": copy.deepcopy(critic)}
    for m in (lm, critic):
        shard_model(m, fsdp_mesh(dims), param_dtype=torch.float32)
    initial = {"lm": full_state_dict(lm), "critic": full_state_dict(critic)}
    samples = all_samples()
    index = BatchIndex(torch.tensor([s.prompt_len for s in samples]), torch.tensor([s.response_len for s in samples]),
                       torch.tensor([s.group for s in samples]), torch.zeros(N, dtype=torch.bool))
    rollout = Rollout([s for s in samples if s.uid % dims.world == dims.rank], index)
    old, ref = -3 + 0.1 * per_uid(4), -3 + 0.1 * per_uid(5)
    scores = torch.tensor([0.0, 1, 1, 0, 0.5, 0.5, 0.2, 0.9, 0.7, 0.1])
    cases = {"dpo": (adjacent_pairs(index), True, "lm"), "online_dpo": (ranked_pairs(index, scores), True, "lm"),
             "grpo_kl": (singles(index), False, "lm"), "critic": (singles(index), False, "critic")}
    result = {}
    for case, (units, paired, which) in cases.items():
        share = make_share(rollout, units, dims, paired=paired, fields_of=lambda i: {})
        local = batch_for(share.samples, share.rows, paired, old, ref)
        rows = torch.tensor([u for unit in units for u in unit])
        full = batch_for([samples[u] for u in rows.tolist()], rows, paired, old, ref)
        want = reference_grads(plain[which], full, case) if dims.rank == 0 else None
        for budget in (1, 10**6):
            module = lm if which == "lm" else critic
            with torch.no_grad():  # every budget starts from the same weights
                for name, p in module.named_parameters():
                    p.copy_(distribute_tensor(initial[which][name], p.device_mesh, p.placements))
            model = Model(module, torch.optim.SGD(module.parameters(), lr=1.0))
            u = UpdateSettings(1, 1, budget, 1.0, 0.0, 8, dims.world)
            if which == "critic":
                stats, _ = update_critic(model, local, value_clip=0.5, loss_agg="token-mean", u=u)
            else:
                stats, _, _ = update_actor(model, local, get_objective("dpo" if paired else "ppo_clip"), SETTINGS, u)
            after = full_state_dict(module)
            if dims.rank == 0:
                names = [n for n, _ in plain[which].named_parameters()]
                steps = [initial[which][n] - after[n] for n in names]
                err = max(float((s - w).abs().max() / (w.abs().max() + 1e-12)) for s, w in zip(steps, want, strict=True))
                result[f"{case}@{budget}"] = {"error": err, "pairs_used": stats.get("train/pairs_used"),
                                              "pairs": len(units)}
    write_result(result)
    dist.destroy_process_group()


main()
