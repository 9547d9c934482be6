"""tpu_scripts/: bash syntax, usage errors before any gcloud call, the gcloud commands they issue (against a fake
gcloud that records its arguments), and gs:// checkpoint directories."""

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from jopd.run.checkpoint import checkpoint_directory
from jopd.parallel.distributed import DistributedConfig, config_from_env

SCRIPTS = Path(__file__).resolve().parents[2] / "tpu_scripts"
COMMANDS = ["create.sh", "setup.sh", "run.sh", "stop.sh", "teardown.sh"]
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="bash is not installed")


@pytest.fixture
def fake_gcloud(tmp_path):
    """A `gcloud` on PATH that appends its argv (one line, shell-quoted) to a log and reports ACTIVE."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "gcloud.log"
    script = bin_dir / "gcloud"
    script.write_text(f'#!{BASH}\nprintf "%q " "$@" >> {shlex.quote(str(log))}\necho >> {shlex.quote(str(log))}\n'
                      'case "$*" in *describe*) echo ACTIVE ;; esac\n')
    script.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    env.pop("DRY_RUN", None)
    env.pop("PROJECT", None)
    return env, log


def run(script, *args, env):
    return subprocess.run([BASH, str(SCRIPTS / script), *args], env=env, capture_output=True, text=True,
                          timeout=30)


def calls(log: Path) -> list[list[str]]:
    return [shlex.split(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.mark.parametrize("script", [*COMMANDS, "common.sh"])
def test_bash_syntax_and_strict_mode(script):
    subprocess.run([BASH, "-n", str(SCRIPTS / script)], check=True)
    text = (SCRIPTS / script).read_text()
    if script != "common.sh":
        assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
        assert os.access(SCRIPTS / script, os.X_OK)


@pytest.mark.parametrize("script", COMMANDS)
def test_missing_arguments_print_usage_and_never_call_gcloud(script, fake_gcloud):
    env, log = fake_gcloud
    res = run(script, env=env)
    assert res.returncode != 0
    assert "usage" in (res.stdout + res.stderr).lower()
    assert calls(log) == []


@pytest.mark.parametrize("script,args,error", [
    ("create.sh", ["Bad_Name", "us-west4-a", "v5litepod-16", "v2-alpha-tpuv5-lite"], "NAME 'Bad_Name'"),
    ("create.sh", ["jopd", "uswest4", "v5litepod-16", "v2-alpha-tpuv5-lite"], "ZONE 'uswest4'"),
    ("create.sh", ["jopd", "us-west4-a", "v5e16", "v2-alpha-tpuv5-lite"], "ACCELERATOR_TYPE 'v5e16'"),
    ("create.sh", ["jopd", "us-west4-a", "v5litepod-16", "v2-alpha-tpuv5-lite", "--spotty"], "unknown option"),
    ("run.sh", ["jopd", "us-west4-a", "configs/x.json"], "CONFIG 'configs/x.json'"),
    ("run.sh", ["jopd", "us-west4-a", "configs/x.yaml", "train.steps"], "override 'train.steps'"),
    ("setup.sh", ["jopd", "us-west4-a", "--data", "/nonexistent/dir"], "not a directory"),
])
def test_bad_arguments_are_named(script, args, error, fake_gcloud):
    env, log = fake_gcloud
    res = run(script, *args, env=env)
    assert res.returncode == 2 and error in res.stderr and "usage" in res.stderr
    assert calls(log) == []


def test_create_queued_spot_waits_until_active(fake_gcloud):
    env, log = fake_gcloud
    res = run("create.sh", "jopd-v5e", "us-west4-a", "v5litepod-16", "v2-alpha-tpuv5-lite", "--spot",
              env=dict(env, PROJECT="my-proj"))
    assert res.returncode == 0, res.stderr
    create, describe = calls(log)
    assert create[:4] == ["compute", "tpus", "queued-resources", "create"]
    for flag, value in [("--node-id", "jopd-v5e"), ("--zone", "us-west4-a"), ("--project", "my-proj"),
                        ("--accelerator-type", "v5litepod-16"), ("--runtime-version", "v2-alpha-tpuv5-lite")]:
        assert create[create.index(flag) + 1] == value
    assert "--spot" in create and describe[3] == "describe"
    assert "+ gcloud compute tpus queued-resources create jopd-v5e" in res.stderr  # says what it runs


def test_create_tpu_vm_on_demand(fake_gcloud):
    env, log = fake_gcloud
    assert run("create.sh", "jopd", "us-east5-a", "v5p-16", "v2-alpha-tpuv5", "--tpu-vm", env=env).returncode == 0
    (create,) = calls(log)
    assert create[:4] == ["compute", "tpus", "tpu-vm", "create"] and "--spot" not in create
    assert create[create.index("--version") + 1] == "v2-alpha-tpuv5"


def test_setup_copies_the_checkout_and_installs_the_tpu_extra(fake_gcloud, tmp_path):
    env, log = fake_gcloud
    data = tmp_path / "gsm8k"
    data.mkdir()
    res = run("setup.sh", "jopd", "us-west4-a", "--data", str(data), env=env)
    assert res.returncode == 0, res.stderr
    cmds = calls(log)
    assert all("--worker=all" in c for c in cmds)
    scp = [c for c in cmds if c[3] == "scp"]
    assert scp[0][4].endswith("jopd.tar.gz") and scp[0][5] == "jopd:~/jopd.tar.gz"
    assert scp[1][4:7] == ["--recurse", str(data), "jopd:~/jopd/data/"]
    install = cmds[-1][cmds[-1].index("--command") + 1]
    assert 'pip install -q -e "$HOME/jopd[tpu]" gcsfs' in install


def test_setup_clones_a_git_url(fake_gcloud):
    env, log = fake_gcloud
    assert run("setup.sh", "jopd", "us-west4-a", "https://github.com/me/jopd.git", env=env).returncode == 0
    clone = calls(log)[0]
    assert "git clone --depth 1 https://github.com/me/jopd.git ~/jopd" in clone[clone.index("--command") + 1]


def test_run_launches_the_same_command_on_every_worker(fake_gcloud):
    env, log = fake_gcloud
    res = run("run.sh", "jopd", "us-west4-a", "configs/qwen3_1p7b_from_8b_v5e.yaml",
              "checkpoint.dir=gs://b/run 1", env=env)
    assert res.returncode == 0, res.stderr
    (ssh,) = calls(log)
    assert ssh[:4] == ["compute", "tpus", "tpu-vm", "ssh"] and "--worker=all" in ssh
    remote = ssh[ssh.index("--command") + 1]
    assert "jopd-venv/bin/jopd train configs/qwen3_1p7b_from_8b_v5e.yaml checkpoint.dir=gs://b/run\\ 1" in remote
    assert "coordinator" not in remote  # JAX finds the pod's workers itself
    assert "env JOPD_DISTRIBUTED=on " in remote  # ... once asked to join a distributed job


def test_dry_run_prints_without_calling(fake_gcloud):
    env, log = fake_gcloud
    res = run("teardown.sh", "jopd", "us-west4-a", env=dict(env, DRY_RUN="1"))
    assert res.returncode == 0 and "queued-resources delete jopd" in res.stderr and calls(log) == []
    res = run("stop.sh", "jopd", "us-west4-a", env=env)
    assert res.returncode == 0 and "pkill -TERM" in calls(log)[0][-1]


def test_checkpoint_dir_keeps_cloud_uris(tmp_path, monkeypatch):
    assert str(checkpoint_directory("gs://bucket/jopd/run")) == "gs://bucket/jopd/run"
    monkeypatch.chdir(tmp_path)
    assert str(checkpoint_directory("runs/x")) == str(tmp_path / "runs" / "x")


def test_jopd_distributed_env_turns_auto_on(monkeypatch):
    monkeypatch.setenv("JOPD_DISTRIBUTED", "on")
    assert config_from_env().enabled == "on"
    assert config_from_env(DistributedConfig(enabled="off")).enabled == "off"  # an explicit config wins
    monkeypatch.setenv("JOPD_DISTRIBUTED", "yes")
    with pytest.raises(ValueError, match="JOPD_DISTRIBUTED: expected auto, on or off, got 'yes'"):
        config_from_env()
    monkeypatch.delenv("JOPD_DISTRIBUTED")
    assert config_from_env().enabled == "auto"
