"""Secret options: the option, then its file, then its variable; a bad file is named, never
its content; every secret option has a -file form and its help says `ps` shows the option."""

from __future__ import annotations

import argparse

import pytest

from pdserve.cli import build_parser
from pdserve.cli.common import etcd_auth
from pdserve.cli.secrets import add_secret_option, secret


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_secret_option(parser, "--admin-key", env="PDSERVE_ADMIN_KEY", help="the key")
    return parser


def test_the_option_then_its_file_then_the_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\nignored second line\n")
    parse = _parser().parse_args
    assert secret(parse(["--admin-key", "on-argv", "--admin-key-file", str(key_file)]), "admin_key", "env") == "on-argv"
    assert secret(parse(["--admin-key-file", str(key_file)]), "admin_key", "env") == "from-file"
    assert secret(parse([]), "admin_key", "env") == "env"
    assert secret(parse([]), "admin_key", None) is None


def test_an_unreadable_or_empty_file_is_named_and_its_content_never_shown(tmp_path):
    with pytest.raises(ValueError, match="--admin-key-file .*missing"):
        secret(_parser().parse_args(["--admin-key-file", str(tmp_path / "missing")]), "admin_key", None)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="the file is empty"):
        secret(_parser().parse_args(["--admin-key-file", str(tmp_path / "empty")]), "admin_key", None)


def test_the_etcd_password_comes_from_its_file(tmp_path, monkeypatch):
    monkeypatch.delenv("PDSERVE_ETCD_PASSWORD", raising=False)
    (tmp_path / "password").write_text("s3cret")
    args = build_parser("status").parse_args(
        ["status", "--etcd-user", "pdserve", "--etcd-password-file", str(tmp_path / "password")]
    )
    assert etcd_auth(args).password == "s3cret"


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ("up", ["--api-key", "--admin-key", "--etcd-password"]),
        ("frontend", ["--api-key", "--etcd-password"]),
        ("prefill", ["--admin-key", "--etcd-password"]),
        ("drain", ["--admin-key"]),
        ("generate", ["--api-key"]),
    ],
)
def test_every_secret_option_has_a_file_form_and_says_ps_shows_it(command, flags):
    subparsers = next(a for a in build_parser(command)._actions if isinstance(a, argparse._SubParsersAction))
    actions = {flag: action for action in subparsers.choices[command]._actions for flag in action.option_strings}
    for flag in flags:
        assert f"{flag}-file" in actions, f"{command} {flag} has no -file form"
        assert "`ps`" in actions[flag].help, f"{command} {flag}'s help does not say ps shows it"
