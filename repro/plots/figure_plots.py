"""The pictures of repro/figures.py: figure1.png, figure5a.png, figure5b.png and figure6.png, one
row of panels per model and seed, drawn from the numbers figures.py computed (issue 42)."""

from __future__ import annotations

from pathlib import Path

import torch

from repro.analysis import tables

APPLICABLE, NON_APPLICABLE = "tab:blue", "tab:red"  # the paper's colours for the two classes


def _rows(models: dict) -> list[tuple[str, dict]]:
    return [(f"{model}, seed {seed}", r) for model, seeds in models.items() for seed, r in seeds.items()]


def _keys(models: dict) -> list[tuple[str, str]]:
    return [(model, seed) for model, seeds in models.items() for seed in seeds]


def _band(ax, windows: list[dict], key: str, label: str) -> None:
    x = [w["t"] for w in windows]
    ax.plot(x, [w[key]["median"] for w in windows], color="black", label="window median")
    ax.fill_between(x, [w[key]["low"] for w in windows], [w[key]["high"] for w in windows], alpha=0.3,
                    label="25%-75%")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)


def _number(value) -> str:
    return "-" if value is None or value != value else f"{value:.2f}"


def _label(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)


def figure1(models: dict, path: Path) -> None:
    plt = tables.pyplot()
    rows = _rows(models)
    fig, axes = plt.subplots(2, len(rows), figsize=(5 * len(rows), 6), squeeze=False)
    for j, (title, r) in enumerate(rows):
        f1 = r["figure1"]
        top, bottom = axes[0][j], axes[1][j]
        if f1["windows"]:
            top.scatter(f1["t"], f1["strength"], s=6, alpha=0.4)
            _band(top, f1["windows"], "strength", "strength ||Delta(x)||")
            _band(bottom, f1["windows"], "dispersion", "1 - cos(Delta, window mean)")
            top.legend(fontsize=7)
        top.set_title(f"{title}: {f1['wrong']} of {f1['questions']} answered wrongly", fontsize=9)
        bottom.set_xlabel("t(x) = PC1 of a(x, y_hat)")
    fig.suptitle("Figure 1 (ours): strength and direction of the correction along PC1")
    tables.save_figure(fig, path)


def figure5a(models: dict, path: Path) -> None:
    plt = tables.pyplot()
    rows = _rows(models)
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 3.5), squeeze=False)
    for ax, (title, r) in zip(axes[0], rows):
        projected = torch.tensor(r["figure5a"]["projections"])
        for k in range(projected.shape[1]):
            ax.hist(projected[:, k].tolist(), bins=20, histtype="step", label=f"expert {k}")
        test = r["figure5a"]["test"]
        p = "-" if test["p"] is None else f"{test['p']:.2g}"
        ax.set_title(f"{title} ({test['test']} p = {p})", fontsize=9)
        ax.set_xlabel("<Delta h_k, v_global>")
        ax.legend(fontsize=7)
    fig.suptitle("Figure 5a (ours): each expert's update projected on the global mean direction")
    tables.save_figure(fig, path)


def figure5b(models: dict, path: Path) -> None:
    plt = tables.pyplot()
    panels = [(title, r, labels) for title, r in _rows(models) for labels in r["figure5b"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (title, r, labels) in zip(axes[0], panels):
        cell = r["figure5b"][labels]
        applicable = torch.tensor(cell["applicable"])
        energy, pc1 = torch.tensor(r["energy"]), torch.tensor(r["pc1"])
        for members, colour, name in ((applicable, APPLICABLE, "applicable"), (~applicable, NON_APPLICABLE, "non-applicable")):
            ax.scatter(energy[members].tolist(), pc1[members].tolist(), s=10, alpha=0.6, color=colour, label=name)
        _label(ax, f"{title}, labels={labels}\nAUROC E(x) {_number(cell['auroc_energy']['value'])}, "
                   f"PC1 {_number(cell['auroc_pc1']['value'])}", "energy E(x)", "PC1 of h_base at (l*, p*)")
    fig.suptitle("Figure 5b (ours): D_ctrl by applicability, energy against PC1")
    tables.save_figure(fig, path)


def figure6(models: dict, states: dict, path: Path) -> None:
    plt = tables.pyplot()
    panels = [(title, r, labels, key) for (title, r), key in zip(_rows(models), _keys(models)) for labels in r["figure6"]]
    fig, axes = plt.subplots(len(panels), 2, figsize=(9, 3.6 * len(panels)), squeeze=False)
    for row, (title, r, labels, key) in zip(axes, panels):
        before, after = states[key]["before"].double(), states[key]["after"].double()
        centre = before.mean(0)
        _, _, v = torch.linalg.svd(before - centre, full_matrices=False)  # the plane of the states before
        applicable = torch.tensor(r["figure5b"][labels]["applicable"])
        for ax, (name, members, colour) in zip(row, (("applicable", applicable, APPLICABLE),
                                                     ("non_applicable", ~applicable, NON_APPLICABLE))):
            for points, marker, when in ((before, "o", "before"), (after, "x", "after")):
                xy = (points[members] - centre) @ v[:2].T
                ax.scatter(xy[:, 0].tolist(), xy[:, 1].tolist(), s=10, alpha=0.5, marker=marker, color=colour,
                           label=when)
            cell = r["figure6"][labels][name]
            _label(ax, f"{title}, labels={labels}: {name} (n={cell['n']})\n||d mu||/sigma = {_number(cell['shift'])} "
                       f"(paper {cell['paper']})", "PC1 (states before)", "PC2")
    fig.suptitle("Figure 6 (ours): the last layer's state at p* before and after MARI")
    tables.save_figure(fig, path)


def draw(models: dict, states: dict, out: Path) -> list[Path]:
    """Every figure under ``out``; ``states``: {(model, seed): {"before": [n, d], "after": [n, d]}}."""
    paths = [out / f"figure{name}.png" for name in ("1", "5a", "5b", "6")]
    figure1(models, paths[0])
    figure5a(models, paths[1])
    figure5b(models, paths[2])
    figure6(models, states, paths[3])
    return paths
