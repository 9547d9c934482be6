"""Bad input never ends in a traceback: configs mutated at random (hypothesis) either load and run, or fail with
one line that names the offending field or file."""

import contextlib
import copy
import io
import math

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from jopd import cli
from jopd.run.config import load_config, to_yaml
from tests.helpers.tiny_testbed import tiny_cache, write_tiny

VALUES = st.one_of(st.none(), st.booleans(), st.sampled_from([-1, 0, 1, 2, 3, 7, 10**12]),
                   st.sampled_from([0.0, -1.0, 0.5, 1.5, math.nan, math.inf]),
                   st.text(alphabet="abc/._-", max_size=6), st.lists(st.integers(-1, 3), max_size=2),
                   st.just({"x": 1}))


def _leaves(d, prefix=()):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, prefix + (k,))
        else:
            yield prefix + (k,)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    path = write_tiny(tmp / "tiny.yaml", train={"steps": 1, "eval_problems": 8})
    return tmp, yaml.safe_load(to_yaml(load_config(str(path))))


def _mutate(data, path, op, value):
    data = copy.deepcopy(data)
    node = data
    for k in path[:-1]:
        node = node[k]
    if op == "set":
        node[path[-1]] = value
    elif op == "delete":
        del node[path[-1]]
    else:  # an unknown key beside it
        node[f"{path[-1]}_typo"] = value
    return data


def _run(args):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(args)
    return code, err.getvalue()


def _one_clean_line(code, err, command="train"):
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("teacher:", "eval", "OPD",
                                                                                         "SFT"))]
    errors = [line for line in lines if line.startswith(f"jopd {command}: error: ")]
    return code == 0 or (code == 2 and len(errors) == 1 and "Traceback" not in err)


def _mutation_strategy(data):
    return st.tuples(st.sampled_from(sorted(_leaves(data))), st.sampled_from(["set", "set", "set", "delete", "typo"]),
                     VALUES)


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_print_config_loads_or_names_the_field(base, data):
    tmp, cfg = base
    path, op, value = data.draw(_mutation_strategy(cfg))
    f = tmp / "mutated.yaml"
    f.write_text(yaml.safe_dump(_mutate(cfg, path, op, value)))
    code, err = _run(["train", str(f), "--print-config"])
    assert _one_clean_line(code, err), (path, op, value, code, err[-2000:])


# Sizes a valid mutation may set without turning a 1-step run into a long one.
_SMALL = st.one_of(st.none(), st.booleans(), st.sampled_from([-1, 0, 1, 2, 3]), st.sampled_from([0.0, 0.5, math.nan]),
                   st.text(alphabet="abc", max_size=3))


@pytest.mark.slow
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_one_step_run_succeeds_or_fails_in_one_line(base, data):
    tmp, cfg = base
    paths = sorted(p for p in _leaves(cfg) if p[0] in ("loss", "sampling", "optim", "rollout_precision", "rl", "data"))
    path = data.draw(st.sampled_from(paths))
    value = data.draw(_SMALL)
    f = tmp / "mutated1.yaml"
    f.write_text(yaml.safe_dump(_mutate(cfg, path, "set", value)))
    code, err = _run(["train", str(f), f"train.out_dir={tmp / 'run'}", f"train.cache_dir={tiny_cache()}"])
    assert code in (0, 1, 3) or _one_clean_line(code, err), (path, value, code, err[-2000:])


@pytest.mark.parametrize("overrides,named", [
    (["loss.top_k=500"], "RunConfig.loss.top_k=500: larger than the vocabulary"),
    (["mesh.data=3"], "MeshConfig: mesh (data=3"),
    (["sampling.top_p=1.5"], "RunConfig.sampling.top_p"),
    (["data.batch_size=0"], "RunConfig.data.batch_size"),
    (["teacher.path=/nonexistent/model"], "RunConfig.teacher.path: /nonexistent/model does not exist"),
    (["data.task=jsonl", "data.train_path={tmp}/empty.jsonl", "data.heldout_path={tmp}/empty.jsonl"],
     "file is empty"),
    (["data.task=jsonl", "data.train_path={tmp}/bad.jsonl", "data.heldout_path={tmp}/bad.jsonl"],
     "bad.jsonl:2: not valid JSON"),
    (["train.out_dir={tmp}/afile/sub"], "RunConfig.train.out_dir: "),
    (["checkpoint.dir={tmp}/afile/ck"], "CheckpointConfig.dir: "),
    (["student.arch.max_position_embeddings=64"],
     "RunConfig.student.arch.max_position_embeddings: a context of 64 tokens cannot hold data.max_prompt_len"),
    (["teacher.arch.max_position_embeddings=64"], "RunConfig.teacher.arch.max_position_embeddings: a context of 64"),
    (["data.max_prompt_len=8"], "arithmetic train #0 (question): 37 tokens after chat formatting > DataConfig.max_prompt_len=8"),
])
def test_named_bad_inputs_fail_in_one_line(base, overrides, named):
    tmp, cfg = base
    (tmp / "empty.jsonl").write_text("")
    (tmp / "bad.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{not json\n')
    (tmp / "afile").write_text("")
    f = tmp / "ok.yaml"
    f.write_text(yaml.safe_dump(cfg))
    over = [o.format(tmp=tmp) for o in overrides]
    code, err = _run(["train", str(f), f"train.cache_dir={tiny_cache()}", f"train.out_dir={tmp / 'out'}", *over])
    assert _one_clean_line(code, err) and code == 2 and named in err, err[-1500:]
