"""A number-guessing game as a user writes an environment in their own file (docs/environments-and-tools.md).

The model guesses a secret number between 1 and the row's "high"; after each guess the game says
"higher" or "lower" (an observation the model reads, masked out of the loss) and costs 0.1 (a
per-turn reward); finding the number ends the episode with a reward of 1.
    regen train examples/guess_grpo.yaml
"""

import random

from regen.envs import Environment, Step


class GuessNumber(Environment):
    def __init__(self, cost: float = 0.1):
        self.cost = cost

    def reset(self, row, seed):
        self.high = int(row.meta["high"])
        self.secret = random.Random(seed).randint(1, self.high)  # seed: this episode's own, replayed on resume
        self.found = False
        return None  # the row's prompt, e.g. "Guess my number (1-99):"

    def step(self, turn):
        digits = "".join(c for c in turn if c.isdigit())[:6]
        if not digits:
            return Step(" say a number:", reward=-self.cost)
        guess = int(digits)
        if guess == self.secret:
            self.found = True
            return Step(None, done=True)
        return Step(" higher:" if guess < self.secret else " lower:", reward=-self.cost)

    def episode_reward(self):
        return 1.0 if self.found else 0.0
