#!/usr/bin/env bash
# Checks the shipped Kubernetes manifests (deploy/kubernetes/*.yaml, or the
# directory or file given as the only argument):
#   1. every document validates against the Kubernetes API schemas with
#      kubernetes-validate (PyPI, installed into a virtualenv of its own when
#      missing) in strict mode, so unknown fields and unknown kinds fail;
#   2. the rules a schema cannot express: terminationGracePeriodSeconds covers
#      preStop sleep + --lb-notice-secs + --drain-timeout-secs + 5 s margin;
#      the startup/liveness/readiness probes hit /livez, /livez, /readyz on the
#      container's port, which is the port of --listen; the Deployment, Service
#      and PodDisruptionBudget selectors all match the pod labels; a
#      NetworkPolicy selects the pods, restricts ingress and egress, and opens
#      keel's port alone.
set -euo pipefail

VERSION=1.37.0
# Kubernetes versions to validate against (schemas shipped by kubernetes-validate
# ${VERSION}): the oldest we support and the newest it knows.
K8S_VERSIONS=(1.30.0 1.37.0)

VENV="${KEEL_TOOLS_DIR:-${HOME}/.cache/keel}/kubernetes-validate-${VERSION}"
if [ ! -x "${VENV}/bin/kubernetes-validate" ]; then
  echo "==> installing kubernetes-validate ${VERSION} (pip, into ${VENV})" >&2
  python3 -m venv "${VENV}"
  "${VENV}/bin/pip" install --quiet --disable-pip-version-check "kubernetes-validate==${VERSION}" >&2
fi

