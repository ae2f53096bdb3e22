"""Generate CURVE key files for the control plane, one folder per role.

    python -m mindspeed_tft.control.wire.keys DIR

writes ZeroMQ certificates (secrets mode 0600, folders 0700) into

- `DIR/controller/`: `server.key_secret` (the server pair) and `authorized/client.key` (the
  client public keys the controller admits). Only for hosts that run a controller or a
  backup controller (under `tft-run`: node 0 and the nodes named in `TTP_BACKUP_ADDRS`).
  A backup authenticates to the active controller with this same server pair, so holding
  the server secret is what makes a backup;
- `DIR/processor/`: `server.key` (the server's PUBLIC key, which processors pin: a peer
  without the server secret cannot pose as a controller) and `client.key_secret` (the
  client pair). For every node that runs workers.

and prints the environment each role needs. Never copy `controller/` to worker-only
nodes: whoever holds the server secret can pose as the controller to every processor.
A host running both a controller and workers (node 0) sets the controller's
`TTP_CURVE_SERVER_KEY` (processors read only its public half) plus `TTP_CURVE_CLIENT_KEY`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import zmq
import zmq.auth

#: what `generate_keys` returns: role -> the environment that role needs
ROLES = ("controller", "processor", "controller+processor")


def _copy(src: str, dst: str, mode: int) -> None:
    """Copy a certificate, created with `mode` (a secret is never readable by others)."""
    with open(src, "rb") as f:
        data = f.read()
    if os.path.exists(dst):
        os.remove(dst)
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def generate_keys(directory: str, *, overwrite: bool = False) -> dict[str, dict[str, str]]:
    """Create the certificates; returns the environment per role (see `ROLES`)."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")
    controller = os.path.join(directory, "controller")
    authorized = os.path.join(controller, "authorized")
    processor = os.path.join(directory, "processor")
    targets = [os.path.join(controller, "server.key_secret"),
               os.path.join(authorized, "client.key"),
               os.path.join(processor, "server.key"),
               os.path.join(processor, "client.key_secret")]
    for path in targets:
        if os.path.exists(path) and not overwrite:
            raise FileExistsError(f"{path} exists (use --overwrite to replace it)")
    for folder in (controller, authorized, processor):
        os.makedirs(folder, exist_ok=True)
        os.chmod(folder, 0o700)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        server_public, server_secret = zmq.auth.create_certificates(tmp, "server")
        client_public, client_secret = zmq.auth.create_certificates(tmp, "client")
        _copy(server_secret, targets[0], 0o600)
        _copy(client_public, targets[1], 0o644)
        _copy(server_public, targets[2], 0o644)
        _copy(client_secret, targets[3], 0o600)
    server_key_secret, client_keys, server_key, client_key_secret = map(os.path.abspath,
                                                                        targets)
    return {
        "controller": {"TTP_CURVE_SERVER_KEY": server_key_secret,
                       "TTP_CURVE_AUTHORIZED_KEYS": os.path.dirname(client_keys)},
        "processor": {"TTP_CURVE_SERVER_KEY": server_key,
                      "TTP_CURVE_CLIENT_KEY": client_key_secret},
        "controller+processor": {"TTP_CURVE_SERVER_KEY": server_key_secret,
                                 "TTP_CURVE_CLIENT_KEY": client_key_secret,
                                 "TTP_CURVE_AUTHORIZED_KEYS": os.path.dirname(client_keys)},
    }


_HEADINGS = {
    "controller": "hosts running only a controller or backup (DIR/controller stays there)",
    "processor": "worker-only nodes (copy DIR/processor there, never DIR/controller)",
    "controller+processor": "a node running a controller and workers (tft-run's node 0, a "
                            "backup's node): both folders",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mindspeed_tft.control.wire.keys",
        description="Generate CURVE certificates for the mindspeed-tft control plane "
                    "(DIR/controller for controller hosts, DIR/processor for every node).",
    )
    parser.add_argument("directory", help="folder to write the certificates into")
    parser.add_argument("--overwrite", action="store_true", help="replace existing files")
    args = parser.parse_args(argv)
    try:
        env = generate_keys(args.directory, overwrite=args.overwrite)
    except (OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for role in ROLES:
        print(f"# {_HEADINGS[role]}:")
        for key, value in env[role].items():
            print(f"export {key}={value}")
        print()
    print("# and on every node the same per-job secret, e.g. from a Kubernetes Secret "
          "(tft-run on one node makes one itself):")
    print("# TTP_JOB_TOKEN=<python -c 'import secrets; print(secrets.token_hex(32))', "
          "generated once per job>")
    return 0


if __name__ == "__main__":
    sys.exit(main())
