"""Training curves: train loss and eval AUC against step, as a PNG (matplotlib, Agg: no display)."""

from __future__ import annotations

import os


def plot_curves(
    records: list[dict],
    out_png: str | os.PathLike,
    title: str = "",
    oracle_auc: float | None = None,
    flag: str | None = "--curves-out",
) -> None:
    """The curves PNG at `out_png` (its directories made), whole or not at all: rendered in memory,
    then written atomically (UserError naming `flag` and the path when it cannot be)."""
    import io

    import matplotlib

    from tpurec.outputs import write_atomic

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1)
    ax1.set_xlabel("step")
    ax1.set_ylabel("train loss (BCE)")
    ax1.grid(alpha=0.3)
    ax2.plot([r["step"] for r in evals], [r["auc"] for r in evals], marker="o", label="eval AUC")
    if oracle_auc:
        ax2.axhline(oracle_auc, color="gray", ls="--", label=f"oracle {oracle_auc:.4f}")
    ax2.set_xlabel("step")
    ax2.set_ylabel("AUC")
    ax2.grid(alpha=0.3)
    ax2.legend(loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    write_atomic(out_png, buf.getvalue(), flag, makes_parents=True)
