"""An environment for the per-turn reward and user-turn tests (imported by path): its tool rewards each step, its
user simulator (`respond`) asks one follow-up then ends the dialogue, and `reward()` adds an outcome."""

from hybrid_rl.rollout.tools import EnvReply


class Dialogue:
    def __init__(self):
        self.follow_ups = 0

    def reset(self, **row):
        self.follow_ups = 0

    def check(self, answer: int) -> EnvReply:
        """Check an answer; rewards 0.5 when it is 5.

        Args:
            answer: The answer.
        """
        return EnvReply("right" if answer == 5 else "wrong", reward=0.5 if answer == 5 else -0.5)

    def ask(self) -> EnvReply:
        """Ask the user a question (the reply comes back as the user's message)."""
        return EnvReply("I meant 2 + 3.", role="user")

    def respond(self, message: str):
        self.follow_ups += 1
        return "Are you sure?" if self.follow_ups == 1 else None

    def reward(self) -> float:
        return 1.0


class StepsOnly:
    """Rewards per turn, no reward(): `rewards_per_turn` makes the environment reward count."""

    rewards_per_turn = True

    def reset(self, **row):
        return None

    def check(self, answer: int) -> EnvReply:
        """Check an answer.

        Args:
            answer: The answer.
        """
        return EnvReply("ok", reward=0.25)
