"""The deployment in deploy/, checked offline: no Kubernetes cluster, no network.

Every manifest parses; every core Kubernetes object validates against the
schemas that `kubernetes-validate` bundles, and so does every pod template of
the `TFJob` (a custom resource, whose own structure is checked here). Each
pod's TF_CONFIG is rendered as it would be made there, by the training
operator for the `TFJob`, by deploy/entrypoint.py for the plain manifests,
and must pass what `strategy_for_cluster` (the chief) or `python -m
tf_diffmap.cluster` (a worker or ps) checks before connecting or serving. The
slow test runs the entrypoint and the training script of the image on a
cluster of this machine's processes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from kubernetes_validate import utils as kubernetes_validate

from tf_diffmap.cluster.connect import check_client, resolve_cluster
from tf_diffmap.cluster.local import free_ports
from tf_diffmap.cluster.member import chief_endpoint
from tf_diffmap.cluster.membership import MEMBERSHIP_PORT_OFFSET
from tf_diffmap.cluster.server import check_server

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
# The oldest Kubernetes the manifests are for, and the newest whose schemas the
# pinned kubernetes-validate bundles.
KUBERNETES_VERSIONS = ("1.30", "1.37")
NAMESPACE = "team-a"
# What the training operator (kubeflow.org/v1) names and reads.
OPERATOR_CONTAINER = "tensorflow"
OPERATOR_PORT_NAME = "tfjob-port"
OPERATOR_DEFAULT_PORT = 2222
OPERATOR_JOB_LABEL = "training.kubeflow.org/job-name"
TFJOB_REPLICA_TYPES = {"Chief", "Worker", "PS"}
TFJOB_SPEC_KEYS = {"enableDynamicWorker", "runPolicy", "successPolicy", "tfReplicaSpecs"}
TFJOB_RUN_POLICY_KEYS = {
    "activeDeadlineSeconds",
    "backoffLimit",
    "cleanPodPolicy",
    "managedBy",
    "schedulingPolicy",
    "suspend",
    "ttlSecondsAfterFinished",
}
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


def _load_entrypoint():
    spec = importlib.util.spec_from_file_location("deploy_entrypoint", DEPLOY / "entrypoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


entrypoint = _load_entrypoint()


def manifests(directory: Path) -> list[dict]:
    """The objects of every YAML file under `directory`, in file order."""
    return [
        obj
        for path in sorted(directory.rglob("*.yaml"))
        for obj in yaml.safe_load_all(path.read_text())
        if obj is not None
    ]


KUBEFLOW = manifests(DEPLOY / "kubeflow")
PLAIN = manifests(DEPLOY / "kubernetes")
TFJOB = next(obj for obj in KUBEFLOW if obj["kind"] == "TFJob")
CORE = [obj for obj in KUBEFLOW + PLAIN if obj["kind"] != "TFJob"]


def name_of(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def the(objects: list[dict], kind: str) -> list[dict]:
    return [obj for obj in objects if obj["kind"] == kind]


def selects(selector: dict, labels: dict) -> bool:
    """Whether a label selector (matchLabels only, as the manifests write them) selects."""
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


# -- parsing and schemas ----------------------------------------------------


@pytest.mark.parametrize(
    "path", sorted(DEPLOY.rglob("*.yaml")), ids=lambda p: str(p.relative_to(DEPLOY))
)
def test_every_manifest_parses_into_named_objects(path):
    objects = [obj for obj in yaml.safe_load_all(path.read_text()) if obj is not None]
    assert objects
    for obj in objects:
        assert {"apiVersion", "kind", "metadata"} <= set(obj), obj
        assert DNS_1035_LABEL.match(obj["metadata"]["name"]), obj["metadata"]
        assert "namespace" not in obj["metadata"]  # applied to the namespace kubectl uses


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("obj", CORE, ids=name_of)
def test_core_objects_validate_against_the_kubernetes_schemas(obj, version):
    # strict: a field the schema does not know (a typo) is an error too.
    kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("replica_type", sorted(TFJOB["spec"]["tfReplicaSpecs"]))
def test_tfjob_pod_templates_validate_as_pod_template_specs(replica_type, version):
    template = TFJOB["spec"]["tfReplicaSpecs"][replica_type]["template"]
    pod_template = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": f"tf-diffmap-{replica_type.lower()}"},
        "template": template,
    }
    kubernetes_validate.validate(pod_template, version, strict=True)


def test_the_schemas_are_bundled_and_catch_a_wrong_field():
    """The check is offline and not vacuous: a misspelt field fails it."""
    bundled = set(kubernetes_validate.all_versions())
    assert {f"{version}.0" for version in KUBERNETES_VERSIONS} <= bundled
    service = next(obj for obj in CORE if obj["kind"] == "Service")
    wrong = {**service, "spec": {**service["spec"], "clusterIp": "None"}}
    with pytest.raises(kubernetes_validate.ValidationError, match="clusterIp"):
        kubernetes_validate.validate(wrong, KUBERNETES_VERSIONS[0], strict=True)


def test_tfjob_structure_is_what_the_operator_reads():
    assert TFJOB["apiVersion"] == "kubeflow.org/v1"
    spec = TFJOB["spec"]
    assert set(spec) <= TFJOB_SPEC_KEYS
    assert set(spec["runPolicy"]) <= TFJOB_RUN_POLICY_KEYS
    # Servers never exit on their own: the chief's completion must end them.
    assert spec["runPolicy"]["cleanPodPolicy"] in ("Running", "All")
    replicas = spec["tfReplicaSpecs"]
    assert set(replicas) == TFJOB_REPLICA_TYPES
    assert replicas["Chief"]["replicas"] == 1
    for replica_type, replica in replicas.items():
        assert set(replica) <= {"replicas", "restartPolicy", "template"}, replica_type
        assert isinstance(replica["replicas"], int) and replica["replicas"] >= 1
        # Never fails the job at the first failed pod, a worker's included;
        # ExitCode at an exit status below 128, the chief's 1 after a lost ps.
        assert replica["restartPolicy"] in ("OnFailure", "Always")
        containers = replica["template"]["spec"]["containers"]
        names = [c["name"] for c in containers]
        assert names.count(OPERATOR_CONTAINER) == 1, names
        assert all(c.get("image") for c in containers)
        ports = operator_container(replica)["ports"]
        # The operator's port (in TF_CONFIG) and, on the chief, the endpoint
        # workers join through, which the operator leaves alone.
        expected = [OPERATOR_PORT_NAME] + (["membership"] if replica_type == "Chief" else [])
        assert [p["name"] for p in ports] == expected
    for replica_type, index in operator_tasks(TFJOB):
        # The operator names a Service after each replica: a DNS-1035 label.
        assert DNS_1035_LABEL.match(f"{TFJOB['metadata']['name']}-{replica_type}-{index}")


# -- TF_CONFIG as the training operator sets it -----------------------------


def operator_replica(tfjob: dict, task_type: str) -> dict:
    """The replica spec of a task type as TF_CONFIG names it (`Worker` is `worker`)."""
    replicas = tfjob["spec"]["tfReplicaSpecs"]
    return next(replica for name, replica in replicas.items() if name.lower() == task_type)


def operator_container(replica: dict) -> dict:
    return next(
        c for c in replica["template"]["spec"]["containers"] if c["name"] == OPERATOR_CONTAINER
    )


def operator_port(replica: dict) -> int:
    """The port the operator puts in TF_CONFIG: the container's `tfjob-port`."""
    for port in operator_container(replica).get("ports", []):
        if port.get("name") == OPERATOR_PORT_NAME:
            return port["containerPort"]
    return OPERATOR_DEFAULT_PORT


