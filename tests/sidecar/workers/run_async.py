"""Asynchronous training on one real vLLM server: its scenarios in one launch (the server starts once).

Argument: JSON {"overrides": [...]} (a reward that varies on a random model: dynamic sampling needs
groups with and without signal). Every batch trained is recorded on every rank as (record index,
sample number, response token ids, rollout log-probs, reward), gathered on rank 0.

A. staleness 0 == synchronous: a checkpoint of the untrained state (step 0), two steps with the
   synchronous source (the loop as it was before the experience buffer), back to the checkpoint, two
   steps with the experience buffer at `rollout.max_staleness=0`: the batches and metrics of both;
   then the same with dynamic sampling (up to 3 rounds a step). Before the steps the server generated for
   four held-out prompts (caching their KV); after them its greedy responses to the same prompts must
   equal Hugging Face's on the trainer's weights (no KV of old weights reused).
B. resume mid-run at staleness 2: from the step-0 checkpoint, step 1, a checkpoint (its experience buffer:
   live groups with finished samples and unfinished ones: half the requests of the rounds after the first
   were held back), the trainer dropped; a new trainer resumes it and trains steps 2-5. Recorded: what
   the buffer held at the checkpoint, and how many requests the resumed trainer had to send again.
C. a server killed mid-generation: during step 6, once its round is dispatched and some responses have
   reached the trainer while other requests are still in flight, the server is killed with SIGKILL;
   steps 6-8 go on. Recorded: every response that reached the trainer, with its tokens, and which
   requests failed.
D. dynamic sampling at staleness 2 with groups finishing out of order (each rank sends its requests
   newest first): from the step-1 checkpoint, steps 2-5; recorded: the batches with their rewards, and
   the buffer's metrics.
"""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from hybrid_rl.utils.env import set_runtime_defaults

set_runtime_defaults()

import torch.distributed as dist  # noqa: E402

from hybrid_rl.build import build, trainer_settings  # noqa: E402
from hybrid_rl.config import load_config  # noqa: E402
from hybrid_rl.distributed.collectives import all_gather_object, barrier  # noqa: E402
from hybrid_rl.experience.source import SyncSource  # noqa: E402
from hybrid_rl.train import setup_logging  # noqa: E402
from hybrid_rl.trainer import Trainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.engine.workers.common import write_result  # noqa: E402
from tests.sidecar.workers.run_sidecar import greedy_check  # noqa: E402

N = 4  # rollout.n of the test's configuration


def trainer_of(c, cfg) -> Trainer:
    """A trainer of the built components under `cfg` as it is now (the cases change settings between trainers)."""
    c.settings = trainer_settings(cfg, world=c.dims.world)
    return Trainer(c)


def recording(trainer: Trainer, batches: list, after=lambda: None) -> Trainer:
    """Record every batch the trainer's source hands it (this rank's samples); `after()` each."""
    source, n = trainer.source, trainer.s.source.n
    inner = source.next_batch

    def next_batch(step):
        exp = inner(step)
        after()
        reward = exp.scoring.result().total  # collective for the synchronous source: every rank is here
        batches.append((step, [(s.record_index, s.uid % n, s.response_ids.tolist(), s.rollout_logprobs.tolist(),
                                float(reward[s.uid])) for s in exp.rollout.held]))
        return exp
    source.next_batch = next_batch
    return trainer


def gathered(batches: list) -> dict[int, list]:
    """step -> every rank's samples of the batch, sorted."""
    out: dict[int, list] = {}
    for part in all_gather_object(batches):
        for step, samples in part:
            out.setdefault(step, []).extend(samples)
    return {step: sorted(samples) for step, samples in out.items()}


def run_steps(trainer: Trainer, steps) -> list[dict]:
    return [trainer.step(step) for step in steps]


def drain(c) -> None:
    """A dropped trainer's requests still in flight finish and are thrown away (they are no buffer's now)."""
    while c.rollout.in_flight():
        time.sleep(0.05)
    c.rollout.arrivals()
    barrier()


def staleness_zero_equals_synchronous(c, cfg, *, dynamic: bool) -> dict:
    cfg.algorithm.dynamic_sampling, cfg.algorithm.max_sampling_rounds = dynamic, 3
    sync = trainer_of(c, cfg)
    sync.source = SyncSource(c.rollout, c.train_loader, sync.scorer, c.dims, sync.timer, sync._session,
                             sync.source.s)
    if not dynamic:
        sync.save(0)
        with c.rollout.session(0):  # held-out prompts in the server's prefix cache, with the untrained weights' KV
            c.rollout.generate(c.val_records[:4], n=1, step=-1, group_base=0, greedy=True)
    else:
        assert sync._resume() == 0
    batches_sync: list = []
    metrics_sync = run_steps(recording(sync, batches_sync), (1, 2))
    buffered = trainer_of(c, cfg)
    assert buffered._resume() == 0
    batches_buf: list = []
    metrics_buf = run_steps(recording(buffered, batches_buf), (1, 2))
    cfg.algorithm.dynamic_sampling = False
    greedy = {} if dynamic else greedy_check(c, cfg, buffered)  # the same prompts after two updates: no stale KV
    return {"sync": gathered(batches_sync), "buffered": gathered(batches_buf), "metrics_sync": metrics_sync,
            "metrics_buffered": metrics_buf, "greedy": greedy}


