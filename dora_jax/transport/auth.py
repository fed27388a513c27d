"""Who may call the coordinator: the run secret, role tokens, TLS material, and how they travel.

A launcher (`launch_local`, `launch/tpu.py run`) makes a 256-bit secret for the run
(`make_run_credentials`). Only the coordinator holds it. Every other role is handed its own role
token, an HMAC-SHA256 of the secret and the role's name (`trainer`, `rollout-3`), which it
presents on every call as the metadata `x-dora-token: <role>.<hex>`. The coordinator recomputes
the HMAC of the role the token names and compares in constant time (`Authenticator`): a token
acts for its own role only, so a rollout slice's token can neither act as the trainer nor for
another slice, and a worker's machine never holds what would mint another role's token.

Secret and tokens travel in files of mode 0600 (in a 0700 directory) named by environment
variables, or in the variables themselves; never on a command line, in a log or in config.json:
  DORA_RUN_SECRET_FILE / DORA_RUN_SECRET   the coordinator: the run secret (64 hex digits)
  DORA_ROLE_TOKEN_FILE / DORA_ROLE_TOKEN   the trainer and each rollout slice: its role token
  DORA_TLS_CA_FILE                         clients: the run's CA certificate (TLS on when set)
  DORA_TLS_CERT_FILE, DORA_TLS_KEY_FILE    the coordinator: its certificate and key (TLS on when set)
A file readable by group or others is refused, as ssh refuses such a key.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping

SECRET_BYTES = 32  # 256 bits
TOKEN_METADATA = "x-dora-token"  # the call metadata key (gRPC metadata keys are lower case)
_TOKEN_CONTEXT = b"dora_jax role token v1\0"  # what the HMAC binds besides the role's name

SECRET_FILE_ENV, SECRET_ENV = "DORA_RUN_SECRET_FILE", "DORA_RUN_SECRET"
TOKEN_FILE_ENV, TOKEN_ENV = "DORA_ROLE_TOKEN_FILE", "DORA_ROLE_TOKEN"
CA_FILE_ENV, CERT_FILE_ENV, KEY_FILE_ENV = "DORA_TLS_CA_FILE", "DORA_TLS_CERT_FILE", "DORA_TLS_KEY_FILE"
CREDENTIAL_ENV = (SECRET_FILE_ENV, SECRET_ENV, TOKEN_FILE_ENV, TOKEN_ENV, CA_FILE_ENV, CERT_FILE_ENV, KEY_FILE_ENV)


class Kind(enum.Enum):
    TRAINER = "trainer"
    ROLLOUT = "rollout"


@dataclasses.dataclass(frozen=True)
class Principal:
    """A role a token speaks for: the trainer, or one rollout slice."""

    kind: Kind
    slice_id: int = -1  # rollout slices only

    @property
    def name(self) -> str:
        return self.kind.value if self.kind is Kind.TRAINER else f"rollout-{self.slice_id}"

    @classmethod
    def parse(cls, name: str, num_slices: int) -> Principal | None:
        """The principal `name` names in a run of `num_slices` rollout slices, or None."""
        if name == Kind.TRAINER.value:
            return cls(Kind.TRAINER)
        prefix, _, index = name.partition("-")
        if prefix == Kind.ROLLOUT.value and index.isdigit() and len(index) < 6 and int(index) < num_slices:
            return cls(Kind.ROLLOUT, int(index))
        return None


TRAINER = Principal(Kind.TRAINER)


def rollout(slice_id: int) -> Principal:
    return Principal(Kind.ROLLOUT, slice_id)


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def role_token(secret: bytes, principal: Principal) -> str:
    """What `principal` presents: its name and the HMAC-SHA256 of the secret over that name."""
    mac = hmac.new(secret, _TOKEN_CONTEXT + principal.name.encode(), hashlib.sha256).hexdigest()
    return f"{principal.name}.{mac}"


class Unauthenticated(Exception):
    pass


class Authenticator:
    """Checks role tokens against the run secret (the coordinator's side)."""

    def __init__(self, secret: bytes, num_slices: int):
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"run secret of {len(secret)} bytes; expected {SECRET_BYTES}")
        self._secret, self._num_slices = secret, num_slices

    def authenticate(self, token: str | None) -> Principal:
        """The principal a valid token speaks for; Unauthenticated (saying nothing more) otherwise."""
        if not token or len(token) > 128:
            raise Unauthenticated("missing or invalid run token")
        name, _, _ = token.rpartition(".")
        principal = Principal.parse(name, self._num_slices)
        # Role names are no secret; the MAC is compared in constant time.
        if principal is None or not hmac.compare_digest(role_token(self._secret, principal).encode(), token.encode()):
            raise Unauthenticated("missing or invalid run token")
        return principal


