"""`regen` with the GRPO loss returning NaN on the given calls (1-based, counted per process):
the entry point of the torchrun rollback test (tests/test_torchrun.py), which cannot monkeypatch
processes it starts. Usage: python tests/nan_entry.py 9,10,11 train ARGS..."""

import sys

import regen.modalities.lm
from regen.cli import main
from tests.conftest import NaNAt

if __name__ == "__main__":
    calls = {int(c) for c in sys.argv[1].split(",")}
    regen.modalities.lm.POLICY_LOSSES["grpo"] = NaNAt(regen.modalities.lm.POLICY_LOSSES["grpo"], calls)
    raise SystemExit(main(sys.argv[2:]))
