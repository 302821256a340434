"""CurveZMQ keys, the ZAP allow-list, size limits of untrusted input, ``pdserve keys``.

Why here: a cluster opened across machines must not let anyone who can reach a
port join as a node (it would read prompts and write tokens), submit work, or
feed a decode node KV. docs/security.md is the operator's side of this file.

Key directory (``--curve-dir DIR``, written by ``pdserve keys generate DIR``)::

    router.key  router.key_secret    the router: server of the control and ingress sockets
    node.key    node.key_secret      nodes: clients of the router; decode nodes also serve
                                     KV with it, so prefill nodes expect it there
    client.key  client.key_secret    queue producers (QueueClient)
    NAME.key    NAME.key_secret      more nodes or producers (--node NAME / --client NAME)
    allow/nodes/*.key                public keys the control and KV sockets accept
    allow/clients/*.key              public keys the ingress accepts

``*.key`` files are pyzmq certificates (public key only); ``*.key_secret`` hold
both keys, mode 0600. Each socket kind has its own ZAP domain, so a producer's
key never opens the control or KV sockets.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import click
import zmq
import zmq.auth

from pdserve.common.config import DTYPE_BYTES
from pdserve.common.curve_guard import CONTROL_DOMAIN, INGRESS_DOMAIN, KV_DOMAIN  # noqa: F401
from pdserve.common.exposure import (  # noqa: F401 (re-exported: one place to import from)
    InsecureWarnings,
    _is_loopback,
    node_exposures,
    refuse_insecure,
    router_exposures,
)
from pdserve.common.sockets import CurveConfig

log = logging.getLogger(__name__)

ROUTER, NODE, CLIENT = "router", "node", "client"
ALLOW_NODES, ALLOW_CLIENTS = Path("allow", "nodes"), Path("allow", "clients")

# Size limits (ZMQ_MAXMSGSIZE, per frame): a bigger frame disconnects the sender.
CONTROL_MAX_MSG_BYTES = 64 * 2**20   # control messages carry token ids, never tensors
KV_ACK_MAX_MSG_BYTES = 2**20          # what a prefill node's KV DEALER receives: acks, errors


def kv_max_msg_size(layout, num_blocks: int) -> int:
    """Largest frame a decode node's KV socket accepts: one layer's K (or V) of a request
    as large as the whole cache, or a header at its protocol cap."""
    from pdserve.common.protocol import MAX_HEADER_BYTES

    frame = (num_blocks * layout.block_size * layout.num_kv_heads * layout.head_dim
             * DTYPE_BYTES.get(layout.dtype, 8))
    return max(frame, MAX_HEADER_BYTES) + 4096


# ---------------------------------------------------------------- key files

def generate_keys(key_dir, nodes=(), clients=(), force: bool = False) -> list[Path]:
    """Writes the keypairs missing from ``key_dir`` (all of them with ``force``) and the
    public key of each node / client into its allow-list. Returns the files written."""
    root = Path(key_dir)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    wanted = [(ROUTER, None)] + [(n, ALLOW_NODES) for n in (NODE, *nodes)] + \
        [(c, ALLOW_CLIENTS) for c in (CLIENT, *clients)]
    written = []
    for name, allow in wanted:
        _check_name(name)
        public = root / f"{name}.key"
        if force or not (public.exists() and (root / f"{name}.key_secret").exists()):
            # Made inside a private (0700) folder, so the secret is never readable by others.
            with tempfile.TemporaryDirectory(dir=root) as tmp:
                pub, sec = zmq.auth.create_certificates(tmp, name)
                os.chmod(sec, 0o600)
                os.chmod(pub, 0o644)
                os.replace(sec, root / f"{name}.key_secret")
                os.replace(pub, public)
            written += [public, root / f"{name}.key_secret"]
        if allow is not None:
            (root / allow).mkdir(parents=True, exist_ok=True)
            target = root / allow / f"{name}.key"
            if force or public in written or not target.exists():
                shutil.copyfile(public, target)
                written.append(target)
    return written


def _check_name(name: str) -> None:
    if not name or name.startswith(".") or any(c in name for c in "/\\ \t\n"):
        raise ValueError(f"key name {name!r} must be a plain file name (no slashes or spaces)")


def _load(path: Path, secret: bool) -> tuple[bytes, Optional[bytes]]:
    if not path.is_file():
        raise ValueError(f"CURVE key file {path} is missing: run `pdserve keys generate "
                         f"{path.parent}` (see docs/security.md)")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"CURVE key file {path} is not a key: {e}") from None
    if secret and not secret_key:
        raise ValueError(f"{path} holds no secret key")
    if secret and os.stat(path).st_mode & 0o077:
        log.warning("secret key %s is readable by other users: chmod 600 it", path)
    return public, secret_key


def load_keypair(key_dir, name: str) -> tuple[bytes, bytes]:
    """(public, secret) of ``NAME.key_secret``, Z85."""
    return _load(Path(key_dir) / f"{name}.key_secret", secret=True)


def load_public(key_dir, name: str) -> bytes:
    return _load(Path(key_dir) / f"{name}.key", secret=False)[0]


def load_allow_list(key_dir, sub: Path) -> frozenset:
    """The public keys of every ``*.key`` in ``key_dir/sub``; a missing folder is an error."""
    folder = Path(key_dir) / sub
    if not folder.is_dir():
        raise ValueError(f"CURVE allow-list folder {folder} is missing (see docs/security.md)")
    keys = frozenset(_load(p, secret=False)[0] for p in sorted(folder.glob("*.key")))
    if not keys:
        log.warning("CURVE allow-list %s is empty: every client will be refused", folder)
    return keys


# ---------------------------------------------------------------- CurveConfigs per role

def server_curve(key_dir, domain: bytes, name: str = ROUTER) -> Optional[CurveConfig]:
    """The CURVE server config of one socket kind, or None when ``key_dir`` is None (off)."""
    if key_dir is None:
        return None
    public, secret = load_keypair(key_dir, name)
    allow = ALLOW_CLIENTS if domain == INGRESS_DOMAIN else ALLOW_NODES
    return CurveConfig.server(secret, public, load_allow_list(key_dir, allow), zap_domain=domain)


def client_curve(key_dir, name: str = CLIENT, server: str = ROUTER) -> Optional[CurveConfig]:
    """A client's own keypair ``name`` and the public key of the server ``server``."""
    if key_dir is None:
        return None
    public, secret = load_keypair(key_dir, name)
    return CurveConfig.client(secret, public, load_public(key_dir, server))


