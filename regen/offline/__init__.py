"""Trainers without sampling or rewards: supervised fine-tuning of language models (sft.py) and
flow models (flow_sft.py), and offline preference optimisation (dpo.py)."""
