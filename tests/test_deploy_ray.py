"""The ``ray up`` cluster files (deploy/ray/), checked offline: no cloud credentials, no nodes, no network.

Every YAML goes through what ``ray up`` does to it before it touches a machine
(``ray.autoscaler._private.commands._bootstrap_config``): Ray's ``prepare_config`` (defaults merged,
the local provider's rewrite), the node provider's resource autofill and ``bootstrap_config`` where
they stay offline (the local provider's; AWS's call the AWS API and are skipped), and Ray's
``validate_config`` (its JSON schema). Then:

- the pool node types exist and offer their custom resources: for node-typed providers in
  ``available_node_types``; for the local provider, which allows no node types, by running each
  worker's ``worker_start_ray_commands`` in bash (``ray``/``hostname`` stubbed) and parsing the
  ``ray start`` it would run with Ray's own CLI parser;
- every ``ray ...`` command in the file's comment block parses with Ray's CLI, and every
  ``pdserve up`` in them parses with pdserve's parser, names resources that pool nodes offer (and
  the head does not), fits the nodes ``ray up`` starts, and uses a model the setup commands create
  on every node (or an absolute path the user provides).

The negative tests at the end mutate a file and check that these checks fail.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pathlib
import re
import shlex
import subprocess
from dataclasses import dataclass

import pytest
import yaml

pytest.importorskip("ray")
from ray.autoscaler._private.providers import _NODE_PROVIDERS, _get_node_provider_cls  # noqa: E402
from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402
from ray.scripts.scripts import cli as ray_cli  # noqa: E402

from pdserve.cli import build_parser, pool_parallel_sizes  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
RAY_DIR = ROOT / "deploy" / "ray"
YAMLS = sorted(RAY_DIR.glob("*.yaml"))
OFFLINE_PROVIDERS = {"local"}  # fillout/bootstrap of the others call their cloud's API
ROLES = ("prefill", "decode")


# --- what `ray up` does to the file ---------------------------------------------------------------

def ray_up_config(raw: dict) -> dict:
    """The config ``ray up`` would launch from (commands._bootstrap_config, minus the cloud calls)."""
    assert raw["provider"]["type"] in _NODE_PROVIDERS, f"unknown provider {raw['provider']['type']}"
    config = prepare_config(copy.deepcopy(raw))
    provider_cls = _get_node_provider_cls(config["provider"])  # imports the provider module (boto3 for AWS)
    if config["provider"]["type"] in OFFLINE_PROVIDERS:
        config = provider_cls.fillout_available_node_types_resources(config)
    validate_config(config)
    if config["provider"]["type"] in OFFLINE_PROVIDERS:
        config = provider_cls.bootstrap_config(config)
    return config


def parse_ray(argv: list[str]):
    """A ``ray SUBCOMMAND ...`` line parsed by Ray's own click CLI (nothing is run)."""
    assert argv[0] == "ray", argv
    command = ray_cli.commands.get(argv[1])
    assert command is not None, f"ray has no subcommand {argv[1]!r}"
    return command.make_context(argv[1], list(argv[2:]))


# --- the nodes and what they offer -----------------------------------------------------------------

@dataclass
class Node:
    name: str  # node type, or worker IP for the local provider
    resources: dict  # custom resources its raylet gets
    count: int  # how many of it `ray up` starts and keeps (min_workers)


def run_start_commands(commands: list[str], head_ip: str, env: dict[str, str] | None = None,
                       host_ips: str = "192.0.2.99") -> list[list[str]]:
    """Run start commands as Ray's updater does (one shell per command, RAY_HEAD_IP exported), with
    ``ray``, ``hostname`` and ``ulimit`` stubbed; returns the argv of every ``ray`` call."""
    log = []
    for command in commands:
        script = (
            "ray() { printf 'RAY'; printf '\\037%s' \"$@\"; printf '\\n'; }\n"
            f'hostname() {{ echo {shlex.quote(host_ips)}; }}\n'
            'ulimit() { :; }\n'
            f'export RAY_HEAD_IP={shlex.quote(head_ip)}; {command}\n')
        proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=10,
                              env={"PATH": os.environ["PATH"], **(env or {})})
        assert proc.returncode == 0, f"{command!r} failed: {proc.stderr}"
        log += [["ray", *line.split("\x1f")[1:]] for line in proc.stdout.splitlines() if line.startswith("RAY\x1f")]
    return log


