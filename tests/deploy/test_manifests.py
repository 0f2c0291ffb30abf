"""The multi-node manifests run CURVE step channels: every pod and every systemd node example
serves with --transport-keys, and on Kubernetes the keys come from the mounted Secret."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import yaml

from deploy.cli import add_serve_arguments

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
LWS_VARIABLES = {"$(LWS_GROUP_SIZE)": "2", "$(LWS_WORKER_INDEX)": "1", "$(LWS_LEADER_ADDRESS)": "leader"}


def serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(argv)


def test_every_pod_of_the_multi_node_manifest_serves_with_the_mounted_transport_keys_secret() -> None:
    lws = next(yaml.safe_load_all((DEPLOY / "k8s" / "multi-node.yaml").read_text()))
    for role in ("leaderTemplate", "workerTemplate"):
        spec = lws["spec"]["leaderWorkerTemplate"][role]["spec"]
        container = spec["containers"][0]
        argv = list(container["args"][1:])  # after "serve"
        for variable, value in LWS_VARIABLES.items():
            argv = [arg.replace(variable, value) for arg in argv]
        args = serve_args(argv)
        assert args.nnodes == 2 and args.transport_keys and not args.insecure_transport
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == args.transport_keys)
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == "conveyor-transport-keys"
        assert [item["path"] for item in volume["secret"]["items"]] == ["conveyor.key_secret"]
        assert volume["secret"]["defaultMode"] == 0o400 and mount["readOnly"]


def test_every_multi_node_example_of_the_systemd_environment_passes_transport_keys() -> None:
    examples = [line.split("=", 1)[1] for line in (DEPLOY / "systemd" / "conveyor.env").read_text().splitlines()
                if line.lstrip("# ").startswith("CONVEYOR_ARGS=") and "--nnodes" in line]
    assert len(examples) == 2
    for example in examples:
        args = serve_args(shlex.split(example))
        assert args.nnodes == 2 and args.transport_keys == "/etc/conveyor/keys"