def operator_tasks(tfjob: dict) -> list[tuple[str, int]]:
    return [
        (replica_type.lower(), index)
        for replica_type, replica in tfjob["spec"]["tfReplicaSpecs"].items()
        for index in range(replica.get("replicas", 1))
    ]


def operator_tf_config(tfjob: dict, task_type: str, index: int, namespace: str) -> str:
    """TF_CONFIG as the training operator (kubeflow.org/v1) sets it in a replica's pod.

    Its convention: the job names the replica types in lower case; each task
    is reached through the headless Service the operator makes for it,
    `<job>-<type>-<index>.<namespace>.svc:<tfjob-port>`; and `environment` is
    `cloud`.
    """
    name = tfjob["metadata"]["name"]
    cluster = {
        replica_type.lower(): [
            f"{name}-{replica_type.lower()}-{i}.{namespace}.svc:{operator_port(replica)}"
            for i in range(replica.get("replicas", 1))
        ]
        for replica_type, replica in tfjob["spec"]["tfReplicaSpecs"].items()
    }
    return json.dumps(
        {"cluster": cluster, "task": {"type": task_type, "index": index}, "environment": "cloud"}
    )


def operator_pod_labels(tfjob: dict, task_type: str, index: int) -> dict:
    """The labels of a replica's pod: its template's and the operator's own."""
    replica = operator_replica(tfjob, task_type)
    return {
        **replica["template"]["metadata"].get("labels", {}),
        "training.kubeflow.org/operator-name": "tfjob-controller",
        OPERATOR_JOB_LABEL: tfjob["metadata"]["name"],
        "training.kubeflow.org/replica-type": task_type,
        "training.kubeflow.org/replica-index": str(index),
    }


