"""Reads deploy/compose/compose.yaml and the files it names, and checks what production needs:
the five services, a Redis that keeps its data and never evicts, ports on the host's loopback
only, and every file it mounts present. Prints what is wrong and exits 1, or prints "ok"."""

import os
import sys

import yaml

root = sys.argv[1]
compose_dir = os.path.join(root, "deploy", "compose")
wrong = []

with open(os.path.join(compose_dir, "compose.yaml")) as f:
    compose = yaml.safe_load(f)

services = compose.get("services", {})
for name in ["gateway", "redis", "postgres", "prometheus", "grafana"]:
    if name not in services:
        wrong.append(f"no service {name}")

redis = " ".join(services.get("redis", {}).get("command", []))
for flag in ["--appendonly yes", "--maxmemory-policy noeviction"]:
    if flag not in redis:
        wrong.append(f"redis runs without {flag}")

for name, s in services.items():
    for port in s.get("ports", []):
        if not str(port).startswith("127.0.0.1:"):
            wrong.append(f"{name} publishes {port} beyond the host's loopback")
    for volume in s.get("volumes", []):
        source = volume.split(":")[0]
        if source.startswith("."):
            path = os.path.normpath(os.path.join(compose_dir, source))
            if not os.path.exists(path):
                wrong.append(f"{name} mounts {source}, which is not there")

gateway = services.get("gateway", {})
if not any("gateway.toml" in v for v in gateway.get("volumes", [])):
    wrong.append("the gateway's configuration is not mounted")
dockerfile = os.path.join(root, gateway.get("build", {}).get("dockerfile", "?"))
if not os.path.exists(dockerfile):
    wrong.append(f"the gateway's Dockerfile {dockerfile} is not there")

with open(os.path.join(compose_dir, "prometheus.yml")) as f:
    prometheus = yaml.safe_load(f)
targets = [t for c in prometheus["scrape_configs"] for s in c["static_configs"] for t in s["targets"]]
if "gateway:9090" not in targets:
    wrong.append("prometheus does not scrape the gateway's metrics listener")
if not prometheus.get("rule_files"):
    wrong.append("prometheus loads no alert rules")
for provisioning in ["datasources/prometheus.yaml", "dashboards/tollgate.yaml"]:
    with open(os.path.join(compose_dir, "grafana", provisioning)) as f:
        yaml.safe_load(f)

if wrong:
    print("\n".join(wrong))
    sys.exit(1)
print("ok")
