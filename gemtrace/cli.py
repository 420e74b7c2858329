"""The `gemtrace` command: agent, run, check-config, status, top.

Owns argument parsing and turning errors into one clear line and an exit status; the work is done
by the modules it calls. Exit statuses: 0 success, 1 a failure the message explains, 2 bad usage
(argparse's convention), EXIT_NO_GPU_DRIVER when the agent finds no usable NVIDIA driver, and for
`run` the command's own status. The Debian package's man page is generated from `help_parsers()`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gemtrace import __version__, defaults
from gemtrace.run.placement import DEFAULT_PACKING, DEFAULT_POLICY, PACKINGS, POLICIES

# sysexits.h's EX_CONFIG: the host lacks what the agent needs (the NVIDIA driver), so restarting
# cannot help; the unit names it in RestartPreventExitStatus= (packaging/deb/gemtrace.service).
EXIT_NO_GPU_DRIVER = 78

EPILOG = """examples:
  gemtrace agent --config /etc/gemtrace/resource.conf
  gemtrace run --group train -- python train.py
  gemtrace check-config
  gemtrace status
  gemtrace top
"""


def _state_dir_default() -> Path:
    """GEMTRACE_STATE_DIR when set (the gate reads the same variable), else the packaged default."""
    return Path(os.environ.get(defaults.ENV_STATE_DIR) or defaults.STATE_DIR)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < 10**6:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds between 0 and 1000000")
    return value


def _host_managed_size(text: str) -> int:
    from gemtrace.agent.agent import host_memory
    from gemtrace.config import format_size, parse_size

    try:
        value = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value > host_memory():
        raise argparse.ArgumentTypeError(f"{text!r} is more than this host's memory ({format_size(host_memory())}): "
                                         "managed memory the host cannot back can hang the GPU; give less")
    return value


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GPUs (1 or more)")
    return int(text)


def _fail(message: str, status: int = 1) -> int:
    print(f"gemtrace: {message}", file=sys.stderr)
    return status


def cmd_agent(args: argparse.Namespace) -> int:
    from gemtrace import eventlog
    from gemtrace.agent import web_config
    from gemtrace.agent.agent import Agent, agent_signals
    from gemtrace.agent.exporter import Exporter, ListenError, listen_target, parse_group, parse_mode
    from gemtrace.agent.state_dir import StateDirError, storage_error
    from gemtrace.config import ConfigError
    from gemtrace.gpus import GpuDiscoveryError
    from gemtrace.region import RegionError

    eventlog.configure(args.log_level)
    # Who may read /metrics is checked before anything else starts: a mistake there stops the agent
    # with one line, not after it has taken the GPUs over.
    try:
        socket_mode = None if args.listen_mode is None else parse_mode(args.listen_mode)
        socket_gid = None if args.listen_group is None else parse_group(args.listen_group)
        listen_target(args.listen, socket_mode, socket_gid)
        web = None if args.web_config is None else web_config.load(args.web_config)
    except (ListenError, web_config.WebConfigError) as e:
        return _fail(str(e))
    try:
        agent = Agent(args.config, args.state_dir, use_ebpf=not args.no_ebpf, probe_mode=args.probe_mode,
                      config_poll_seconds=args.config_poll, pod_names=args.pod_names,
                      managed_host_limit=args.managed_host_limit, mps_control=args.mps_control,
                      unattached=args.unattached)
    except GpuDiscoveryError as e:
        return _fail(f"{e} The agent cannot run without it: install the NVIDIA driver (`nvidia-smi` lists the "
                     "GPUs once it works), then `systemctl restart gemtrace`. The service does not restart the "
                     f"agent by itself for this (exit status {EXIT_NO_GPU_DRIVER}).", EXIT_NO_GPU_DRIVER)
    except (ConfigError, RegionError, StateDirError) as e:
        return _fail(str(e))
    except PermissionError as e:
        return _fail(f"{e.filename}: permission denied; the agent runs as root (or with the unit's capabilities)")
    except OSError as e:  # any other write in the state dir (the MPS pipes' directories) on a full or read-only one
        found = storage_error(Path(e.filename or args.state_dir), e)
        if found is None:
            raise
        return _fail(str(found))
    try:
        exporter = Exporter(agent.metrics_registry(), args.listen, web, socket_mode, socket_gid)
    except (ListenError, OSError) as e:
        agent.close()
        return _fail(f"cannot serve /metrics on {args.listen}: {e}")
    signals = agent_signals()
    exporter.start()
    agent.start()
    try:
        agent.run_until_stopped(signals)
    finally:
        exporter.stop()
        agent.close()
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from gemtrace.run.launcher import LaunchError, run

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        run(args.group, command, args.config, args.state_dir, args.require_agent, args.gpus, args.policy,
            args.release_cache)
    except LaunchError as e:
        return _fail(str(e), e.status)
    return 0  # not reached: run() execs


def cmd_check_config(args: argparse.Namespace) -> int:
    from gemtrace.config import ConfigError, format_size, load, unknown_gpus
    from gemtrace.gpus import GpuDiscoveryError, discover

    try:
        config = load(args.file)
    except ConfigError as e:
        return _fail(str(e))
    print(f"{args.file}: OK, {len(config.groups)} groups")
    for refusal in config.refused:  # the agent leaves these out too, and keeps the rest
        print(f"gemtrace: warning: drop-in left out: {refusal.reason}", file=sys.stderr)
    groups = sorted(config.groups.values(), key=lambda g: g.name)
    gpus = {g.name: ";".join(g.gpus) or "all" for g in groups}
    width = max(len("Gpus"), *(len(text) for text in gpus.values()))
    print(f"{'group':<20} {'MinUtil':>8} {'MaxUtil':>8} {'Priority':>8} {'MemoryLimit':>26} "
          f"{'Oversubscribe':>26} {'Isolation':>9} {'Opportunistic':>13}  {'Gpus':<{width}}  Cgroup")
    for g in groups:
        limit = "whole GPU" if g.memory_limit is None else f"{format_size(g.memory_limit)} ({g.memory_limit} B)"
        over = ("no" if not g.oversubscribe else "up to the host's bound" if g.oversubscribe_limit is None
                else f"{format_size(g.oversubscribe_limit)} ({g.oversubscribe_limit} B)")
        print(f"{g.name:<20} {g.min_util:>8g} {g.max_util:>8g} {g.priority:>8} {limit:>26} {over:>26} "
              f"{g.isolation:>9} {'yes' if g.opportunistic else 'no':>13}  {gpus[g.name]:<{width}}  "
              f"{'; '.join(g.cgroups) or '-'}")
    if any(g.gpus for g in groups):  # (asking NVML costs a driver's start-up: only when there is a UUID to check)
        try:
            host = [gpu.uuid for gpu in discover()]
        except GpuDiscoveryError as e:
            print(f"gemtrace: note: the Gpus UUIDs were not checked against this host's GPUs: {e}", file=sys.stderr)
            return 0
        for warning in unknown_gpus(config, host):
            print(f"gemtrace: warning: {args.file}: {warning}", file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from gemtrace import status

    return status.main(args.listen, args.json)


def cmd_kube_plugin(args: argparse.Namespace) -> int:
    import signal
    import threading

    from gemtrace import eventlog
    from gemtrace.config import dropin_dir
    from gemtrace.gpus import GpuDiscoveryError, discover

    try:
        from gemtrace.kube.deviceplugin import EVENT_REASON, DevicePlugin
        from gemtrace.kube.grants import Grants
        from gemtrace.kube.injection import Injection
        from gemtrace.kube.rooms import ANNOTATION_GPU_ROOM
    except ImportError as e:
        return _fail(f"{e}: the Kubernetes commands need grpcio and protobuf (pip install 'gemtrace[kube]', or "
                     "apt-get install python3-grpcio python3-protobuf)")
    eventlog.configure(args.log_level)
    try:
        found = discover()
    except GpuDiscoveryError as e:
        return _fail(f"{e} The device plugin advertises this node's GPUs: install the NVIDIA driver first.")
    gpus = [(g.uuid, g.memory_total) for g in found]
    injection = Injection(gate=args.gate, state_dir=args.state_dir, preload_file=args.preload_file)
    try:
        injection.write_preload_file()
    except OSError as e:
        return _fail(f"cannot write the preload list {args.preload_file}: {e.strerror}")
    from gemtrace.kube.apiserver import ApiError, Apiserver
    from gemtrace.signals import SignalInbox

    pods = tell = publish_room = None
    if args.node_name:
        try:
            api = Apiserver.from_kubeconfig(args.kubeconfig) if args.kubeconfig else Apiserver.in_cluster()
        except ApiError as e:
            return _fail(str(e))
        node = args.node_name
        pods = lambda: api.pods_of_node(node)  # noqa: E731
        tell = lambda namespace, pod, uid, message: api.pod_event(  # noqa: E731
            namespace, pod, uid, EVENT_REASON, message, node)
        publish_room = lambda text: api.annotate_node(node, ANNOTATION_GPU_ROOM, text)  # noqa: E731
    plugin = DevicePlugin(gpus, args.state_dir, Grants(dropin_dir(args.config)), injection,
                          device_plugins=args.device_plugins, pod_resources=args.pod_resources,
                          gpus_present=lambda: {g.uuid for g in discover()}, pods=pods, names_file=args.pod_names,
                          tell=tell, names={g.uuid: g.name for g in found},
                          packing=PACKINGS[args.placement](), config=args.config, publish_room=publish_room)
    # The plugin runs in a thread; the main thread only takes the signals (gemtrace.signals says why).
    signals = SignalInbox((signal.SIGTERM, signal.SIGINT))
    worker = threading.Thread(target=plugin.run, name="gemtrace-plugin", daemon=True)
    worker.start()
    try:
        while worker.is_alive() and not signals.wait(1.0):
            pass
    finally:
        plugin.close()
        worker.join(timeout=10)
    return 0


def cmd_kube_webhook(args: argparse.Namespace) -> int:
    from gemtrace import eventlog
    from gemtrace.kube.injection import Injection
    from gemtrace.kube.webhook import resource_groups, serve

    eventlog.configure(args.log_level)
    injection = Injection(gate=args.gate, state_dir=args.state_dir, preload_file=args.preload_file)
    keeper = None
    if args.tls_secret:
        from gemtrace.kube.apiserver import ApiError, Apiserver
        from gemtrace.kube.servingcert import MUTATING, VALIDATING, Keeper

        secret, service = args.tls_secret.split("/"), args.service.split("/")
        if len(secret) != 2 or len(service) != 2 or not all(secret + service):
            return _fail("--tls-secret and --service take NAMESPACE/NAME, e.g. gemtrace-system/gemtrace-webhook-tls")
        try:
            api = Apiserver.from_kubeconfig(args.kubeconfig) if args.kubeconfig else Apiserver.in_cluster()
        except ApiError as e:
            return _fail(str(e))
        configurations = tuple((resource, name) for resource, name in (
            (MUTATING, args.webhook_configuration), (VALIDATING, args.validating_webhook_configuration)) if name)
        keeper = Keeper(api, (secret[0], secret[1]), (service[0], service[1]), configurations, args.cert, args.key)
    try:
        serve(args.listen, args.cert, args.key, injection, resource_groups(args.config), keeper)
    except OSError as e:
        return _fail(f"cannot serve the webhook on {args.listen} with {args.cert}: {e}")
    return 0


def cmd_kube_extender(args: argparse.Namespace) -> int:
    from gemtrace import eventlog
    from gemtrace.kube.extender import serve

    eventlog.configure(args.log_level)
    try:
        serve(args.listen, PACKINGS[args.placement](), args.placement)
    except (OSError, ValueError) as e:
        return _fail(f"cannot serve the scheduler extender on {args.listen}: {e}")
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    from gemtrace import top

    return top.main(args.rest)


def help_parsers() -> dict[str, argparse.ArgumentParser]:
    """The parser whose --help each command prints, by name ("" for `gemtrace` itself): what the
    man page documents. `top` parses its own options (gemtrace.top.parser)."""
    from gemtrace import top

    ap = parser()
    commands = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    parsers = {"": ap, **commands.choices}
    parsers["top"] = top.parser()
    return parsers


def parser() -> argparse.ArgumentParser:
    from gemtrace.config import UNATTACHED, UNATTACHED_DEFAULT
    from gemtrace.kube.pods import NAMES_FILE as POD_NAMES

    ap = argparse.ArgumentParser(
        prog="gemtrace",
        description="Share NVIDIA GPUs between groups of processes with quotas, and see who uses what.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--version", action="version", version=f"gemtrace {__version__}")
    sub = ap.add_subparsers(dest="command_name", metavar="COMMAND", required=True)

    agent = sub.add_parser("agent", help="run the agent in the foreground (the systemd unit runs this)",
                           description="Schedule every GPU of this host by the resource file's quotas, "
                           "account every process through eBPF, and serve Prometheus metrics. Stops "
                           "cleanly on SIGTERM or SIGINT.")
    agent.add_argument("--config", type=Path, default=defaults.CONFIG_PATH, metavar="FILE",
                       help=f"the resource file (default {defaults.CONFIG_PATH}); reloaded when it changes "
                       "and on SIGHUP")
    agent.add_argument("--config-poll", type=_positive_seconds, default=defaults.CONFIG_POLL_SECONDS,
                       metavar="SECONDS", help="how often to look whether the resource file changed "
                       f"(default {defaults.CONFIG_POLL_SECONDS:g})")
    agent.add_argument("--state-dir", type=Path, default=_state_dir_default(), metavar="DIR",
                       help=f"where the region shared with the gates lives (default ${defaults.ENV_STATE_DIR} "
                       f"or {defaults.STATE_DIR})")
    agent.add_argument("--listen", default=defaults.LISTEN, metavar="HOST:PORT",
                       help=f"HOST:PORT to serve /metrics on (default {defaults.LISTEN}: every local user can "
                       "read it, processes and commands included), or unix:PATH for a unix socket whose mode "
                       "and group say who can")
    agent.add_argument("--listen-mode", metavar="MODE",
                       help="with --listen unix:PATH, the socket's permission bits in octal (default 0660)")
    agent.add_argument("--listen-group", metavar="GROUP",
                       help="with --listen unix:PATH, the socket's group, e.g. prometheus (default root's)")
    agent.add_argument("--web-config", type=Path, metavar="FILE",
                       help="TLS and basic auth for /metrics, in node_exporter's web config format "
                       "(tls_server_config, basic_auth_users with bcrypt hashes): docs/metrics.md")
    agent.add_argument("--pod-names", type=Path, default=POD_NAMES, metavar="FILE",
                       help="the Kubernetes pods' names that `gemtrace kube-plugin` writes, for the namespace, pod "
                       "and container labels (default %(default)s; absent: those labels are empty)")
    agent.add_argument("--no-ebpf", action="store_true",
                       help="do not attach eBPF probes (accounting then comes from the gates and NVML)")
    agent.add_argument("--probe-mode", choices=defaults.PROBE_MODES, default=defaults.PROBE_MODE,
                       help="memory: probe allocations and contexts (default, no cost per launch); launches: "
                       "also count every ungated launch (about 0.8 us each: docs/accounting.md)")
    agent.add_argument("--managed-host-limit", type=_host_managed_size, default=None, metavar="SIZE",
                       help="the most managed memory that Oversubscribe groups may hold in all, on every GPU "
                       f"together (default: {defaults.MANAGED_HOST_SHARE:g} of the host's memory; never more than "
                       "the host has)")
    agent.add_argument("--unattached", choices=tuple(UNATTACHED), default=UNATTACHED_DEFAULT,
                       help="what a gated program does while it cannot get a process slot from the agent: wait "
                       "(default: its allocations wait, it never runs past its limit), ungated (after 5 s of "
                       "trying it runs without limits), refuse (after 5 s its allocations fail); each says so "
                       "on stderr (docs/security.md)")
    agent.add_argument("--mps-control", default=defaults.MPS_CONTROL, metavar="PROGRAM",
                       help="the nvidia-cuda-mps-control program that groups with Isolation=mps run under, a "
                       "name found in PATH or a path (default %(default)s; docs/mps.md)")
    agent.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                       help="log events of this severity and above (default info); the log goes to stderr, "
                       "one JSON object per line unless stderr is a terminal")
    agent.set_defaults(func=cmd_agent)

    run = sub.add_parser("run", help="run a command in a group, with the gate preloaded",
                         description="Run CMD with the gate (libgemgate.so) preloaded in group NAME; the "
                         "exit status is CMD's. Any LD_PRELOAD already set is kept after the gate.",
                         usage="gemtrace run --group NAME [--gpus N [--policy P]] [--config FILE] "
                         "[--state-dir DIR] [--require-agent] [--[no-]release-cache] -- CMD [ARGS...]")
    run.add_argument("--group", required=True, metavar="NAME", help="a group of the resource file")
    run.add_argument("--config", type=Path, default=None, metavar="FILE",
                     help="check the group against this resource file (default: the groups of the running "
                     f"agent, else {defaults.CONFIG_PATH})")
    run.add_argument("--state-dir", type=Path, default=_state_dir_default(), metavar="DIR",
                     help=f"the agent's state dir (default ${defaults.ENV_STATE_DIR} or {defaults.STATE_DIR})")
    run.add_argument("--require-agent", action="store_true",
                     help="refuse to run CMD (exit 1) when no agent is running, instead of running it without "
                     "its group's quotas after a warning")
    run.add_argument("--gpus", type=_positive_int, metavar="N",
                     help="give CMD N GPUs (CUDA_VISIBLE_DEVICES, by UUID) that have room for the group, "
                     "best linked first (docs/placement.md); among CUDA_VISIBLE_DEVICES if set")
    run.add_argument("--policy", choices=sorted(POLICIES), default=DEFAULT_POLICY,
                     help=f"how --gpus chooses (default {DEFAULT_POLICY})")
    run.add_argument("--release-cache", action=argparse.BooleanOptionalAction, default=None,
                     help="a PyTorch CMD empties its CUDA cache each time its group is held (default: on for "
                     "groups with Oversubscribe, or as $GEMTRACE_RELEASE_CACHE=1|0 says; docs/frameworks.md)")
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]", help="the command to run")
    run.set_defaults(func=cmd_run)

    check = sub.add_parser("check-config", help="validate a resource file and print its effective settings",
                           description="Validate FILE; on error print FILE:LINE and what is wrong, exit 1.")
    check.add_argument("file", type=Path, metavar="FILE", nargs="?", default=defaults.CONFIG_PATH,
                       help=f"the resource file to check (default {defaults.CONFIG_PATH}, the agent's)")
    check.set_defaults(func=cmd_check_config)

    status = sub.add_parser("status", help="each GPU's groups: share, memory, processes",
                            description="One view of each GPU's groups from the agent's /metrics: the share "
                            "used against MinUtil/MaxUtil, memory against the limit, and the processes.")
    status.add_argument("--listen", default=defaults.LISTEN, metavar="HOST:PORT",
                        help="the agent's address (its `agent --listen`: HOST:PORT or unix:PATH) or /metrics URL "
                        f"(default {defaults.LISTEN})")
    # `top` once took --url for the same address: accepted here too, so either name works for both.
    status.add_argument("--url", dest="listen", help=argparse.SUPPRESS)
    status.add_argument("--json", action="store_true", help="print the figures as JSON")
    status.set_defaults(func=cmd_status)

    def injection_options(p: argparse.ArgumentParser) -> None:
        from gemtrace.kube.injection import HOST_PRELOAD

        p.add_argument("--gate", type=Path, default=defaults.GATE_INSTALLED, metavar="FILE",
                       help=f"the gate library on the node, mounted into containers "
                       f"(default {defaults.GATE_INSTALLED})")
        p.add_argument("--preload-file", type=Path, default=HOST_PRELOAD, metavar="FILE",
                       help=f"the node's preload list, mounted as the containers' /etc/ld.so.preload "
                       f"(default {HOST_PRELOAD})")
        p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                       help="log events of this severity and above (default info)")

    kube_plugin = sub.add_parser(
        "kube-plugin", help="serve the Kubernetes device plugin for GPU shares (on each GPU node)",
        description="Advertise gemtrace.io/gpu-memory (GiB) and gemtrace.io/gpu-util (% of a GPU) to the "
        "kubelet, gate the containers that get them, and give each its own group through a drop-in of the "
        "resource file (docs/kubernetes.md). Runs beside the agent; stops on SIGTERM.")
    kube_plugin.add_argument("--config", type=Path, default=defaults.CONFIG_PATH, metavar="FILE",
                             help=f"the agent's resource file; pods' groups go to its drop-in directory "
                             f"(default {defaults.CONFIG_PATH}, so /etc/gemtrace/resource.d)")
    kube_plugin.add_argument("--state-dir", type=Path, default=_state_dir_default(), metavar="DIR",
                             help=f"the agent's state dir (default {defaults.STATE_DIR})")
    kube_plugin.add_argument("--device-plugins", type=Path, default=Path("/var/lib/kubelet/device-plugins"),
                             metavar="DIR", help="the kubelet's device-plugins directory (default %(default)s)")
    kube_plugin.add_argument("--pod-resources", type=Path, default=Path("/var/lib/kubelet/pod-resources/kubelet.sock"),
                             metavar="SOCKET", help="the kubelet's PodResources socket (default %(default)s)")
    kube_plugin.add_argument("--node-name", default=os.environ.get("NODE_NAME"), metavar="NODE",
                             help="this node's name: the plugin then reads its pods from the apiserver to place "
                             "each container's share on its GPUs, and for their cgroup (a Cgroup rule) and "
                             "annotations, and puts each GPU's free room on its node for the scheduler extender "
                             "(annotation gemtrace.io/gpu-room; default $NODE_NAME; unset: none of these)")
    kube_plugin.add_argument("--pod-names", type=Path, default=POD_NAMES, metavar="FILE",
                             help="where to write the pods' names for the agent's metrics labels (default %(default)s; "
                             "the agent's --pod-names)")
    kube_plugin.add_argument("--kubeconfig", type=Path, metavar="FILE",
                             help="credentials for the apiserver (default: the pod's service account)")
    kube_plugin.add_argument("--placement", choices=sorted(PACKINGS), default=DEFAULT_PACKING,
                             help="which GPU a pod's share goes to among those it fits: binpack, the fullest "
                                  "first (whole GPUs stay free for large pods), or spread, the emptiest first "
                                  "(default %(default)s; needs --node-name)")
    injection_options(kube_plugin)
    kube_plugin.set_defaults(func=cmd_kube_plugin)

    kube_webhook = sub.add_parser(
        "kube-webhook", help="serve the mutating admission webhook that gates pods labelled gemtrace.io/group",
        description="A pod labelled gemtrace.io/group=NAME gets the gate mounted and joins group NAME of the "
        "resource file; other pods are left as they are (docs/kubernetes.md).")
    kube_webhook.add_argument("--listen", default="0.0.0.0:8443", metavar="HOST:PORT",
                              help="HOST:PORT to serve HTTPS on (default %(default)s)")
    kube_webhook.add_argument("--cert", type=Path, required=True, metavar="FILE",
                              help="the TLS certificate (PEM); with --tls-secret, where it is written")
    kube_webhook.add_argument("--key", type=Path, required=True, metavar="FILE",
                              help="its private key (PEM); with --tls-secret, where it is written")
    kube_webhook.add_argument("--tls-secret", metavar="NAMESPACE/NAME",
                              help="make the certificate and its CA, keep them in this Secret, renew them before "
                              "they expire and put the CA in the webhook configurations' caBundle (deploy/ does)")
    kube_webhook.add_argument("--service", default="gemtrace-system/gemtrace-webhook", metavar="NAMESPACE/NAME",
                              help="with --tls-secret: the webhook's Service, named by the certificate "
                              "(default %(default)s)")
    kube_webhook.add_argument("--webhook-configuration", default="gemtrace-webhook", metavar="NAME",
                              help="with --tls-secret: the MutatingWebhookConfiguration whose webhooks calling "
                              "--service get the CA, '' for none (default %(default)s)")
    kube_webhook.add_argument("--validating-webhook-configuration", default="gemtrace-webhook-validation",
                              metavar="NAME", help="with --tls-secret: the ValidatingWebhookConfiguration whose "
                              "webhooks calling --service get the CA, '' for none (default %(default)s)")
    kube_webhook.add_argument("--kubeconfig", type=Path, metavar="FILE",
                              help="with --tls-secret: the apiserver's credentials (default: the pod's service "
                              "account)")
    kube_webhook.add_argument("--state-dir", type=Path, default=defaults.STATE_DIR, metavar="DIR",
                              help=f"the agent's state dir on the nodes (default {defaults.STATE_DIR})")
    kube_webhook.add_argument("--config", type=Path, default=defaults.CONFIG_PATH, metavar="FILE",
                              help="the nodes' resource file: a label naming a group it does not define is refused "
                              "(default %(default)s)")
    injection_options(kube_webhook)
    kube_webhook.set_defaults(func=cmd_kube_webhook)

    kube_extender = sub.add_parser(
        "kube-extender", help="serve the kube-scheduler extender that checks pods' GPU shares on each GPU",
        description="Filter and rank the nodes for a pod asking gemtrace.io/gpu-memory or gpu-util by each GPU's "
        "free room, which `gemtrace kube-plugin` puts on its node: a pod no GPU of any node can take whole stays "
        "Pending with the reason (docs/kubernetes.md gives kube-scheduler's configuration). Stops on SIGTERM.")
    kube_extender.add_argument("--listen", default=defaults.EXTENDER_LISTEN, metavar="HOST:PORT",
                               help="HOST:PORT to serve HTTP on, where kube-scheduler calls it (default %(default)s)")
    kube_extender.add_argument("--placement", choices=sorted(PACKINGS), default=DEFAULT_PACKING,
                               help="which nodes to prefer among those that fit, as the nodes' plugins order their "
                               "GPUs: binpack, the fullest GPU first, or spread, the emptiest (default %(default)s)")
    kube_extender.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                               help="log events of this severity and above (default info)")
    kube_extender.set_defaults(func=cmd_kube_extender)

    top = sub.add_parser("top", help="live view of the groups (q quits)", add_help=False,
                         description="Live view; `gemtrace top --help` lists its options.")
    top.add_argument("rest", nargs=argparse.REMAINDER)
    top.set_defaults(func=cmd_top)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["top"]:
        # top parses its own options (argparse's REMAINDER would refuse a leading --help).
        return cmd_top(argparse.Namespace(rest=argv[1:]))
    args = parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
