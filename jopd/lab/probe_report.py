"""The probe's report: per-set outcome rates with bootstrap CIs, recognition, the verdict line and warning, the
JSON / CSV / PNG files, and the few numbers a training run logs (`training_metrics`). Definitions: `jopd.lab.probe`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from jopd.lab.stats import Estimate, mean_estimate

SETS = ("student_error", "reference", "teacher_own")
SET_LABELS = {"student_error": "student's erroneous prefixes", "reference": "correct prefixes (reference)",
              "teacher_own": "teacher's own prefixes"}
OUTCOMES = ("recovery", "agreement", "other")
FOLLOWS = "follows_error"  # not recovered, and the completed chain carries exactly one error (arithmetic task)
AGREEMENT_WARNING = 0.5  # agreement above this on the student's errors: the warning


def position_key(label: str) -> float:
    """Sort order of prefix-position buckets: "step 1" < "step 2" < ... < "answer"; "25%" < "50%" < ..."""
    if label == "answer":
        return 1e9
    return float(label.rstrip("%").removeprefix("step "))


def _fmt(e: Estimate) -> str:
    return f"{e.mean:6.1%} [{e.ci_low:6.1%}, {e.ci_high:6.1%}]"


@dataclasses.dataclass
class ProbeReport:
    """Counts, per-set rates with CIs (overall and per prefix position), recognition, the verdict, and the rows."""

    n_problems: int
    n_wrong: int
    skipped: dict[str, int]
    kinds: dict[str, int]  # first-error kinds of the probed student responses
    samples: int
    cut: str
    sets: dict[str, dict[str, Any]]  # set -> {n, greedy, sampled, recognition, by_position, [by_kind]}
    positions: list[str]  # bucket order
    verdict: str
    warning: str | None
    rows: list[dict[str, Any]]  # one per prefix (the CSV)
    settings: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("rows")
        return d

    def table(self) -> str:
        lines = [f"{self.n_problems} problems, {self.n_wrong} wrong student answers, "
                 f"{self.sets['student_error']['n']} erroneous prefixes probed (cut: {self.cut}, K={self.samples})"]
        if self.kinds:
            lines.append("first errors: " + ", ".join(f"{k} {v}" for k, v in sorted(self.kinds.items(),
                                                                                    key=lambda kv: -kv[1])))
        if self.skipped:
            lines.append("not probed: " + ", ".join(f"{k} {v}" for k, v in self.skipped.items()))
        lines.append(f"{'prefix set':32s} {'mode':8s} {'recovery':>24s} {'agreement':>24s} {'other':>24s}")
        for name in SETS:
            s = self.sets[name]
            for mode in ("greedy", "sampled"):
                if s.get(mode):
                    r = s[mode]
                    lines.append(f"{SET_LABELS[name]:32s} {mode:8s} " + " ".join(
                        f"{_fmt(Estimate(**r[o])):>24s}" for o in OUTCOMES))
        err = self.sets["student_error"]
        follows = [(m, err[m][FOLLOWS]) for m in ("greedy", "sampled") if err.get(m) and FOLLOWS in err[m]]
        if follows:
            lines.append("not recovered and carrying the error consistently to the end (follows_error): " + ", ".join(
                f"{m} {_fmt(Estimate(**e)).strip()}" for m, e in follows))
        lines.append(f"{'recognition at the cut':32s} {'p(token)':>24s} {'p(teacher top)':>24s} "
                     f"{'token is top':>24s} median rank")
        for name in SETS:
            rec = self.sets[name]["recognition"]
            lines.append(f"{SET_LABELS[name]:32s} " + " ".join(
                f"{_fmt(Estimate(**rec[k])):>24s}" for k in ("p_token", "p_top", "top1")) +
                f" {rec['median_rank']:g}")
        lines.append(self.verdict)
        if self.warning:
            lines.append(self.warning)
        return "\n".join(lines)

    def save_csv(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as f:
            if not self.rows:
                f.write("")
                return
            w = csv.DictWriter(f, fieldnames=list(self.rows[0]))
            w.writeheader()
            w.writerows(self.rows)

    def plot(self, path: str | Path, title: str = "") -> str:
        """Recovery and agreement vs prefix position, per prefix set and mode, with 95% CI bars."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4), squeeze=False)
        x = np.arange(len(self.positions))
        colors = {"student_error": "tab:red", "reference": "tab:green", "teacher_own": "tab:blue"}
        for ax, what in zip(axes[0], ("recovery", "agreement")):
            for si, name in enumerate(SETS):
                for mode, style in (("greedy", "--"), ("sampled", "-")):
                    pts = [(k, self.sets[name]["by_position"][p][mode][what]) for k, p in enumerate(self.positions)
                           if p in self.sets[name]["by_position"] and self.sets[name]["by_position"][p].get(mode)]
                    if not pts:
                        continue
                    xs = np.array([k for k, _ in pts]) + (si - 1) * 0.08 + (0.02 if mode == "sampled" else -0.02)
                    m = np.array([e["mean"] for _, e in pts])
                    err = np.array([[e["mean"] - e["ci_low"] for _, e in pts],
                                    [e["ci_high"] - e["mean"] for _, e in pts]])
                    ax.errorbar(xs, m, yerr=err, fmt="o", linestyle=style, color=colors[name], capsize=3,
                                alpha=1.0 if mode == "sampled" else 0.6, markerfacecolor="none" if mode == "greedy"
                                else colors[name], label=f"{SET_LABELS[name]} ({mode})")
            counts = [self.sets["student_error"]["by_position"].get(p, {}).get("n", 0) for p in self.positions]
            ax.set_xticks(x, [f"{p}\n(n={n})" for p, n in zip(self.positions, counts)])
            ax.set_ylim(-0.05, 1.05)
            ax.set_ylabel(what)
            ax.set_xlabel("prefix cut at the student's first error in" if self.cut == "first_error"
                          else "prefix cut at this fraction of the response")
            ax.grid(alpha=0.3)
        axes[0][1].legend(fontsize=7, loc="best")
        fig.suptitle(title or "teacher reliability on prefixes (95% bootstrap CIs)", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return str(path)

    def save(self, json_path: str | Path, title: str = "") -> dict[str, str]:
        """JSON report at `json_path`; the CSV and PNG beside it (same stem)."""
        json_path = Path(json_path)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        csv_path, png_path = json_path.with_suffix(".csv"), json_path.with_suffix(".png")
        self.save_csv(csv_path)
        self.plot(png_path, title)
        return {"json": str(json_path), "csv": str(csv_path), "png": str(png_path)}


def _rates(values_NxM: np.ndarray, resamples: int) -> dict[str, dict[str, float]]:
    """The three outcome rates (columns 0-2), and `follows_error` (column 3) where it was measured."""
    out = {o: mean_estimate(values_NxM[:, k], resamples).to_dict() for k, o in enumerate(OUTCOMES)}
    if values_NxM.shape[1] > len(OUTCOMES) and not np.isnan(values_NxM[:, len(OUTCOMES)]).any():
        out[FOLLOWS] = mean_estimate(values_NxM[:, len(OUTCOMES)], resamples).to_dict()
    return out


def _recognition_summary(rec: dict[str, np.ndarray], resamples: int) -> dict[str, Any]:
    return {"p_token": mean_estimate(rec["p_token"], resamples).to_dict(),
            "p_top": mean_estimate(rec["p_top"], resamples).to_dict(),
            "top1": mean_estimate(rec["rank"] == 1, resamples).to_dict(),
            "median_rank": float(np.median(rec["rank"])) if len(rec["rank"]) else float("nan")}


def set_summary(rows: list[dict[str, Any]], greedy: np.ndarray, sampled: np.ndarray | None,
                 rec: dict[str, np.ndarray], resamples: int, by_kind: bool) -> dict[str, Any]:
    def block(sel: np.ndarray) -> dict[str, Any]:
        return {"n": int(sel.sum()), "greedy": _rates(greedy[sel], resamples),
                "sampled": _rates(sampled[sel], resamples) if sampled is not None else None}

    everything = np.ones(len(rows), bool)
    out = block(everything) | {"recognition": _recognition_summary(rec, resamples)}
    positions = np.array([r["position"] for r in rows])
    out["by_position"] = {p: block(positions == p) for p in sorted(set(positions), key=position_key)}
    if by_kind:
        kinds = np.array([r["kind"] for r in rows])
        out["by_kind"] = {k: block(kinds == k) | {"recognition": _recognition_summary(
            {n: v[kinds == k] for n, v in rec.items()}, resamples)} for k in sorted(set(kinds))}
    erroneous = [r["prefix_erroneous"] for r in rows if r["prefix_erroneous"] != ""]
    if erroneous:
        out["n_prefix_erroneous"] = int(sum(erroneous))
    return out


def verdict(sets: dict[str, dict[str, Any]], samples: int) -> tuple[str, str | None]:
    """One line on the teacher's reliability on the student's errors, and the warning when it mostly agrees."""
    mode = "sampled" if samples > 0 else "greedy"
    err, ref = sets["student_error"], sets["reference"]
    if err["n"] == 0:
        return "verdict: no erroneous prefixes to probe (the student got every probed problem right)", None
    rec, agr = Estimate(**err[mode]["recovery"]), Estimate(**err[mode]["agreement"])
    ref_rec = Estimate(**ref[mode]["recovery"])
    sees = 1.0 - err["recognition"]["top1"]["mean"]
    if rec.mean >= 0.5:
        gist = "it mostly escapes the student's errors"
    elif sees >= 0.5:
        gist = "it sees most errors but does not escape them"
    else:
        gist = "it neither sees nor escapes most errors"
    follows = Estimate(**err[mode][FOLLOWS]) if FOLLOWS in err[mode] else None
    carried = (f", and carries it consistently to a wrong answer {follows.mean:.0%} [{follows.ci_low:.0%}, "
               f"{follows.ci_high:.0%}]" if follows else "")
    line = (f"verdict ({mode}{f', K={samples}' if samples else ''}): from the student's erroneous prefixes the "
            f"teacher recovers {rec.mean:.0%} [{rec.ci_low:.0%}, {rec.ci_high:.0%}], ends on the student's wrong "
            f"answer {agr.mean:.0%} [{agr.ci_low:.0%}, {agr.ci_high:.0%}]{carried}; from correct prefixes it "
            f"reaches the answer {ref_rec.mean:.0%} [{ref_rec.ci_low:.0%}, {ref_rec.ci_high:.0%}]; at the error "
            f"its own top choice is another token {sees:.0%} of the time: {gist}.")
    warns = []
    if agr.mean > AGREEMENT_WARNING:
        warns.append(f"WARNING: the teacher mostly agrees with the student's errors ({agr.mean:.0%} of erroneous "
                     f"prefixes end on the student's wrong answer): its supervision on such prefixes is noise.")
    if follows is not None and follows.mean > AGREEMENT_WARNING:
        warns.append(f"WARNING: the teacher mostly writes along the student's errors ({follows.mean:.0%} of erroneous "
                     f"prefixes carried consistently to a wrong answer): on such prefixes its supervision "
                     f"reinforces the error instead of correcting it.")
    return line, "\n".join(warns) or None




def training_metrics(report: ProbeReport) -> dict[str, float]:
    """The few numbers a training run logs from a probe (`train.probe_every`): the outcome rates from the
    student's erroneous prefixes (sampled draws when there are any, else greedy), the corrected-prefix control's
    recovery, and how often the erroneous token is the teacher's own top choice. With no erroneous prefix (the
    student got every probed problem right) only the count is logged: the rates are missing, not 0."""
    mode = "sampled" if report.samples else "greedy"
    err = report.sets["student_error"]
    out = {"n_wrong": float(report.n_wrong), "n_prefixes": float(err["n"])}
    if err["n"]:
        out |= {name: float(est["mean"]) for name, est in err[mode].items()}
        out["reference_recovery"] = float(report.sets["reference"][mode]["recovery"]["mean"])
        out["error_is_teacher_top1"] = float(err["recognition"]["top1"]["mean"])
    return out