def accepted(tf_config: str, monkeypatch) -> dict:
    """Checks TF_CONFIG as its task would, connecting nothing; the cluster it names.

    The chief's as `strategy_for_cluster()` does before it waits for the
    tasks, a worker's or ps' as `python -m tf_diffmap.cluster` does before it
    serves; both read it through TensorFlow's `TFConfigClusterResolver`.
    """
    monkeypatch.setenv("TF_CONFIG", tf_config)
    resolver = resolve_cluster()
    if resolver.task_type == "chief":
        return check_client(resolver)
    check_server(resolver)
    return resolver.cluster_spec().as_dict()


@pytest.mark.parametrize("task", operator_tasks(TFJOB), ids=lambda t: f"{t[0]}-{t[1]}")
def test_the_operators_tf_config_of_each_replica_is_accepted(task, monkeypatch):
    task_type, index = task
    tf_config = operator_tf_config(TFJOB, task_type, index, NAMESPACE)
    cluster = accepted(tf_config, monkeypatch)
    assert {job: len(tasks) for job, tasks in cluster.items()} == {"chief": 1, "worker": 2, "ps": 1}
    replica = operator_replica(TFJOB, task_type)
    args = operator_container(replica).get("args", [])
    env = {v["name"]: v["value"] for v in operator_container(replica).get("env", [])}
    run = entrypoint.command(tf_config, args, env)
    if task_type == "chief":
        assert run == args and run[:2] == ["python", "/opt/tf_diffmap/train.py"]
        # The chief's membership endpoint, where `--join` looks for it.
        assert membership_ports(operator_container(replica)) == [
            operator_port(replica) + MEMBERSHIP_PORT_OFFSET
        ]
        assert int(env["TF_DIFFMAP_MAX_WORKERS"]) >= len(cluster["worker"])
    elif task_type == "worker":
        assert run == [sys.executable, "-m", "tf_diffmap.cluster", "--join"]
        assert (
            env["TF_DIFFMAP_MAX_WORKERS"] == operator_env(TFJOB, "chief")["TF_DIFFMAP_MAX_WORKERS"]
        )
    else:
        assert run == [sys.executable, "-m", "tf_diffmap.cluster"]


def operator_env(tfjob: dict, task_type: str) -> dict:
    container = operator_container(operator_replica(tfjob, task_type))
    return {v["name"]: v["value"] for v in container.get("env", [])}


# -- TF_CONFIG as the plain manifests' entrypoint computes it ---------------


def plain_pods(objects: list[dict], namespace: str) -> list[dict]:
    """Every pod the plain manifests make, as Kubernetes would make it.

    Each with its task type, index, hostname, DNS name (`<hostname>.<subdomain
    or serviceName>.<namespace>.svc`), labels, container and environment:
    its `env` (the downward API's namespace filled in), its ConfigMaps'
    `envFrom`, and an indexed Job's `JOB_COMPLETION_INDEX`.
    """
    config_maps = {c["metadata"]["name"]: c.get("data", {}) for c in the(objects, "ConfigMap")}
    pods = []
    for workload in the(objects, "StatefulSet") + the(objects, "Job"):
        spec = workload["spec"]
        template = spec["template"]
        if workload["kind"] == "StatefulSet":
            count, subdomain = spec["replicas"], spec["serviceName"]
            assert selects(spec["selector"], template["metadata"]["labels"])
        else:
            assert spec["completionMode"] == "Indexed"
            assert spec["completions"] == spec["parallelism"]
            count, subdomain = spec["completions"], template["spec"]["subdomain"]
        (container,) = template["spec"]["containers"]
        for index in range(count):
            hostname = f"{workload['metadata']['name']}-{index}"
            env = {}
            for source in container.get("envFrom", []):
                env.update(config_maps[source["configMapRef"]["name"]])
            for variable in container.get("env", []):
                if "value" in variable:
                    assert "$(" not in variable["value"]
                    env[variable["name"]] = variable["value"]
                else:
                    field = variable["valueFrom"]["fieldRef"]["fieldPath"]
                    assert field == "metadata.namespace", field
                    env[variable["name"]] = namespace
            if workload["kind"] == "Job":
                env["JOB_COMPLETION_INDEX"] = str(index)
            pods.append(
                {
                    "type": env["TF_DIFFMAP_TASK_TYPE"],
                    "index": index,
                    "hostname": hostname,
                    "dns": f"{hostname}.{subdomain}.{namespace}.svc",
                    "subdomain": subdomain,
                    "labels": template["metadata"]["labels"],
                    "container": container,
                    "env": env,
                }
            )
    return pods


