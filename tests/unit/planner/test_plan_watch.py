"""`PlanWatch`: a phase measured above its plan is said once, naming the phase and both figures; within the slack,
or with the watch off (CPU), nothing is said."""

from hybrid_rl.planner.watch import OVER_PLAN_SLACK, PlanWatch


def test_a_phase_above_its_plan_is_said_once_with_both_figures():
    watch = PlanWatch({"update": 33.3, "rollout": 129.2}, enabled=True)
    first = watch.check({"update": 48.7, "rollout": 120.0})
    assert len(first) == 1 and "update phase peaked at 48.70 GiB" in first[0] and "33.30 GiB" in first[0]
    assert watch.check({"update": 50.0}) == []  # said already
    assert len(watch.check({"rollout": 140.0})) == 1  # another phase


def test_within_the_slack_unplanned_phases_and_cpu_say_nothing():
    watch = PlanWatch({"update": 10.0}, enabled=True)
    assert watch.check({"update": 10.0 * OVER_PLAN_SLACK, "warmup": 99.0}) == []
    assert PlanWatch({"update": 10.0}, enabled=False).check({"update": 20.0}) == []
