"""The teacher-reliability probe on a tiny testbed: a teacher that is a copy of the student reproduces the
student's greedy continuation (agreement 1), an oracle teacher that writes the right solution recovers from
every prefix, outcomes add up to 1 per prefix set, and `jopd probe` writes its JSON/CSV/PNG."""

import csv
import dataclasses
import json

import numpy as np
import pytest
import yaml

from jopd import cli
from jopd.data.pipeline import load_problems
from jopd.lab import probe as probelib
from jopd.run import loop
from jopd.run.config import load_config

# The teacher is left untrained and shares the student's architecture (its quality does not matter here; one SFT
# compile and one init compile less keep the file fast); the student gets just enough SFT to write step-shaped,
# mostly wrong answers ('2*2=1. #### 1').
ARCH = {"hidden_size": 16, "intermediate_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 8}
TINY = {
    "teacher": {"arch": ARCH, "warm_start": {"steps": 0}},
    "student": {"arch": ARCH, "warm_start": {"steps": 100, "batch_size": 16, "learning_rate": 1e-2,
                                             "warmup_steps": 0}},
    "data": {"batch_size": 8, "eval_batch_size": 16,
             "arithmetic": {"max_steps": 2, "max_number": 9, "heldout_size": 32}},
    "sampling": {"max_new_tokens": 16},
    "loss": {"top_k": 16},
    "train": {"steps": 3, "eval_problems": 16, "eval_max_new_tokens": 16},
    "checkpoint": {"every": 100, "async_save": False},
}
FAST = dict(batch_size=16, resamples=200, progress=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe")
    path = tmp / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    over = [f"train.cache_dir={tmp / 'cache'}", f"train.out_dir={tmp / 'out'}"]
    run, state = loop.build(load_config(str(path), over), log=lambda *_: None)
    problems = list(load_problems(run.cfg.data, "heldout"))[:16]
    return tmp, path, over, run, state, problems


def _oracle(problems):
    """A teacher double that always continues with the correct worked solution."""
    return lambda prefixes, sample: [" " + problems[p.problem].solution for p in prefixes]


def _sums_to_one(report):
    for name, s in report.sets.items():
        blocks = [s] + list(s["by_position"].values()) + list(s.get("by_kind", {}).values())
        for block in blocks:
            for mode in ("greedy", "sampled"):
                if block[mode] is not None and block["n"]:
                    total = sum(block[mode][o]["mean"] for o in probelib.OUTCOMES)
                    assert total == pytest.approx(1.0), (name, mode, block)


def test_final_answer_and_outcome():
    assert probelib.final_answer("3*4=12. #### 12") == "12"
    assert probelib.final_answer("#### 15 3*4=12. #### 12") == "12"  # the answer the text ends on
    assert probelib.final_answer("3*4=12.") is None
    assert probelib.outcome("#### 12", "12", "13") == "recovery"
    assert probelib.outcome("#### 13", "12", "13") == "agreement"
    assert probelib.outcome("#### 14", "12", "13") == "other"
    assert probelib.outcome("3*4=", "12", None) == "agreement"  # neither ends on an answer
    assert probelib.outcome("3*4=", "12", "13") == "other"


def test_copy_teacher_agrees_on_its_own_greedy_errors(tiny):
    _, _, _, run, state, problems = tiny
    copy = dataclasses.replace(run, teacher_params=(state.params,),
                               step=dataclasses.replace(run.step, teacher_cfgs=(run.step.student_cfg,)))
    report = probelib.probe(copy, state.params, problems,
                            options=probelib.ProbeOptions(samples=0, student_greedy=True, **FAST))
    rows = [r for r in report.rows if r["set"] == "student_error"]
    assert len(rows) >= 8, report.table()  # a 10-step warm start gets most problems wrong
    for r in rows:  # greedy from its own prefix, the same model writes exactly what it wrote
        assert r["prefix"] + r["greedy_continuation"] == r["response"], r
        assert int(r["rank"]) == 1  # and the erroneous token was its own top choice
    assert report.sets["student_error"]["greedy"]["agreement"]["mean"] == 1.0
    assert report.sets["student_error"]["recognition"]["top1"]["mean"] == 1.0
    assert report.warning and "noise" in report.warning
    _sums_to_one(report)


def test_oracle_teacher_recovers_from_every_prefix(tiny):
    _, _, _, run, state, problems = tiny
    report = probelib.probe(run, state.params, problems, options=probelib.ProbeOptions(samples=2, **FAST),
                            continue_fn=_oracle(problems))
    assert report.cut == "first_error" and report.sets["student_error"]["n"] >= 8
    assert sum(report.kinds.values()) == report.sets["student_error"]["n"]
    for name in probelib.SETS:
        for mode in ("greedy", "sampled"):
            assert report.sets[name][mode]["recovery"]["mean"] == 1.0, (name, mode)
    assert report.warning is None and "recovers 100%" in report.verdict
    # the erroneous prefix ends at the first wrong character; the reference control at the same place
    by_problem = {}
    for r in report.rows:
        by_problem.setdefault(r["problem"], {})[r["set"]] = r
    for sets in by_problem.values():
        err, ref = sets["student_error"], sets["reference"]
        assert err["kept_tokens"] == ref["kept_tokens"] or err["scored_token"] == "<|end|>"
        assert err["prefix"][:-1] == ref["prefix"][:-1] or err["kind"] in ("truncated", "malformed")
    _sums_to_one(report)


def test_fraction_cuts_fallback(tiny):
    _, _, _, run, state, problems = tiny
    report = probelib.probe(run, state.params, problems,
                            options=probelib.ProbeOptions(samples=0, cut="fractions", **FAST),
                            continue_fn=_oracle(problems))
    assert report.positions == ["25%", "50%", "75%"]
    n_wrong = report.n_wrong - sum(report.skipped.values())
    assert report.sets["student_error"]["n"] == 3 * n_wrong and report.sets["reference"]["n"] == 3 * n_wrong
    for r in report.rows:
        assert 1 <= r["kept_tokens"] and r["response"].startswith(r["prefix"])
    assert report.sets["student_error"]["greedy"]["recovery"]["mean"] == 1.0


def test_cli_writes_json_csv_png(tiny, capsys):
    tmp, path, over, _, _, _ = tiny
    out = tmp / "report" / "probe.json"
    rc = cli.main(["probe", str(path), *over, "--problems", "16", "--samples", "2", "--resamples", "200",
                   "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "verdict" in printed and "recovery" in printed
    report = json.loads(out.read_text())
    assert report["n_problems"] == 16 and report["samples"] == 2 and report["cut"] == "first_error"
    for name in probelib.SETS:
        s = report["sets"][name]
        for mode in ("greedy", "sampled"):
            assert sum(s[mode][o]["mean"] for o in probelib.OUTCOMES) == pytest.approx(1.0)
            for o in probelib.OUTCOMES:
                e = s[mode][o]
                assert e["ci_low"] <= e["mean"] <= e["ci_high"]
        assert 0 <= s["recognition"]["p_token"]["mean"] <= 1
    rows = list(csv.DictReader(open(out.with_suffix(".csv"))))
    assert len(rows) == sum(report["sets"][n]["n"] for n in probelib.SETS)
    sampled = np.array([[float(r[f"sampled_{o}"]) for o in probelib.OUTCOMES] for r in rows])
    np.testing.assert_allclose(sampled.sum(1), 1.0)  # per prefix too
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli.main(["probe", str(path), *over, "--step", "3"]) == 2  # --step without --checkpoint


def test_train_probe_every_logs_the_probe_during_training(tiny):
    """`train.probe_every=2` over 3 steps: probe/* rows before the first step and at step 2, the first equal to
    the probe of the starting student measured directly; outcome rates sum to 1."""
    tmp, path, over, run, state, problems = tiny
    n = 16
    cfg = load_config(str(path), over[:1] + [f"train.out_dir={tmp / 'probed'}", "train.probe_every=2",
                                             f"train.probe_problems={n}", "train.eval_problems=8"])
    with pytest.raises(ValueError, match="train.probe_every: needs the probe hook"):
        loop.train(cfg, log=lambda *_: None)  # the loop does not import the lab: the probe is handed to it
    assert not (tmp / "probed").exists()  # refused before anything is written
    loop.train(cfg, log=lambda *_: None, probe_hook=probelib.training_probe)
    rows = [json.loads(line) for line in (tmp / "probed" / "metrics.jsonl").read_text().splitlines()]
    probed = {r["step"]: {k[len("probe/"):]: v for k, v in r.items() if k.startswith("probe/")}
              for r in rows if any(k.startswith("probe/") for k in r)}
    assert sorted(probed) == [0, 2]
    direct = probelib.training_metrics(probelib.probe(
        run, state.params, problems[:n], options=probelib.ProbeOptions(samples=0, resamples=200, progress=False)))
    assert probed[0] == pytest.approx(direct)
    for m in probed.values():
        assert m["n_prefixes"] >= 1 and sum(m[o] for o in probelib.OUTCOMES) == pytest.approx(1.0)
        assert 0.0 <= m["follows_error"] <= 1.0 and 0.0 <= m["reference_recovery"] <= 1.0