PLAIN_PODS = plain_pods(PLAIN, NAMESPACE)


def grpc_port(container: dict) -> int:
    (port,) = [p for p in container["ports"] if p["name"] == "grpc"]
    return port["containerPort"]


def membership_ports(container: dict) -> list[int]:
    """The chief's membership endpoint, where a container declares it."""
    return [p["containerPort"] for p in container.get("ports", []) if p["name"] == "membership"]


@pytest.mark.parametrize("pod", PLAIN_PODS, ids=lambda p: p["hostname"])
def test_each_plain_pods_tf_config_is_accepted_and_names_the_pods_dns_names(pod, monkeypatch):
    tf_config = entrypoint.tf_config_from_pod(pod["env"], pod["hostname"])
    assert json.loads(tf_config)["task"] == {"type": pod["type"], "index": pod["index"]}
    cluster = accepted(tf_config, monkeypatch)
    # Every address is the DNS name Kubernetes gives that task's pod.
    expected = {}
    for other in PLAIN_PODS:
        expected.setdefault(other["type"], []).append(
            f"{other['dns']}:{grpc_port(other['container'])}"
        )
    assert cluster == expected
    run = entrypoint.command(tf_config, pod["container"].get("args", []), pod["env"])
    if pod["type"] == "chief":
        assert run[:2] == ["python", "/opt/tf_diffmap/train.py"]
    elif pod["type"] == "worker":
        # Elastic membership is on in the ConfigMap: workers join and leave.
        assert run == [sys.executable, "-m", "tf_diffmap.cluster", "--join"]
    else:
        assert run == [sys.executable, "-m", "tf_diffmap.cluster"]


def test_the_headless_service_gives_every_plain_pod_its_name():
    (service,) = the(PLAIN, "Service")
    assert service["spec"]["clusterIP"] == "None"
    # The chief waits for the servers itself; their names must resolve before
    # they are ready.
    assert service["spec"]["publishNotReadyAddresses"] is True
    for pod in PLAIN_PODS:
        assert pod["subdomain"] == service["metadata"]["name"]
        assert selects({"matchLabels": service["spec"]["selector"]}, pod["labels"])
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {
        port["name"] for pod in PLAIN_PODS for port in pod["container"]["ports"]
    }


# -- secure defaults --------------------------------------------------------


def job_pods() -> list[tuple[str, dict, list[int]]]:
    """(deployment, pod labels, ports: gRPC and membership) of every pod of both deployments."""
    pods = [
        ("kubernetes", p["labels"], [grpc_port(p["container"]), *membership_ports(p["container"])])
        for p in PLAIN_PODS
    ]
    for task_type, index in operator_tasks(TFJOB):
        replica = operator_replica(TFJOB, task_type)
        ports = [operator_port(replica), *membership_ports(operator_container(replica))]
        pods.append(("kubeflow", operator_pod_labels(TFJOB, task_type, index), ports))
    return pods


