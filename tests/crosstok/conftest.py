import pytest

from jopd.data.toy_tokenizer import build_toy_tokenizer


@pytest.fixture(scope="session")
def smollm2():
    from jopd.models import io

    return io.load_tokenizer(io.smollm2_gguf_path())


@pytest.fixture(scope="session")
def toy():
    return build_toy_tokenizer()
