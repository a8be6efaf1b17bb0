"""A rollout-only pod of a sidecar run: its own vLLM server, fed by the training pod's checkpoint engine.

    python -m hybrid_rl.pod --config-name=<the trainer's recipe> <the trainer's overrides> \\
        sidecar.pod=1 sidecar.host=<this node's address> sidecar.port=8100

Start one per extra pod (sidecar.pod = 1 .. sidecar.pods-1), with the trainer's model, rollout and
sidecar settings. The pod starts its server from dummy weights, registers it in etcd, joins the pod
group the trainer publishes there, then loads every update the trainer broadcasts (verified, then
stamped with its version) until the trainer finishes. Exit codes as `hybrid_rl.train`.
"""

from __future__ import annotations

from hybrid_rl.utils.env import set_runtime_defaults

set_runtime_defaults()

import logging  # noqa: E402
import secrets  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from hybrid_rl.errors import EXIT_BAD_INPUT, EXIT_RUNTIME  # noqa: E402

log = logging.getLogger("hybrid_rl.pod")


def main(argv: list[str] | None = None) -> int:
    from hybrid_rl.build import server_spec, sidecar_namespace, sidecar_prefix
    from hybrid_rl.config import ConfigError, load_config, split_command_line
    from hybrid_rl.sidecar.etcd import Etcd, EtcdUnavailable
    from hybrid_rl.utils.logs import setup_logging

    setup_logging()
    try:
        cfg = load_config(*split_command_line(sys.argv[1:] if argv is None else argv))
        sc = cfg.sidecar
        if not 1 <= sc.pod < sc.pods:
            raise ConfigError(f"sidecar.pod={sc.pod}: a rollout-only pod is numbered 1 .. sidecar.pods-1 "
                              f"(sidecar.pods={sc.pods}; pod 0 is the trainer's)")
        etcd = Etcd(sc.etcd, sidecar_prefix(cfg), wait_s=sc.etcd_wait_s)
        etcd.check()
    except (ConfigError, ValueError, EtcdUnavailable) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    nonce = secrets.token_hex(8)  # this launch's ring names: unguessable before they exist
    try:
        run(cfg, etcd, log_path=Path(cfg.trainer.output_dir) / f"vllm_server_pod{sc.pod}.log",
            namespace=lambda run_id: sidecar_namespace(cfg, sc.pod, run_id=run_id, nonce=nonce), spec=server_spec,
            prefix=lambda run_id: sidecar_prefix(cfg, run_id))
    except TimeoutError as e:  # the trainer never came (no secret, no run, an incomplete pod group): said plainly
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_RUNTIME
    return 0


def run(cfg, etcd, *, log_path: Path, namespace, spec, prefix) -> None:
    import dataclasses
    import os
    import re

    import torch

    from hybrid_rl.sidecar.pod_group import PodGroup, payload_device_for, pod_store
    from hybrid_rl.sidecar.pod_link import GROUP_KEY, PodReceiver
    from hybrid_rl.sidecar.server_adapter import AdapterFolders
    from hybrid_rl.sidecar.sidecar_server import Sidecar

    sc = cfg.sidecar
    sidecar = Sidecar(spec(cfg, port=sc.port, log_path=log_path), etcd, pod=sc.pod, ttl_s=sc.lease_ttl_s,
                      start_timeout_s=sc.start_timeout_s)
    receiver = None
    try:
        _install_secret(Path(cfg.trainer.output_dir), sc.pod_wait_s)
        run_id = sc.run_id or _live_run(etcd, sc.pod_wait_s)
        # The server starts knowing the one ring namespace it may map (`HYBRID_RL_SHM_NAMESPACE`)
        sidecar.server.spec = dataclasses.replace(sidecar.server.spec, namespace=namespace(run_id))
        sidecar.server.spawn()  # it loads (a minute) while the trainer starts
        etcd.prefix = prefix(run_id).rstrip("/")  # the run's own keys from here on
        log.info("pod %d serves run %s (keys under %s)", sc.pod, run_id, etcd.prefix)
        sidecar.register()
        where = _wait_for(etcd, GROUP_KEY, sc.pod_wait_s)
        member = where["tp"] + sc.pod - 1
        store = pod_store(where["host"], where["port"], member=member, tp=where["tp"], pods=where["pods"],
                          timeout_s=sc.pod_wait_s)
        device = payload_device_for(cuda=torch.cuda.is_available(), local_rank=int(os.environ.get("LOCAL_RANK", 0)))
        group = PodGroup(store, member=member, tp=where["tp"], pods=where["pods"], timeout_s=sc.pod_timeout_s,
                         payload_device=device, join_timeout_s=sc.pod_wait_s)
        sidecar.ensure_running()
        log.info("pod %d joined the trainer's pod group; waiting for weight updates", sc.pod)
        spec_ = sidecar.server.spec
        # labels from the pod group are this run's versions only (`<run id>-v<n>`): each names a folder under the root
        adapters = AdapterFolders(Path(cfg.trainer.output_dir) / f"adapter_sync_pod{sc.pod}", keep=spec_.max_loras + 1,
                                  labels=rf"{re.escape(run_id)}-v\d+") if spec_.max_lora_rank else None  # `model.lora.sync=adapter`: the versions this pod's server may serve
        receiver = PodReceiver(group, sidecar, namespace=sidecar.server.spec.namespace, slots=sc.slots, timeout_s=sc.update_timeout_s,
                               adapters=adapters)
        receiver.run()
    finally:
        if receiver is not None:
            receiver.close()
        sidecar.close()


def _install_secret(folder: Path, wait_s: float) -> None:
    """The run's secret: `HYBRID_RL_SECRET` in this process's environment, or the trainer's `<output_dir>/secret`
    (a shared folder, or the file copied here with its 0600 mode), waited for while the trainer starts."""
    import os

    from hybrid_rl.sidecar.auth import SECRET_ENV, SECRET_FILE, install_secret, read_secret

    if os.environ.get(SECRET_ENV):
        return
    path, deadline = folder / SECRET_FILE, time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no run secret: set {SECRET_ENV} or give this pod the trainer's {path} (mode 0600) "
                               f"within {wait_s:.0f} s")
        time.sleep(1.0)
    install_secret(read_secret(path))


def _live_run(etcd, wait_s: float) -> str:
    """The id of the one live run announced under this output folder's prefix (several: name one, sidecar.run_id)."""
    deadline = time.monotonic() + wait_s
    while not (runs := sorted(etcd.get_prefix("runs"))):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no trainer announced a run under {etcd.key('runs')} in etcd at {etcd.endpoint} "
                               f"within {wait_s:.0f} s (a run announced with another secret is ignored: this pod "
                               "takes HYBRID_RL_SECRET from its environment when set, else the trainer's "
                               "<output_dir>/secret)")
        time.sleep(1.0)
    if len(runs) > 1:
        raise RuntimeError(f"{len(runs)} live runs share this output folder's name in etcd ({', '.join(runs)}): "
                           "start the pod with sidecar.run_id=<id> (the trainer logs it, and writes it in "
                           "<output_dir>/run_id)")
    return runs[0]


def _wait_for(etcd, key: str, wait_s: float) -> dict:
    deadline = time.monotonic() + wait_s
    while (value := etcd.get(key)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no trainer published {etcd.key(key)} in etcd at {etcd.endpoint} within {wait_s:.0f} s")
        time.sleep(1.0)
    return value


if __name__ == "__main__":
    sys.exit(main())