@pytest.mark.parametrize("deployment", ["kubeflow", "kubernetes"])
def test_the_grpc_ports_are_reachable_only_from_pods_of_the_same_job(deployment):
    objects = KUBEFLOW if deployment == "kubeflow" else PLAIN
    (policy,) = the(objects, "NetworkPolicy")
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    pods = [(labels, ports) for d, labels, ports in job_pods() if d == deployment]
    # It selects every pod of the job: what it does not allow is denied them.
    assert all(selects(spec["podSelector"], labels) for labels, _ in pods)
    (rule,) = spec["ingress"]
    # From pods of this namespace (no namespaceSelector, no ipBlock) that are
    # of this job, and to the gRPC ports and the chief's membership endpoint only.
    for peer in rule["from"]:
        assert set(peer) == {"podSelector"}, peer
        assert peer["podSelector"] == spec["podSelector"]
    assert {(p["protocol"], p["port"]) for p in rule["ports"]} == {
        ("TCP", port) for _, ports in pods for port in ports
    }
    # The chief declares its membership endpoint where workers look for it.
    assert {port for _, ports in pods for port in ports[1:]} == {2222 + MEMBERSHIP_PORT_OFFSET}
    # The pods of another job, of this image or of another TFJob, are not peers.
    stranger = {
        "app.kubernetes.io/name": "tf-diffmap",
        "app.kubernetes.io/instance": "other",
        OPERATOR_JOB_LABEL: "other",
    }
    assert not any(selects(peer["podSelector"], stranger) for peer in rule["from"])


def pod_templates() -> list[tuple[str, dict]]:
    templates = [(f"TFJob/{t}", r["template"]) for t, r in TFJOB["spec"]["tfReplicaSpecs"].items()]
    templates += [(name_of(w), w["spec"]["template"]) for w in the(PLAIN, "StatefulSet")]
    templates += [(name_of(w), w["spec"]["template"]) for w in the(PLAIN, "Job")]
    return templates


@pytest.mark.parametrize("template", pod_templates(), ids=lambda t: t[0])
def test_pods_run_unprivileged_with_resources_requested(template):
    _, template = template
    spec = template["spec"]
    assert spec["automountServiceAccountToken"] is False
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(host)
    pod_security = spec["securityContext"]
    assert pod_security["runAsNonRoot"] is True and pod_security["runAsUser"] != 0
    assert pod_security["seccompProfile"]["type"] == "RuntimeDefault"
    for container in spec["containers"]:
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False
        assert security["privileged"] is False
        assert security["capabilities"]["drop"] == ["ALL"]
        assert "add" not in security["capabilities"]
        assert security["readOnlyRootFilesystem"] is True
        assert {"cpu", "memory"} <= set(container["resources"]["requests"])
        assert "memory" in container["resources"]["limits"]
        assert all("hostPort" not in p for p in container["ports"])
        # The read-only root leaves /tmp writable, a volume of the pod.
        assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}


# -- the image --------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


def test_the_image_installs_the_source_tree_and_runs_the_entrypoint_as_non_root():
    instructions = dockerfile()
    copied = set()
    for instruction, argument in instructions:
        if instruction == "COPY":
            *sources, destination = argument.split()
            for source in sources:
                assert (ROOT / source).exists(), source
                copied.add(
                    destination + Path(source).name
                    if destination.endswith("/") and len(sources) > 1
                    else destination
                )
    runs = " ".join(argument for instruction, argument in instructions if instruction == "RUN")
    assert 'pip install "/tmp/src[${TF_EXTRA}]"' in runs
    assert ("ARG", "TF_EXTRA=cpu") in instructions
    order = [instruction for instruction, _ in instructions]
    user = dict(instructions)["USER"]
    assert user.split(":")[0] not in ("0", "root")
    assert order.index("USER") < order.index("ENTRYPOINT")
    entry = json.loads(dict(instructions)["ENTRYPOINT"])
    assert entry[:2] == ["tini", "--"] and entry[-1] in copied
    cmd = json.loads(dict(instructions)["CMD"])
    assert cmd[-1] in copied
    # The uid the manifests run as is the image's user.
    for _, template in pod_templates():
        assert str(template["spec"]["securityContext"]["runAsUser"]) == user.split(":")[0]


def test_every_manifest_runs_the_image_the_docs_build():
    images = {c["image"] for _, template in pod_templates() for c in template["spec"]["containers"]}
    assert len(images) == 1
    (image,) = images
    docs = (ROOT / "docs" / "cluster.md").read_text()
    assert f"docker build -f deploy/Dockerfile -t {image} ." in docs


def test_the_docs_show_the_tf_config_a_plain_pod_gets():
    pod = next(p for p in PLAIN_PODS if (p["type"], p["index"]) == ("worker", 1))
    docs = (ROOT / "docs" / "cluster.md").read_text()
    assert entrypoint.tf_config_from_pod(pod["env"], pod["hostname"]) in docs