@dataclass(frozen=True)
class NodeCurves:
    """Every CURVE config a node's sockets need; built (and checked) before they exist."""
    control: CurveConfig               # DEALER to the router
    kv_server: Optional[CurveConfig]   # decode: the KV ROUTER
    kv_client: Optional[CurveConfig]   # prefill: DEALERs to decode nodes' KV sockets


def node_curves(key_dir, role: str, name: str = NODE) -> Optional[NodeCurves]:
    if key_dir is None:
        return None
    return NodeCurves(
        control=client_curve(key_dir, name, ROUTER),
        kv_server=server_curve(key_dir, KV_DOMAIN, NODE) if role != "prefill" else None,
        kv_client=client_curve(key_dir, name, NODE) if role != "decode" else None)


def check_router_security(config) -> None:
    """Loads the router's keys (a clear ValueError now, not at the first connection) and
    refuses what the config opens to other machines without protection, unless
    ``config.insecure``."""
    if config.curve_dir is not None:
        for domain in (CONTROL_DOMAIN, INGRESS_DOMAIN):
            server_curve(config.curve_dir, domain)
    refuse_insecure(router_exposures(config), config.insecure)
    if not _is_loopback(f"tcp://{config.host}:0"):
        log.info("HTTP is plain text: put a TLS proxy in front of it between machines")


# ---------------------------------------------------------------- pdserve keys

@click.group("keys")
def keys_group() -> None:
    """CurveZMQ keys for the control, ingress and KV sockets (docs/security.md)."""


@keys_group.command("generate")
@click.argument("key_dir", type=click.Path(file_okay=False))
@click.option("--node", "nodes", multiple=True, metavar="NAME",
              help="Another node keypair, added to allow/nodes (repeatable).")
@click.option("--client", "clients", multiple=True, metavar="NAME",
              help="Another producer keypair, added to allow/clients (repeatable).")
@click.option("--force", is_flag=True, help="Replace existing keys (every peer needs the new "
                                            "public keys).")
def generate_cmd(key_dir, nodes, clients, force) -> None:
    """Write router, node and client keypairs (and NAMEs) to KEY_DIR, keeping existing ones."""
    try:
        written = generate_keys(key_dir, nodes, clients, force)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    for path in written:
        click.echo(f"wrote {path}")
    if not written:
        click.echo(f"{key_dir}: every key exists already (--force replaces them)")
    click.echo("copy to each host only what it needs: docs/security.md, 'Which host needs what'")
