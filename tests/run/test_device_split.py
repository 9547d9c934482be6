"""`run.device_split`: the environment of each side of rollout.placement=process with rollout.sampler_devices=N, on
GPU, TPU and CPU, against the values written out (the GPU and TPU ones are never run here: no such device)."""

import pytest

from jopd.config_dataclass import ConfigError
from jopd.run import device_split as ds


def test_gpu_the_worker_gets_the_first_physical_ids_and_the_trainer_the_rest_by_index():
    split = ds.gpu_split(2, ["0", "1", "2", "3"])  # no CUDA_VISIBLE_DEVICES: /dev/nvidia0..3
    assert split.worker_env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert split.trainer_options == {"jax_cuda_visible_devices": "2,3"} and split.trainer_env == {}
    # the trainer's own CUDA_VISIBLE_DEVICES=5,3,7: the worker is given physical ids, the trainer indices into them
    visible = ds.visible_gpus({"CUDA_VISIBLE_DEVICES": "5, 3,7"})
    assert visible == ["5", "3", "7"]
    split = ds.gpu_split(1, visible)
    assert split.worker_env == {"CUDA_VISIBLE_DEVICES": "5"}
    assert split.trainer_options == {"jax_cuda_visible_devices": "1,2"} and split.restricts_trainer
    with pytest.raises(ConfigError, match=r"^rollout.sampler_devices=3: must be between 1 and 2 \(the sampler "
                                          r"process's share of this host's 3 visible GPUs"):
        ds.gpu_split(3, visible)


def _tpu_side(chips: str, bounds: str, ports: tuple[int, int]) -> dict[str, str]:
    return {"TPU_VISIBLE_CHIPS": chips, "TPU_VISIBLE_DEVICES": chips,
            "TPU_CHIPS_PER_PROCESS_BOUNDS": bounds, "TPU_CHIPS_PER_HOST_BOUNDS": bounds,
            "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_HOST_BOUNDS": "1,1,1",
            "TPU_MESH_CONTROLLER_ADDRESS": f"localhost:{ports[0]}", "TPU_MESH_CONTROLLER_PORT": str(ports[0]),
            "TPU_PROCESS_ADDRESSES": f"localhost:{ports[1]}", "TPU_PROCESS_PORT": str(ports[1]),
            "CLOUD_TPU_TASK_ID": "0", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def test_tpu_each_side_is_an_independent_process_on_a_sub_box_with_ports_of_its_own():
    # one side's environment for 1, 2 and 4 chips of a 2x4 host
    assert ds.tpu_env([0], (9001, 9002)) == _tpu_side("0", "1,1,1", (9001, 9002))
    assert ds.tpu_env([0, 1], (9001, 9002)) == _tpu_side("0,1", "1,2,1", (9001, 9002))
    assert ds.tpu_env([4, 5, 6, 7], (9001, 9002)) == _tpu_side("4,5,6,7", "2,2,1", (9001, 9002))
    # a 2x4 host split 4 + 4; a 2x2 host split 2 + 2
    split = ds.tpu_split(4, 8, (9001, 9002, 9003, 9004))
    assert split.worker_env == _tpu_side("0,1,2,3", "2,2,1", (9001, 9002))
    assert split.trainer_env == _tpu_side("4,5,6,7", "2,2,1", (9003, 9004)) and split.trainer_options == {}
    split = ds.tpu_split(2, 4, (9001, 9002, 9003, 9004))
    assert split.worker_env == _tpu_side("0,1", "1,2,1", (9001, 9002))
    assert split.trainer_env == _tpu_side("2,3", "1,2,1", (9003, 9004))
    # the ports the host gives: distinct
    assert len(set(ds.free_ports(2 * ds.TPU_PORTS))) == 4


def test_tpu_splits_that_are_not_sub_boxes_and_multi_host_slices_are_refused():
    ports = (9001, 9002, 9003, 9004)
    with pytest.raises(ConfigError, match=r"^rollout.sampler_devices=2: 2 of this host's 8 TPU chips leaves sides of "
                                          r"2 and 6 chips, each must be a sub-box \(\[1, 2, 4, 8\] chips\)$"):
        ds.tpu_split(2, 8, ports)
    with pytest.raises(ConfigError, match=r"^rollout.sampler_devices=3: 3 of this host's 4 TPU chips"):
        ds.tpu_split(3, 4, ports)
    with pytest.raises(ConfigError, match=r"^rollout.sampler_devices=4: must be between 1 and 3"):
        ds.tpu_split(4, 4, ports)
    with pytest.raises(ConfigError, match=r"^rollout.sampler_devices=4: with rollout.placement=process on a "
                                          r"multi-host TPU slice is not built \(one host only for now\)$"):
        ds.tpu_split(4, 8, ports, {"TPU_WORKER_HOSTNAMES": "h0,h1"})
    with pytest.raises(ConfigError, match=r"^rollout.sampler_devices=4: TPU_VISIBLE_CHIPS is set already"):
        ds.tpu_split(4, 8, ports, {"TPU_VISIBLE_CHIPS": "0,1,2,3"})
    with pytest.raises(ValueError, match=r"^tpu_split: 4 distinct ports needed"):
        ds.tpu_split(4, 8, (9001, 9001, 9003, 9004))


def test_cpu_the_worker_count_replaces_the_trainers_and_the_trainer_is_not_restricted():
    flags = "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8 --xla_bar=2"
    split = ds.cpu_split(3, 8, flags)
    assert split.worker_env == {"XLA_FLAGS": "--xla_cpu_foo=1 --xla_force_host_platform_device_count=3 --xla_bar=2"}
    assert split.worker_options == {"jax_num_cpu_devices": 3} and not split.restricts_trainer
    assert ds.cpu_split(1, 2, "").worker_env == {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    with pytest.raises(ConfigError, match=r"^rollout.sampler_devices=8: must be between 1 and 7"):
        ds.cpu_split(8, 8, flags)


def test_the_trainer_is_restricted_before_its_backend_starts_never_after(monkeypatch):
    """A GPU host (faked: its platform and visible GPUs): the trainer's jax option is set once, before its backend
    starts; with the backend started first, one line instead of a silently shared GPU."""
    import types

    import jax

    cfg = types.SimpleNamespace(rollout=types.SimpleNamespace(placement="process", sampler_devices=1))
    monkeypatch.setattr(ds, "host_platform", lambda: "gpu")
    monkeypatch.setattr(ds, "visible_gpus", lambda environ: ["0", "1", "2"])
    monkeypatch.setattr(ds, "_SPLIT", None), monkeypatch.setattr(ds, "_APPLIED", None)
    set_options = []
    monkeypatch.setattr(jax.config, "update", lambda k, v: set_options.append((k, v)))
    monkeypatch.setattr(ds, "_backend_started", lambda: False)
    split = ds.restrict_trainer(cfg)
    assert set_options == [("jax_cuda_visible_devices", "1,2")] and split.worker_env["CUDA_VISIBLE_DEVICES"] == "0"
    assert ds.restrict_trainer(cfg) is split and len(set_options) == 1  # applied once
    monkeypatch.setattr(ds, "_APPLIED", None)
    monkeypatch.setattr(ds, "_backend_started", lambda: True)
    with pytest.raises(ConfigError, match=r"^rollout.sampler_devices=1: jax's gpu backend had started in this "
                                          r"process before the trainer could be restricted"):
        ds.restrict_trainer(cfg)
    assert len(set_options) == 1
    colocated = types.SimpleNamespace(rollout=types.SimpleNamespace(placement="colocated", sampler_devices=0))
    assert ds.restrict_trainer(colocated) is None  # the default run: nothing read, nothing set