# -- the entrypoint's own checks ----------------------------------------------

WORKER_ENV = {
    "TF_DIFFMAP_TASK_TYPE": "worker",
    "TF_DIFFMAP_CLUSTER": "chief=1,worker=2,ps=1",
    "TF_DIFFMAP_ADDRESS": "job-{type}-{index}.job.{namespace}.svc:2222",
    "POD_NAMESPACE": "ns",
}


def test_the_index_is_the_job_completion_index_or_the_statefulset_ordinal():
    assert entrypoint.task_index({"JOB_COMPLETION_INDEX": "0"}, "job-chief-0") == 0
    assert entrypoint.task_index({}, "job-worker-12") == 12
    with pytest.raises(entrypoint.TaskError, match="does not end in -<ordinal>"):
        entrypoint.task_index({}, "worker")


@pytest.mark.parametrize(
    "change, hostname, message",
    [
        ({"TF_DIFFMAP_CLUSTER": None}, "job-worker-1", "are TF_DIFFMAP_CLUSTER"),
        ({"TF_DIFFMAP_TASK_TYPE": "evaluator"}, "job-worker-1", "must be one of"),
        ({"TF_DIFFMAP_CLUSTER": "chief=1,worker=0,ps=1"}, "job-worker-1", "at least 1"),
        ({"TF_DIFFMAP_CLUSTER": "chief=1,workers=2,ps=1"}, "job-worker-1", "type=count"),
        ({}, "job-worker-2", "counts 2: scale"),
        ({"TF_DIFFMAP_ADDRESS": "job-{index}.job:2222"}, "job-1", "the same address"),
        ({"TF_DIFFMAP_ADDRESS": "job-{kind}-{index}:2222"}, "job-worker-1", "template"),
        ({}, "renamed-worker-1", "disagree"),
    ],
)
def test_a_pod_environment_that_names_no_task_is_refused(change, hostname, message):
    env = {k: v for k, v in {**WORKER_ENV, **change}.items() if v is not None}
    with pytest.raises(entrypoint.TaskError, match=message):
        entrypoint.tf_config_from_pod(env, hostname)


def test_the_task_type_picks_the_server_or_the_chiefs_command():
    config = entrypoint.tf_config_from_pod(WORKER_ENV, "job-worker-1")
    assert json.loads(config)["cluster"]["worker"][1] == "job-worker-1.job.ns.svc:2222"
    server = [sys.executable, "-m", "tf_diffmap.cluster"]
    assert entrypoint.command(config, ["python", "train.py"], {}) == server
    assert entrypoint.command(config, [], {"TF_DIFFMAP_LOGICAL_CPUS": "4"}) == [
        *server,
        "--logical-cpus",
        "4",
    ]
    with pytest.raises(entrypoint.TaskError, match="LOGICAL_CPUS"):
        entrypoint.command(config, [], {"TF_DIFFMAP_LOGICAL_CPUS": "0"})
    ps = entrypoint.tf_config_from_pod({**WORKER_ENV, "TF_DIFFMAP_TASK_TYPE": "ps"}, "job-ps-0")
    assert entrypoint.command(ps, [], {"TF_DIFFMAP_LOGICAL_CPUS": "4"}) == server
    chief = json.dumps({"cluster": {}, "task": {"type": "chief", "index": 0}})
    assert entrypoint.command(chief, ["python", "train.py"], {}) == ["python", "train.py"]
    with pytest.raises(entrypoint.TaskError, match="none was given"):
        entrypoint.command(chief, [], {})
    evaluator = json.dumps({"cluster": {}, "task": {"type": "evaluator", "index": 0}})
    with pytest.raises(entrypoint.TaskError, match="evaluator"):
        entrypoint.command(evaluator, ["python", "train.py"], {})


