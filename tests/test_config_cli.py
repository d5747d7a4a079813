"""params.yaml validation, overrides, and the CLI's one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mempo.cli import main
from mempo.config import load_params, params_flat, parse_override
from mempo.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def test_repo_params_file_is_valid() -> None:
    params = load_params(REPO / "params.yaml")
    assert params.world.size in {"tiny", "small", "medium"}
    assert isinstance(params.world.seed, int)


def test_unknown_key_is_named(tmp_path: Path) -> None:
    p = tmp_path / "params.yaml"
    p.write_text("world:\n  sead: 3\n")
    with pytest.raises(ConfigError) as err:
        load_params(p)
    assert err.value.field == "world.sead"
    assert "unknown key" in err.value.one_line()


def test_unknown_section_is_named(tmp_path: Path) -> None:
    p = tmp_path / "params.yaml"
    p.write_text("wrold:\n  seed: 3\n")
    with pytest.raises(ConfigError) as err:
        load_params(p)
    assert err.value.field == "wrold"


def test_wrong_type_is_named(tmp_path: Path) -> None:
    p = tmp_path / "params.yaml"
    p.write_text("world:\n  seed: three\n")
    with pytest.raises(ConfigError) as err:
        load_params(p)
    assert err.value.field == "world.seed"
    assert "three" in err.value.one_line()


def test_bad_enum_and_bad_yaml(tmp_path: Path) -> None:
    p = tmp_path / "params.yaml"
    p.write_text("world:\n  size: huge\n")
    with pytest.raises(ConfigError, match="world.size"):
        load_params(p)
    p.write_text("world: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_params(p)


def test_overrides_win_and_are_typed(tmp_path: Path) -> None:
    p = tmp_path / "params.yaml"
    p.write_text("world:\n  seed: 3\n  size: tiny\n")
    params = load_params(p, overrides=["world.seed=9"])
    assert params.world.seed == 9 and params.world.size == "tiny"
    assert load_params(p, overrides={"world.seed": None}).world.seed == 3  # unset flag
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    with pytest.raises(ConfigError):
        parse_override("no-equals-sign")
    assert params_flat(params)["world.seed"] == 9


def test_cli_error_is_one_line_and_nonzero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "params.yaml"
    p.write_text("world:\n  seed: x\n")
    rc = main(["--params", str(p), "world", "generate", "--out", str(tmp_path / "w")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0
    assert len(err) == 1 and "world.seed" in err[0]
    assert not (tmp_path / "w").exists()


def test_cli_flags_override_params(tmp_path: Path) -> None:
    p = tmp_path / "params.yaml"
    p.write_text("world:\n  seed: 1\n  size: small\n  out: elsewhere\n")
    rc = main(["--params", str(p), "world", "generate", "--size", "tiny", "--out", str(tmp_path / "w")])
    assert rc == 0
    import json
    manifest = json.loads((tmp_path / "w" / "manifest.json").read_text())
    assert manifest["size"] == "tiny" and manifest["seed"] == 1


def test_console_script_help_lists_stages() -> None:
    out = subprocess.run([sys.executable, "-m", "mempo", "--help"], capture_output=True, text=True, check=True)
    assert "world" in out.stdout
    sub = subprocess.run([sys.executable, "-m", "mempo", "world", "generate", "--help"],
                         capture_output=True, text=True, check=True)
    assert "--size" in sub.stdout and "default" in sub.stdout
