"""regen: reinforcement-learning post-training for generative models."""

__version__ = "0.1.0"
