"""`jopd.models.tokenizer_cache`: a GGUF file's converted tokenizer is built once per file version and machine, then
read back from disk equal to the built one; a cache that cannot be written only costs the build. (The real SmolLM2
tokenizer's cached copy is checked against transformers' own conversion in tests/data/test_data_tasks.py.)"""

import pytest

from jopd.data.toy_tokenizer import build_toy_tokenizer
from jopd.models import io, tokenizer_cache
from tests.helpers.same_tokenizer import assert_same_tokenizer


def test_a_built_tokenizer_is_saved_once_and_read_back_equal(tmp_path):
    built = []

    def build():
        built.append(build_toy_tokenizer())
        return built[-1]

    version = (str(tmp_path / "model.gguf"), 1234, 5678)
    first = tokenizer_cache.load_or_build(version, build, root=tmp_path)
    again = tokenizer_cache.load_or_build(version, lambda: pytest.fail("built again"), root=tmp_path)
    assert len(built) == 1 and first is built[0]
    assert (tokenizer_cache.entry_dir(version, tmp_path) / "tokenizer.json").is_file()
    assert_same_tokenizer(first, again)
    # the file rewritten (another mtime): another entry, built again; no temporary directory left behind
    tokenizer_cache.load_or_build((version[0], 1234, 9999), build, root=tmp_path)
    assert len(built) == 2 and not [p for p in (tmp_path / "tokenizers").iterdir() if ".tmp" in p.name]


def test_an_unwritable_cache_only_costs_the_build(tmp_path):
    root = tmp_path / "a-file"
    root.write_text("not a directory")  # (chmod would not stop root from writing)
    tok = tokenizer_cache.load_or_build(("m.gguf", 1, 2), build_toy_tokenizer, root=root)
    assert tok.encode("2+3") == build_toy_tokenizer().encode("2+3") and root.read_text() == "not a directory"


def test_load_tokenizer_reads_a_gguf_tokenizer_from_the_cache(tmp_path, monkeypatch):
    """`io.load_tokenizer` on a .gguf file consults $JOPD_CACHE under the file's version before converting: an entry
    planted there (the toy tokenizer) is what it returns."""
    monkeypatch.setenv("JOPD_CACHE", str(tmp_path))
    monkeypatch.setattr(io, "_GGUF_TOKENIZERS", {})
    gguf = io.smollm2_gguf_path()
    build_toy_tokenizer().save_pretrained(str(tokenizer_cache.entry_dir(io.file_version(gguf))))
    tok = io.load_tokenizer(gguf)
    assert len(tok.get_vocab()) == len(build_toy_tokenizer().get_vocab()) < 49152