def started_resources(ray_calls: list[list[str]], head_ip: str | None) -> dict:
    """The custom resources of the one ``ray start`` in ``ray_calls`` (the head's if ``head_ip`` is
    None, else a worker's that must join ``head_ip``), parsed by Ray's own CLI parser."""
    starts = [parse_ray(argv).params for argv in ray_calls if argv[1] == "start"]
    assert len(starts) == 1, f"expected one `ray start`, got {ray_calls}"
    params = starts[0]
    assert params["head"] == (head_ip is None)
    if head_ip is None:
        assert params["autoscaling_config"], "the head's `ray start` needs --autoscaling-config (else no workers)"
    else:
        assert params["address"] == f"{head_ip}:6379", params["address"]
    return json.loads(params["resources"]) if params["resources"] else {}


def nodes(raw: dict, config: dict) -> tuple[Node, list[Node]]:
    """The head and the worker nodes ``ray up`` brings up, with the custom resources each offers."""
    head_ip = raw["provider"].get("head_ip", "10.255.255.1")
    head_res = started_resources(run_start_commands(config["head_start_ray_commands"], head_ip), None)
    if raw["provider"]["type"] == "local":
        # One node type for all workers (prepare_local); all worker_ips join (min = max = len(worker_ips)).
        (node_type,) = config["available_node_types"].values()
        ips = raw["provider"]["worker_ips"]
        assert node_type["min_workers"] == node_type["max_workers"] == len(ips), \
            "the local provider should keep every worker IP in the cluster"
        workers = []
        for ip in ips:
            # Ray's autoscaler v2 sets RAY_CLOUD_INSTANCE_ID to the worker_ips entry; v1 does not, and
            # then `hostname -I` must find it. Both must put the node in the same pool.
            v2 = started_resources(run_start_commands(config["worker_start_ray_commands"], head_ip,
                                                      env={"RAY_CLOUD_INSTANCE_ID": ip}), head_ip)
            v1 = started_resources(run_start_commands(config["worker_start_ray_commands"], head_ip,
                                                      host_ips=f"{ip} 172.17.0.1"), head_ip)
            assert v1 == v2, f"{ip}: {v1} (v1) != {v2} (v2)"
            workers.append(Node(ip, v2, 1))
        return Node("head", head_res, 1), workers
    types = config["available_node_types"]
    head_type = types[config["head_node_type"]]
    head = Node(config["head_node_type"], {**head_type["resources"], **head_res}, 1)
    worker_cmd_res = started_resources(run_start_commands(config["worker_start_ray_commands"], head_ip), head_ip)
    workers = [Node(name, {**t["resources"], **worker_cmd_res}, t["min_workers"])
               for name, t in types.items() if name != config["head_node_type"]]
    return head, workers


# --- the documented commands -----------------------------------------------------------------------

def documented_ray_commands(path: pathlib.Path) -> list[list[str]]:
    """Every ``#   ray ...`` line of the file's comments, split as the shell would."""
    return [shlex.split(m.group(1)) for m in re.finditer(r"^#\s+(ray \S+ .*)$", path.read_text(), re.M)]


def pdserve_up_commands(path: pathlib.Path) -> list[list[str]]:
    """The ``pdserve up`` command lines run by the documented ``ray exec`` commands."""
    ups = []
    for argv in documented_ray_commands(path):
        if argv[1] == "exec":
            cmd = shlex.split(parse_ray(argv).params["cmd"])
            if cmd[:2] == ["pdserve", "up"]:
                ups.append(cmd)
    return ups