def test_an_elastic_cluster_names_workers_beyond_its_count_up_to_its_most(monkeypatch):
    """A StatefulSet scaled up under `TF_DIFFMAP_MAX_WORKERS`: its new pods
    are named in their own TF_CONFIG and join through the chief's endpoint."""
    server = [sys.executable, "-m", "tf_diffmap.cluster"]
    env = {**WORKER_ENV, "TF_DIFFMAP_MAX_WORKERS": "4"}
    for index in (0, 2, 3):
        config = entrypoint.tf_config_from_pod(env, f"job-worker-{index}")
        cluster = json.loads(config)["cluster"]
        assert json.loads(config)["task"] == {"type": "worker", "index": index}
        assert cluster["worker"][index] == f"job-worker-{index}.job.ns.svc:2222"
        assert len(cluster["worker"]) == max(2, index + 1)
        assert accepted(config, monkeypatch) == cluster  # as `--join` checks it
        assert entrypoint.command(config, [], env) == [*server, "--join"]
        # `--join` finds the chief's endpoint at its address, port + 1.
        port = 2222 + MEMBERSHIP_PORT_OFFSET
        assert chief_endpoint(cluster) == f"job-chief-0.job.ns.svc:{port}"
    with pytest.raises(entrypoint.TaskError, match="grow to workers 0 to 3"):
        entrypoint.tf_config_from_pod(env, "job-worker-4")
    with pytest.raises(entrypoint.TaskError, match="set TF_DIFFMAP_MAX_WORKERS so that"):
        entrypoint.tf_config_from_pod(WORKER_ENV, "job-worker-2")
    with pytest.raises(entrypoint.TaskError, match="below the 2 workers"):
        entrypoint.tf_config_from_pod({**env, "TF_DIFFMAP_MAX_WORKERS": "1"}, "job-worker-0")
    with pytest.raises(entrypoint.TaskError, match="MAX_WORKERS must be a whole number"):
        entrypoint.command(config, [], {"TF_DIFFMAP_MAX_WORKERS": "many"})
    # The ps and the chief run as in a fixed cluster (the chief's script
    # reads the variable itself).
    ps = entrypoint.tf_config_from_pod({**env, "TF_DIFFMAP_TASK_TYPE": "ps"}, "job-ps-0")
    assert entrypoint.command(ps, [], env) == server
    with pytest.raises(entrypoint.TaskError, match="counts 1"):
        entrypoint.tf_config_from_pod({**env, "TF_DIFFMAP_TASK_TYPE": "ps"}, "job-ps-1")


# -- the image's processes on this machine ------------------------------------

CHILD_ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")


