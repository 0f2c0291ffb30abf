"""deploy: GPUs seen without torch, one GPU per worker, and placement flags refused up front."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
from support import hides_gpus

from deploy.cli import add_serve_arguments, config_from_args, main
from deploy.devices import check_devices, visible_gpus, worker_env
from proto.config import EngineConfig
from proto.errors import ValidationError


def serve_args(model: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args([str(model), *extra])


@pytest.fixture
def no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def test_visible_gpus_follow_cuda_visible_devices_then_the_driver(tmp_path: Path) -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,GPU-abc"}) == ["2", "GPU-abc"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    for bus_id in ("0000:01:00.0", "0000:02:00.0"):
        (tmp_path / bus_id).mkdir()
    assert visible_gpus({}, driver_dir=tmp_path) == ["0", "1"]
    assert visible_gpus({}, driver_dir=tmp_path / "absent") == []


def test_each_worker_sees_only_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    config = EngineConfig(tensor_parallel_size=4, nnodes=2, node_rank=1, master_addr="h",
                          devices=(3, 1), insecure_transport=True)
    gpus = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]
    assert [worker_env(config, local, gpus) for local in range(2)] == [
        {"CUDA_VISIBLE_DEVICES": "GPU-d"}, {"CUDA_VISIBLE_DEVICES": "GPU-b"}]
    assert worker_env(EngineConfig(tensor_parallel_size=2), 1, ["0", "1"]) == {"CUDA_VISIBLE_DEVICES": "1"}
    # CPU: the worker splits cores; torch's allocator takes huge pages unless the environment says no
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert worker_env(EngineConfig(tensor_parallel_size=2), 1, []) == {"THP_MEM_ALLOC_ENABLE": "1"}
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert worker_env(EngineConfig(tensor_parallel_size=2), 1, []) == {"THP_MEM_ALLOC_ENABLE": "0"}


def test_more_devices_than_exist_are_refused_with_what_is_visible() -> None:
    with pytest.raises(ValidationError, match=r"need GPUs 0,1,2,3, but only 2 are visible \(0,1\): "
                                              r"lower --tensor-parallel-size.*CUDA_VISIBLE_DEVICES=''"):
        check_devices(EngineConfig(tensor_parallel_size=4), ["0", "1"])
    with pytest.raises(ValidationError,
                       match=r"need GPUs 5, but only 2 are visible \(0,1\): name GPUs 0-1 in --devices"):
        check_devices(EngineConfig(devices=(5,)), ["0", "1"])
    with pytest.raises(ValidationError, match="names GPUs, but this machine has none visible"):
        check_devices(EngineConfig(devices=(0,)), [])
    check_devices(EngineConfig(tensor_parallel_size=2), [])  # CPU workers need no GPU


def test_devices_on_a_machine_without_gpus_are_refused_by_the_cli(tiny_model_dir: Path,
                                                                  no_gpus: None) -> None:
    with pytest.raises(ValidationError, match="has none visible"):
        config_from_args(serve_args(tiny_model_dir, "--tensor-parallel-size", "2", "--devices", "0,1"))


def test_several_nodes_without_a_master_address_are_refused(tiny_model_dir: Path, no_gpus: None,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValidationError, match="needs master_addr"):
        config_from_args(serve_args(tiny_model_dir, "--tensor-parallel-size", "2", "--nnodes", "2"))
    assert main(["serve", str(tiny_model_dir), "--tensor-parallel-size", "2", "--nnodes", "2"]) == 2
    assert "--master-addr" in caplog.text


def test_placement_flags_reach_the_engine_config(tiny_model_dir: Path, no_gpus: None) -> None:
    config = config_from_args(serve_args(
        tiny_model_dir, "--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1",
        "--master-addr", "10.1.2.3", "--master-port", "31000", "--insecure-transport"))
    assert (config.tensor_parallel_size, config.nnodes, config.node_rank) == (4, 2, 1)
    assert (config.master_addr, config.master_port, list(config.local_ranks)) == ("10.1.2.3", 31000, [2, 3])


def test_gpu_memory_utilization_reaches_the_engine_config(tiny_model_dir: Path) -> None:
    assert config_from_args(serve_args(tiny_model_dir)).gpu_memory_utilization == 0.9
    config = config_from_args(serve_args(tiny_model_dir, "--gpu-memory-utilization", "0.6"))
    assert config.gpu_memory_utilization == 0.6


def test_a_tensor_parallel_size_that_splits_kv_heads_unevenly_is_refused(tiny_model_dir: Path,
                                                                         tmp_path: Path) -> None:
    model = tmp_path / "six-heads"
    shutil.copytree(tiny_model_dir, model)
    raw = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**raw, "num_attention_heads": 6,
                                                   "num_key_value_heads": 3}))
    with pytest.raises(ValidationError, match="must divide the model's 3 KV heads or be a multiple"):
        config_from_args(serve_args(model, "--tensor-parallel-size", "2"))


def test_bad_device_lists_are_refused_by_the_parser(tiny_model_dir: Path) -> None:
    with pytest.raises(SystemExit):
        serve_args(tiny_model_dir, "--devices", "zero,one")


def test_a_test_of_cpu_workers_or_of_more_ranks_than_gpus_hides_them_from_its_stack() -> None:
    assert not hides_gpus(None, False, ["0"])  # unmarked: workers take the GPUs as users' would
    assert hides_gpus(None, True, ["0", "1"])
    assert hides_gpus(2, False, ["0"]) and not hides_gpus(2, False, ["0", "1"])


@pytest.mark.ranks(4)
def test_a_test_marked_with_more_ranks_than_visible_gpus_sees_none() -> None:
    assert not visible_gpus() or len(visible_gpus()) >= 4