TARGET="${1:-$(dirname "$0")/../deploy/kubernetes}"
if [ -d "${TARGET}" ]; then
  shopt -s nullglob
  FILES=("${TARGET}"/*.yaml "${TARGET}"/*.yml)
  shopt -u nullglob
else
  FILES=("${TARGET}")
fi
if [ "${#FILES[@]}" -eq 0 ]; then
  echo "kubernetes.sh: FAIL: no *.yaml files in ${TARGET}" >&2
  exit 1
fi

# 1. Schemas. kubernetes-validate only warns (exit 0) on a kind/apiVersion it
# has no schema for, so any WARN line fails too.
K_ARGS=()
for v in "${K8S_VERSIONS[@]}"; do K_ARGS+=(-k "${v}"); done
set +e
OUT="$("${VENV}/bin/kubernetes-validate" --strict --quiet "${K_ARGS[@]}" "${FILES[@]}" 2>&1)"
RC=$?
set -e
if [ "${RC}" -ne 0 ] || [ -n "${OUT}" ]; then
  printf '%s\n' "${OUT}" >&2
  echo "kubernetes.sh: FAIL: schema validation (kubernetes-validate ${VERSION} --strict, Kubernetes ${K8S_VERSIONS[*]})" >&2
  exit 1
fi

# 2. Shutdown timing, probes, selectors.
exec "${VENV}/bin/python" - "${VERSION}" "${K8S_VERSIONS[*]}" "${FILES[@]}" <<'PY'
import shlex
import sys

import yaml

MARGIN = 5
tool_version, k8s_versions, files = sys.argv[1], sys.argv[2], sys.argv[3:]
errors = []


def fail(msg):
    errors.append(msg)


docs = []
for f in files:
    with open(f) as fh:
        docs += [(f, d) for d in yaml.safe_load_all(fh) if d]

deployments = [(f, d) for f, d in docs if d.get("kind") == "Deployment"]
services = [(f, d) for f, d in docs if d.get("kind") == "Service"]
pdbs = [(f, d) for f, d in docs if d.get("kind") == "PodDisruptionBudget"]
policies = [(f, d) for f, d in docs if d.get("kind") == "NetworkPolicy"]
if len(deployments) != 1:
    sys.exit(f"kubernetes.sh: FAIL: expected exactly one Deployment, found {len(deployments)}")
if not services:
    fail("no Service")
if not pdbs:
    fail("no PodDisruptionBudget")
if not policies:
    fail("no NetworkPolicy")

_, dep = deployments[0]
pod = dep["spec"]["template"]
pod_labels = pod.get("metadata", {}).get("labels", {}) or {}
spec = pod["spec"]
containers = [c for c in spec.get("containers", []) if c.get("name") == "keel"]
if len(containers) != 1:
    sys.exit("kubernetes.sh: FAIL: the Deployment needs exactly one container named 'keel'")
c = containers[0]


def arg_value(args, flag):
    """Value of --flag V or --flag=V in a container's args (the last one wins)."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a[len(flag) + 1:]
    return value


def int_arg(args, flag):
    v = arg_value(args, flag)
    if v is None:
        fail(f"container args lack an explicit {flag}")
        return 0
    try:
        return int(v)
    except ValueError:
        fail(f"{flag} {v!r} is not a whole number of seconds")
        return 0


args = [str(a) for a in (c.get("command", []) + c.get("args", []))]
drain = int_arg(args, "--drain-timeout-secs")
notice = int_arg(args, "--lb-notice-secs")


def prestop_seconds(container):
    pre = (container.get("lifecycle") or {}).get("preStop")
    if not pre:
        return 0
    if "sleep" in pre:
        return int(pre["sleep"]["seconds"])
    if "exec" in pre:
        cmd = [str(x) for x in pre["exec"].get("command", [])]
        if len(cmd) >= 3 and cmd[0].endswith("sh") and cmd[1] == "-c":
            cmd = shlex.split(cmd[2])
        if len(cmd) == 2 and cmd[0].split("/")[-1] == "sleep":
            try:
                return int(cmd[1])
            except ValueError:
                pass
        fail(f"cannot read a sleep time from preStop exec {pre['exec'].get('command')!r}")
        return 0
    return 0  # an httpGet/tcpSocket hook: no fixed sleep to count


prestop = prestop_seconds(c)
grace = int(spec.get("terminationGracePeriodSeconds", 30))  # 30 is Kubernetes' default
needed = prestop + notice + drain + MARGIN
if grace < needed:
    fail(f"terminationGracePeriodSeconds {grace} < preStop {prestop} + lb notice {notice}"
         f" + drain {drain} + margin {MARGIN} = {needed}: the kubelet would SIGKILL mid-drain")

# Ports: --listen must bind all interfaces on the container port.
ports = c.get("ports", [])
port_numbers = {p["containerPort"] for p in ports}
port_names = {p["name"]: p["containerPort"] for p in ports if "name" in p}
listen = arg_value(args, "--listen")
if listen is None:
    fail("container args lack --listen (the default 127.0.0.1:8080 is unreachable from outside the pod)")
else:
    host, _, lport = listen.rpartition(":")
    if host in ("127.0.0.1", "localhost", "[::1]"):
        fail(f"--listen {listen} is loopback: unreachable from outside the pod")
    if not lport.isdigit() or int(lport) not in port_numbers:
        fail(f"--listen {listen} does not use a declared containerPort {sorted(port_numbers)}")


def resolve(port):
    return port_names.get(port) if isinstance(port, str) else port


listen_port = int(listen.rpartition(":")[2]) if listen and listen.rpartition(":")[2].isdigit() else None
for probe, path in (("startupProbe", "/livez"), ("livenessProbe", "/livez"), ("readinessProbe", "/readyz")):
    p = c.get(probe)
    if not p:
        fail(f"container has no {probe}")
        continue
    get = p.get("httpGet")
    if not get:
        fail(f"{probe} is not an httpGet probe")
        continue
    if get.get("path") != path:
        fail(f"{probe} path is {get.get('path')!r}, expected {path!r}")
    port = resolve(get.get("port"))
    if port not in port_numbers or (listen_port is not None and port != listen_port):
        fail(f"{probe} port {get.get('port')!r} is not the container port keel listens on ({listen_port})")


def selects(selector, labels, simple=False):
    """Whether a label selector (matchLabels/matchExpressions, or a Service's map) matches labels."""
    if simple:
        return bool(selector) and all(labels.get(k) == v for k, v in selector.items())
    if not selector or not (selector.get("matchLabels") or selector.get("matchExpressions")):
        return False
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels,
              "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


if not selects(dep["spec"].get("selector"), pod_labels):
    fail("the Deployment's selector does not match its own pod template labels")
for _, pdb in pdbs:
    if not selects(pdb["spec"].get("selector"), pod_labels):
        fail(f"PodDisruptionBudget {pdb['metadata']['name']} selector does not match the Deployment's pod labels {pod_labels}")
for _, svc in services:
    if not selects(svc["spec"].get("selector"), pod_labels, simple=True):
        fail(f"Service {svc['metadata']['name']} selector does not match the Deployment's pod labels {pod_labels}")
    for sp in svc["spec"].get("ports", []):
        if resolve(sp.get("targetPort", sp.get("port"))) != listen_port:
            fail(f"Service {svc['metadata']['name']} targetPort {sp.get('targetPort')!r} is not keel's port ({listen_port})")

for _, policy in policies:
    name = policy["metadata"]["name"]
    if not selects(policy["spec"].get("podSelector"), pod_labels):
        fail(f"NetworkPolicy {name} does not select the Deployment's pods {pod_labels}")
    if set(policy["spec"].get("policyTypes", [])) != {"Ingress", "Egress"}:
        fail(f"NetworkPolicy {name} must restrict both Ingress and Egress")
    opened = {resolve(p.get("port")) for rule in policy["spec"].get("ingress", [])
              for p in rule.get("ports", [])}
    if opened != {listen_port}:
        fail(f"NetworkPolicy {name} must open keel's port ({listen_port}) and only it, not {opened}")

if errors:
    for e in errors:
        print(f"kubernetes.sh: FAIL: {e}", file=sys.stderr)
    sys.exit(1)

print(f"kubernetes.sh: OK: {len(docs)} documents valid (kubernetes-validate {tool_version} --strict,"
      f" Kubernetes {k8s_versions}); grace {grace}s >= preStop {prestop} + lb notice {notice}"
      f" + drain {drain} + margin {MARGIN} = {needed}s; probes /livez,/livez,/readyz on :{listen_port};"
      f" Service, PDB and NetworkPolicy select the pods; the policy opens only :{listen_port}")
PY
