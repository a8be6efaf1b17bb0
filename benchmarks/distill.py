"""On-policy distillation on a real model: a 6-block cut of SmolLM2-135M-Instruct learns from the full model.

    python benchmarks/distill.py [--steps 30] [--layers 0-4,29] [--lr 1e-4] [--warmup-steps 100] [--smoke]

Teacher: SmolLM2-135M-Instruct (30 blocks), built offline by `hybrid_rl.model.smollm2` and cached in
$HR_MODEL_CACHE (default ~/.cache/hybrid_rl) like the tests' copy. Student: the same model cut to `--layers`
(`python -m hybrid_rl.model.smollm2 DIR --layers 0-4,29`: embeddings, final norm, tokenizer and chat template kept,
the chosen blocks bit for bit), so both share the tokenizer and the student starts from the teacher's own weights.
A cut writes no text, so `--warmup-steps N` first fine-tunes it (sequence-level KD, plain torch, seeded) on the
teacher's greedy answers to `--warmup-prompts` training prompts: OPD then starts from a student that writes text.
`--student DIR` starts OPD from a given folder instead (e.g. an earlier run's warmed-up student: `<cut>-warm`).
Prompts: short one-turn chat requests written here from templates (`chat_prompts`), train and held-out disjoint.
Training: `hybrid_rl.train --config-name=opd` (pure distillation: no reward, each token's advantage is minus the
student-teacher log-prob gap) on 2 CPU ranks, `model.dtype=auto` (bf16 where the CPU has AVX512-BF16, else float32).
Recorded: `opd/reverse_kl` every step (the per-token k1 estimate of KL(student || teacher) on the student's own
samples); before and after OPD, on the held-out prompts, KL(student || teacher) per token over the whole vocabulary
on `--kl-samples` student samples a prompt, and the student's greedy answers next to the teacher's, with their
agreement: the share of the first `--k` tokens equal position by position, shared with order ignored, and the share
of answers whose first `--k` tokens all match (the chat prompts have no task reward); teacher-forced, on whole greedy
answers: the share of the student's greedy tokens that are the teacher's argmax given the same prefix, the teacher's
mean log-prob of them (OPD's direction, on the student's own path), the student's mean log-prob of the teacher's
greedy answers (the forward direction); and the share of distinct bigrams in the answers (repetition). Helpers run
with bf16 matmuls (`distill_kd`). `--temperature` sets the rollout's (and so the trained log-probs'). Writes
benchmarks/results/NAME.json and NAME.png (the curve).
`--smoke`: the 4M tiny model as teacher and its 2-block cut as student, 2 warm-up and 2 OPD steps, seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from distill_kd import greedy, heldout_kl, teacher_forced, warm_up  # noqa: E402

SUBJECTS = ["the moon", "a rainbow", "coffee", "the ocean", "a volcano", "bread", "a bicycle", "winter", "a library",
            "the internet", "honey bees", "a thunderstorm", "chess", "a lighthouse", "the piano", "tea", "a forest",
            "the sun", "a train", "autumn leaves", "a river", "snow", "a garden", "the desert", "a robot", "music",
            "a camera", "a volcano island", "paper", "a clock"]
TEMPLATES = ["Describe {s} in one sentence.", "What is {s}?", "Write a short poem about {s}.",
             "Give me one fun fact about {s}.", "Why do people like {s}?", "Explain {s} to a child.",
             "Name three words that describe {s}.", "Write a haiku about {s}."]


def chat_prompts(out: Path, n_val: int, seed: int = 0) -> tuple[Path, Path]:
    """Every template x subject as a one-turn chat prompt, shuffled; the first `n_val` held out."""
    rows = [{"prompt": [{"role": "user", "content": t.format(s=s)}]} for t in TEMPLATES for s in SUBJECTS]
    random.Random(seed).shuffle(rows)
    out.mkdir(parents=True, exist_ok=True)
    train, val = out / "train.jsonl", out / "val.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[n_val:]))
    val.write_text("".join(json.dumps(r) + "\n" for r in rows[:n_val]))
    return train, val


def models(smoke: bool, layers: list[int]) -> tuple[Path, Path]:
    """(teacher, student) folders."""
    from hybrid_rl.model.layer_cut import cut_layers
    from hybrid_rl.model.smollm2 import build_smollm2_cut

    if smoke:
        teacher = common.sized_model("4M")
        return teacher, cut_layers(teacher, common.CACHE / "models" / "distill_student_smoke", layers)
    cache = Path(os.environ.get("HR_MODEL_CACHE", Path.home() / ".cache" / "hybrid_rl"))
    name = "SmolLM2-cut-" + "_".join(map(str, layers))
    student = build_smollm2_cut(cache / name, layers, full_dir=cache / "SmolLM2-135M-Instruct")
    return cache / "SmolLM2-135M-Instruct", student


def agreement(student: list[list[int]], teacher: list[list[int]], k: int) -> dict:
    """Agreement of the first k tokens of each answer: position by position (a missing token counts as a mismatch),
    as bags of tokens (shared tokens, order ignored: a student near the teacher's words but not yet its order), and
    the share of answers equal over all k."""
    pairs = list(zip(student, teacher, strict=True))
    same = [sum(1 for i in range(min(k, len(s), len(t))) if s[i] == t[i]) for s, t in pairs]
    full = [s[:k] == t[:k] for s, t in pairs]
    common_ = [sum((Counter(s[:k]) & Counter(t[:k])).values()) for s, t in pairs]
    return {"token_match": sum(same) / (k * len(pairs)), "token_overlap": sum(common_) / (k * len(pairs)),
            "exact_first_k": sum(full) / len(pairs), "distinct_bigrams": distinct_bigrams(student),
            "teacher_distinct_bigrams": distinct_bigrams(teacher)}


def distinct_bigrams(answers: list[list[int]]) -> float:
    """The mean over answers of the share of an answer's token bigrams that are distinct: 1 for no repeated pair,
    near 0 for "coffee, coffee, coffee, ..." (a repetition the teacher predicts well, so its log-prob rises)."""
    shares = [len(set(zip(x[:-1], x[1:], strict=True))) / (len(x) - 1) for x in answers if len(x) > 1]
    return sum(shares) / max(len(shares), 1)


def closeness(model: Path, teacher: Path, val: list, answers: list[list[int]],
              teacher_answers: list[list[int]]) -> dict:
    """Teacher-forced closeness of a student to the teacher on the held-out prompts, both directions: the teacher
    reading the student's greedy answers (the share of the student's greedy tokens that are the teacher's argmax given
    the same prefix; the teacher's log-prob of them: OPD's direction, on the student's own path) and the student
    reading the teacher's greedy answers (its log-prob of them and its argmax agreement: the forward direction)."""
    t_on_s, s_on_t = teacher_forced(teacher, val, answers), teacher_forced(model, val, teacher_answers)
    return {"teacher_argmax_on_student_greedy": t_on_s["argmax_agree"],
            "teacher_logp_of_student_greedy": t_on_s["logp"], "student_logp_of_teacher_greedy": s_on_t["logp"],
            "student_argmax_on_teacher_greedy": s_on_t["argmax_agree"],
            "teacher_argmax_on_student_greedy_fresh": t_on_s["argmax_agree_fresh"],
            "teacher_logp_of_student_greedy_fresh": t_on_s["logp_fresh"],
            "tokens": {"student_greedy": t_on_s["tokens"], "teacher_greedy": s_on_t["tokens"],
                       "student_greedy_fresh": t_on_s["fresh_tokens"]}}


def evaluate(model: Path, teacher: Path, val: list, teacher_answers: list[list[int]], a: argparse.Namespace) -> dict:
    """A student on the held-out prompts: its greedy answers, its reverse KL to the teacher, the teacher-forced
    closeness (all seeded: the same folder and settings give the same figures)."""
    answers = greedy(model, val, a.max_new_tokens)
    return {"answers": answers, "kl": heldout_kl(model, teacher, val, n=a.kl_samples, max_new_tokens=a.max_new_tokens),
            "close": closeness(model, teacher, val, answers, teacher_answers)}


def evaluate_cached(model: Path, teacher: Path, val: list, teacher_answers: list[list[int]],
                    a: argparse.Namespace) -> dict:
    """`evaluate`, kept in the cache for the next run from the same `--student` folder (its weights' size and time,
    the prompts and the settings in the key): several OPD runs from one warmed-up student share its evaluation."""
    weights = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model.glob("*.safetensors"))
    key = json.dumps([str(model), str(teacher), weights, val, teacher_answers, a.max_new_tokens, a.kl_samples])
    path = common.CACHE / "distill_eval" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
    if path.exists():
        print(f"evaluation of {model.name} from {path}", flush=True)
        return json.loads(path.read_text())
    out = evaluate(model, teacher, val, teacher_answers, a)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    return out


