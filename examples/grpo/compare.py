"""The runs of examples/grpo/train.py on one plot: each run's metrics.csv, one line per run in each
panel (reward, ratio deviation on current-version and on stale tokens, clip rate, KL, entropy), so
the service's run and its contrasts (``--baseline raw-logprobs``) read side by side.

    python examples/grpo/compare.py --out /tmp/contrast.png ours=/tmp/grpo-ours raw-logprobs=/tmp/grpo-raw

Prints a table of each run's first and last values.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

PANELS = [("reward_mean", "reward"), ("ratio_dev_e4_current", "|ratio − 1| × 10⁴, current-version tokens"),
          ("ratio_dev_e4_stale", "|ratio − 1| × 10⁴, stale tokens"), ("clip_rate", "clip rate"),
          ("kl_k3", "KL (k3)"), ("entropy", "entropy")]


def load(run_dir: str) -> list[dict[str, float]]:
    with open(Path(run_dir) / "metrics.csv") as f:
        return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _number(value: str):
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="LABEL=RUN_DIR (a --out directory of train.py)")
    p.add_argument("--out", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    runs = []
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep:
            p.error(f"{spec!r}: expected LABEL=RUN_DIR")
        runs.append((label, load(path)))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    for ax, (key, title) in zip(axes.flat, PANELS):
        for label, rows in runs:
            points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), float) and not math.isnan(r[key])]
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key.startswith("ratio_dev"):
            ax.set_yscale("symlog", linthresh=0.01)
    axes.flat[0].legend()
    fig.suptitle("GRPO through rollout-service: the service's logprobs against the contrasts")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    plt.close(fig)

    print("| run | steps | reward first → last | ratio_dev_e4_current (mean) | clip rate (mean) |")
    print("|---|---:|---|---:|---:|")
    for label, rows in runs:
        cur = [r["ratio_dev_e4_current"] for r in rows if not math.isnan(r["ratio_dev_e4_current"])]
        clip = [r["clip_rate"] for r in rows]
        print(f"| {label} | {len(rows)} | {rows[0]['reward_mean']:.3f} → {rows[-1]['reward_mean']:.3f} | "
              f"{sum(cur) / len(cur) if cur else float('nan'):.4g} | {sum(clip) / len(clip):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