def check_pdserve_up(argv: list[str], config: dict, head: Node, workers: list[Node]) -> None:
    """One documented ``pdserve up --ray``: real flags, pinned to resources pool nodes offer, fits."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv[1:])
    assert args.command == "up" and args.ray and args.address == "auto", argv
    if extra:  # `pdserve up` hands unknown flags to every worker: they must be real worker flags
        _, unknown = parser.parse_known_args(["decode", "--model", "m", "--router", "tcp://h:1", *extra])
        assert not unknown, f"flags neither `pdserve up` nor a worker knows: {unknown}"
    sizes = pool_parallel_sizes(args)
    counts = {"prefill": 1 if args.num_prefill is None else args.num_prefill, "decode": args.num_decode}
    pool_nodes = {}
    for role in ROLES:
        flag = getattr(args, f"{role}_resources")
        assert flag, f"--{role}-resources missing: the {role} pool would land on any node"
        wanted = json.loads(flag)
        assert wanted, f"--{role}-resources is empty"
        for resource, amount in wanted.items():
            offering = [n for n in workers if n.resources.get(resource, 0) > 0]
            assert offering, f"no node offers {resource!r} (--{role}-resources); offered: " \
                             f"{[n.resources for n in workers]}"
            assert resource not in head.resources, f"the head offers the pool resource {resource!r}"
            # Ray places a worker's tp*pp ranks (one bundle each) on the nodes `ray up` started:
            # one node for STRICT_PACK (pp == 1), any nodes for PACK.
            tp, pp = sizes[f"{role}_tensor_parallel_size"], sizes[f"{role}_pipeline_parallel_size"]
            if pp == 1:
                fit = sum(n.count * math.floor(n.resources[resource] / (amount * tp)) for n in offering)
            else:
                fit = math.floor(sum(n.count * n.resources[resource] for n in offering) / (amount * tp * pp))
            assert fit >= counts[role], (f"{counts[role]} {role} workers (tp={tp}, pp={pp}) need more "
                                         f"{resource!r} than the nodes `ray up` starts offer ({fit} fit)")
        pool_nodes[role] = {n.name for n in workers if any(n.resources.get(r, 0) > 0 for r in wanted)}
    assert not pool_nodes["prefill"] & pool_nodes["decode"], f"nodes in both pools: {pool_nodes}"
    # The model must exist at the same path on every node: one the setup commands write, or the user's.
    written = ("pdserve default-model ", "pdserve tiny-model ")
    on_head = {shlex.split(c)[2] for c in config["head_setup_commands"] if c.startswith(written)}
    everywhere = on_head & {shlex.split(c)[2] for c in config["worker_setup_commands"] if c.startswith(written)}
    assert args.model is not None, "no --model: the head would name its own install's default model, a path workers may lack"
    assert args.model in everywhere or os.path.isabs(args.model), \
        f"--model {args.model} is neither written on every node by setup_commands nor an absolute path"


# --- the tests -------------------------------------------------------------------------------------

@pytest.fixture(params=YAMLS, ids=[p.name for p in YAMLS])
def cluster_file(request, monkeypatch):
    monkeypatch.chdir(ROOT)  # `ray up` is documented to run from the repository root (file_mounts)
    return request.param


def test_there_are_cluster_files():
    assert {p.name for p in YAMLS} >= {"cluster-local.yaml", "cluster-aws.yaml"}


def check_cluster(path: pathlib.Path, raw: dict) -> None:
    config = ray_up_config(raw)
    head, workers = nodes(raw, config)
    rel = str(path.relative_to(ROOT))
    ray_lines = documented_ray_commands(path)
    for argv in ray_lines:
        ctx = parse_ray(argv)
        if "cluster_config_file" in ctx.params:
            assert ctx.params["cluster_config_file"] == rel, f"{argv} names another file than {rel}"
    assert {a[1] for a in ray_lines} >= {"up", "exec", "attach", "down"}, "document up, exec, attach, down"
    ups = pdserve_up_commands(path)
    assert ups, "no `ray exec ... 'pdserve up ...'` in the comments"
    for argv in ups:
        check_pdserve_up(argv, config, head, workers)
    # file_mounts: local paths exist (relative to the repository root) and pdserve is installed from
    # what they copy; Ray on the nodes is pinned.
    for remote, local in config["file_mounts"].items():
        if remote in ("~/ray_bootstrap_config.yaml", "~/ray_bootstrap_key.pem"):
            continue
        assert (ROOT / local).is_dir(), f"file_mounts {remote}: {local} is not a directory of this checkout"
    installs = [c for c in config["setup_commands"] if c.startswith("pip install") and "pdserve[ray]" in c]
    assert installs, "no `pip install ...pdserve[ray]...` in setup_commands"
    for command in installs:
        for source in re.findall(r'"\$HOME/([^"\[]+)\[ray\]"', command):
            assert f"~/{source}" in config["file_mounts"], f"{source} is installed but not mounted"
        assert re.search(r'"ray\[default\]==[\d.]+"', command), "pin Ray on the nodes (same as `ray up`'s)"
    for command in config["setup_commands"]:
        if command.startswith("pdserve "):
            args, extra = build_parser().parse_known_args(shlex.split(command)[1:])
            assert not extra, command


def test_cluster_file(cluster_file):
    check_cluster(cluster_file, yaml.safe_load(cluster_file.read_text()))


def test_pools_are_distinct_node_sets(cluster_file):
    raw = yaml.safe_load(cluster_file.read_text())
    head, workers = nodes(raw, ray_up_config(raw))
    prefill = {n.name for n in workers if n.resources.get("prefill_node")}
    decode = {n.name for n in workers if n.resources.get("decode_node")}
    assert prefill and decode and not prefill & decode, (prefill, decode)
    assert not {"prefill_node", "decode_node"} & set(head.resources)


def test_same_ray_pin_everywhere():
    pins = {p.name: set(re.findall(r"ray\[default\]==([\d.]+)", p.read_text())) for p in YAMLS}
    assert len(set().union(*pins.values())) == 1, pins


# --- the checks can fail ---------------------------------------------------------------------------

def _local_ip_in_no_pool(raw):  # a worker IP in neither pool list: its `ray start` must not happen
    raw["provider"]["worker_ips"].append("10.0.0.99")
    raw["min_workers"] = raw["max_workers"] = 5


def _aws_wrong_resource_name(raw):  # the pool node type advertises another resource than pdserve asks for
    raw["available_node_types"]["prefill"]["resources"] = {"prefill_nodes": 1}


def _aws_misspelled_node_type_key(raw):
    raw["available_node_types"]["decode"]["resource"] = raw["available_node_types"]["decode"].pop("resources")


def _misspelled_top_level_key(raw):
    raw["worker_start_ray_command"] = raw.pop("worker_start_ray_commands")


def _aws_too_few_nodes(raw):
    raw["available_node_types"]["decode"]["min_workers"] = 1


def _local_too_few_nodes(raw):
    raw["provider"]["worker_ips"] = raw["provider"]["worker_ips"][:3]  # one decode IP left


def _local_node_types(raw):
    raw["available_node_types"] = {"decode": {"resources": {"decode_node": 1}, "node_config": {}}}



MUTATIONS = [
    ("cluster-local.yaml", _local_ip_in_no_pool, "neither PREFILL_IPS nor DECODE_IPS"),
    ("cluster-local.yaml", _misspelled_top_level_key, "'worker_start_ray_command' was unexpected"),
    ("cluster-local.yaml", _local_too_few_nodes, "need more 'decode_node'"),
    ("cluster-local.yaml", _local_node_types, "available_node_types is not supported"),
    ("cluster-aws.yaml", _aws_wrong_resource_name, "no node offers 'prefill_node'"),
    ("cluster-aws.yaml", _aws_misspelled_node_type_key, "'resources' is a required property"),
    ("cluster-aws.yaml", _misspelled_top_level_key, "'worker_start_ray_command' was unexpected"),
    ("cluster-aws.yaml", _aws_too_few_nodes, "need more 'decode_node'"),
]


@pytest.mark.parametrize("name,mutate,match", MUTATIONS,
                         ids=[f"{n.split('.')[0]}-{m.__name__.strip('_')}" for n, m, _ in MUTATIONS])
def test_broken_file_fails(name, mutate, match, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = RAY_DIR / name
    raw = yaml.safe_load(path.read_text())
    mutate(raw)
    with pytest.raises(Exception, match=match):  # jsonschema's ValidationError, click's abort, AssertionError
        check_cluster(path, raw)


@pytest.mark.parametrize("flag,match", [("--num-decode-workers 2", "neither `pdserve up` nor a worker knows"),
                                        ("--decode-resources '{\"decode_nodes\": 1}'", "no node offers"),
                                        ("--model ./relative", "neither written on every node")])
def test_broken_pdserve_command_fails(flag, match, monkeypatch):
    """A documented `pdserve up` with a flag pdserve lacks, a resource no node offers, or a model
    path that exists on no node fails the check."""
    monkeypatch.chdir(ROOT)
    path = RAY_DIR / "cluster-aws.yaml"
    raw = yaml.safe_load(path.read_text())
    config = ray_up_config(raw)
    head, workers = nodes(raw, config)
    broken = [*pdserve_up_commands(path)[0], *shlex.split(flag)]
    with pytest.raises(AssertionError, match=match):
        check_pdserve_up(broken, config, head, workers)
