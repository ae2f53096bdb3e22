"""Generate CURVE key files for the control plane.

    python -m mindspeed_tft.control.keys DIR

writes `server.key`, `server.key_secret`, `client.key` and `client.key_secret` (ZeroMQ
certificates, secrets mode 0600) into DIR and prints the environment to export:
controllers need `TTP_CURVE_SERVER_KEY=DIR/server.key_secret`; processors need the server's
public key and the client pair. Using `server.key_secret` on every node is simplest; a
processor only reads the public half of it. Backup controllers also talk to the active
controller as clients, so they need both pairs.
"""

from __future__ import annotations

import argparse
import os
import sys

import zmq
import zmq.auth


def generate_keys(directory: str, *, overwrite: bool = False) -> dict[str, str]:
    """Create the server and client certificates; returns the environment to set."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")
    os.makedirs(directory, exist_ok=True)
    for name in ("server", "client"):
        for suffix in (".key", ".key_secret"):
            path = os.path.join(directory, name + suffix)
            if os.path.exists(path) and not overwrite:
                raise FileExistsError(f"{path} exists (use --overwrite to replace it)")
    paths = {}
    for name in ("server", "client"):
        public, secret = zmq.auth.create_certificates(directory, name)
        os.chmod(secret, 0o600)
        paths[name] = (public, secret)
    return {
        "TTP_CURVE_SERVER_KEY": os.path.abspath(paths["server"][1]),
        "TTP_CURVE_CLIENT_KEY": os.path.abspath(paths["client"][1]),
        "TTP_CURVE_AUTHORIZED_KEYS": os.path.abspath(paths["client"][0]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mindspeed_tft.control.keys",
        description="Generate CURVE certificates for the mindspeed-tft control plane.",
    )
    parser.add_argument("directory", help="folder to write the certificates into")
    parser.add_argument("--overwrite", action="store_true", help="replace existing files")
    args = parser.parse_args(argv)
    try:
        env = generate_keys(args.directory, overwrite=args.overwrite)
    except (OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for key, value in env.items():
        print(f"export {key}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
