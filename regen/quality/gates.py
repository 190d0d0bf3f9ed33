"""Acceptance thresholds on evaluation metrics: eval.gates {fid: "<= 15", bleu4: ">= 0.3"}.

Each evaluation logs eval/gate/<metric> (1 pass, 0 fail) and eval/gates_passed (1 only when
every gate passed); a metric the evaluation did not produce fails its gate, so a gate can
never pass by being misspelt."""

from __future__ import annotations

import math

from regen.config.eval import OPS, parse  # noqa: F401  (OPS: re-exported; eval.gates is checked on load)


def check(gates: dict[str, str], metrics: dict[str, float]) -> dict[str, float]:
    """eval/gate/<metric> for each gate and eval/gates_passed, from metrics keyed eval/<metric>."""
    if not gates:
        return {}
    out = {}
    for name, rule in gates.items():
        op, bound = parse(name, rule)
        value = metrics.get(f"eval/{name}")
        ok = value is not None and math.isfinite(value) and OPS[op](value, bound)
        out[f"eval/gate/{name}"] = float(ok)
    out["eval/gates_passed"] = float(all(v == 1.0 for v in out.values()))
    return out


def failed(gates: dict[str, str], metrics: dict[str, float]) -> list[str]:
    """'fid 21.3 (gate <= 15)' for each gate that failed in `metrics` (an evaluation's row)."""
    out = []
    for name, rule in gates.items():
        if metrics.get(f"eval/gate/{name}") == 1.0:
            continue
        value = metrics.get(f"eval/{name}")
        shown = "not computed" if value is None or not math.isfinite(value) else f"{value:.4g}"
        out.append(f"{name} {shown} (gate {str(rule).strip()})")
    return out


def require(folder) -> None:
    """`regen export --require-gates`: UserError unless the evaluation logged at checkpoint
    `folder`'s step (RUN/metrics.jsonl) passed every gate."""
    import json
    from pathlib import Path

    from regen.errors import UserError

    folder = Path(folder)
    run_dir = folder.parent.parent
    step = int(folder.name.removeprefix("step_")) if folder.name.startswith("step_") else None
    log = run_dir / "metrics.jsonl"
    if step is None or folder.parent.name != "checkpoints" or not log.is_file():
        raise UserError(f"export --require-gates: {folder} is not a checkpoint of a run with metrics.jsonl, so its "
                        "gates cannot be read")
    evals: dict[int, dict] = {}
    for line in log.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line (a killed run)
        if isinstance(row, dict) and "eval/gates_passed" in row:
            evals[row["step"]] = row
    if not evals:
        raise UserError(f"export --require-gates: no evaluation in {log} checked gates (set eval.gates in the config)")
    passed = sorted(s for s, r in evals.items() if r["eval/gates_passed"] == 1.0)
    kept = {int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir()}
    hint = [s for s in passed if s in kept]
    better = (f"; the newest checkpoint whose evaluation passed is step_{hint[-1]:08d}: export that folder"
              if hint else "; no kept checkpoint passed")
    row = evals.get(step)
    if row is None:
        raise UserError(f"export --require-gates: no evaluation at step {step} (evaluated steps: "
                        f"{', '.join(map(str, sorted(evals)))}){better}")
    if row["eval/gates_passed"] != 1.0:
        names = [k.removeprefix("eval/gate/") for k in row if k.startswith("eval/gate/")]
        rules = {n: "?" for n in names}
        cfg = run_dir / "config.yaml"
        if cfg.is_file():
            import yaml

            rules |= ((yaml.safe_load(cfg.read_text()) or {}).get("eval") or {}).get("gates") or {}
        raise UserError(f"export --require-gates: the evaluation at step {step} failed its gates: "
                        f"{'; '.join(failed({n: rules.get(n, '?') for n in names}, row))}{better}")
