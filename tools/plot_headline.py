"""Draw docs/hicache.png (the README's plot) from the SGLang HiCache table in docs/benchmarks.md.

The plot is made from the table, not from a separate copy of the numbers, so the two cannot
disagree: re-measure with `umbp-nvme bench hicache`, update the table, run this.

    python tools/plot_headline.py [--out docs/hicache.png]
"""

from __future__ import annotations

import argparse
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE_HEADER = "| shape | memory | set GB/s ours / file |"


def hicache_rows(markdown: str) -> list[dict]:
    """(label, set ours, set file, get ours, get file, get fio) per row of the HiCache table."""
    lines = markdown.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(TABLE_HEADER))
    rows = []
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        sets = [float(x) for x in re.findall(r"[\d.]+", cells[2])]
        gets = [float(x) for x in re.findall(r"[\d.]+", cells[4])]
        shape = cells[0].split(" (")[0]
        rows.append({"label": f"{shape}\n{cells[1]} pages", "set": sets[:2], "get": gets[:3]})
    return rows


def draw(rows: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a_set, a_get) = plt.subplots(1, 2, figsize=(9, 3.7), dpi=90)
    x = range(len(rows))
    w = 0.27
    for ax, key, names in ((a_set, "set", ("umbp_nvme", "SGLang file backend")),
                           (a_get, "get", ("umbp_nvme", "SGLang file backend", "fio, same objects"))):
        for j, name in enumerate(names):
            ax.bar([i + (j - (len(names) - 1) / 2) * w for i in x], [r[key][j] for r in rows], w, label=name)
        ax.set_xticks(list(x), [r["label"] for r in rows], fontsize=8)
        ax.set_ylabel("GB/s")
        ax.grid(axis="y", alpha=0.3)
    a_set.set_title("backup: batch_set_v1, 128 pages", fontsize=10)
    a_get.set_title("prefetch: batch_get_v1, cold", fontsize=10)
    fig.legend(*a_get.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle("SGLang HiCache L3 on a 2-core VM, virtio disk (docs/benchmarks.md)", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "hicache.png"))
    args = ap.parse_args()
    with open(os.path.join(ROOT, "docs", "benchmarks.md"), encoding="utf-8") as f:
        rows = hicache_rows(f.read())
    draw(rows, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
