"""Shipped configuration stays consistent: Kubernetes manifest, shell scripts, model presets."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from mindspeed_tft.control.wire.config import DEFAULT_PORT

REPO = Path(__file__).resolve().parent.parent


def test_kubernetes_manifest_exposes_the_controller_port_to_the_job_only():
    docs = list(yaml.safe_load_all((REPO / "configs/k8s/llama2-7b-indexed-job.yaml").read_text()))
    service, job, policy = docs
    assert {"name": "ttp-port", "port": DEFAULT_PORT} in service["spec"]["ports"]
    pod = job["spec"]["template"]["spec"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert pod["subdomain"] == service["metadata"]["name"]
    (container,) = pod["containers"]
    assert {"containerPort": DEFAULT_PORT, "name": "ttp-port"} in container["ports"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["TTP_PORT"] == str(DEFAULT_PORT)
    assert env["LAUNCHER"].startswith("tft-run")
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == int(env["NNODES"])
    script = container["args"][0]
    for name in ("NODE_RANK", "MASTER_ADDR", "PROCESSOR_ADDR", "CONTROLLER_ADDR", "TTP_ADDR",
                 "TTP_CURVE_SERVER_KEY"):
        assert f"export {name}=" in script
    assert "pretrain_llama2_7b_ptd.sh" in script
    # secrets come from Kubernetes Secrets; worker-only pods get the server's public key only
    assert env["TTP_JOB_TOKEN"]["secretKeyRef"]["name"] == "tft-llama2-job-token"
    assert "export TTP_CURVE_SERVER_KEY=/etc/tft/processor/server.key\n" in script
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert len(secrets) == 2 and all(v["secret"]["defaultMode"] == 0o400
                                     for v in pod["volumes"] if "secret" in v)
    # only the job's own pods reach its ports
    job_pods = {"job-name": job["metadata"]["name"]}
    assert policy["kind"] == "NetworkPolicy"
    assert policy["spec"]["podSelector"]["matchLabels"] == job_pods
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": job_pods}}]}]


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "scripts").glob("*.sh")))
def test_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", str(REPO / "scripts" / script)], check=True)


def test_the_reference_script_carries_the_four_flags():
    text = (REPO / "scripts/pretrain_llama2_7b_ptd.sh").read_text()
    for flag in ("--enable-high-availability", "--enable-hbmfault-repair",
                 "--enable-worker-reboot", "--distributed-optimizer-no-replica"):
        assert flag in text
