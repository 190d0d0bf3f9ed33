"""Trainers without sampling or rewards: supervised fine-tuning of language models (sft.py) and
flow models (flow_sft.py), offline preference optimisation (dpo.py) and reward models (rm.py), all
on the same books (books.py)."""
