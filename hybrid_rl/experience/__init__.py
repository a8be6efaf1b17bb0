"""From a rollout to this rank's `TrainBatch`: scoring, the training share, the model passes, advantages.

Each module is one stage of the RL step as `Trainer.step` tells it:

* `scoring`: every rank scores the samples it holds in its reward workers (overlapped with the
  passes); the scores of all samples then meet on every rank (`Scores`, `[N]`).
* `share`: training units (samples, or preference pairs) balanced over ranks by tokens; each rank
  receives the tokens of its own units only.
* `passes`: old log-probs, reference, critic and reward model on the share.
* `batch`: advantages of the share from the whole batch's scores; the `TrainBatch` and the metrics.
"""
