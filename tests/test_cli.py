"""The ``hicache`` command line (hicache.cli)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from hicache.cli import main
from hicache.config import loading


@pytest.fixture
def in_repo(repo_root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run from the repository root, where ``config.yaml`` lives."""
    monkeypatch.chdir(repo_root)
    return repo_root


def test_check_config_prints_pools(in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """check-config on the default file prints every pool and the totals, in GiB."""
    assert main(["check-config", "config.yaml"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("config.yaml: 4 layers (sliding-window 1, 3, window 64 tokens), "
                             "mha 2 KV heads x 32 dims, float32")
    assert out[1].split() == ["tier", "pool", "layers", "tokens", "pages", "bytes", "GiB"]
    assert [line.split() for line in out[2:8]] == [
        ["device", "full", "2", "1024", "64", "1064960", "0.0010"],
        ["device", "swa", "2", "256", "16", "278528", "0.0003"],
        ["device", "total", "1280", "80", "1343488", "0.0013"],
        ["host", "full", "2", "4096", "256", "4210688", "0.0039"],
        ["host", "swa", "2", "4096", "256", "4210688", "0.0039"],
        ["host", "total", "8192", "512", "8421376", "0.0078"],
    ]
    assert out[8] == (
        "host.swa_history: all (chosen): SWA pool 4096 tokens, 0.0039 GiB (full pool 4096 "
        "tokens); window_tails: SWA pool 1024 tokens, 0.0010 GiB (full pool 4096 tokens)")
    assert out[9].startswith("host RAM: pools take 0.0078 GiB, ")
    assert out[9].endswith("GiB kept in reserve: fits")


def test_table_columns_align(in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Numbers are right-aligned: every table row ends at the same column."""
    main(["check-config", "config.yaml"])
    table = capsys.readouterr().out.splitlines()[1:8]
    assert len({len(line) for line in table}) == 1


def test_missing_file_is_one_line(
    in_repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing config file returns 2 with one line on stderr."""
    assert main(["check-config", "absent.yaml"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("hicache: error: absent.yaml: no such config file; ")
    assert "hicache init absent.yaml" in captured.err and captured.err.count("\n") == 1


def test_unknown_key_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown key returns 2 and names the dotted key and the closest valid one."""
    text = (Path(__file__).resolve().parents[1] / "config.yaml").read_text()
    path = tmp_path / "typo.yaml"
    path.write_text(text.replace("num_kv_heads:", "num_kv_head:"))
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (f"hicache: error: {path}: model.num_kv_head: unknown key; "
                   f"did you mean 'num_kv_heads'?\n")


@pytest.mark.parametrize(("page", "note"), [
    (16, "host layout page_first_direct (4096 bytes per layer, component and page, one block "
         "each)"),
    (1, "host layout page_first_direct (1-token pages: the same bytes as page_first)"),
])
def test_check_config_prints_the_page_first_direct_block(
        tmp_path: Path, page: int, note: str, capsys: pytest.CaptureFixture[str]) -> None:
    """check-config names the layout and what one layer of a page is in it."""
    text = (Path(__file__).resolve().parents[1] / "config.yaml").read_text()
    text = text.replace("layout: layer_first", "layout: page_first_direct")
    text = text.replace("page_size_tokens: 16", f"page_size_tokens: {page}")
    path = tmp_path / "direct.yaml"
    path.write_text(text)
    assert main(["check-config", "--skip-ram-check", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(note)


def test_ram_check_can_be_skipped(
    in_repo: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--skip-ram-check accepts host pools larger than this machine's free RAM."""
    monkeypatch.setattr(loading, "available_ram_bytes", lambda: 0)
    assert main(["check-config", "config.yaml"]) == 2
    assert "device_pool.num_tokens = 1024: host and CPU device pools need" in \
        capsys.readouterr().err
    assert main(["check-config", "--skip-ram-check", "config.yaml"]) == 0
    assert "not checked against this machine" in capsys.readouterr().out


def test_help_mentions_check_config(capsys: pytest.CaptureFixture[str]) -> None:
    """--help exits 0 and lists check-config."""
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert "check-config" in capsys.readouterr().out


def test_check_config_help_explains_options(capsys: pytest.CaptureFixture[str]) -> None:
    """check-config --help explains PATH and --skip-ram-check."""
    with pytest.raises(SystemExit) as info:
        main(["check-config", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "the YAML config file" in out
    assert "--skip-ram-check" in out


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """Without a subcommand: exit 2 and one line that points to --help."""
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert capsys.readouterr().err == ("hicache: error: the following arguments are required: "
                                       "COMMAND; see 'hicache --help'\n")


def test_console_script(in_repo: Path) -> None:
    """The installed ``hicache`` script runs check-config on the default file."""
    scripts = Path(sysconfig.get_path("scripts"))
    script = shutil.which("hicache", path=str(scripts)) or shutil.which("hicache")
    assert script is not None, f"no hicache console script on PATH or in {scripts}"
    result = subprocess.run(
        [script, "check-config", "config.yaml"], capture_output=True, text=True, timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "device  full" in result.stdout
    assert result.stdout.splitlines()[-4].split()[:2] == ["host", "total"]
    assert result.stdout.splitlines()[-1] == "storage (L3): none"


def test_module_entry_point(in_repo: Path) -> None:
    """``python -m hicache.cli`` reports errors with exit code 2."""
    result = subprocess.run(
        [sys.executable, "-m", "hicache.cli", "check-config", "absent.yaml"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("hicache: error: absent.yaml: no such config file; ")


def test_check_config_reports_staging_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """With the staged backend, check-config prints the staging memory it may take. Staged
    needs CUDA pools (staged on a cpu device is a config error), so the pools go on cuda;
    the machine is made to show one GPU, in case check-config asks whether it has it."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    text = Path("config.yaml").read_text().replace("io_backend: auto", "io_backend: staged")
    text = text.replace("device: cpu ", "device: cuda ")
    assert "device: cuda " in text and "io_backend: staged" in text
    path = tmp_path / "staged.yaml"
    path.write_text(text)
    assert main(["check-config", str(path)]) == 0
    # widest pool: 2 full layers x K,V x 2 heads x 32 dims x 4 bytes = 1024 bytes per token;
    # two lanes of two buffers of 1024 tokens and one 16-token page
    expected = 2 * 2 * (1024 + 16) * 1024
    assert f"up to {expected} bytes" in capsys.readouterr().out


def test_check_config_no_staging_on_cpu_auto(capsys: pytest.CaptureFixture[str]) -> None:
    """auto on a CPU is the torch backend: no staging line."""
    assert main(["check-config", "config.yaml"]) == 0
    assert "staging" not in capsys.readouterr().out