def start_task(
    tf_config: str, log: Path, args: list[str] | None = None, env: dict | None = None
) -> subprocess.Popen:
    """One task through the image's entrypoint, with TF_CONFIG as the operator
    sets it (and `env` beside it, as a pod's manifest gives)."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, str(DEPLOY / "entrypoint.py"), *(args or [])],
            env=dict(CHILD_ENV, TF_CONFIG=tf_config, **(env or {})),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {seconds:g} s")
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_entrypoint_serves_and_trains_and_a_lost_ps_exits_the_chief(tmp_path):
    """The image's processes, with TF_CONFIG shaped as the operator's.

    The servers and the chief start through the entrypoint; the chief runs the
    image's training script to its end, with exit status 0. A second chief is
    made to lose its ps mid-fit and must exit with status 1 within bounded
    time, which is what lets a pod's restart policy restart it.
    """
    ports = iter(free_ports(4))
    cluster = {
        "chief": [f"127.0.0.1:{next(ports)}"],
        "worker": [f"127.0.0.1:{next(ports)}", f"127.0.0.1:{next(ports)}"],
        "ps": [f"127.0.0.1:{next(ports)}"],
    }

    def tf_config(task_type: str, index: int) -> str:
        return json.dumps(
            {
                "cluster": cluster,
                "task": {"type": task_type, "index": index},
                "environment": "cloud",
            }
        )

    processes = {}
    try:
        for task_type, index in (("worker", 0), ("worker", 1), ("ps", 0)):
            processes[task_type, index] = start_task(
                tf_config(task_type, index), tmp_path / f"{task_type}-{index}.log"
            )
        for (task_type, index), process in processes.items():
            log = tmp_path / f"{task_type}-{index}.log"
            wait_for(lambda log=log: '"serving"' in log.read_text(), 120, f"{task_type} serving")
            assert process.poll() is None

        train = [sys.executable, str(DEPLOY / "train.py"), "--examples=1024", "--epochs=2"]
        chief = start_task(tf_config("chief", 0), tmp_path / "chief.log", train)
        processes["chief", 0] = chief
        assert chief.wait(timeout=180) == 0, (tmp_path / "chief.log").read_text()[-4000:]
        output = (tmp_path / "chief.log").read_text()
        assert "tf_diffmap chief 0: " in output and "Epoch 2/2" in output
        assert "store version" in output  # the statistics, printed at the end

        backup = tmp_path / "backup"
        train = [*train[:-1], "--epochs=1000", f"--backup-dir={backup}"]
        chief = start_task(tf_config("chief", 0), tmp_path / "chief-2.log", train)
        processes["chief", 0] = chief
        # Kill the ps once an epoch is backed up, while the chief trains.
        wait_for(lambda: (backup / "training_metadata.json").exists(), 120, "a backup")
        os.kill(processes["ps", 0].pid, signal.SIGKILL)
        assert chief.wait(timeout=60) == 1
        output = (tmp_path / "chief-2.log").read_text()
        assert "UnavailableError" in output and "/job:ps/replica:0/task:0" in output
    finally:
        for process in processes.values():  # this test's own children, by their handles
            if process.poll() is None:
                process.kill()
                process.wait()


def free_port_pair() -> int:
    """A free port whose next port is free too: the chief's and its membership endpoint's."""
    import socket

    for _ in range(50):
        (port,) = free_ports(1)
        try:
            with socket.create_server(("127.0.0.1", port + MEMBERSHIP_PORT_OFFSET)):
                return port
        except OSError:
            continue
    raise AssertionError("no free pair of ports on 127.0.0.1")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_through_the_entrypoint_a_scaled_up_worker_joins_and_leaves_on_sigterm(tmp_path):
    """The elastic deployment's processes, with TF_CONFIG shaped as the operator's.

    Workers 0 and 1 and the ps start through the entrypoint with
    `TF_DIFFMAP_MAX_WORKERS=3` (so the workers run `--join`), the chief runs
    the image's training script, which reads the same variable. A third
    worker, whose TF_CONFIG names three workers (as after a scale-up), joins
    the running fit through the endpoint the entrypoint derives from the
    chief's address; SIGTERM (a scale-down) makes it leave and exit with
    status 0, and training goes on.
    """
    chief_port = free_port_pair()
    ports = iter(p for p in free_ports(6) if p not in (chief_port, chief_port + 1))
    workers = [f"127.0.0.1:{next(ports)}" for _ in range(3)]
    ps = [f"127.0.0.1:{next(ports)}"]
    cluster = {"chief": [f"127.0.0.1:{chief_port}"], "worker": workers[:2], "ps": ps}
    elastic = {"TF_DIFFMAP_MAX_WORKERS": "3"}

    def tf_config(task_type: str, index: int, workers_named: int = 2) -> str:
        named = {**cluster, "worker": workers[:workers_named]}
        return json.dumps({"cluster": named, "task": {"type": task_type, "index": index}})

    def start(name: str, config: str, args=None) -> subprocess.Popen:
        return start_task(config, tmp_path / f"{name}.log", args, env=elastic)

    def log(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text()

    processes = {}
    try:
        for name, config in (
            ("worker-0", tf_config("worker", 0)),
            ("worker-1", tf_config("worker", 1)),
            ("ps-0", tf_config("ps", 0)),
        ):
            processes[name] = start(name, config)
        # The entrypoint says what it runs before it runs it.
        wait_for(lambda: "--join" in log("worker-0"), 60, "worker 0 running --join")
        train = [sys.executable, str(DEPLOY / "train.py"), "--examples=4096", "--epochs=100000"]
        processes["chief"] = start("chief", tf_config("chief", 0), train)
        wait_for(lambda: "Epoch 1/" in log("chief"), 300, "the chief training")
        processes["worker-2"] = start("worker-2", tf_config("worker", 2, workers_named=3))
        wait_for(lambda: "joined in" in log("chief"), 300, "worker 2 joining")
        assert "/job:worker/replica:0/task:2" in log("chief")
        assert processes["chief"].poll() is None
        processes["worker-2"].send_signal(signal.SIGTERM)
        assert processes["worker-2"].wait(timeout=90) == 0, log("worker-2")[-3000:]
        assert "left after" in log("chief"), log("chief")[-3000:]
        # Training goes on with workers 0 and 1: another epoch ends.
        epochs = log("chief").count("Epoch ")
        wait_for(lambda: log("chief").count("Epoch ") > epochs, 120, "an epoch after the leave")
        assert processes["chief"].poll() is None, log("chief")[-3000:]
    finally:
        for process in processes.values():  # this test's own children, by their handles
            if process.poll() is None:
                process.kill()
                process.wait()
