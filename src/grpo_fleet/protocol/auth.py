"""CURVE keys and the learner's allow-list of actor public keys (ZAP).

Layout of a keys directory (`grpo-fleet keys init DIR`):

    DIR/learner.key            learner public key: copy to every actor Mac
    DIR/learner.key_secret     learner secret key (mode 0600): stays on the learner
    DIR/authorized/NAME.key    the allow-list: public keys of actors that may join
    DIR/actors/NAME.key_secret an actor's keypair made by `keys add-actor NAME`
                               (mode 0600): copy to that actor's Mac, then delete here
    DIR/authorized/observers/NAME.key
                               observers: keys that may ask Status and nothing else
    DIR/authorized/ranks/NAME.key
                               learner ranks other than 0: keys allowed at rank 0's ring door only
    DIR/ranks/NAME.key_secret  a rank's keypair made by `keys add-rank NAME` (mode 0600): copy to that Mac
    DIR/observers/NAME.key_secret
                               an observer's keypair made by `keys add-observer NAME`
                               (mode 0600), for `grpo-fleet status --key`

An actor's identity is its CURVE public key (libzmq's ZAP User-Id), never a name
it claims. The allow-list can be reloaded while the learner runs.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from grpo_fleet.protocol.logsafe import shown

log = logging.getLogger("grpo_fleet.auth")
LEARNER_NAME = "learner"
# Under the allow-list directory: the keys that may only ask for the run's status.
OBSERVERS = "observers"


@dataclass(frozen=True)
class Keypair:
    """A CURVE keypair in z85 form."""

    public: bytes
    secret: Optional[bytes]


def _restrict(path: Path) -> None:
    os.chmod(path, 0o600)


def _make_keypair(directory: Path, name: str) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / f"{name}.key_secret").exists():
        raise FileExistsError(f"{directory / (name + '.key_secret')} exists; refusing to overwrite a key")
    public, secret = zmq.auth.create_certificates(str(directory), name)
    _restrict(Path(secret))
    return Path(public), Path(secret)


def init_keys(directory: str | Path) -> Path:
    """Create the learner's keypair and an empty allow-list; returns the public key file."""
    root = Path(directory)
    public, _ = _make_keypair(root, LEARNER_NAME)
    (root / "authorized").mkdir(exist_ok=True)
    return public


def add_actor(directory: str | Path, name: str) -> Path:
    """Create an actor keypair and allow its public key; returns the actor's secret key file."""
    return _add_key(Path(directory), name, keypair_dir="actors", allow_dir="authorized")


def add_rank(directory: str | Path, name: str) -> Path:
    """Create a keypair for a data-parallel learner rank other than 0 and allow it at the ring door; returns the
    secret key file (protocol/ring_door.py)."""
    return _add_key(Path(directory), name, keypair_dir="ranks", allow_dir="authorized/ranks")


def add_observer(directory: str | Path, name: str) -> Path:
    """Create an observer keypair (Status only) and allow its public key; returns the secret key file."""
    return _add_key(Path(directory), name, keypair_dir=OBSERVERS, allow_dir=f"authorized/{OBSERVERS}")


def _add_key(root: Path, name: str, *, keypair_dir: str, allow_dir: str) -> Path:
    if not (root / f"{LEARNER_NAME}.key").exists():
        raise FileNotFoundError(f"{root} has no learner key; run `grpo-fleet keys init {root}` first")
    if not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError("key names may use letters, digits, '-' and '_' only")
    public, secret = _make_keypair(root / keypair_dir, name)
    (root / allow_dir).mkdir(parents=True, exist_ok=True)
    shutil.copy(public, root / allow_dir / public.name)
    return secret


def revoke_actor(directory: str | Path, name: str) -> bool:
    """Remove an actor or an observer from the allow-list; True if it was there."""
    authorized = Path(directory) / "authorized"
    found = False
    for path in (authorized / f"{name}.key", authorized / OBSERVERS / f"{name}.key"):
        if path.exists():
            path.unlink()
            found = True
    return found


def load_keypair(path: str | Path) -> Keypair:
    """Read a .key (public only) or .key_secret (both halves) file."""
    public, secret = zmq.auth.load_certificate(str(path))
    return Keypair(public=public, secret=secret)