def rescore(names: list[str], teacher: Path, val: list, teacher_answers: list[list[int]], a: argparse.Namespace) -> None:
    """Earlier runs' students (`results/NAME.json`'s student, `.cache/runs/NAME/export`) measured again for the
    greedy agreement and the teacher-forced closeness (e.g. after a measure was added), into their JSON files."""
    done: dict[Path, tuple] = {}
    for name in names:
        path = common.RESULTS / f"{name}.json"
        d = json.loads(path.read_text())
        assert d["spec"]["val_prompts"] == a.val_prompts, f"{name} was measured on {d['spec']['val_prompts']} prompts"
        for side, model in (("before", Path(d["spec"]["student"])), ("after", common.CACHE / "runs" / name / "export")):
            if model not in done:
                answers = greedy(model, val, a.max_new_tokens)
                done[model] = (closeness(model, teacher, val, answers, teacher_answers),
                               agreement(answers, teacher_answers, a.k))
            d["teacher_forced"][side], d["agreement"][side] = done[model]
            print(f"{name} {side}: {done[model]}", flush=True)
        d["rescored"] = f"agreement and teacher_forced measured again: {' '.join(sys.argv[1:])}"
        path.write_text(json.dumps(d, indent=2) + "\n")


def train(teacher: Path, student: Path, train_file: Path, a: argparse.Namespace) -> tuple[Path, list[dict]]:
    from hybrid_rl.metrics.jsonl import read_records

    out = common.CACHE / "runs" / (a.name + ("_smoke" if a.smoke else ""))
    shutil.rmtree(out, ignore_errors=True)  # metrics.jsonl would otherwise continue an earlier run's file
    overrides = [f"model.path={student}", f"teacher.path={teacher}", f"data.train_files=[{train_file}]",
                 f"data.prompts_per_step={a.prompts}", f"rollout.n={a.n}", f"rollout.max_new_tokens={a.max_new_tokens}",
                 f"optim.lr={a.lr}", "optim.warmup_steps=0", f"rollout.temperature={a.temperature}",
                 "data.max_prompt_tokens=128", "rollout.kv_cache_gb=0.5",
                 "trainer.micro_batch_tokens=2048", f"trainer.total_steps={a.steps}", "trainer.save_every=0",
                 "trainer.show_progress=false", "trainer.resume=never", f"trainer.output_dir={out}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "hybrid_rl.train", "--config-name=opd", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    print("running:", " ".join(cmd[2:]), flush=True)
    proc = subprocess.run(cmd, cwd=common.REPO, env=env, capture_output=True, text=True, timeout=3 * 3600)
    log = common.CACHE / "logs" / f"{out.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print("\n".join((proc.stdout + proc.stderr).splitlines()[-60:]), file=sys.stderr)
        raise RuntimeError(f"hybrid_rl.train failed (exit {proc.returncode}); full output: {log}")
    keys = ("opd/reverse_kl", "timing/step_s", "actor/grad_norm", "response/length_mean")
    curve = [{"step": r["step"], **{k.split("/")[1]: r.get(k) for k in keys}}
             for r in read_records(out / "metrics.jsonl") if "opd/reverse_kl" in r]
    return out / "export", curve


def plot(curve: list[dict], png: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    ax.plot([c["step"] for c in curve], [c["reverse_kl"] for c in curve], marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("opd/reverse_kl (nats per token, student samples)")
    ax.set_title(title)
    FigureCanvasAgg(fig)
    fig.savefig(png, dpi=110, bbox_inches="tight")


def main() -> None:
    from hybrid_rl.model.layer_cut import parse_layers

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--layers", default="0-4,29", help="the teacher's blocks the student keeps")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--prompts", type=int, default=4, help="prompts a step")
    p.add_argument("--n", type=int, default=4, help="samples a prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0, help="rollout.temperature (the log-probs use it too)")
    p.add_argument("--val-prompts", type=int, default=8, help="held-out prompts for the greedy comparison")
    p.add_argument("--k", type=int, default=16, help="tokens of each greedy answer compared")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="supervised warm-up steps on the teacher's greedy answers before OPD (0: none)")
    p.add_argument("--warmup-prompts", type=int, default=96, help="training prompts the teacher answers for it")
    p.add_argument("--warmup-lr", type=float, default=3e-4)
    p.add_argument("--student", default="", help="start OPD from this model folder instead of the cut (no warm-up)")
    p.add_argument("--kl-samples", type=int, default=4, help="student samples a held-out prompt for the KL")
    p.add_argument("--name", default="distill", help="result files: benchmarks/results/NAME.json and NAME.png")
    p.add_argument("--rescore", default="", help="NAME,...: measure these earlier runs' students again, no training")
    p.add_argument("--smoke", action="store_true", help=common.SMOKE_HELP)
    a = p.parse_args()
    if a.smoke:
        a.steps, a.layers, a.prompts, a.n, a.max_new_tokens, a.val_prompts, a.k = 2, "0,3", 2, 2, 8, 2, 4
        a.warmup_steps, a.warmup_prompts, a.kl_samples = 2, 4, 2
    layers = parse_layers(a.layers)
    teacher, student = models(a.smoke, layers)
    if a.student:  # e.g. an earlier run's warmed-up student: its OPD alone
        student, a.warmup_steps = Path(a.student), 0
    train_file, val_file = chat_prompts(common.CACHE / "distill_prompts", a.val_prompts)
    val = [json.loads(line)["prompt"] for line in val_file.read_text().splitlines()]
    answers = {"teacher": greedy(teacher, val, a.max_new_tokens)}
    if a.rescore:
        return rescore(a.rescore.split(","), teacher, val, answers["teacher"], a)
    warm_curve: list[dict] = []
    if a.warmup_steps:
        answers["cut"] = greedy(student, val, a.max_new_tokens)
        train_prompts = [json.loads(line)["prompt"] for line in train_file.read_text().splitlines()]
        train_prompts = train_prompts[:a.warmup_prompts]
        targets = greedy(teacher, train_prompts, a.max_new_tokens, keep_eos=True)
        print(f"warm-up: {len(targets)} teacher answers; {a.warmup_steps} steps", flush=True)
        student, warm_curve = warm_up(student, student.parent / (student.name + "-warm"), train_prompts, targets,
                                      steps=a.warmup_steps, lr=a.warmup_lr, seed=0)
    before = (evaluate_cached if a.student else evaluate)(student, teacher, val, answers["teacher"], a)
    answers.setdefault("cut", before["answers"])
    answers["before"], kl, close = before["answers"], {"before": before["kl"]}, {"before": before["close"]}
    print(f"held-out KL before OPD: {kl['before']}\nteacher-forced before OPD: {close['before']}", flush=True)
    export, curve = train(teacher, student, train_file, a)
    after = evaluate(export, teacher, val, answers["teacher"], a)
    answers["after"], kl["after"], close["after"] = after["answers"], after["kl"], after["close"]
    close["teacher_itself"] = teacher_forced(teacher, val, answers["teacher"])  # the ceiling of the first two
    print(f"held-out KL after OPD: {kl['after']}\nteacher-forced after OPD: {close['after']}", flush=True)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher)
    agree = {side: agreement(answers[side], answers["teacher"], a.k) for side in ("cut", "before", "after")}
    examples = [{"prompt": v[-1]["content"], **{s: tok.decode(answers[s][i]) for s in answers}}
                for i, v in enumerate(val)]
    print(common.table(curve, [("step", "step", "d"), ("reverse_kl", "opd/reverse_kl", ".4f"),
                               ("step_s", "step s", ".1f"), ("length_mean", "resp len", ".1f")]))
    for side, g in agree.items():
        print(f"  {side}: first {a.k} greedy tokens vs the teacher's: {g['token_match']:.3f} of positions equal, "
              f"{g['token_overlap']:.3f} shared (order ignored), {g['exact_first_k']:.3f} of answers equal, "
              f"distinct bigrams {g['distinct_bigrams']:.3f} (the teacher's {g['teacher_distinct_bigrams']:.3f})")
    for side in ("before", "after"):
        c = close[side]
        print(f"  {side}: teacher's argmax on the student's greedy tokens {c['teacher_argmax_on_student_greedy']:.3f}, "
              f"teacher log-prob of them {c['teacher_logp_of_student_greedy']:.3f}, student log-prob of the "
              f"teacher's greedy answers {c['student_logp_of_teacher_greedy']:.3f}")
    headline = [{"what": "opd/reverse_kl, first step", "value": curve[0]["reverse_kl"]},
                {"what": "opd/reverse_kl, last step", "value": curve[-1]["reverse_kl"]},
                *({"what": f"held-out KL(student || teacher) per token, {s}", "value": v["exact"]} for s, v in kl.items()),
                *({"what": f"greedy token agreement with the teacher (first {a.k}), {s}", "value": g["token_match"]}
                  for s, g in agree.items()),
                *({"what": f"{m} (held-out, teacher-forced), {s}", "value": close[s][m]} for s in ("before", "after")
                  for m in ("teacher_argmax_on_student_greedy", "teacher_logp_of_student_greedy",
                            "student_logp_of_teacher_greedy"))]
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    plot(curve, common.RESULTS / f"{a.name}.png", f"OPD: {student.name} <- {teacher.name}, {a.steps} steps")
    spec = {"teacher": str(teacher), "student": str(student), "layers": layers, "steps": a.steps, "lr": a.lr,
            "prompts": a.prompts, "n": a.n, "max_new_tokens": a.max_new_tokens, "val_prompts": a.val_prompts,
            "k": a.k, "ranks": 2, "model_dtype": "auto", "warmup_steps": a.warmup_steps,
            "warmup_prompts": a.warmup_prompts, "warmup_lr": a.warmup_lr, "kl_samples": a.kl_samples,
            "temperature": a.temperature}
    common.write_result(a.name, {"spec": spec, "curve": curve, "agreement": agree, "heldout_kl": kl,
                                 "teacher_forced": close, "warmup_curve": warm_curve, "examples": examples,
                                 "headline": headline},
                        quick=False)


if __name__ == "__main__":
    main()