# ---------------------------------------------------------------- files and environment
def write_private(path: str, data: bytes) -> str:
    """Writes `data` to a new file of mode 0600 (never readable by others, not even for a moment)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def read_private(path: str, what: str) -> bytes:
    """The bytes of a file only its owner may read; a clear error naming it otherwise."""
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        raise ValueError(f"{what} file {path}: {err.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{what} file {path} has mode {stat.S_IMODE(mode):o}; expected 600 (chmod 600 {path})")
    with open(path, "rb") as f:
        return f.read().strip()


def _value(environ: Mapping[str, str], file_key: str, value_key: str, what: str) -> bytes | None:
    if environ.get(file_key):
        return read_private(environ[file_key], what)
    if environ.get(value_key):
        return environ[value_key].strip().encode()
    return None


def load_secret(environ: Mapping[str, str]) -> bytes:
    """The run secret the launcher handed the coordinator; a ValueError naming the variables if none."""
    raw = _value(environ, SECRET_FILE_ENV, SECRET_ENV, "run secret")
    if raw is None:
        raise ValueError(
            f"no run secret: set {SECRET_FILE_ENV} to a file of mode 600 holding it (or {SECRET_ENV}); "
            "launch_local and launch/tpu.py make one per run"
        )
    try:
        secret = bytes.fromhex(raw.decode())
    except ValueError:
        secret = b""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"the run secret must be {2 * SECRET_BYTES} hex digits ({SECRET_FILE_ENV} / {SECRET_ENV})")
    return secret


def load_token(environ: Mapping[str, str]) -> str:
    """This role's token; a ValueError naming the variables if none."""
    raw = _value(environ, TOKEN_FILE_ENV, TOKEN_ENV, "role token")
    if not raw:
        raise ValueError(
            f"no role token: set {TOKEN_FILE_ENV} to a file of mode 600 holding it (or {TOKEN_ENV}); "
            "launch_local and launch/tpu.py hand every role its own"
        )
    return raw.decode()


@dataclasses.dataclass(frozen=True)
class ServerTls:
    cert_pem: bytes
    key_pem: bytes


def load_server_tls(environ: Mapping[str, str]) -> ServerTls | None:
    """The coordinator's certificate and key when both variables are set; None: plaintext."""
    cert, key = environ.get(CERT_FILE_ENV), environ.get(KEY_FILE_ENV)
    if bool(cert) != bool(key):
        raise ValueError(f"set both {CERT_FILE_ENV} and {KEY_FILE_ENV} (TLS), or neither")
    if not cert:
        return None
    with open(cert, "rb") as f:
        return ServerTls(f.read(), read_private(key, "TLS key"))


def load_client_ca(environ: Mapping[str, str]) -> bytes | None:
    """The CA certificate clients pin the coordinator to; None: plaintext."""
    path = environ.get(CA_FILE_ENV)
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


@dataclasses.dataclass(frozen=True)
class ClientCredentials:
    """What a client presents: its role token, and the run's CA when the coordinator speaks TLS."""

    token: str
    ca_pem: bytes | None = None


def client_credentials(environ: Mapping[str, str]) -> ClientCredentials:
    return ClientCredentials(load_token(environ), load_client_ca(environ))


# ---------------------------------------------------------------- what a launcher makes
@dataclasses.dataclass(frozen=True)
class RunCredentials:
    """The files a launcher made for one run in `directory` (mode 0700)."""

    directory: str
    secret_file: str
    token_files: dict[str, str]  # principal name -> its token file
    tls: dict[str, str] | None  # "ca", "cert", "key" -> file, or None: plaintext

    def environment(self, principal: Principal | None) -> dict[str, str]:
        """The variables of one role: the coordinator's (None) or a client's."""
        env = {}
        if principal is None:
            env[SECRET_FILE_ENV] = self.secret_file
            if self.tls:
                env.update({CERT_FILE_ENV: self.tls["cert"], KEY_FILE_ENV: self.tls["key"]})
        else:
            env[TOKEN_FILE_ENV] = self.token_files[principal.name]
            if self.tls:
                env[CA_FILE_ENV] = self.tls["ca"]
        return env


def principals(num_slices: int) -> list[Principal]:
    return [TRAINER] + [rollout(s) for s in range(num_slices)]


def make_run_credentials(directory: str, num_slices: int, *, tls: bool) -> RunCredentials:
    """A fresh secret, every role's token and (with `tls`) a CA and the coordinator's certificate,
    written under `directory` (created 0700; it must not exist yet or be empty)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    secret = new_secret()
    secret_file = write_private(os.path.join(directory, "run_secret"), secret.hex().encode())
    tokens = {
        p.name: write_private(os.path.join(directory, f"{p.name}.token"), role_token(secret, p).encode())
        for p in principals(num_slices)
    }
    files = None
    if tls:
        from dora_jax.transport.tls import make_ca_and_server_cert

        ca, cert, key = make_ca_and_server_cert()
        files = {
            "ca": write_private(os.path.join(directory, "ca.pem"), ca),
            "cert": write_private(os.path.join(directory, "server.pem"), cert),
            "key": write_private(os.path.join(directory, "server.key"), key),
        }
    return RunCredentials(directory, secret_file, tokens, files)
