"""Run secret and role tokens: a token acts for its role only, files are refused unless private,
and a launcher's credentials give each role only its own."""

from __future__ import annotations

import hashlib
import hmac
import os
import stat

import pytest

from dora_jax.transport import auth


def test_role_tokens_are_hmacs_of_the_secret_and_the_role():
    secret = bytes(range(32))
    token = auth.role_token(secret, auth.rollout(3))
    expected = hmac.new(secret, b"dora_jax role token v1\0rollout-3", hashlib.sha256).hexdigest()
    assert token == f"rollout-3.{expected}"
    checker = auth.Authenticator(secret, num_slices=4)
    assert checker.authenticate(token) == auth.rollout(3)
    assert checker.authenticate(auth.role_token(secret, auth.TRAINER)) == auth.TRAINER
    for bad in (
        None,
        "",
        f"rollout-2.{expected}",  # another slice's name on slice 3's MAC
        f"trainer.{expected}",
        auth.role_token(bytes(32), auth.rollout(3)),  # another secret
        auth.role_token(secret, auth.rollout(4)),  # no such slice in this run
        token + "0",
        "x" * 4096,
    ):
        with pytest.raises(auth.Unauthenticated):
            checker.authenticate(bad)


def test_principal_names_parse_back_within_the_run_only():
    assert auth.Principal.parse("trainer", 2) == auth.TRAINER
    assert auth.Principal.parse("rollout-1", 2) == auth.rollout(1)
    for name in ("rollout-2", "rollout--1", "rollout-", "rollout-01x", "evaluator", "rollout-999999"):
        assert auth.Principal.parse(name, 2) is None, name


def test_launcher_credentials_are_private_and_each_role_gets_its_own(tmp_path):
    made = auth.make_run_credentials(str(tmp_path / "run"), 2, tls=True)
    assert stat.S_IMODE(os.stat(made.directory).st_mode) == 0o700
    files = [made.secret_file, *made.token_files.values(), *made.tls.values()]
    assert all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in files)
    coordinator = made.environment(None)
    secret = auth.load_secret(coordinator)
    assert len(secret) == 32 and auth.load_server_tls(coordinator) is not None
    assert set(coordinator) == {auth.SECRET_FILE_ENV, auth.CERT_FILE_ENV, auth.KEY_FILE_ENV}
    for principal in auth.principals(2):
        env = made.environment(principal)
        assert set(env) == {auth.TOKEN_FILE_ENV, auth.CA_FILE_ENV}  # never the secret
        assert auth.Authenticator(secret, 2).authenticate(auth.load_token(env)) == principal
    again = auth.make_run_credentials(str(tmp_path / "run2"), 2, tls=False)
    assert auth.load_secret(again.environment(None)) != secret and again.tls is None


def test_a_readable_secret_file_or_a_bad_secret_is_refused(tmp_path):
    path = tmp_path / "secret"
    path.write_text("ab" * 32)
    path.chmod(0o644)
    with pytest.raises(ValueError, match=r"has mode 644; expected 600 \(chmod 600"):
        auth.load_secret({auth.SECRET_FILE_ENV: str(path)})
    path.chmod(0o600)
    assert auth.load_secret({auth.SECRET_FILE_ENV: str(path)}) == bytes.fromhex("ab" * 32)
    assert auth.load_secret({auth.SECRET_ENV: "cd" * 32}) == bytes.fromhex("cd" * 32)
    with pytest.raises(ValueError, match="64 hex digits"):
        auth.load_secret({auth.SECRET_ENV: "cd" * 16})
    with pytest.raises(ValueError, match="no run secret: set DORA_RUN_SECRET_FILE"):
        auth.load_secret({})
    with pytest.raises(ValueError, match="no role token: set DORA_ROLE_TOKEN_FILE"):
        auth.load_token({})