def dynamic_out_of_order(c, cfg) -> dict:
    """Requests sent newest first, so that groups finish out of dispatch order (as long responses make them)."""
    drain(c)
    cfg.rollout.max_staleness, cfg.algorithm.dynamic_sampling = 2, True
    trainer = trainer_of(c, cfg)
    assert trainer._resume() == 1
    submit = c.rollout.submit
    c.rollout.submit = lambda requests, **kw: submit(list(reversed(requests)), **kw)
    batches: list = []
    metrics = run_steps(recording(trainer, batches), (2, 3, 4, 5))
    c.rollout.submit = submit
    return {"batches": gathered(batches), "metrics": metrics}


def resume_mid_run(c, cfg) -> tuple[dict, Trainer]:
    cfg.rollout.max_staleness = 2
    first = trainer_of(c, cfg)
    assert first._resume() == 0
    submit = c.rollout.submit
    # The first round goes out whole; of the later ones every other request is held back (never sent): at the
    # checkpoint the buffer's live groups have finished samples and samples still to generate.
    c.rollout.submit = lambda requests, **kw: submit([r for r in requests if r.key < 4 * N or r.key % 2 == 0], **kw)
    batches: list = []
    run_steps(recording(first, batches), (1,))
    while c.rollout.in_flight():  # the requests sent have finished (the checkpoint takes them in)
        time.sleep(0.05)
    barrier()
    first.save(1)
    c.rollout.submit = submit
    src = first.source
    live = [(g.gid, g.record.index) for g in src.book.live.values()]
    held = [(src.book.live[s.uid // cfg.rollout.n].record.index, s.uid % cfg.rollout.n, s.response_ids.tolist())
            for s in src.held.values()]
    drain(c)
    second = trainer_of(c, cfg)
    assert second._resume() == 1
    resent = sum(all_gather_object(len(second.source.resend)))
    resumed: list = []
    run_steps(recording(second, resumed), (2, 3, 4, 5))
    held = [x for part in all_gather_object(held) for x in part]
    return {"before": gathered(batches), "after": gathered(resumed), "live_at_checkpoint": live, "held": held,
            "resent": resent}, second


def server_killed(c, cfg, trainer: Trainer) -> dict:
    n, source = cfg.rollout.n, trainer.source
    arrived, failed = [], []
    inner = c.rollout.arrivals

    def arrivals():
        done, bad = inner()
        for key, a in done.items():
            arrived.append((source.book.live[key // n].record.index, key % n, list(a.generation.token_ids)))
        failed.extend((source.book.live[key // n].record.index, key % n) for key in bad)
        return done, bad
    c.rollout.arrivals = arrivals
    resent = []  # requests sent again after a failure: their responses may still be in flight when the run ends
    send = source._send

    def send_recording(groups, v, *, again=()):
        resent.extend((source.book.live[key // n].record.index, key % n) for key in again)
        return send(groups, v, again=again)
    source._send = send_recording
    killed = {}

    def kill_mid_generation():
        """Once a round of step 6 on is dispatched and some of its responses arrived while others are in flight."""
        rounds, seen, deadline = source.book.regular_rounds, len(arrived), time.monotonic() + 120
        while time.monotonic() < deadline:
            if source.book.regular_rounds > rounds and len(arrived) > seen and c.rollout.in_flight():
                break
            time.sleep(0.001)
        killed.update(finished_before=len(arrived) - seen, in_flight=c.rollout.in_flight())
        os.kill(c.rollout.sidecar.server.proc.pid, signal.SIGKILL)  # the API server; its children linger

    watcher = threading.Thread(target=kill_mid_generation) if c.dims.rank == 0 else None
    if watcher is not None:
        watcher.start()
    batches: list = []
    run_steps(recording(trainer, batches), (6, 7, 8))
    if watcher is not None:
        watcher.join()
    c.rollout.arrivals, source._send = inner, send
    # Groups still in the buffer after the last step: their responses arrived but are trained in a later step
    live_at_end = sorted({g.record.index for g in source.book.live.values()})
    out = {"batches": gathered(batches), "arrived": [x for p in all_gather_object(arrived) for x in p],
           "live_at_end": live_at_end,
           "failed": [x for p in all_gather_object(failed) for x in p],
           "resent": [x for p in all_gather_object(resent) for x in p], **killed}
    if c.dims.rank == 0:
        out["server_starts"] = c.rollout.sidecar.server.starts
    return out


def main() -> None:
    setup_logging()
    args = json.loads(sys.argv[1])
    cfg = load_config("grpo", args["overrides"])
    c = build(cfg)
    trainer = None
    try:
        result = {"equal": staleness_zero_equals_synchronous(c, cfg, dynamic=False),
                  "equal_dynamic": staleness_zero_equals_synchronous(c, cfg, dynamic=True)}
        result["resume"], trainer = resume_mid_run(c, cfg)
        result["killed"] = server_killed(c, cfg, trainer)
        result["dynamic"] = dynamic_out_of_order(c, cfg)
    finally:
        (trainer or trainer_of(c, cfg)).close()
    write_result(result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