def client_curve(key_file: Optional[str | Path], learner_key_file: Optional[str | Path]) -> Optional[tuple[Keypair, bytes]]:
    """(own keypair, learner public key) for a CURVE client, or None when neither file is given."""
    if not key_file and not learner_key_file:
        return None
    if not (key_file and learner_key_file):
        raise ValueError("CURVE needs both --key (this actor's secret key) and --learner-key (learner.key)")
    keypair = load_keypair(key_file)
    if keypair.secret is None:
        raise ValueError(f"{key_file} holds no secret key; pass the NAME.key_secret file")
    return keypair, load_keypair(learner_key_file).public


class KeyRing:
    """The allow-list, swapped atomically on reload so the ZAP thread always sees a whole set.

    Actor keys lie in the directory itself, observer keys in its `observers/`;
    both pass the CURVE handshake, and `is_observer` tells the learner which
    of them may ask for nothing but Status.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._actors: frozenset[bytes] = frozenset()
        self._observers: frozenset[bytes] = frozenset()
        self._stamp: tuple = ()
        self._lock = threading.Lock()
        self.reload()

    def __len__(self) -> int:
        return len(self._actors | self._observers)

    def _listing(self) -> tuple:
        files = sorted(self.directory.glob("*.key")) + sorted((self.directory / OBSERVERS).glob("*.key"))
        return tuple((str(f), f.stat().st_mtime_ns) for f in files)

    def reload(self) -> bool:
        """Re-read the directory; True when the allow-list changed."""
        actors, observers = _public_keys(self.directory), _public_keys(self.directory / OBSERVERS)
        with self._lock:
            changed = (actors, observers) != (self._actors, self._observers)
            self._actors, self._observers = actors, observers
            self._stamp = self._listing() if self.directory.exists() else ()
        if changed:
            log.info("allow-list now holds %d actor keys and %d observer keys", len(actors), len(observers))
        return changed

    def reload_if_changed(self) -> bool:
        """Cheap file watch: reload only when the directory listing or mtimes moved."""
        listing = self._listing() if self.directory.exists() else ()
        return self.reload() if listing != self._stamp else False

    def allows(self, public_key_z85: bytes) -> bool:
        return public_key_z85 in self._actors or public_key_z85 in self._observers

    def is_observer(self, public_key_z85: bytes) -> bool:
        """True for a key allowed only as an observer (on both lists, the lesser right wins)."""
        return public_key_z85 in self._observers

    def callback(self, domain: str, key: bytes) -> bool:
        """The ZAP credentials provider hook."""
        return self.allows(key)


def _public_keys(directory: Path) -> frozenset[bytes]:
    return frozenset(zmq.auth.load_certificates(str(directory)).keys()) if directory.is_dir() else frozenset()


class _LoggingAuthenticator(ThreadAuthenticator):
    """ZAP handler that logs every refused handshake with the peer's address."""

    on_denied: Callable[[str, str], None] = staticmethod(lambda address, reason: None)
    _peer = "?"

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._peer = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def _send_zap_reply(self, request_id: bytes, status_code: bytes, status_text: bytes, user_id: str = "anonymous") -> None:
        if status_code != b"200":
            self.on_denied(self._peer, status_text.decode("utf-8", "replace"))
        super()._send_zap_reply(request_id, status_code, status_text, user_id)


def start_authenticator(ctx: zmq.Context, keyring: KeyRing,
                        on_denied: Optional[Callable[[str, str], None]] = None) -> ThreadAuthenticator:
    """ZAP on the same context as the learner's sockets, checking the allow-list; `on_denied(address, reason)`
    for each refused handshake (default: a warning)."""
    auth = _LoggingAuthenticator(ctx)
    auth.on_denied = on_denied or (
        lambda address, reason: log.warning("refused CURVE handshake from %s: %s", shown(address), shown(reason)))
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=keyring)
    return auth


def make_server(sock: zmq.Socket, keypair: Keypair) -> None:
    """Make a socket a CURVE server (must happen before bind)."""
    sock.curve_secretkey = keypair.secret
    sock.curve_publickey = keypair.public
    sock.curve_server = True


def make_client(sock: zmq.Socket, keypair: Keypair, server_public: bytes) -> None:
    """Make a socket a CURVE client of the learner (must happen before connect)."""
    sock.curve_secretkey = keypair.secret
    sock.curve_publickey = keypair.public
    sock.curve_serverkey = server_public

